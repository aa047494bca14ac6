"""W8A8: an 8-bit GEMM over 8-bit weights and activations quantized per token in the step.

    x[t, i] ~= xq[t, i] * xs[t]        xq [n, in] in q's storage dtype, xs [n] float32 (per token)
    w[i, o] ~= q[i, o] * scale[o]      q [in, out] (or [out, in] K-major), scale [out] (per channel)
    y[t, o]  = (sum_i xq[t, i] * q[i, o]) * xs[t] * scale[o]

The product of two 8-bit operands runs on the tensor cores' 8-bit rate (twice bf16's on Hopper)
and no dequantized copy of the weight is ever written: XLA rewrites a `dot_general` over two
float8_e4m3fn operands with a float32 result into a cuBLASLt FP8 GEMM, and an int8 x int8 -> int32
one into an integer GEMM; both scales multiply the (small) output, never an operand. CPU runs the
same `dot_general`, so tests check this math where CI runs.

Per-token activation scales (xs = amax of the row / the format's largest value) keep a row of small
values from being rounded to zero by a row of large ones in the same step; a row of zeros gets
scale 1 and stays zero (never 0/0).

Formats follow the weights' (jaxlora.model.quant.Quantization): e4m3 rounds to nearest (relative
error <= 2^-4 per normal value), int8 rounds to the nearest of [-127, 127].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The largest magnitude an 8-bit activation takes, by storage dtype (the weights' formats).
_MAX_VALUE: dict[jnp.dtype, float] = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.0}
# The dot's accumulator: float32 for FP8, int32 for int8 (exact: a term is at most 127^2, so int32
# holds any sum over fewer than 133,000 terms, wider than any projection).
_ACCUMULATOR: dict[jnp.dtype, jnp.dtype] = {
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.float32),
    jnp.dtype(jnp.int8): jnp.dtype(jnp.int32),
}


def storage_dtypes() -> tuple[jnp.dtype, ...]:
    """The weight storage dtypes W8A8 takes."""
    return tuple(_MAX_VALUE)


def quantize_rows(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """x [n, k] (any float dtype) -> (xq [n, k] `dtype`, xs [n] float32), one scale per row."""
    dtype = _checked_dtype(dtype)
    limit = _MAX_VALUE[dtype]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    xs = jnp.where(amax > 0, amax / limit, 1.0)
    scaled = xf / xs[:, None]
    if dtype == jnp.int8:
        scaled = jnp.round(scaled)
    # e4m3fn has no infinity: a value a hair past the limit after the division would turn NaN.
    return jnp.clip(scaled, -limit, limit).astype(dtype), xs


def matmul_w8a8(x: jax.Array, q: jax.Array, scale: jax.Array, *, k_major: bool = False) -> jax.Array:
    """x [n, in] @ the quantized w -> [n, out] in x's dtype, through an 8-bit GEMM (module doc).

    q: [in, out] float8_e4m3fn or int8, or [out, in] with k_major; scale: [out] float32.
    """
    dtype = _checked_dtype(q.dtype)
    if x.ndim != 2 or q.ndim != 2:
        raise ValueError(f"matmul_w8a8 takes x [n, in] and q [in, out]; got x {x.shape}, q {q.shape}")
    depth = q.shape[1] if k_major else q.shape[0]
    if x.shape[1] != depth:
        raise ValueError(f"x {x.shape} and q {q.shape} (k_major={k_major}) disagree on the contracted width")
    xq, xs = quantize_rows(x, dtype)
    dims = (((1,), (1 if k_major else 0,)), ((), ()))
    acc = jax.lax.dot_general(xq, q, dims, preferred_element_type=_ACCUMULATOR[dtype])
    return (acc.astype(jnp.float32) * xs[:, None] * scale.astype(jnp.float32)).astype(x.dtype)


def _checked_dtype(dtype: jnp.dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in _MAX_VALUE:
        raise ValueError(f"W8A8 takes float8_e4m3fn or int8 weights, not {dtype}")
    return dtype
