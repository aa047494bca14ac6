"""Weight-only quantized projections: int8 or FP8 (e4m3) weights, one float32 scale per output channel.

    w[i, o] ~= q[i, o] * scale[o]                q [in, out] int8 | float8_e4m3fn, scale [out] float32
    layer(x) = (x @ q.astype(x.dtype)) * scale (+ bias)

The scale multiplies the GEMM's output columns, never the weight: XLA fuses the int8/fp8 -> bf16
convert into the dot's operand read and the scale into its epilogue, so a decode step (memory-bound)
reads one byte per weight. The LoRA delta is added to this output, as it is to a dense layer's, so
adapters trained on the dense base apply unchanged.

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
    """x [n, in] @ the quantized w -> [n, out] in x's dtype. Accumulates and scales in float32."""
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

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x.astype(self.dtype), self.qkernel[...], self.qscale[...])
        return y if self.bias is None else y + self.bias[...]


def project(layer: nnx.Linear | QuantLinear, x: jax.Array) -> jax.Array:
    """x @ W of a dense or quantized projection, without its bias.

    A row-parallel projection under tensor parallelism adds its bias after the all-reduce (else every
    shard would add it); the per-column scale commutes with that sum, so each shard applies it.
    """
    if isinstance(layer, QuantLinear):
        return matmul(x.astype(layer.dtype), layer.qkernel[...], layer.qscale[...])
    return x @ layer.kernel[...]


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
