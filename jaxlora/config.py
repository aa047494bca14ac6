"""Frozen configuration records: the model's architecture and the LoRA bank's static limits.

Everything here is a compile-time constant of the jitted steps. YAML presets in `configs/` only fill
these in; nothing is read from the environment.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

# Projections that can carry a LoRA term, in a fixed order (the bank and the adapters use it).
TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ATTENTION_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")


class LoraBackend(enum.StrEnum):
    """How the per-row LoRA term is computed (all give the same numbers): the backends of
    `pallas_kernels.Backend` a model serves with (the others are naive references for tests)."""

    XLA = "xla"  # gather A[slot] / B[slot] per row, then einsum
    RAGGED = "ragged"  # lax.ragged_dot over rows sorted by slot
    PALLAS = "pallas"  # pallas_kernels shrink/expand kernels


class LoraBank(enum.StrEnum):
    """How the device holds resident adapters (both give the same tokens)."""

    PADDED = "padded"  # one slot per adapter, every module padded to max_rank (jaxlora.lora.bank)
    PAGED = "paged"  # true-rank pages of one pool, read through page tables (jaxlora.lora.paged_bank)
    UNIFIED = "unified"  # true-rank runs in the KV cache's own pages, one allocator (jaxlora.lora.unified_layout)


class AttentionBackend(enum.StrEnum):
    """How the step's attention is computed (all give the same numbers)."""

    AUTO = "auto"  # PALLAS on GPU, XLA elsewhere (resolved by `jaxlora.kernels.KernelConfig.resolve`)
    XLA = "xla"  # plain XLA ops (the blocked ragged attention; dense masked einsum for dense caches)
    PALLAS = "pallas"  # pallas_kernels attention kernels


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"invalid llama3 rope_scaling: {self}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2 with qkv bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama's attention_bias also sets o_proj_bias)
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, in Hugging Face terms."""
        shapes = {
            "q_proj": (self.hidden_size, self.q_size),
            "k_proj": (self.hidden_size, self.kv_size),
            "v_proj": (self.hidden_size, self.kv_size),
            "o_proj": (self.q_size, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in shapes:
            raise ValueError(f"unknown module {module!r}; known: {', '.join(TARGET_MODULES)}")
        return shapes[module]

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` of an equivalent Hugging Face LlamaForCausalLM."""
        # Bias on q/k/v without o is Qwen2's layout; Llama's attention_bias covers all four.
        qwen2 = self.attention_bias and not self.o_proj_bias
        if self.o_proj_bias and not self.attention_bias:
            raise ValueError("no Hugging Face architecture has an o_proj bias without q/k/v biases")
        out: dict[str, Any] = {
            "_name_or_path": self.name,
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "use_sliding_window": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Static limits of the device adapter bank.

    Attributes:
      max_slots: device slots S, slot 0 included (slot 0 is the all-zero "base model" slot).
      max_rank: R; every adapter's rank is zero-padded to it.
      target_modules: projections that get a LoRA term; others cost nothing.
      backend: how the per-row term is computed (padded bank only; the paged bank always runs the
        paged kernels, pallas_kernels.lora.paged).
      bank: "padded" (every slot at max_rank), "paged" (adapters at their true rank in pages of
        one pool per rank-row width; max_slots then bounds the page-table rows, pool_pages the bytes)
        or "unified" (adapters at their true rank in the KV cache's pages, taken from the same
        allocator as sequences: S-LoRA's unified pool; max_slots bounds the resident adapters, the
        KV pool the bytes; page_rows and pool_pages do not apply).
      page_rows: rank-rows per page of the paged bank (a power of two).
      pool_pages: pages of the paged bank's pools, summed over them (None: each pool holds
        max_slots - 1 adapters at max_rank on every target module, the padded bank's capacity). A
        given count is split over the pools in proportion to that default, so k times the pages of
        one max-rank all-module adapter hold exactly k of them; it must hold at least one
        (`jaxlora.lora.paged_bank.num_pool_pages`).
    """

    max_slots: int = 8
    max_rank: int = 16
    target_modules: tuple[str, ...] = TARGET_MODULES
    backend: LoraBackend = LoraBackend.XLA
    bank: LoraBank = LoraBank.PADDED
    page_rows: int = 8
    pool_pages: int | None = None

    def __post_init__(self) -> None:
        if self.max_slots < 2:
            raise ValueError(f"max_slots={self.max_slots} must be >= 2 (slot 0 is the base model)")
        if self.max_rank < 1:
            raise ValueError(f"max_rank={self.max_rank} must be >= 1")
        unknown = set(self.target_modules) - set(TARGET_MODULES)
        if unknown:
            raise ValueError(f"unknown target modules {sorted(unknown)}; known: {', '.join(TARGET_MODULES)}")
        if not self.target_modules:
            raise ValueError("target_modules must not be empty")
        object.__setattr__(self, "backend", LoraBackend(self.backend))
        if self.bank not in tuple(LoraBank):
            raise ValueError(f"bank={self.bank!r} must be one of {tuple(b.value for b in LoraBank)}")
        object.__setattr__(self, "bank", LoraBank(self.bank))
        if self.page_rows < 1 or self.page_rows & (self.page_rows - 1):
            raise ValueError(f"page_rows={self.page_rows} must be a power of two")
        if self.pool_pages is not None and self.pool_pages < 1:
            raise ValueError(f"pool_pages={self.pool_pages} must be >= 1")
        # Keep the canonical order so two configs naming the same set compare equal.
        object.__setattr__(self, "target_modules", tuple(m for m in TARGET_MODULES if m in self.target_modules))
