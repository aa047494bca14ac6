"""Random HostAdapters for tests: many, tiny, fast (shared with the engine tests)."""

from __future__ import annotations

import numpy as np

from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.lora.host_adapter import HostAdapter
from tests.helpers import tiny_config


def tiny_lora(**overrides) -> LoraConfig:
    base = dict(max_slots=8, max_rank=4, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    base.update(overrides)
    return LoraConfig(**base)


def random_host_adapter(
    name: str,
    model: ModelConfig,
    *,
    rank: int,
    modules: tuple[str, ...],
    rng: np.random.Generator,
    scale: float = 0.1,
) -> HostAdapter:
    """One adapter with random non-zero float32 weights on `modules` (every module at `rank`)."""
    weights = {}
    for m in modules:
        d_in, d_out = model.module_shape(m)
        a = rng.standard_normal((model.num_layers, d_in, rank), dtype=np.float32) * scale
        b = rng.standard_normal((model.num_layers, rank, d_out), dtype=np.float32) * scale
        weights[m] = (a, b)
    return HostAdapter(name=name, rank=rank, target_modules=modules, weights=weights, source=f"random:{name}")


def random_host_adapters(
    num: int,
    model: ModelConfig | None = None,
    lora: LoraConfig | None = None,
    *,
    seed: int = 0,
    prefix: str = "lora",
) -> list[HostAdapter]:
    """`num` adapters named `{prefix}-{i}`, random rank 1..max_rank, random non-empty module subsets.

    1,000 adapters on `tiny_config()` take well under a second.
    """
    model = model or tiny_config()
    lora = lora or tiny_lora()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        rank = int(rng.integers(1, lora.max_rank + 1))
        mask = rng.random(len(lora.target_modules)) < 0.6
        mask[rng.integers(len(mask))] = True
        modules = tuple(m for m, keep in zip(lora.target_modules, mask) if keep)
        out.append(random_host_adapter(f"{prefix}-{i}", model, rank=rank, modules=modules, rng=rng))
    return out
