"""Which kernels a jitted model step runs: one frozen record, chosen once per engine.

    KernelConfig   the `kernels:` section of EngineConfig and the YAML presets; "auto" allowed
    StepKernels    the resolved choice (`KernelConfig.resolve`), a static argument of every step

Seven decisions, each with its rule per step size where one exists:

    LoRA        lora.backend (the bank's config): xla | ragged | pallas; a paged bank (lora.bank)
                always runs the paged Pallas kernels (pallas_kernels.lora.paged)
    attention   the paged step's attention: the Pallas kernel or its plain-XLA twin
    unroll      layers as an unrolled loop for steps of at most unroll_max_tokens tokens, else lax.scan
    quant       how quantized projections multiply, per step size (`QUANT_AUTO`, `quant_matmul_at`)
    w8a8        per storage format, from which step size XLA's path quantizes the activations too
                and runs an 8-bit GEMM (`W8A8_AUTO`, `w8a8_at`)
    gemm        the XLA compile options of the step programs' dense GEMMs (`GEMM_COMPILER_OPTIONS`)
    concurrent  CONCURRENT command-buffer scheduling for steps of at least concurrent_min_tokens

Why each rule is what it is, the runs behind it and what would change it (one section each):

    attention   benchmarks/DECISIONS.md#attention-backend
    unroll      benchmarks/DECISIONS.md#unroll-layers
    quant       benchmarks/DECISIONS.md#quant-kernel-choice
    w8a8        benchmarks/DECISIONS.md#w8a8-min-tokens
    gemm        benchmarks/DECISIONS.md#gemm-backend
    concurrent  benchmarks/DECISIONS.md#concurrent-scheduling

One table here is a choice of the model's storage rather than of the step: `KMAJOR_SERVING`, which
8-bit formats the serving layout stores K-major (jaxlora.model.params.build_model reads it where its
`kmajor` argument is not given; benchmarks/DECISIONS.md#fp8-layout).

This module is the ground floor of the choice: it imports nothing of the model or the engine, which
read it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxlora.config import AttentionBackend, LoraBackend, LoraBank


class QuantMatmul(enum.StrEnum):
    """How the GEMM of a weight-only quantized projection runs (jaxlora.model.quant; same math)."""

    AUTO = "auto"  # per GPU kind and step size, QUANT_AUTO (`KernelConfig.resolve`)
    XLA = "xla"  # (x @ q.astype(x.dtype)) * scale: XLA writes a dequantized copy of the weight first
    PALLAS = "pallas"  # pallas_kernels.quant.triton: converts tiles in registers, reads a layer in place
    MGPU = "mgpu"  # pallas_kernels.quant.mgpu (Mosaic GPU, Hopper): TMA-fed wgmma, K-major weights
    BEST = "best"  # per format, the fastest kernel whose output was checked on the GPU (BEST_KERNEL)


class QuantKernel(enum.StrEnum):
    """Which kernel multiplies a quantized projection that holds the whole stack (model.quant.project)."""

    TRITON = "triton"  # pallas_kernels.quant.triton: any shape, either layout
    MGPU = "mgpu"  # pallas_kernels.quant.mgpu: Hopper, K-major, <= 256 rows, widths of 64
    BEST = "best"  # per format, the fastest kernel checked on the GPU: BEST_KERNEL


# QuantKernel.BEST by storage dtype: per format the fastest kernel whose output was compared with a
# float64 product on the GPU. Both 8-bit formats run the Mosaic kernel, faster than the Triton one at
# every decode size, e4m3 since its output passed that check (benchmarks/DECISIONS.md#quant-kernel-choice).
BEST_KERNEL: dict[jnp.dtype, QuantKernel] = {
    jnp.dtype(jnp.int8): QuantKernel.MGPU,
    jnp.dtype(jnp.float8_e4m3fn): QuantKernel.MGPU,
}

# The serving layout's storage by format, where build_model is not told (its `kmajor` argument,
# `model.quant.serving_kmajor`): True stores the projections K-major (`qkernel_t` [L, out, in], the
# layout both the Mosaic kernel and cuBLASLt's 8-bit GEMMs read without a transpose), False as
# `qkernel` [L, in, out]. A format whose BEST_KERNEL is the Mosaic kernel must be K-major (that
# kernel reads nothing else); for e4m3 the formats benchmark's A/B of both layouts also measured
# K-major W8A8 steps faster and its Triton decode steps no slower (benchmarks/DECISIONS.md#fp8-layout).
KMAJOR_SERVING: dict[jnp.dtype, bool] = {
    jnp.dtype(jnp.int8): True,
    jnp.dtype(jnp.float8_e4m3fn): True,
}

# QuantMatmul -> QuantKernel, for the choices that run a kernel.
_QUANT_KERNELS = {
    QuantMatmul.PALLAS: QuantKernel.TRITON,
    QuantMatmul.MGPU: QuantKernel.MGPU,
    QuantMatmul.BEST: QuantKernel.BEST,
}
_HOPPER_ONLY = (QuantMatmul.MGPU, QuantMatmul.BEST)
# KernelConfig.w8a8 (other than "auto") -> the storage dtypes that run W8A8.
_W8A8_CHOICES: dict[bool | str, tuple[str, ...]] = {
    "auto": (),
    True: ("float8_e4m3fn", "int8"),
    False: (),
    "fp8": ("float8_e4m3fn",),
    "int8": ("int8",),
}  # wgmma and the TMA engine: compute capability 9.x
# The Mosaic kernel's largest step (wgmma's N): MGPU and BEST run steps of at most this many tokens.
QUANT_KERNEL_MAX_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class QuantRule:
    """quant_matmul="auto" on one kind of GPU: `kernel` for steps of at most `max_tokens` tokens, XLA above."""

    kernel: QuantMatmul
    max_tokens: int


# quant_matmul="auto" for a model in the serving layout on GPU, by GPU kind ("hopper": compute
# capability 9.x; "gpu": any other): the rule's kernel for steps of at most max_tokens tokens, XLA above.
# On a Hopper GPU the per-format kernel (BEST), up to the Mosaic kernel's limit (wgmma's N); on
# other GPUs the Triton kernel. Rule: each format's kernel beats XLA's dequantize-then-GEMM at every
# step size it takes (benchmarks/DECISIONS.md#quant-kernel-choice).
QUANT_AUTO: dict[str, QuantRule] = {
    "hopper": QuantRule(QuantMatmul.BEST, QUANT_KERNEL_MAX_TOKENS),
    "gpu": QuantRule(QuantMatmul.PALLAS, QUANT_KERNEL_MAX_TOKENS),
}


# W8A8 ("auto") by GPU kind and weight storage dtype: steps of at least this many tokens that take
# XLA's path (no weight-only kernel takes them, `quant_matmul_at`) quantize their activations per
# token and multiply 8-bit by 8-bit (jaxlora.model.w8a8); a format absent here stays weight-only
# (XLA's dequantize-then-GEMM). On Hopper both 8-bit formats switch at the first step the weight-only
# kernel leaves to XLA: XLA's path there writes a bf16 copy of every weight before a bf16 GEMM, where
# W8A8 reads the 1-byte weights straight into an 8-bit GEMM, and the formats benchmark measured W8A8
# faster than weight-only there for both (benchmarks/DECISIONS.md#w8a8-min-tokens). Other GPUs have
# no FP8 tensor cores (before 8.9) or were not measured.
W8A8_AUTO: dict[str, dict[jnp.dtype, int]] = {
    "hopper": {
        jnp.dtype(jnp.float8_e4m3fn): QUANT_KERNEL_MAX_TOKENS + 1,
        jnp.dtype(jnp.int8): QUANT_KERNEL_MAX_TOKENS + 1,
    },
    "gpu": {},
}


class GemmBackend(enum.StrEnum):
    """Who runs the step's dense GEMMs on GPU (an XLA compile option of the step program; same math)."""

    AUTO = "auto"  # CUBLAS on GPU for the serving layout, XLA elsewhere (`KernelConfig.resolve`)
    XLA = "xla"  # XLA's own choice per GEMM: autotuned Triton fusions or cuBLAS
    CUBLAS = "cublas"  # Triton GEMM fusions off: every GEMM a cuBLAS call


