"""Weight-only quantized projections: int8 or FP8 (e4m3) weights, one float32 scale per output channel.

    w[i, o] ~= q[i, o] * scale[o]                q [in, out] int8 | float8_e4m3fn, scale [out] float32
    layer(x) = (x @ q.astype(x.dtype)) * scale (+ bias)

The scale multiplies the GEMM's output columns, never the weight, so a GEMM can read the 1-byte
weights, convert them on the fly and scale its result. XLA does not do that (it writes a
dequantized copy of the weight first); `pallas_kernels.quant.triton` does, and reads one layer of
the stacked weights in place: a QuantLinear holding the whole stack [L, in, out] runs that kernel on
the layer it is given (the model's GPU path, `jaxlora.kernels.StepKernels.quant_matmul`), one holding a single layer
[in, out] runs `matmul` through XLA. The LoRA delta is added to this output, as it is to a dense
layer's, so adapters trained on the dense base apply unchanged. Steps that StepKernels.w8a8_at names
quantize their activations per token as well and multiply 8-bit by 8-bit (jaxlora.model.w8a8).

Formats (amax = max |w[:, o]| of the channel; a zero channel gets scale 1 and stays zero):

    int8  symmetric, scale = amax / 127, q = round(w / scale) in [-127, 127];
          |w - q * scale| <= scale / 2.
    fp8   e4m3fn (3 mantissa bits, largest finite 448), scale = amax / 448, q = e4m3(w / scale)
          rounded to nearest; |w - q * scale| <= max(|w| * 2^-4, scale * 2^-10) (relative half-ulp
          of a normal e4m3 value; half the subnormal step 2^-9 below 2^-6).

Only the seven projections of every layer are quantized (jaxlora.config.TARGET_MODULES); embeddings,
norms and the LM head keep the model's dtype. A quantized projection's parameters are named
`qkernel` ([L, in, out], stacked over layers like `kernel`) and `qscale` ([L, out]), so that code
reading a dense `kernel` fails loudly instead of multiplying by raw integers.

The serving layout (jaxlora.model.fused) may store the weights K-major instead, as `qkernel_t`
([L, out, in]: each output column's weights contiguous): the layout the Hopper GEMM kernel
`pallas_kernels.quant.mgpu` reads (wgmma takes its register operand, the widened weight tile,
from the [out, in] side), and the one cuBLASLt's 8-bit GEMMs want for both operands (contracting
axis last), so a W8A8 step on K-major weights needs no transposed copy of a weight. A different
name again, so that code expecting [in, out] fails loudly rather than reading a square matrix
transposed. Which formats are K-major is build_model's `kmajor` argument, by default
jaxlora.kernels.KMAJOR_SERVING (`serving_kmajor`): both 8-bit formats are (their BEST_KERNEL is the
Mosaic kernel; benchmarks/DECISIONS.md#fp8-layout); the Triton kernel reads either layout.
`to_kmajor_arrays` / `from_kmajor_arrays` convert; `LoadedModel.flat_params()` always returns the
canonical `qkernel`.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.config import TARGET_MODULES
from jaxlora.kernels import BEST_KERNEL, KMAJOR_SERVING, QuantKernel
from jaxlora.model.w8a8 import matmul_w8a8
from pallas_kernels.quant.mgpu import X_DTYPES as MGPU_X_DTYPES
from pallas_kernels.quant.mgpu import quant_matmul_mgpu
from pallas_kernels.quant.triton import quant_matmul
from pallas_kernels.quant.tuning import mgpu_knobs


class Quantization(enum.StrEnum):
    """Storage format of the projection weights (None everywhere means dense, in the model's dtype)."""

    FP8 = "fp8"
    INT8 = "int8"

    @property
    def storage_dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.float8_e4m3fn if self is Quantization.FP8 else jnp.int8)

    @property
    def max_value(self) -> float:
        """The largest magnitude q may take: the channel's amax maps onto it."""
        return 448.0 if self is Quantization.FP8 else 127.0


def parse_quantization(value: str | Quantization | None) -> Quantization | None:
    """None, "fp8" or "int8" -> the enum; anything else raises ValueError naming the choices."""
    if value is None or isinstance(value, Quantization):
        return value
    try:
        return Quantization(value)
    except ValueError:
        raise ValueError(f"quantization={value!r} must be one of {[q.value for q in Quantization]}") from None


