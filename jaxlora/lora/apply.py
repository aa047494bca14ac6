"""The one seam where LoRA enters the model: per-row `y += scale * (x @ A[slot]) @ B[slot]`.

Contract (every backend computes exactly this; pallas_kernels documents the math of each op):

    for each token t with slot s = token_slots[t]:
        h[t]        = x[t] @ bank[group]["a"][s]                 # shrink, all modules of the group
        y_m[t]     += h[t, i*R:(i+1)*R] @ bank[group]["b"][m][s]  # expand, module m = modules[i]

Slot 0 is all-zero, so base-model rows come out unchanged.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxlora.config import AttentionBackend, LoraBackend
from jaxlora.lora.bank import GROUPS

GROUP_MODULES: dict[str, tuple[str, ...]] = dict(GROUPS)


class QuantMatmul(enum.StrEnum):
    """How the GEMM of a weight-only quantized projection runs (jaxlora.model.quant; same math)."""

    AUTO = "auto"  # BEST (Hopper) or PALLAS for small steps of the serving layout on GPU, else XLA (`for_platform`)
    XLA = "xla"  # (x @ q.astype(x.dtype)) * scale: XLA writes a dequantized copy of the weight first
    PALLAS = "pallas"  # pallas_kernels.quant.triton (Triton): converts tiles in registers, reads a layer in place
    MGPU = "mgpu"  # pallas_kernels.quant.mgpu (Mosaic GPU, Hopper): TMA-fed wgmma, K-major weights
    BEST = "best"  # per format, the fastest kernel whose output was checked on the GPU (model.quant.BEST_KERNEL)


class GemmBackend(enum.StrEnum):
    """Who runs the step's dense GEMMs on GPU (an XLA compile option of the step program; same math)."""

    AUTO = "auto"  # CUBLAS on GPU, XLA elsewhere (resolved by `LoraRuntime.for_platform`)
    XLA = "xla"  # XLA's own choice per GEMM: autotuned Triton fusions or cuBLAS
    CUBLAS = "cublas"  # Triton GEMM fusions off: every GEMM a cuBLAS call (faster decode GEMMs, H200)


# The XLA compile options of each choice (jax.jit(compiler_options=...)); none change the math, and
# GPU options are ignored on other platforms. "cublas" (the one-device serving layout on GPU) also
# lets the step's command buffer run commands that share no buffer side by side (CONCURRENT; XLA's
# default keeps its thunk order): a module group's LoRA shrink, which reads only x, can then overlap
# the base GEMM. H200, 7B shape, the engine's decode step: 64 rows on 64 adapters 7.78 -> 7.50 ms,
# on one adapter 6.66 -> 6.30 ms, 256 rows 14.96 -> 14.91 ms, the same tokens; S-LoRA's `all` trace
# at 40 req/s unchanged, 28.66 / 28.67 req/s (benchmarks/results/probe_s11c, probe_s11d, probe_s11e).
# Not on the "xla" choice: the tensor-parallel path's collectives were not run under it.
GEMM_COMPILER_OPTIONS: dict[str, dict[str, bool | str]] = {
    "xla": {},
    "cublas": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
}
_SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"
# Steps of fewer tokens compile without CONCURRENT scheduling (LoraRuntime.concurrent_min_tokens).
# 1: every step has it, as measured at 64 and 256 rows. At one row the engine's dispatch took 8.5 ms
# against a 4.8 ms device step in the first run under it, 4.7 against 5.2 ms in the run before
# (benchmarks/results/e2e_formats_probe/, e2e_probe_s9/); whether CONCURRENT causes that is not
# measured yet: `benchmarks.host_loop --concurrent-min-tokens` is that A/B.
CONCURRENT_MIN_TOKENS = 1


def gemm_compiler_options(gemm: GemmBackend | str, *, concurrent: bool) -> dict[str, bool | str]:
    """The compile options of a step program on `gemm`; without CONCURRENT scheduling unless `concurrent`."""
    options = dict(GEMM_COMPILER_OPTIONS[GemmBackend(gemm).value])
    if not concurrent:
        options.pop(_SCHEDULING_OPTION, None)
    return options