# The XLA compile options of each choice (jax.jit(compiler_options=...)); none change the math, and
# GPU options are ignored on other platforms. "cublas" (the one-device serving layout on GPU) also
# lets the step's command buffer run commands that share no buffer side by side (CONCURRENT; XLA's
# default keeps its thunk order): a module group's LoRA shrink, which reads only x, can then overlap
# the base GEMM. It shortened decode steps with the same tokens and left served throughput as it
# was (benchmarks/DECISIONS.md#concurrent-scheduling). Not on the "xla" choice: the tensor-parallel
# path's collectives were not run under it. The dense GEMMs go to cuBLAS only for the serving
# layout, where its wide fused matrices stream faster (benchmarks/DECISIONS.md#gemm-backend).
GEMM_COMPILER_OPTIONS: dict[str, dict[str, bool | str]] = {
    "xla": {},
    "cublas": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
}
_SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"
# Steps of fewer tokens compile without CONCURRENT scheduling (StepKernels.concurrent_min_tokens).
# 1: every step has it. It helped at 64 and 256 rows, and at one row the host loop decoded faster
# with it than without (benchmarks/DECISIONS.md#concurrent-scheduling).
CONCURRENT_MIN_TOKENS = 1
# Steps of at most this many tokens unroll their layers where unrolling is on: small steps are bound
# by reading the weights, where the scan's per-layer weight copy costs most; large ones are
# compute-bound and keep the scan's short compile (benchmarks/DECISIONS.md#unroll-layers).
UNROLL_MAX_TOKENS = 512