@functools.partial(jax.jit, static_argnames=("quantization",))
def quantize(w: jax.Array, quantization: Quantization) -> tuple[jax.Array, jax.Array]:
    """w [..., in, out] (any float dtype) -> (q [..., in, out] storage dtype, scale [..., out] float32).

    Scales are per output channel: the reduction runs over the input axis (-2).
    """
    quantization = Quantization(quantization)
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)
    scale = jnp.where(amax > 0, amax / quantization.max_value, 1.0)
    scaled = wf / scale[..., None, :]
    limit = quantization.max_value
    if quantization is Quantization.INT8:
        scaled = jnp.round(scaled)
    # Division can land a hair past the limit; e4m3fn has no infinity (out of range turns NaN).
    return jnp.clip(scaled, -limit, limit).astype(quantization.storage_dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """q [..., in, out], scale [..., out] -> w [..., in, out] in `dtype` (computed in float32)."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None, :]).astype(dtype)


def matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, k_major: bool = False) -> jax.Array:
    """x [n, in] @ the quantized w -> [n, out] in x's dtype. Accumulates and scales in float32.
    q is [in, out], or [out, in] with k_major (contracted on its last axis: no transposed copy).

    Plain XLA, and the reference `pallas_kernels.quant.triton` is tested against."""
    dims = (((1,), (1 if k_major else 0,)), ((), ()))
    y = jax.lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def kmajor_serving(quantization: Quantization | None) -> bool:
    """Whether the serving layout stores this format's weights K-major (`qkernel_t`) by default:
    jaxlora.kernels.KMAJOR_SERVING's entry (False for dense weights)."""
    return quantization is not None and KMAJOR_SERVING[quantization.storage_dtype]


def serving_kmajor(quantization: Quantization | None, fused: bool, kmajor: bool | None = None) -> bool:
    """Whether a model of this format and layout stores its projections K-major.

    kmajor None: the table's default for the serving layout (`kmajor_serving`), never for the
    separate one. True or False is taken as given; True needs quantized weights in the serving
    layout (the separate layout, which tensor parallelism splits, has no K-major storage), else
    ValueError.
    """
    if kmajor is None:
        return fused and kmajor_serving(quantization)
    if not isinstance(kmajor, bool):
        raise ValueError(f"kmajor={kmajor!r} must be a bool or None")
    if kmajor and (quantization is None or not fused):
        raise ValueError(
            f"kmajor=True stores quantized projections of the serving layout K-major; this model is "
            f"{quantization or 'dense'}, fused={fused}"
        )
    return kmajor


class QuantLinear(nnx.Module):
    """`nnx.Linear`'s call, `layer(x) = x @ W (+ bias)`, over a quantized W (see the module doc).

    The parameters start as placeholders (zeros, scale 1): quantized models are built from dense or
    already quantized arrays by jaxlora.model.params.build_model, never trained from an init.

    k_major: the weights are stored [out, in] as `qkernel_t` (the serving layout, module doc), not
    [in, out] as `qkernel`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        quantization: Quantization,
        use_bias: bool,
        dtype: jnp.dtype,
        k_major: bool = False,
    ):
        self.k_major = k_major
        if k_major:
            self.qkernel_t = nnx.Param(jnp.zeros((out_features, in_features), quantization.storage_dtype))  # [out, in]
        else:
            self.qkernel = nnx.Param(jnp.zeros((in_features, out_features), quantization.storage_dtype))  # [in, out]
        self.qscale = nnx.Param(jnp.ones((out_features,), jnp.float32))  # [out]
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None  # [out]
        self.dtype = dtype

    @property
    def storage_dtype(self) -> jnp.dtype:
        return jnp.dtype((self.qkernel_t if self.k_major else self.qkernel).dtype)

    def __call__(
        self,
        x: jax.Array,
        *,
        layer: jax.Array | None = None,
        kernel: QuantKernel | str = QuantKernel.TRITON,
        interpret: bool = False,
        w8a8: bool = False,
    ) -> jax.Array:
        """x [n, in] -> [n, out]; `layer`, `kernel`, `interpret` and `w8a8` as in `project`."""
        y = project(self, x, layer=layer, kernel=kernel, interpret=interpret, w8a8=w8a8)
        return y if self.bias is None else y + self.bias[...]


def project(
    linear: nnx.Linear | QuantLinear,
    x: jax.Array,
    *,
    layer: jax.Array | None = None,
    kernel: QuantKernel | str = QuantKernel.TRITON,
    interpret: bool = False,
    w8a8: bool = False,
) -> jax.Array:
    """x @ W of a dense or quantized projection, without its bias.

    layer: this projection's layer in the model (int32 scalar, may be traced). A quantized projection
    holding the whole stack (qkernel [L, in, out] or qkernel_t [L, out, in], qscale [L, out])
    multiplies by that layer in a kernel that reads it in place: `kernel` TRITON is
    `pallas_kernels.quant.triton` (either layout); MGPU is `pallas_kernels.quant.mgpu`, which
    needs the K-major layout and takes bf16 / f16 steps of at most 256 rows whose widths fit its
    tiles (`pallas_kernels.quant.tuning.mgpu_knobs`), and raises ValueError for any other;
    BEST picks per format (BEST_KERNEL for K-major weights; TRITON for [in, out] ones), and where the Mosaic kernel
    cannot take a projection (a float32 model, a width that is not a multiple of 64) runs the
    Triton kernel instead: a static choice by shape and dtype, made at trace time. `interpret`: in the Pallas
    interpreter (CPU; the Mosaic kernel's shared-memory operand variant, which the interpreter
    supports). A projection holding a single layer runs `matmul` and needs no index, or with `w8a8`
    quantizes x per token and runs the 8-bit GEMM (jaxlora.model.w8a8; dense projections ignore it).

    A row-parallel projection under tensor parallelism adds its bias after the all-reduce (else every
    shard would add it); the per-column scale commutes with that sum, so each shard applies it.
    """
    if not isinstance(linear, QuantLinear):
        return x @ linear.kernel[...]
    q = linear.qkernel_t[...] if linear.k_major else linear.qkernel[...]
    scale = linear.qscale[...]
    x = x.astype(linear.dtype)
    if q.ndim == 2:
        return (matmul_w8a8 if w8a8 else matmul)(x, q, scale, k_major=linear.k_major)
    if w8a8:
        raise ValueError(f"W8A8 multiplies one layer's weights, not the whole stack {q.shape}")
    if layer is None:
        raise ValueError(f"a QuantLinear holding the whole stack {q.shape} needs the layer index")
    kernel = QuantKernel(kernel)
    best = kernel is QuantKernel.BEST
    if best:
        kernel = BEST_KERNEL[jnp.dtype(q.dtype)] if linear.k_major else QuantKernel.TRITON
    if kernel is QuantKernel.MGPU:
        if not linear.k_major:
            raise ValueError(
                "the Mosaic GPU kernel reads K-major weights (qkernel_t): build the serving layout with kmajor=True"
            )
        knobs = mgpu_knobs(x.shape[0], q.shape[1], q.shape[2], interpret=interpret)
        fits = knobs is not None and jnp.dtype(x.dtype) in MGPU_X_DTYPES
        if fits:
            return quant_matmul_mgpu(x, q, scale, layer, knobs, interpret=interpret)
        if not best:  # asked for by name: say why it cannot run rather than run another kernel
            raise ValueError(
                f"the Mosaic GPU kernel cannot take x {x.shape} {x.dtype} @ q {q.shape}: it needs bf16 / f16 "
                "activations, at most 256 rows, widths that are multiples of 64 and depths of 32"
            )
    return quant_matmul(x, q, scale, layer, k_major=linear.k_major, interpret=interpret)


# -- flat parameter names (jaxlora.model.params) -----------------------------------------------------

PROJECTION_PREFIXES: dict[str, str] = {
    m: f"layers.{'self_attn' if m in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{m}" for m in TARGET_MODULES
}


def quantize_arrays(
    arrays: Mapping[str, np.ndarray | jax.Array], quantization: Quantization
) -> dict[str, np.ndarray | jax.Array]:
    """Flat parameters with every dense projection `kernel` replaced by its `qkernel` + `qscale`.

    Already quantized projections (a `qkernel` present, e.g. from a GGUF Q8_0 file) pass through;
    everything else is returned as given.
    """
    out = dict(arrays)
    for prefix in PROJECTION_PREFIXES.values():
        dense = out.pop(f"{prefix}.kernel", None)
        if dense is not None:
            out[f"{prefix}.qkernel"], out[f"{prefix}.qscale"] = quantize(dense, quantization)
    return out


def dequantize_arrays(
    arrays: Mapping[str, np.ndarray | jax.Array], dtype: jnp.dtype = jnp.float32
) -> dict[str, jax.Array]:
    """The inverse view: every `qkernel` + `qscale` pair as a dense `kernel` in `dtype` (tests, tools)."""
    out = dict(arrays)
    for prefix in PROJECTION_PREFIXES.values():
        q = out.pop(f"{prefix}.qkernel", None)
        if q is not None:
            out[f"{prefix}.kernel"] = dequantize(q, out.pop(f"{prefix}.qscale"), dtype)
    return out


def to_kmajor_arrays(arrays: Mapping[str, np.ndarray | jax.Array]) -> dict[str, np.ndarray | jax.Array]:
    """Every `...qkernel` [..., in, out] as `...qkernel_t` [..., out, in] (the serving layout's)."""
    return {
        _renamed(n, "qkernel", "qkernel_t"): _swapped(a) if n.endswith(".qkernel") else a for n, a in arrays.items()
    }


def from_kmajor_arrays(arrays: Mapping[str, np.ndarray | jax.Array]) -> dict[str, np.ndarray | jax.Array]:
    """The inverse of `to_kmajor_arrays`."""
    return {
        _renamed(n, "qkernel_t", "qkernel"): _swapped(a) if n.endswith(".qkernel_t") else a for n, a in arrays.items()
    }


def _renamed(name: str, leaf: str, new: str) -> str:
    return name[: -len(leaf)] + new if name.endswith(f".{leaf}") else name


def _swapped(a: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    return np.swapaxes(a, -1, -2) if isinstance(a, np.ndarray) else jnp.swapaxes(a, -1, -2)


def weight_nbytes(arrays: Mapping[str, np.ndarray | jax.Array]) -> int:
    """Bytes the parameters occupy (device memory for weights, when they live on the device)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays.values())
