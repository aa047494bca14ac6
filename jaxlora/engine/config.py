"""Engine limits: every static shape of the jitted steps, plus host-side bounds.

`B = max_batch` decode rows, `max_seq_len` cache positions per row, one prefill shape per bucket
(`prefill_batch` rows x bucket tokens), `S = lora.max_slots` adapter slots. YAML presets in
`configs/` only fill this in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import yaml

from jaxlora.config import LoraConfig
from jaxlora.parallel.mesh import MeshConfig

_DTYPES = ("float32", "bfloat16")

# Which engine this package builds: "bucketed" (prefill calls apart from the decode call, each padded
# to a compiled shape). Benchmarks label their rows with it and pick the engine's limits by it.
ENGINE_KIND = "bucketed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Static limits of one engine.

    Attributes:
      max_batch: B, decode rows (one KV cache row each).
      max_seq_len: cache positions per row; prompt + max_tokens must fit.
      prefill_buckets: prompt chunk lengths compiled for prefill, sorted; longer prompts are prefilled
        in chunks of the largest bucket.
      prefill_batch: rows per prefill call (padding rows cost compute, not correctness).
      max_new_tokens_limit: the largest `max_tokens` a request may ask for.
      max_queue: requests waiting for admission; submit raises CapacityError beyond it.
      max_adapters_per_batch: distinct adapters among running rows (None: max_slots - 1).
      max_wait_steps: a waiting request older than this many steps blocks later requests for other
        adapters until it is admitted (no starvation of cold adapters).
      lora: the adapter bank's static limits.
      dtype: parameter, activation and KV cache dtype name.
      host_capacity_bytes: host memory for registered adapters (None: unbounded).
      mesh: devices the engine spans (`mesh: {tensor: 2}` splits every layer over two devices).
      attention: decode attention, "auto" (the Pallas kernel on GPU, XLA elsewhere), "pallas" or "xla".
      prefetch_adapters: page in (unpinned) the adapters of up to this many waiting requests, in
        arrival order, while rows are busy, so a request's adapter is resident when its row frees
        (0: page in only on admission).
    """

    max_batch: int = 8
    max_seq_len: int = 512
    prefill_buckets: tuple[int, ...] = (32, 128, 512)
    prefill_batch: int = 4
    max_new_tokens_limit: int = 256
    max_queue: int = 1024
    max_adapters_per_batch: int | None = None
    max_wait_steps: int = 64
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    dtype: str = "float32"
    host_capacity_bytes: int | None = None
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    attention: str = "auto"
    prefetch_adapters: int = 16

    def __post_init__(self) -> None:
        for field in ("max_batch", "max_seq_len", "prefill_batch", "max_new_tokens_limit", "max_queue",
                      "max_wait_steps"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        buckets = tuple(int(b) for b in self.prefill_buckets)
        object.__setattr__(self, "prefill_buckets", buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"prefill_buckets={buckets} must be non-empty, positive, sorted and distinct")
        if buckets[-1] > self.max_seq_len:
            raise ValueError(f"prefill_buckets={buckets} must be <= max_seq_len={self.max_seq_len}")
        if self.max_new_tokens_limit >= self.max_seq_len:
            raise ValueError(f"max_new_tokens_limit={self.max_new_tokens_limit} must be < "
                             f"max_seq_len={self.max_seq_len}")
        cap = self.max_adapters_per_batch
        if cap is not None and not 1 <= cap <= self.lora.max_slots - 1:
            raise ValueError(f"max_adapters_per_batch={cap} must be in [1, max_slots-1={self.lora.max_slots - 1}]")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {_DTYPES}")
        if self.attention not in ("auto", "pallas", "xla"):
            raise ValueError(f"attention={self.attention!r} must be one of ('auto', 'pallas', 'xla')")
        if self.prefetch_adapters < 0:
            raise ValueError(f"prefetch_adapters={self.prefetch_adapters} must be >= 0")
        if self.host_capacity_bytes is not None and self.host_capacity_bytes < 1:
            raise ValueError(f"host_capacity_bytes={self.host_capacity_bytes} must be >= 1")

    @property
    def adapter_cap(self) -> int:
        return self.max_adapters_per_batch or self.lora.max_slots - 1

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown engine config key(s) {sorted(unknown)}")
        if isinstance(d.get("lora"), dict):
            lora = dict(d["lora"])
            if "target_modules" in lora:
                lora["target_modules"] = tuple(lora["target_modules"])
            d["lora"] = LoraConfig(**lora)
        if isinstance(d.get("mesh"), dict):
            d["mesh"] = MeshConfig(**d["mesh"])
        if "prefill_buckets" in d:
            d["prefill_buckets"] = tuple(d["prefill_buckets"])
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        """Reads a preset; the YAML may hold the fields at top level or under an `engine:` key."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of engine config fields")
        return cls.from_dict(data.get("engine", data))