# quant_matmul="auto" on a Hopper GPU: the per-format kernel (BEST) for steps of at most this many
# tokens (the Mosaic kernel's limit: wgmma's N), XLA above. H200, the seven projections of 8
# Llama-2-7B layers in the serving layout, ms at 16 / 64 / 128 / 256 rows
# (benchmarks/results/mgpu_probe/): bf16 cuBLAS 0.93 / 0.95 / 1.04 / 1.31; int8 on the Mosaic kernel
# 0.72 / 1.04 / 1.29 / 2.00, on the Triton kernel 1.20 / 1.43 / 1.75 / 2.88; FP8 on the Triton
# kernel 1.59 / 1.90 / 2.07 / 3.35 and XLA's dequantize-then-GEMM (int8) 2.90 / 2.95 / 3.03 / 3.38
# (decode_floor_probe/q). So each format's kernel beats XLA's path at every size it takes, and int8
# beats bf16 at 16 rows (measured at 16, 64, 128 and 256 only).
QUANT_KERNEL_MAX_TOKENS = 256
# QuantMatmul -> jaxlora.model.quant.QuantKernel, for the choices that run a kernel.
_QUANT_KERNELS = {"pallas": "triton", "mgpu": "mgpu", "best": "best"}
_HOPPER_ONLY = ("mgpu", "best")  # wgmma and the TMA engine: compute capability 9.x


def gpu_compute_capability() -> str | None:
    """The default GPU's compute capability ("9.0" on an H100 / H200), or None without a CUDA GPU."""
    try:
        return getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:
        return None


def is_hopper(compute_capability: str | None) -> bool:
    """Whether wgmma runs there: 9.x only (Blackwell, 10.x, has tcgen05 instead)."""
    return compute_capability is not None and compute_capability.split(".")[0] == "9"


