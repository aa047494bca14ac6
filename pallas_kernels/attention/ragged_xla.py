"""Ragged paged attention in XLA ops: the model's "xla" attention path (the CPU default).

Same contract as `ragged.ragged_paged_attention`. The flat batch is cut into query blocks
of `block_q` tokens of one sequence each (a sequence of n tokens owns cdiv(n, block_q) blocks; at
most cdiv(T, block_q) + S blocks in all), and each block gathers its sequence's pages once. So the
gathered context is (blocks x context), not (tokens x context) as in the per-token reference: a
decode-only step gathers each sequence once, and a prompt chunk once per block_q tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _blocks(num_tokens: int, q_start: jax.Array, q_len: jax.Array, block_q: int):
    """Per query block: (sequence [NB], flat index of each of its queries [NB, block_q], which of
    them are real [NB, block_q])."""
    num_seqs = q_start.shape[0]
    num_blocks = -(-num_tokens // block_q) + num_seqs
    owned = -(-q_len // block_q)  # [S] blocks per sequence
    ends = jnp.cumsum(owned)
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), num_seqs - 1).astype(jnp.int32)
    first = q_start[seq] + (b - (ends[seq] - owned[seq])) * block_q
    index = first[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    real = (index < (q_start + q_len)[seq][:, None]) & (b < ends[-1])[:, None]
    return seq, index, real


@functools.partial(jax.jit, static_argnames=("block_q",))
def ragged_paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    layer: jax.Array,
    q_start: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    block_tables: jax.Array,
    *,
    block_q: int = 16,
) -> jax.Array:
    """q [T, H, Dh], k_pages / v_pages [L, P, page_size, KVH, Dh], layer int32 scalar, q_start / q_len /
    kv_len [S] int32, block_tables [S, pages_per_seq] int32 -> [T, H, Dh] in q.dtype (zeros at padding)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv, _ = k_pages.shape
    ctx = block_tables.shape[1] * page_size
    seq, index, real = _blocks(num_tokens, q_start, q_len, block_q)
    qb = q[jnp.clip(index, 0, num_tokens - 1)].astype(_F32)  # [NB, bq, H, Dh]
    qb = qb.reshape(*index.shape, num_kv, num_heads // num_kv, head_dim)
    position = (kv_len - q_len - q_start)[seq][:, None] + index  # [NB, bq]
    table = block_tables[seq]  # [NB, pages]; entries past kv_len may be garbage: clipped, then masked

    def context(pages):
        return pages.at[layer, table].get(mode="clip").reshape(table.shape[0], ctx, num_kv, head_dim)

    visible = (jnp.arange(ctx)[None, None, :] <= position[:, :, None]) & real[:, :, None]  # [NB, bq, ctx]
    keys = context(k_pages).astype(_F32)
    scores = jnp.einsum("bqkgd,bckd->bkgqc", qb, keys) * head_dim**-0.5
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    # A padding query sees nothing: give it uniform weights over zeroed values instead of NaN.
    scores = jnp.where(real[:, None, None, :, None], scores, 0.0)
    weights = jax.nn.softmax(scores, axis=-1)
    # Positions past a sequence's length can hold anything, NaN included: zero the values too.
    seen = jnp.any(visible, axis=1)  # [NB, ctx]
    values = jnp.where(seen[:, :, None, None], context(v_pages), 0).astype(_F32)
    out = jnp.einsum("bkgqc,bckd->bqkgd", weights, values).reshape(*index.shape, num_heads, head_dim)
    target = jnp.where(real, index, num_tokens)  # padding queries are dropped
    return jnp.zeros(q.shape, q.dtype).at[target].set(out.astype(q.dtype), mode="drop")
