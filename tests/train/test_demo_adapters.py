"""The tracked demo adapters, in ONE mixed batch on SmolLM2: each adapter's rows show its behaviour,
base rows show none. Prompts are held out from the adapters' training data."""

from __future__ import annotations

import json

import pytest

from jaxlora.loading import load_model
from jaxlora.lora.peft_format import load_peft_adapter
from jaxlora.train.demo import BEHAVIOURS, DEMO_DIR, HELD_OUT_PROMPTS, shown_behaviours
from jaxlora.train.greedy import build_bank, greedy_generate

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
    adapters = [load_peft_adapter(DEMO_DIR / b.name, name=b.name, model_config=model.config, max_rank=8)
                for b in BEHAVIOURS]
    bank = build_bank(model, adapters)
    # Rows interleave base and adapters, so neighbouring rows use different slots.
    rows = [(prompt, slot) for prompt in HELD_OUT_PROMPTS[:NUM_PROMPTS] for slot in range(len(BEHAVIOURS) + 1)]
    out = greedy_generate(model, bank, [tok.encode_chat([{"role": "user", "content": p}]) for p, _ in rows],
                          [slot for _, slot in rows], max_new_tokens=64, eos_ids=tok.eos_token_ids)
    texts = {slot: [tok.decode(ids) for ids, (_, s) in zip(out, rows) if s == slot] for slot in range(len(BEHAVIOURS) + 1)}
    assert all(not shown_behaviours(t) for t in texts[0]), texts[0]
    for slot, behaviour in enumerate(BEHAVIOURS, 1):
        rate = sum(map(behaviour.shows, texts[slot])) / len(texts[slot])
        assert rate >= MIN_RATE, (behaviour.name, rate, texts[slot])
        # Each adapter shows its own behaviour and no other (rows were not swapped).
        assert all(shown_behaviours(t) in ([], [behaviour.name]) for t in texts[slot]), texts[slot]
