"""Engine limits: every static shape of the jitted step, plus host-side bounds.

`max_batch` rows (sequences per step), one step shape per token budget, `num_pages` KV pages of
`page_size` positions, `S = lora.max_slots` adapter slots. YAML presets in `configs/` only fill this in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import yaml

from jaxlora.config import LoraConfig
from jaxlora.kernels import KernelConfig, StepKernels
from jaxlora.parallel.mesh import MeshConfig

_DTYPES = ("float32", "bfloat16")

# The default context on CPU, whatever the model allows (configs/smollm2-135m-cpu.yaml's). Attention
# on CPU reads only the context in use (pallas_kernels.attention.ragged_xla), so this width costs
# memory, not time (benchmarks/DECISIONS.md#cpu-context). A longer context is one --max-seq-len away.
CPU_MAX_SEQ_LEN = 4096
# Positions the CPU page pool holds by default (the rows share them; the host's memory, not a
# device's): four sequences of CPU_MAX_SEQ_LEN. SmolLM2-135M keeps 45 KiB per position
# (30 layers x K and V x 3 KV heads x 64 x float32), so 720 MiB.
CPU_POOL_POSITIONS = 4 * CPU_MAX_SEQ_LEN

# What forms the engine's steps: one jitted call over a flat batch of decode tokens and prompt chunks.
ENGINE_KIND = "ragged"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Static limits of one engine.

    Attributes:
      max_batch: rows, i.e. sequences running at once (each step has at most one chunk per row).
      max_seq_len: positions per sequence; prompt + max_tokens must fit (None: the model's own
        maximum, within what the KV pool holds, and at most CPU_MAX_SEQ_LEN on CPU; `with_context`).
      token_budgets: the step sizes compiled (tokens per step), sorted; a step is padded to the
        smallest that holds it. The largest bounds a step: decode tokens first, then prompt chunks
        fill it, so a long prompt is prefilled across steps. It must be >= max_batch.
      page_size: positions per KV page.
      num_pages: KV pages in the pool (None: from the device memory left after weights and adapter
        bank on GPU, `kv_memory_fraction` of it; on CPU max_batch sequences of max_seq_len).
      kv_memory_fraction: share of the free device memory the page pool takes when num_pages is None.
      max_new_tokens_limit: the largest `max_tokens` a request may ask for (None: max_seq_len - 1).
      max_queue: requests waiting for admission; submit raises CapacityError beyond it.
      max_adapters_per_batch: distinct adapters among running rows (None: max_slots - 1).
      max_wait_steps: a waiting request older than this many steps blocks later requests for other
        adapters until it is admitted (no starvation of cold adapters).
      lora: the adapter bank's static limits.
      dtype: parameter, activation and KV cache dtype name.
      host_capacity_bytes: host memory for registered adapters (None: unbounded).
      mesh: devices the engine spans (`mesh: {tensor: 2}` splits every layer over two devices).
      kernels: which kernels the steps run (`jaxlora.kernels.KernelConfig`: attention, unrolling, quant
        GEMM, GEMM compile options, CONCURRENT scheduling; the LoRA backend is `lora.backend`),
        resolved once per engine by `step_kernels`.
      prefetch_adapters: page in (unpinned) the adapters of up to this many waiting requests, in
        arrival order, while rows are busy, so a request's adapter is resident when its row frees
        (0: page in only on admission).
      bank_free_steps: also compile each step without the adapter bank, for steps where no token
        has an adapter (they skip the LoRA launches). False halves the warm-up's compiles; such
        steps then run with the bank (the same tokens: slot 0 is all zero). For deployments where
        nearly every request names an adapter.
      enable_prefix_caching: share the KV pages of a prefix between requests on the same weights
        (the base model, or one adapter's weights: never across adapters; see
        `jaxlora.engine.scheduler`). A request whose prompt starts with full pages another request
        computed skips their prefill; a finished request's pages stay cached until memory is needed.
      seed: seeds the sampling seeds drawn for requests that give none, so that a re-run of the
        same requests in the same order gives the same tokens (None: drawn from the OS).
    """

    max_batch: int = 8
    max_seq_len: int | None = None
    token_budgets: tuple[int, ...] = (16, 64, 256)
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_fraction: float = 0.85
    max_new_tokens_limit: int | None = None
    max_queue: int = 1024
    max_adapters_per_batch: int | None = None
    max_wait_steps: int = 64
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    dtype: str = "float32"
    host_capacity_bytes: int | None = None
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    prefetch_adapters: int = 16
    bank_free_steps: bool = True
    enable_prefix_caching: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        for field in ("max_batch", "max_seq_len", "page_size", "max_new_tokens_limit", "max_queue", "max_wait_steps"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        budgets = tuple(int(b) for b in self.token_budgets)
        object.__setattr__(self, "token_budgets", budgets)
        if not budgets or list(budgets) != sorted(set(budgets)) or budgets[0] < 1:
            raise ValueError(f"token_budgets={budgets} must be non-empty, positive, sorted and distinct")
        if budgets[-1] < self.max_batch:
            raise ValueError(
                f"the largest token budget {budgets[-1]} must be >= max_batch={self.max_batch} "
                "(every running row decodes one token per step)"
            )
        pages_per_seq = -(-(self.max_seq_len or 1) // self.page_size)
        if self.num_pages is not None and self.max_seq_len is not None and self.num_pages < pages_per_seq:
            raise ValueError(
                f"num_pages={self.num_pages} must hold one sequence of max_seq_len={self.max_seq_len} "
                f"({pages_per_seq} pages of {self.page_size})"
            )
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]")
        if None not in (self.max_seq_len, self.max_new_tokens_limit) and self.max_new_tokens_limit >= self.max_seq_len:
            raise ValueError(
                f"max_new_tokens_limit={self.max_new_tokens_limit} must be < max_seq_len={self.max_seq_len}"
            )
        cap = self.max_adapters_per_batch
        if cap is not None and not 1 <= cap <= self.lora.max_slots - 1:
            raise ValueError(f"max_adapters_per_batch={cap} must be in [1, max_slots-1={self.lora.max_slots - 1}]")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {_DTYPES}")
        if not isinstance(self.kernels, KernelConfig):
            raise ValueError(f"kernels={self.kernels!r} must be a KernelConfig")
        if self.prefetch_adapters < 0:
            raise ValueError(f"prefetch_adapters={self.prefetch_adapters} must be >= 0")
        if self.host_capacity_bytes is not None and self.host_capacity_bytes < 1:
            raise ValueError(f"host_capacity_bytes={self.host_capacity_bytes} must be >= 1")

    def with_context(self, *, model_max: int, pool_positions: int | None) -> EngineConfig:
        """This config with its context decided: max_seq_len None becomes the model's own maximum
        (`model_max`), within `pool_positions` (what the KV pool can hold; None: no bound); a
        max_new_tokens_limit None becomes max_seq_len - 1, and one the derived context leaves no
        room for comes down to it."""
        seq = self.max_seq_len
        if seq is None:
            seq = model_max if pool_positions is None else min(model_max, pool_positions)
            if seq < 2:
                raise ValueError(f"the KV pool holds {pool_positions} positions: no room for a prompt and an answer")
        limit = seq - 1 if self.max_new_tokens_limit is None else min(self.max_new_tokens_limit, seq - 1)
        return dataclasses.replace(self, max_seq_len=seq, max_new_tokens_limit=limit)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def step_kernels(self, *, fused_projections: bool, platform: str | None = None) -> StepKernels:
        """The kernels this engine's steps run, for a model in the serving layout (`fused_projections`,
        jaxlora.model.fused) or not, on `platform` (None: JAX's default backend)."""
        return self.kernels.resolve(
            self.lora.backend, platform, fused_projections=fused_projections, lora_bank=self.lora.bank
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
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
        if isinstance(d.get("kernels"), dict):
            d["kernels"] = KernelConfig.from_dict(d["kernels"])
        if "token_budgets" in d:
            d["token_budgets"] = tuple(d["token_budgets"])
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        """Reads a preset; the YAML may hold the fields at top level or under an `engine:` key."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of engine config fields")
        return cls.from_dict(data.get("engine", data))
