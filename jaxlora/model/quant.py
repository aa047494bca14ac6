"""Weight-only quantized projections: int8 or FP8 (e4m3) weights, one float32 scale per output channel.

    w[i, o] ~= q[i, o] * scale[o]                q [in, out] int8 | float8_e4m3fn, scale [out] float32
    layer(x) = (x @ q.astype(x.dtype)) * scale (+ bias)

The scale multiplies the GEMM's output columns, never the weight, so a GEMM can read the 1-byte
weights, convert them on the fly and scale its result. XLA does not do that (it writes a
dequantized copy of the weight first); `pallas_kernels.quant_matmul` does, and reads one layer of
the stacked weights in place: a QuantLinear holding the whole stack [L, in, out] runs that kernel on
the layer it is given (the model's GPU path, `LoraRuntime.quant_matmul`), one holding a single layer
[in, out] runs `matmul` through XLA. The LoRA delta is added to this output, as it is to a dense
layer's, so adapters trained on the dense base apply unchanged.

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
from pallas_kernels.quant_matmul import quant_matmul


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


def matmul(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [n, in] @ the quantized w -> [n, out] in x's dtype. Accumulates and scales in float32.

    Plain XLA, and the reference `pallas_kernels.quant_matmul` is tested against."""
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


class QuantLinear(nnx.Module):
    """`nnx.Linear`'s call, `layer(x) = x @ W (+ bias)`, over a quantized W (see the module doc).

    The parameters start as placeholders (zeros, scale 1): quantized models are built from dense or
    already quantized arrays by jaxlora.model.params.build_model, never trained from an init.
    """

    def __init__(
        self, in_features: int, out_features: int, *, quantization: Quantization, use_bias: bool, dtype: jnp.dtype
    ):
        self.qkernel = nnx.Param(jnp.zeros((in_features, out_features), quantization.storage_dtype))  # [in, out]
        self.qscale = nnx.Param(jnp.ones((out_features,), jnp.float32))  # [out]
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None  # [out]
        self.dtype = dtype

    def __call__(self, x: jax.Array, *, layer: jax.Array | None = None, interpret: bool = False) -> jax.Array:
        """x [n, in] -> [n, out]; `layer` and `interpret` as in `project`."""
        y = project(self, x, layer=layer, interpret=interpret)
        return y if self.bias is None else y + self.bias[...]


def project(
    linear: nnx.Linear | QuantLinear, x: jax.Array, *, layer: jax.Array | None = None, interpret: bool = False
) -> jax.Array:
    """x @ W of a dense or quantized projection, without its bias.

    layer: this projection's layer in the model (int32 scalar, may be traced). A quantized projection
    holding the whole stack (qkernel [L, in, out], qscale [L, out]) multiplies by that layer with
    `pallas_kernels.quant_matmul`, which reads it in place (`interpret`: in the Pallas interpreter,
    CPU); one holding a single layer [in, out] runs `matmul` and needs no index.

    A row-parallel projection under tensor parallelism adds its bias after the all-reduce (else every
    shard would add it); the per-column scale commutes with that sum, so each shard applies it.
    """
    if not isinstance(linear, QuantLinear):
        return x @ linear.kernel[...]
    q, scale = linear.qkernel[...], linear.qscale[...]
    x = x.astype(linear.dtype)
    if q.ndim == 3:
        if layer is None:
            raise ValueError(f"a QuantLinear holding the whole stack {q.shape} [L, in, out] needs the layer index")
        return quant_matmul(x, q, scale, layer, interpret=interpret)
    return matmul(x, q, scale)


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


def weight_nbytes(arrays: Mapping[str, np.ndarray | jax.Array]) -> int:
    """Bytes the parameters occupy (device memory for weights, when they live on the device)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays.values())
