"""Decode attention (one new token per row) as a Pallas kernel for the Triton (GPU) backend.

For each batch row b and query head h, with G = H // KVH query heads per KV head and
n_b = min(lengths[b], T) valid positions:

    out[b, h] = softmax(q[b, h] @ K[layer, b, :n_b, h // G]^T * scale) @ V[layer, b, :n_b, h // G]

Why a kernel: the XLA path slices one layer out of the stacked cache, lays it out for a batched
GEMM (a copy), masks positions it has read anyway and keeps float32 scores in memory. This kernel
reads the keys and values of positions < n_b straight out of the whole cache, in place (the layer
index is data, so it runs inside the model's layer scan without slicing), with an online softmax in
registers (the flash-decoding recurrence), and never reads a position at or past n_b.

Program (b, h) walks its row's positions in blocks of `block_t`. Each query head reads its KV head's
blocks itself: for grouped-query models the G programs of one KV head read the same blocks, which
sit next to each other in the grid, so the repeats are mostly L2 hits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32
_NEG = -1e30  # finite: exp(_NEG - m) underflows to 0 without the NaN that -inf - -inf gives


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kernel(
    layer_ref,
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    block_t: int,
    head_dim: int,
    group: int,
    max_len: int,
    scale: float,
):
    # layer_ref: [1] int32; len_ref: [B] int32; q_ref: [B, H, Dh]; k_ref / v_ref: [L, R, T, KVH, Dh];
    # o_ref: [B, H, Dh].
    b, h = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    length = jnp.clip(len_ref[b], 1, max_len)
    kvh = h // group
    d = jnp.arange(head_dim, dtype=jnp.int32)
    q = pltriton.load(q_ref.at[b, h, d]).astype(_F32) * scale  # [Dh]

    def block(i, carry):
        m, l, acc = carry
        t = i * block_t + jnp.arange(block_t, dtype=jnp.int32)
        ok = t < length
        at = (layer, b, t[:, None], kvh, d[None, :])
        k = pltriton.load(k_ref.at[at], mask=ok[:, None], other=0).astype(_F32)  # [BT, Dh]
        s = jnp.where(ok, jnp.sum(k * q[None, :], axis=1), _NEG)  # [BT]
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        v = pltriton.load(v_ref.at[at], mask=ok[:, None], other=0).astype(_F32)  # [BT, Dh]
        return m_new, l * alpha + jnp.sum(p), acc * alpha + jnp.sum(p[:, None] * v, axis=0)

    init = (jnp.full((), _NEG, _F32), jnp.zeros((), _F32), jnp.zeros((head_dim,), _F32))
    _, l, acc = lax.fori_loop(0, pl.cdiv(length, block_t), block, init)
    pltriton.store(o_ref.at[b, h, d], (acc / l).astype(o_ref.dtype))


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    lengths: jax.Array,
    *,
    block_t: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one new token per row over the first `lengths[b]` positions of its cache row.

    Args:
      q: [B, H, Dh] queries (RoPE applied).
      k_cache, v_cache: [L, R, T, KVH, Dh], every layer's cache; batch row b reads cache row b
        (R >= B). The new token's key and value must already be written.
      layer: int32 scalar (may be traced, e.g. a scan's layer index).
      lengths: [B] int32, valid positions per row (position of the new token + 1); clamped to
        [1, T], so an idle row parked past the end reads the whole row and its output is ignored.
      block_t: positions per loop step (power of two).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [B, H, Dh] in q.dtype (float32 softmax and accumulation).
    """
    batch, num_heads, head_dim = q.shape
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be [L, R, T, KVH, Dh]")
    _, rows, max_len, num_kv, cache_dim = k_cache.shape
    if cache_dim != head_dim or rows < batch or num_heads % num_kv:
        raise ValueError(
            f"q {q.shape} [B, H, Dh] does not fit the cache {k_cache.shape} [L, R>=B, T, KVH, Dh] "
            "with H a multiple of KVH"
        )
    if lengths.shape != (batch,):
        raise ValueError(f"lengths {lengths.shape} must be [B] with B={batch}")
    for name, value in (("head_dim", head_dim), ("block_t", block_t)):
        if not _is_pow2(value):
            raise ValueError(f"{name}={value} must be a power of two (Triton works on power-of-two blocks)")
    kernel = functools.partial(
        _kernel, block_t=block_t, head_dim=head_dim, group=num_heads // num_kv, max_len=max_len, scale=head_dim**-0.5
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch, num_heads),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths.astype(jnp.int32), q, k_cache, v_cache)
