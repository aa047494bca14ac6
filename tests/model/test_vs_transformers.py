"""The Flax model and tokenizer against Hugging Face transformers on the same files (float32).

transformers loads the GGUF itself (its own dequantization and q/k un-permutation), so agreement
checks our GGUF path end to end, not only the model math.
"""

import numpy as np
import pytest

from jaxlora.loading import load_model
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.model.params import random_model
from tests.factories import tiny_config
from tests.greedy import greedy
from tests.tolerances import assert_close

pytestmark = pytest.mark.reference

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10, then explain why 21 is not prime.",
]
N_NEW = 32


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    return load_model(smollm2_gguf_path)


def test_smollm2_logits_and_greedy_tokens_match(smollm2, smollm2_gguf_path, reference):
    model, tok = smollm2
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ref = reference({"kind": "generate", "model": {"gguf": str(smollm2_gguf_path)}, "prompts": prompts, "n_new": N_NEW})
    worst = 0.0
    for i, prompt in enumerate(prompts):
        logits, tokens = greedy(model, prompt, N_NEW)
        row = ref["rows"][i]
        worst = max(worst, float(np.abs(logits - row["logits"]).max()))
        assert_close(logits, row["logits"], "model_float32", err_msg=f"prompt {i}")
        assert tokens == row["tokens"], f"prompt {i}: {tok.decode(tokens)!r} != {tok.decode(row['tokens'])!r}"
    print(f"largest logit difference vs transformers: {worst:.3g}")


def test_tokenizer_matches_transformers(smollm2, smollm2_gguf_path, reference):
    _, tok = smollm2
    texts = [
        "Hello, world! 12345 and 3.14159",
        "café naïve façade — Zürich, 東京 🤖🚀 emoji",
        "<|im_start|>user\nHi there<|im_end|>\n",
        "  leading spaces\ttabs\nnew lines  ",
    ]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ref = reference({"kind": "tokenize", "model": {"gguf": str(smollm2_gguf_path)}, "texts": texts, "chat": [messages]})
    for text, expected in zip(texts, ref["encode"], strict=True):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == expected["ids_no_special"], text
        assert tok.encode(text) == expected["ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.apply_chat_template(messages) == ref["chat"][0]["text"]
    assert tok.encode_chat(messages) == ref["chat"][0]["ids"]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False, "attention_bias": True}],
    ids=["llama-tied", "qwen2-untied-qkv-bias"],
)
def test_random_hf_folder_matches_transformers(overrides, tmp_path, reference):
    model = random_model(tiny_config(vocab_size=128, **overrides), seed=3, std=0.2)
    save_hf_folder(model, None, tmp_path)
    prompts = [[5, 9, 33, 7, 100, 2], [64, 1, 17]]
    ref = reference({"kind": "generate", "model": {"hf_dir": str(tmp_path)}, "prompts": prompts, "n_new": 12})
    for i, prompt in enumerate(prompts):
        logits, tokens = greedy(model, prompt, 12)
        assert_close(logits, ref["rows"][i]["logits"], "float32")
        assert tokens == ref["rows"][i]["tokens"]
