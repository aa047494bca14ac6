"""Chat templating, loss masks, buckets and batches of jaxlora.train.data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxlora.train.data import (
    Example,
    bucket_length,
    make_batch,
    read_jsonl,
    record_messages,
    split_holdout,
    tokenize_conversation,
    train_batch,
)

PROMPT = "Name a color."
RESPONSE = "Blue, like the sky."


def test_mask_covers_exactly_the_response_and_end_of_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = record_messages({"prompt": PROMPT, "response": RESPONSE})
    example = tokenize_conversation(tok, messages)
    prompt_ids = tok.encode_chat(messages[:1])
    # The context is exactly what inference feeds the model, and none of it is learned.
    assert example.ids[: len(prompt_ids)].tolist() == prompt_ids
    assert not example.loss_mask[: len(prompt_ids)].any()
    learned = example.ids[example.loss_mask]
    assert tok.decode(learned, skip_special_tokens=False) == RESPONSE + "<|im_end|>"
    assert learned[-1] in tok.eos_token_ids
    # The template's newline after <|im_end|> is context, not target.
    assert example.loss_mask[len(prompt_ids) :].sum() == len(learned)
    assert not example.loss_mask[-1] or example.ids[-1] in tok.eos_token_ids


def test_multi_turn_masks_every_assistant_turn_only(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!"},
    ]
    example = tokenize_conversation(tok, messages)
    learned = tok.decode(example.ids[example.loss_mask], skip_special_tokens=False)
    assert learned == "Hello!<|im_end|>Goodbye!<|im_end|>"
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(example.ids, skip_special_tokens=False) == full


def test_make_batch_shifts_targets_and_pads_with_zero_weight():
    e1 = Example(ids=np.array([5, 6, 7, 8], np.int32), loss_mask=np.array([0, 0, 1, 1], bool))
    e2 = Example(ids=np.array([9, 10], np.int32), loss_mask=np.array([0, 1], bool))
    batch = make_batch([e1, e2], max_len=64, rows=3)
    assert batch.tokens.shape == (3, 16)
    assert batch.tokens[0, :3].tolist() == [5, 6, 7] and batch.targets[0, :3].tolist() == [6, 7, 8]
    # weights[i] says whether targets[i] (= ids[i + 1]) is learned.
    assert batch.weights[0, :3].tolist() == [0, 1, 1]
    assert batch.weights[1, :1].tolist() == [1]
    assert batch.weights.sum() == 3  # padding and the missing third row weigh nothing


def test_make_batch_truncates_to_max_len():
    e = Example(ids=np.arange(100, dtype=np.int32), loss_mask=np.ones(100, bool))
    batch = make_batch([e], max_len=32)
    assert batch.tokens.shape == (1, 32)
    assert batch.targets[0, -1] == 32


@pytest.mark.parametrize(
    "n, expected", [(1, 16), (16, 16), (17, 32), (71, 80), (128, 128), (129, 192), (193, 256), (257, 384), (1000, 1024)]
)
def test_bucket_length(n, expected):
    assert bucket_length(n, 4096) == expected
    assert bucket_length(n, 100) == min(expected, 100)


def test_split_and_batches_are_deterministic():
    examples = [Example(ids=np.full(i + 2, i, np.int32), loss_mask=np.ones(i + 2, bool)) for i in range(20)]
    train, held = split_holdout(examples, fraction=0.1, seed=1)
    assert len(held) == 2 and len(train) == 18
    assert {int(e.ids[0]) for e in train}.isdisjoint({int(e.ids[0]) for e in held})
    assert [int(e.ids[0]) for e in split_holdout(examples, fraction=0.1, seed=1)[1]] == [int(e.ids[0]) for e in held]
    b1 = train_batch(train, 5, batch_size=4, seed=0, max_len=64)
    b2 = train_batch(train, 5, batch_size=4, seed=0, max_len=64)
    assert np.array_equal(b1.tokens, b2.tokens)
    # One epoch visits every example once.
    seen = [
        int(train_batch(train, s, batch_size=3, seed=0, max_len=64).tokens[r, 0]) for s in range(6) for r in range(3)
    ]
    assert sorted(seen) == sorted(int(e.ids[0]) for e in train)


def test_read_jsonl_accepts_both_forms_and_names_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "a", "response": "b"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n"
    )
    convs = read_jsonl(good)
    assert convs[0] == convs[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: "):
        read_jsonl(bad)
    with pytest.raises(ValueError, match="no assistant turn"):
        record_messages({"messages": [{"role": "user", "content": "a"}]})