def gemm_compiler_options(gemm: GemmBackend | str, *, concurrent: bool) -> dict[str, bool | str]:
    """The compile options of a step program on `gemm`; without CONCURRENT scheduling unless `concurrent`."""
    options = dict(GEMM_COMPILER_OPTIONS[GemmBackend(gemm).value])
    if not concurrent:
        options.pop(_SCHEDULING_OPTION, None)
    return options


def gpu_compute_capability() -> str | None:
    """The default GPU's compute capability ("9.0" on an H100 / H200), or None without a CUDA GPU."""
    try:
        return getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:
        return None


def is_hopper(compute_capability: str | None) -> bool:
    """Whether wgmma runs there: 9.x only (Blackwell, 10.x, has tcgen05 instead)."""
    return compute_capability is not None and compute_capability.split(".")[0] == "9"


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _resolved(name: str, value: Any, kind: type[enum.StrEnum]) -> enum.StrEnum:
    allowed = tuple(a.value for a in kind if a.value != "auto")
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {allowed}")
    return kind(value)


@dataclasses.dataclass(frozen=True)
class StepKernels:
    """Static kernel choices for one jitted model step (hashable, never traced; nothing here is "auto").

    lora: how the LoRA term is computed (pallas_kernels.lora.api's backend) with a padded bank.
    lora_bank: PAGED when the steps read a paged bank, whose LoRA term always runs the paged Pallas
      kernels (pallas_kernels.lora.paged), interpreted on CPU; UNIFIED for a unified bank, whose term
      runs the unified Pallas kernels when `lora` is PALLAS (pallas_kernels.lora.unified), else their
      XLA gather (pallas_kernels.lora.unified_xla).
    interpret: run Pallas kernels in interpret mode (CPU).
    attention: PALLAS runs the paged step's attention through `pallas_kernels.ragged_paged_attention`,
      XLA through its plain-XLA twin (a dense KVCache always uses the masked einsum).
    unroll_layers: run the layers as an unrolled Python loop instead of `lax.scan` for steps of one
      token per row and at most `unroll_max_tokens` rows (same math; XLA then sees each layer's
      weights as a static slice, at the cost of compile time growing with depth).
    quant_matmul: how quantized projections multiply in steps of at most `quant_kernel_max_tokens`
      tokens (None: every step, PALLAS only; MGPU and BEST need 1..QUANT_KERNEL_MAX_TOKENS); larger
      steps take XLA's path (`quant_matmul_at`). With a kernel the model hands each quantized
      projection its whole stack and the layer index (see `Llama.__call__`).
    gemm: the XLA compile options of the engine's step programs for their dense GEMMs.
    concurrent_min_tokens: step programs of fewer tokens compile without the choice's CONCURRENT
      command-buffer scheduling (`compiler_options`): the command buffer of such a step is updated
      on the host at every dispatch, and where the device step is short that update is what the
      step waits for.
    w8a8_min_tokens: ((storage dtype name, min tokens), ...): steps of at least `min tokens` tokens
      on XLA's path (`quant_matmul_at`) multiply weights of that storage dtype W8A8
      (jaxlora.model.w8a8); formats not listed stay weight-only.
    """

    lora: LoraBackend = LoraBackend.XLA
    lora_bank: LoraBank = LoraBank.PADDED
    interpret: bool = False
    attention: AttentionBackend = AttentionBackend.XLA
    unroll_layers: bool = False
    unroll_max_tokens: int = UNROLL_MAX_TOKENS
    quant_matmul: QuantMatmul = QuantMatmul.XLA
    quant_kernel_max_tokens: int | None = None
    gemm: GemmBackend = GemmBackend.XLA
    concurrent_min_tokens: int = CONCURRENT_MIN_TOKENS
    w8a8_min_tokens: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "w8a8_min_tokens", _w8a8_table(self.w8a8_min_tokens))
        object.__setattr__(self, "lora", LoraBackend(self.lora))  # accept the string form too
        object.__setattr__(self, "lora_bank", LoraBank(self.lora_bank))
        for name, kind in (("attention", AttentionBackend), ("quant_matmul", QuantMatmul), ("gemm", GemmBackend)):
            object.__setattr__(self, name, _resolved(name, getattr(self, name), kind))
        if self.quant_kernel_max_tokens is not None and not _is_positive_int(self.quant_kernel_max_tokens):
            raise ValueError(f"quant_kernel_max_tokens={self.quant_kernel_max_tokens!r} must be a positive int or None")
        limit = self.quant_kernel_max_tokens
        if self.quant_matmul in _HOPPER_ONLY and (limit is None or limit > QUANT_KERNEL_MAX_TOKENS):
            raise ValueError(
                f"quant_matmul={self.quant_matmul.value} runs the Mosaic kernel, which takes at most "
                f"{QUANT_KERNEL_MAX_TOKENS} rows: quant_kernel_max_tokens={limit!r} must be 1..{QUANT_KERNEL_MAX_TOKENS}"
            )
        for name in ("concurrent_min_tokens", "unroll_max_tokens"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive int")

    @classmethod
    def for_platform(
        cls,
        lora: LoraBackend | str,
        platform: str | None = None,
        *,
        fused_projections: bool = True,
        compute_capability: str | None = None,
        lora_bank: LoraBank | str = LoraBank.PADDED,
        **choices: Any,
    ) -> StepKernels:
        """`KernelConfig(**choices).resolve(...)`: the kernels of a model on `platform`, "auto" where
        `choices` does not say."""
        return KernelConfig(**choices).resolve(
            lora,
            platform,
            fused_projections=fused_projections,
            compute_capability=compute_capability,
            lora_bank=lora_bank,
        )

    def compiler_options(self, num_tokens: int) -> dict[str, bool | str]:
        """The XLA compile options of a step program of `num_tokens` tokens."""
        return gemm_compiler_options(self.gemm, concurrent=num_tokens >= self.concurrent_min_tokens)

    def quant_matmul_at(self, num_tokens: int) -> QuantMatmul:
        """How a step of `num_tokens` tokens multiplies its quantized projections."""
        limit = self.quant_kernel_max_tokens
        return self.quant_matmul if limit is None or num_tokens <= limit else QuantMatmul.XLA

    def w8a8_at(self, num_tokens: int, storage_dtype: jnp.dtype) -> bool:
        """Whether a step of `num_tokens` tokens multiplies weights of `storage_dtype` W8A8."""
        if self.uses_quant_kernel(num_tokens):
            return False
        min_tokens = dict(self.w8a8_min_tokens).get(jnp.dtype(storage_dtype).name)
        return min_tokens is not None and num_tokens >= min_tokens

    def uses_quant_kernel(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs its quantized GEMMs in a Pallas kernel."""
        return self.quant_matmul_at(num_tokens) in _QUANT_KERNELS

    @property
    def quant_kernel(self) -> QuantKernel:
        """The kernel a quantized projection holding its stack runs (model.quant.project)."""
        return _QUANT_KERNELS.get(self.quant_matmul, QuantKernel.TRITON)

    def unrolls(self, rows: int, tokens_per_row: int = 1) -> bool:
        """Whether a step of `rows` rows of `tokens_per_row` tokens runs its layers unrolled."""
        return self.unroll_layers and tokens_per_row == 1 and rows <= self.unroll_max_tokens

    def describe(self, num_tokens: int) -> str:
        """What a step of `num_tokens` tokens (one per row) runs, for the warm-up's log."""
        options = self.compiler_options(num_tokens)
        lora = {
            LoraBank.PADDED: self.lora.value,
            LoraBank.PAGED: "paged",
            LoraBank.UNIFIED: f"unified-{'pallas' if self.lora is LoraBackend.PALLAS else 'xla'}",
        }[self.lora_bank]
        return (
            f"lora={lora} attention={self.attention.value} "
            f"layers={'unrolled' if self.unrolls(num_tokens) else 'scan'} "
            f"quant={self.quant_matmul_at(num_tokens).value}{self._describe_w8a8(num_tokens)} "
            f"gemm={self.gemm.value}{' concurrent' if _SCHEDULING_OPTION in options else ''}"
            f"{' interpret' if self.interpret else ''}"
        )

    def _describe_w8a8(self, num_tokens: int) -> str:
        names = [name for name, _ in self.w8a8_min_tokens if self.w8a8_at(num_tokens, jnp.dtype(name))]
        return f" w8a8={','.join(names)}" if names else ""


_W8A8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn).name, jnp.dtype(jnp.int8).name)