@dataclasses.dataclass(frozen=True)
class LoraRuntime:
    """Static kernel choices for one jitted model step (hashable, never traced).

    backend: how the LoRA term is computed.
    interpret: run Pallas kernels in interpret mode (CPU).
    attention: PALLAS runs the paged step's attention through `pallas_kernels.ragged_paged_attention`,
      XLA through its plain-XLA twin (a dense KVCache always uses the masked einsum). Never AUTO
      here: `for_platform` resolves it.
    unroll_layers: run the layers as an unrolled Python loop instead of `lax.scan` (same math; lets
      XLA see each layer's weights as a static slice, at the cost of compile time growing with depth).
    unroll_max_tokens: unroll only steps of at most this many tokens (one token per row). Small
      steps are bound by reading the weights, where the scan's per-layer weight copy costs most;
      large ones are compute-bound and keep the scan's short compile.
    quant_matmul: how quantized projections multiply (unrolled or scanned). With PALLAS or MGPU
      the model hands each quantized projection its whole stack and the layer index (see
      `Llama.__call__`). Never AUTO here: `for_platform` resolves it.
    quant_kernel_max_tokens: PALLAS / MGPU / BEST run step programs of at most this many tokens (a
      step's budget, padding included); larger ones take XLA's path (None: every step, PALLAS only;
      MGPU and BEST need 1..QUANT_KERNEL_MAX_TOKENS, the Mosaic kernel's limit). See
      QUANT_KERNEL_MAX_TOKENS for what was measured.
    gemm: the XLA compile options of the engine's step programs for their dense GEMMs
      (GEMM_COMPILER_OPTIONS; read by jaxlora.engine.runner). Never AUTO here.
    concurrent_min_tokens: step programs of fewer tokens compile without the choice's CONCURRENT
      command-buffer scheduling (`gemm_compiler_options`): the command buffer of such a step is
      updated on the host at every dispatch, and where the device step is short that update is
      what the step waits for.
    """

    backend: LoraBackend = LoraBackend.XLA
    interpret: bool = False
    attention: AttentionBackend = AttentionBackend.XLA
    unroll_layers: bool = False
    unroll_max_tokens: int = 512
    quant_matmul: QuantMatmul = QuantMatmul.XLA
    quant_kernel_max_tokens: int | None = None
    gemm: GemmBackend = GemmBackend.XLA
    concurrent_min_tokens: int = CONCURRENT_MIN_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", LoraBackend(self.backend))  # accept the string form too
        for name, kind in (("attention", AttentionBackend), ("quant_matmul", QuantMatmul), ("gemm", GemmBackend)):
            resolved = tuple(a.value for a in kind if a.value != "auto")
            if getattr(self, name) not in resolved:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {resolved}")
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.quant_kernel_max_tokens is not None and not _is_positive_int(self.quant_kernel_max_tokens):
            raise ValueError(f"quant_kernel_max_tokens={self.quant_kernel_max_tokens!r} must be a positive int or None")
        limit = self.quant_kernel_max_tokens
        if self.quant_matmul.value in _HOPPER_ONLY and (limit is None or limit > QUANT_KERNEL_MAX_TOKENS):
            raise ValueError(
                f"quant_matmul={self.quant_matmul.value} runs the Mosaic kernel, which takes at most "
                f"{QUANT_KERNEL_MAX_TOKENS} rows: quant_kernel_max_tokens={limit!r} must be 1..{QUANT_KERNEL_MAX_TOKENS}"
            )
        if not _is_positive_int(self.concurrent_min_tokens):
            raise ValueError(f"concurrent_min_tokens={self.concurrent_min_tokens!r} must be a positive int")

    def compiler_options(self, num_tokens: int) -> dict[str, bool | str]:
        """The XLA compile options of a step program of `num_tokens` tokens."""
        return gemm_compiler_options(self.gemm, concurrent=num_tokens >= self.concurrent_min_tokens)

    def uses_quant_kernel(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs its quantized GEMMs in a Pallas kernel."""
        limit = self.quant_kernel_max_tokens
        return self.quant_matmul.value in _QUANT_KERNELS and (limit is None or num_tokens <= limit)

    @property
    def quant_kernel(self) -> str:
        """The kernel a quantized projection holding its stack runs (jaxlora.model.quant.QuantKernel)."""
        return _QUANT_KERNELS.get(self.quant_matmul.value, "triton")

    @classmethod
    def for_platform(
        cls,
        backend: LoraBackend | str,
        platform: str | None = None,
        *,
        attention: AttentionBackend | str = AttentionBackend.AUTO,
        unroll_layers: bool | None = None,
        quant_matmul: QuantMatmul | str = QuantMatmul.AUTO,
        gemm: GemmBackend | str = GemmBackend.AUTO,
        fused_projections: bool = True,
        concurrent_min_tokens: int = CONCURRENT_MIN_TOKENS,
        compute_capability: str | None = None,
    ) -> LoraRuntime:
        """Pallas runs natively on GPU and TPU; on CPU the only way to run it is the interpreter.

        attention="auto" picks the Pallas decode-attention kernel on GPU and XLA elsewhere;
        unroll_layers=None unrolls decode steps on GPU (see `Llama.__call__`) and scans elsewhere,
        where compile time matters more. quant_matmul="auto" picks, on GPU and for a model in the
        serving layout, a quantized-GEMM kernel for steps of at most QUANT_KERNEL_MAX_TOKENS tokens
        (where each was measured faster than XLA's path) and XLA for larger steps: on a Hopper GPU
        (`compute_capability` 9.x; None reads the default GPU's) BEST, the kernel chosen per format
        (jaxlora.model.quant.BEST_KERNEL: the Mosaic GPU kernel for int8, the Triton one for FP8),
        elsewhere the Triton kernel (PALLAS); XLA for the separate layout (tensor parallelism: no
        kernel was run on shards) and off GPU. By name, "pallas" runs the Triton kernel in every
        step; "mgpu" (the Mosaic kernel, which reads only the serving layout's K-major int8 weights)
        and "best" need a Hopper GPU (or the interpreter on CPU), and run steps of up to 256 tokens
        (XLA above). Every kernel is a GPU one, so any on a TPU raises ValueError, as do "mgpu"
        for the separate layout and "mgpu" / "best" on a GPU that is not a Hopper.
        gemm="auto" picks CUBLAS on GPU for a model in the serving layout
        (`fused_projections`, jaxlora.model.fused: its wide q|k|v and gate|up GEMMs stream their
        weights faster through cuBLAS at decode sizes) and XLA otherwise: with one matrix per module
        cuBLAS was the slower choice at 64 rows (8 layers of the 7B projections: 1.31 against 1.23 ms,
        benchmarks/results/floor_probe_s8/).
        """
        platform = platform or jax.default_backend()
        if unroll_layers is None:
            unroll_layers = platform == "gpu"
        backend = LoraBackend(backend)
        attention = AttentionBackend(attention)
        if attention is AttentionBackend.AUTO:
            attention = AttentionBackend.PALLAS if platform == "gpu" else AttentionBackend.XLA
        quant_matmul = QuantMatmul(quant_matmul)
        quant_kernel_max_tokens = None
        if platform == "gpu" and compute_capability is None:
            compute_capability = gpu_compute_capability()
        hopper = platform == "cpu" or is_hopper(compute_capability)  # the interpreter runs anything
        if quant_matmul is QuantMatmul.AUTO:
            measured = platform == "gpu" and fused_projections
            kernel = QuantMatmul.BEST if hopper else QuantMatmul.PALLAS
            quant_matmul = kernel if measured else QuantMatmul.XLA
            quant_kernel_max_tokens = QUANT_KERNEL_MAX_TOKENS if measured else None
        if quant_matmul.value in _HOPPER_ONLY:
            if platform == "gpu" and not hopper:
                raise ValueError(
                    f"quant_matmul={quant_matmul.value} runs wgmma: it needs a Hopper GPU (compute capability 9.x), "
                    f"not {compute_capability}; use 'pallas'"
                )
            if quant_matmul is QuantMatmul.MGPU and not fused_projections:
                raise ValueError(
                    "quant_matmul=mgpu reads the serving layout's K-major int8 weights; the separate layout "
                    "(tensor parallelism) has none: use 'pallas' or 'best'"
                )
            quant_kernel_max_tokens = QUANT_KERNEL_MAX_TOKENS
        gemm = GemmBackend(gemm)
        if gemm is GemmBackend.AUTO:
            gemm = GemmBackend.CUBLAS if platform == "gpu" and fused_projections else GemmBackend.XLA
        quant_kernel = quant_matmul.value in _QUANT_KERNELS
        if quant_kernel and platform not in ("gpu", "cpu"):
            raise ValueError(
                f"quant_matmul={quant_matmul.value} is a GPU kernel: it runs on GPU (or interpreted on CPU), not {platform}"
            )
        uses_pallas = backend is LoraBackend.PALLAS or attention is AttentionBackend.PALLAS or quant_kernel
        return cls(
            backend=backend,
            interpret=uses_pallas and platform == "cpu",
            attention=attention,
            unroll_layers=unroll_layers,
            quant_matmul=quant_matmul,
            quant_kernel_max_tokens=quant_kernel_max_tokens,
            gemm=gemm,
            concurrent_min_tokens=concurrent_min_tokens,
        )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def apply_group(
    group: str,
    group_bank: dict | None,
    x: jax.Array,
    outputs: dict[str, jax.Array],
    token_slots: jax.Array,
    runtime: LoraRuntime,
    seg_len: int | None,
    *,
    plan: pallas_kernels.LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Adds each row's adapter term to the outputs of one module group.

    Args:
      group: group name from `bank.GROUPS` (fixes the order of modules along the rank axis).
      group_bank: the group's bank entries ({"a": [S, in, G*R], "b": {m: [S, R, out]}}), or None when
        no module of the group is targeted. With `layer`, the entries of every layer ([L, S, ...]).
      x: [N, in] the group's shared input, N = rows * tokens.
      outputs: module -> [N, out_m], the base projections of every module of the group.
      token_slots: [N] int32 slot of each token.
      seg_len: tokens per row when N is rows of equal length sharing a slot (prefill), else None.
      plan: `step_plan(...)` for these token_slots, built once per step; None builds one per op.
      layer: int32 scalar, this layer's index into a stacked group_bank (the kernels read it in place).

    Returns:
      `outputs` with the LoRA term added to every module the bank holds.
    """
    if group_bank is None:
        return outputs
    # Pytrees sort dict keys, so the rank-axis order comes from GROUPS, never from the dict.
    modules = tuple(m for m in GROUP_MODULES[group] if m in group_bank["b"])
    kw = dict(backend=runtime.backend.value, interpret=runtime.interpret, seg_len=seg_len, plan=plan, layer=layer)
    ys = pallas_kernels.lora_group(
        x,
        group_bank["a"],
        tuple(outputs[m] for m in modules),
        tuple(group_bank["b"][m] for m in modules),
        token_slots,
        **kw,
    )
    return {**outputs, **dict(zip(modules, ys))}


def apply_group_fused(
    group: str,
    group_bank: dict | None,
    x: jax.Array,
    y: jax.Array,
    columns: tuple[int, ...],
    token_slots: jax.Array,
    runtime: LoraRuntime,
    seg_len: int | None,
    *,
    plan: pallas_kernels.LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """`apply_group` for a fused projection (jaxlora.model.fused): y [N, W] holds every module of the
    group, module GROUP_MODULES[group][i] in the columns from columns[i]; the LoRA term of each
    module the bank holds is added in those columns. Returns the updated y."""
    if group_bank is None:
        return y
    modules = GROUP_MODULES[group]
    held = [i for i, m in enumerate(modules) if m in group_bank["b"]]
    (y,) = pallas_kernels.lora_group(
        x,
        group_bank["a"],
        (y,),
        tuple(group_bank["b"][modules[i]] for i in held),
        token_slots,
        backend=runtime.backend.value,
        interpret=runtime.interpret,
        seg_len=seg_len,
        plan=plan,
        layer=layer,
        out_cols=tuple(columns[i] for i in held),
    )
    return y


def step_plan(
    bank: dict | None, token_slots: jax.Array, runtime: LoraRuntime, seg_len: int | None
) -> pallas_kernels.LoraPlan | None:
    """The row grouping shared by every LoRA op of one step (all layers, all groups); None without a bank.

    bank leaves are stacked over layers, [L, S, ...], so axis 1 is the slot count.
    """
    if not bank:
        return None
    num_slots = jax.tree.leaves(bank)[0].shape[1]
    return pallas_kernels.lora_plan(token_slots, num_slots=num_slots, seg_len=seg_len, backend=runtime.backend.value)


def token_slots_for(slot_ids: jax.Array, tokens_per_row: int) -> jax.Array:
    """[rows] slot ids -> [rows * tokens_per_row] slot of every token (rows are contiguous)."""
    return jnp.repeat(
        slot_ids.astype(jnp.int32), tokens_per_row, total_repeat_length=slot_ids.shape[0] * tokens_per_row
    )
