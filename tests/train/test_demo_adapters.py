"""The tracked demo adapters, in ONE continuous batch of the engine on SmolLM2: each adapter's rows
show its behaviour, base rows show none. Prompts are held out from the adapters' training data."""

from __future__ import annotations

import json

import pytest

from jaxlora.engine import FinishReason
from jaxlora.loading import load_model
from jaxlora.train.demo import BEHAVIOURS, DEMO_DIR, HELD_OUT_PROMPTS, answer_in_one_batch, shown_behaviours

NUM_PROMPTS = 6  # the first six held-out prompts; the full set's rates are in checkpoints/demo/results.json
MIN_RATE = 0.8
MAX_FILE_BYTES = 5_000_000


@pytest.mark.parametrize("name", [b.name for b in BEHAVIOURS])
def test_demo_adapter_folders_are_small_peft_folders(name):
    folder = DEMO_DIR / name
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] <= 8
    assert (folder / "adapter_model.safetensors").stat().st_size < MAX_FILE_BYTES


def test_mixed_batch_shows_every_behaviour(smollm2_gguf_path):
    model, tok = load_model(smollm2_gguf_path)
    answers = answer_in_one_batch(
        model,
        tok,
        {b.name: DEMO_DIR / b.name for b in BEHAVIOURS},
        HELD_OUT_PROMPTS[:NUM_PROMPTS],
        max_new_tokens=64,
        max_rank=8,
    )
    assert [a.adapter for a in answers[: len(BEHAVIOURS) + 1]] == [None, *(b.name for b in BEHAVIOURS)]
    assert all(a.output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for a in answers)
    texts = {
        name: [a.output.text for a in answers if a.adapter == name] for name in [None, *(b.name for b in BEHAVIOURS)]
    }
    assert all(len(t) == NUM_PROMPTS for t in texts.values())
    assert all(not shown_behaviours(t) for t in texts[None]), texts[None]
    for behaviour in BEHAVIOURS:
        rate = sum(map(behaviour.shows, texts[behaviour.name])) / NUM_PROMPTS
        assert rate >= MIN_RATE, (behaviour.name, rate, texts[behaviour.name])
        # Each adapter shows its own behaviour and no other (rows were not swapped).
        assert all(shown_behaviours(t) in ([], [behaviour.name]) for t in texts[behaviour.name]), texts[behaviour.name]