def _w8a8_table(table: Any) -> tuple[tuple[str, int], ...]:
    """StepKernels.w8a8_min_tokens in its canonical form (sorted, dtype names); ValueError if malformed."""
    try:
        entries = dict(table)
    except (TypeError, ValueError):
        raise ValueError(f"w8a8_min_tokens={table!r} must be pairs of (storage dtype, min tokens)") from None
    out = []
    for dtype, min_tokens in entries.items():
        name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if name not in _W8A8_DTYPES:
            raise ValueError(f"w8a8_min_tokens names {dtype!r}: W8A8 takes {_W8A8_DTYPES}")
        if not _is_positive_int(min_tokens):
            raise ValueError(f"w8a8_min_tokens[{name!r}]={min_tokens!r} must be a positive int")
        out.append((name, min_tokens))
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """The `kernels:` section of an engine config: every choice but the LoRA backend (the bank's
    config, `lora.backend`), "auto" allowed; `resolve` turns it into a StepKernels.

    attention: "auto" (the Pallas kernel on GPU, XLA elsewhere) | "pallas" | "xla".
    unroll_layers: "auto" (on GPU) | true | false; unroll_max_tokens: the largest step that unrolls.
    quant_matmul: "auto" (on GPU and for the serving layout, QUANT_AUTO's rule for the GPU kind; XLA
      otherwise) | "xla" | "pallas" (the Triton kernel, every step) | "mgpu" | "best" (Hopper only).
    quant_kernel_max_tokens: the largest step a quant kernel runs (None: the rule's; XLA above).
    gemm: "auto" (cuBLAS on GPU for the serving layout, XLA otherwise) | "xla" | "cublas".
    concurrent_min_tokens: the smallest step compiled with CONCURRENT scheduling (on "cublas").
    w8a8: "auto" (on GPU and for the serving layout, W8A8_AUTO's table for the GPU kind; off
      otherwise) | true (both 8-bit formats) | "fp8" | "int8" | false: which formats quantize their
      activations in steps on XLA's path; w8a8_min_tokens: from which step size (None: the table's
      for "auto", 1 otherwise).
    """

    attention: AttentionBackend = AttentionBackend.AUTO
    unroll_layers: bool | str = "auto"
    unroll_max_tokens: int = UNROLL_MAX_TOKENS
    quant_matmul: QuantMatmul = QuantMatmul.AUTO
    quant_kernel_max_tokens: int | None = None
    gemm: GemmBackend = GemmBackend.AUTO
    concurrent_min_tokens: int = CONCURRENT_MIN_TOKENS
    w8a8: bool | str = "auto"
    w8a8_min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.w8a8 not in _W8A8_CHOICES:
            raise ValueError(f"w8a8={self.w8a8!r} must be one of {tuple(_W8A8_CHOICES)}")
        if self.w8a8_min_tokens is not None and not _is_positive_int(self.w8a8_min_tokens):
            raise ValueError(f"w8a8_min_tokens={self.w8a8_min_tokens!r} must be a positive int or None")
        for name, kind in (("attention", AttentionBackend), ("quant_matmul", QuantMatmul), ("gemm", GemmBackend)):
            if getattr(self, name) not in tuple(kind):
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {tuple(a.value for a in kind)}")
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.unroll_layers not in (True, False, "auto"):
            raise ValueError(f"unroll_layers={self.unroll_layers!r} must be true, false or 'auto'")
        if self.quant_kernel_max_tokens is not None and not _is_positive_int(self.quant_kernel_max_tokens):
            raise ValueError(f"quant_kernel_max_tokens={self.quant_kernel_max_tokens!r} must be a positive int or None")
        for name in ("concurrent_min_tokens", "unroll_max_tokens"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive int")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KernelConfig:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown kernels config key(s) {sorted(unknown)}")
        return cls(**d)

    def resolve(
        self,
        lora: LoraBackend | str,
        platform: str | None = None,
        *,
        fused_projections: bool = True,
        compute_capability: str | None = None,
        lora_bank: LoraBank | str = LoraBank.PADDED,
    ) -> StepKernels:
        """The StepKernels of a model on `platform` (None: JAX's default backend), its LoRA bank
        `lora_bank` (a paged bank runs Pallas kernels: interpreted on CPU).

        Pallas runs natively on GPU; on CPU the only way to run it is the interpreter. A quant kernel
        by name: "pallas" runs the Triton kernel in every step (up to quant_kernel_max_tokens when
        given); "mgpu" (which reads only the serving layout's K-major weights, `KMAJOR_SERVING`) and "best" need a
        Hopper GPU (`compute_capability` 9.x; None reads the default GPU's) or the interpreter on CPU,
        and run steps of up to QUANT_KERNEL_MAX_TOKENS (XLA above). Every quant kernel is a GPU one,
        so any on a TPU raises ValueError, as do "mgpu" for the separate layout
        (`fused_projections` False: tensor parallelism, where no kernel was run on shards) and
        "mgpu" / "best" on a GPU that is not a Hopper. gemm="auto" picks cuBLAS only for the serving
        layout (jaxlora.model.fused: its wide q|k|v and gate|up GEMMs stream their weights faster
        through cuBLAS at decode sizes): with one matrix per module cuBLAS was the slower choice
        (benchmarks/DECISIONS.md#gemm-backend).
        """
        platform = platform or jax.default_backend()
        lora, lora_bank = LoraBackend(lora), LoraBank(lora_bank)
        attention = self.attention
        if attention is AttentionBackend.AUTO:
            attention = AttentionBackend.PALLAS if platform == "gpu" else AttentionBackend.XLA
        unroll = platform == "gpu" if self.unroll_layers == "auto" else bool(self.unroll_layers)
        if platform == "gpu" and compute_capability is None:
            compute_capability = gpu_compute_capability()
        hopper = platform == "cpu" or is_hopper(compute_capability)  # the interpreter runs anything
        quant_matmul, limit = self._quant(platform, hopper, fused_projections, compute_capability)
        gemm = self.gemm
        if gemm is GemmBackend.AUTO:
            gemm = GemmBackend.CUBLAS if platform == "gpu" and fused_projections else GemmBackend.XLA
        uses_pallas = (
            lora is LoraBackend.PALLAS
            or lora_bank is LoraBank.PAGED  # always the paged kernels (the unified bank follows `lora`)
            or attention is AttentionBackend.PALLAS
            or quant_matmul in _QUANT_KERNELS
        )
        return StepKernels(
            lora=lora,
            lora_bank=lora_bank,
            interpret=uses_pallas and platform == "cpu",
            attention=attention,
            unroll_layers=unroll,
            unroll_max_tokens=self.unroll_max_tokens,
            quant_matmul=quant_matmul,
            quant_kernel_max_tokens=limit,
            gemm=gemm,
            concurrent_min_tokens=self.concurrent_min_tokens,
            w8a8_min_tokens=self._w8a8(platform, hopper, fused_projections),
        )

    def _w8a8(self, platform: str, hopper: bool, fused_projections: bool) -> tuple[tuple[str, int], ...]:
        """StepKernels.w8a8_min_tokens of the resolved choice."""
        if self.w8a8 == "auto":
            if platform != "gpu" or not fused_projections:
                return ()
            table = W8A8_AUTO["hopper" if hopper else "gpu"]
            return tuple((d.name, self.w8a8_min_tokens or n) for d, n in table.items())
        return tuple((name, self.w8a8_min_tokens or 1) for name in _W8A8_CHOICES[self.w8a8])

    def _quant(
        self, platform: str, hopper: bool, fused_projections: bool, compute_capability: str | None
    ) -> tuple[QuantMatmul, int | None]:
        """(quant_matmul, quant_kernel_max_tokens) of the resolved choice; raises ValueError where it cannot run."""
        quant_matmul, limit = self.quant_matmul, self.quant_kernel_max_tokens
        if quant_matmul is QuantMatmul.AUTO:
            if platform != "gpu" or not fused_projections:
                return QuantMatmul.XLA, None
            rule = QUANT_AUTO["hopper" if hopper else "gpu"]
            quant_matmul, limit = rule.kernel, min(rule.max_tokens, limit or rule.max_tokens)
        if quant_matmul in _HOPPER_ONLY:
            if platform == "gpu" and not hopper:
                raise ValueError(
                    f"quant_matmul={quant_matmul.value} runs wgmma: it needs a Hopper GPU (compute capability 9.x), "
                    f"not {compute_capability}; use 'pallas'"
                )
            if quant_matmul is QuantMatmul.MGPU and not fused_projections:
                raise ValueError(
                    "quant_matmul=mgpu reads the serving layout's K-major weights; the separate layout "
                    "(tensor parallelism) has none: use 'pallas' or 'best'"
                )
            limit = min(limit or QUANT_KERNEL_MAX_TOKENS, QUANT_KERNEL_MAX_TOKENS)
        if quant_matmul in _QUANT_KERNELS and platform not in ("gpu", "cpu"):
            raise ValueError(
                f"quant_matmul={quant_matmul.value} is a GPU kernel: it runs on GPU (or interpreted on CPU), not {platform}"
            )
        return quant_matmul, limit
