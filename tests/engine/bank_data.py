"""What the bank tests share (padded, paged and unified banks): a tiny model with adapters of mixed
ranks, a `rank_pattern`-like one and an attention-only one, and a mixed batch of requests."""

from __future__ import annotations

import numpy as np

from jaxlora.config import TARGET_MODULES
from jaxlora.engine import GenerationRequest, SamplingParams
from jaxlora.lora.host_adapter import HostAdapter
from tests.factories import char_tokenizer, random_adapter, tiny_model

MAX_TOKENS = 6
# Ranks 4-64, a per-module rank pattern, attention-only and base rows in one batch.
MIXED = ["r4", None, "r8", "pattern", "r16", "r64", None, "attn8"]


def pattern_adapter(name: str, config, rng: int) -> HostAdapter:
    """A `rank_pattern`-like adapter: a different rank per module, some modules untouched."""
    ranks = {"q_proj": 2, "v_proj": 16, "gate_proj": 9, "down_proj": 64}
    gen = np.random.default_rng(rng)
    weights = {}
    for m, r in ranks.items():
        d_in, d_out = config.module_shape(m)
        a = gen.normal(0, 2 / np.sqrt(d_in), (config.num_layers, d_in, r)).astype(np.float32)
        b = gen.normal(0, 2, (config.num_layers, r, d_out)).astype(np.float32)
        weights[m] = (a, b)
    return HostAdapter(name=name, rank=64, target_modules=tuple(ranks), weights=weights, source=f"random:{name}")


def bank_parts():
    """(model, tokenizer, adapters): the tiny model and the adapters MIXED names."""
    model, tok = tiny_model(), char_tokenizer()
    adapters = {
        f"r{r}": random_adapter(f"r{r}", model.config, modules=TARGET_MODULES, rank=r, rng=r) for r in (4, 8, 16, 64)
    }
    adapters["attn8"] = random_adapter("attn8", model.config, modules=("q_proj", "o_proj"), rank=8, rng=11)
    adapters["pattern"] = pattern_adapter("pattern", model.config, rng=12)
    return model, tok, adapters


def requests(names: list[str | None], seed: int = 0, max_tokens: int = MAX_TOKENS) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            request_id=f"q{i}",
            prompt_ids=[int(t) for t in rng.integers(4, 60, 3 + i % 4)],
            adapter=name,
            sampling=SamplingParams(max_tokens=max_tokens),
        )
        for i, name in enumerate(names)
    ]
