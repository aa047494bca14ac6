"""Ragged paged attention in XLA ops: the model's "xla" attention path (the CPU default).

Same contract as `ragged.ragged_paged_attention`. The flat batch is cut into query blocks
of `block_q` tokens of one sequence each (a sequence of n tokens owns cdiv(n, block_q) blocks; at
most cdiv(T, block_q) + S blocks in all), and each block gathers its sequence's pages once.

The context is read in chunks of `chunk_pages` pages with an online (flash) softmax: for chunk c
of C positions, with scores s_c = q . k_c / sqrt(Dh) masked to -inf where a query may not look,

    m_c = max(m_{c-1}, max s_c),  l_c = l_{c-1} e^(m_{c-1} - m_c) + sum e^(s_c - m_c),
    acc_c = acc_{c-1} e^(m_{c-1} - m_c) + e^(s_c - m_c) @ v_c,   out = acc_last / l_last.

The loop runs cdiv(max kv_len of the step's sequences, C) times, a traced trip count: shapes stay
static (one compiled program per step size) while a step reads only the context in use, not every
row's whole block table (max_seq_len wide).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

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


def num_chunks(q_len: jax.Array, kv_len: jax.Array, chunk_positions: int, max_chunks: int) -> jax.Array:
    """Chunks of `chunk_positions` the step reads: enough for the longest context among sequences
    with tokens in this step (a sequence without any may hold anything in kv_len), at most
    `max_chunks` (the whole table). int32 scalar."""
    longest = jnp.max(jnp.where(q_len > 0, kv_len, 0))
    return jnp.clip(-(-longest // chunk_positions), 0, max_chunks).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_q", "chunk_pages"))
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
    chunk_pages: int = 16,
) -> jax.Array:
    """q [T, H, Dh], k_pages / v_pages [L, P, page_size, KVH, Dh], layer int32 scalar, q_start / q_len /
    kv_len [S] int32, block_tables [S, pages_per_seq] int32 -> [T, H, Dh] in q.dtype (zeros at padding).

    block_q: queries per block (each block gathers its sequence's pages once per chunk);
    chunk_pages: pages read per loop iteration (more than the table's: the table, then); the
      default's choice is benchmarks/DECISIONS.md#cpu-context.
    """
    if block_q < 1 or chunk_pages < 1:
        raise ValueError(f"{block_q=} and {chunk_pages=} must be >= 1")
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    chunk_pages = min(chunk_pages, pages_per_seq)
    max_chunks = -(-pages_per_seq // chunk_pages)
    seq, index, real = _blocks(num_tokens, q_start, q_len, block_q)
    qb = q[jnp.clip(index, 0, num_tokens - 1)].astype(_F32) * head_dim**-0.5  # [NB, bq, H, Dh]
    qb = qb.reshape(*index.shape, num_kv, num_heads // num_kv, head_dim)  # [NB, bq, KVH, G, Dh]
    position = (kv_len - q_len - q_start)[seq][:, None] + index  # [NB, bq]
    # Entries past kv_len may be garbage: clipped at the gather, then masked. The padding to whole
    # chunks keeps every chunk's slice inside the table (dynamic_slice would shift a slice that
    # overhangs, and with it the positions).
    table = jnp.pad(block_tables[seq], ((0, 0), (0, max_chunks * chunk_pages - pages_per_seq)))  # [NB, C*cp]
    num_blocks, group = qb.shape[0], qb.shape[3]
    state = (
        jnp.full((num_blocks, num_kv, group, block_q), -jnp.inf, _F32),  # m: running max
        jnp.zeros((num_blocks, num_kv, group, block_q), _F32),  # l: running sum of weights
        jnp.zeros((num_blocks, num_kv, group, block_q, head_dim), _F32),  # acc: weighted values
    )

    def chunk(c, state):
        pages = lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages, axis=1)  # [NB, cp]
        at = c * chunk_pages * page_size + jnp.arange(chunk_pages * page_size)  # [cpos] positions
        visible = (at[None, None, :] <= position[:, :, None]) & real[:, :, None]  # [NB, bq, cpos]
        return _online_softmax_step(state, qb, _gather(k_pages, layer, pages), _gather(v_pages, layer, pages), visible)

    m, l, acc = lax.fori_loop(0, num_chunks(q_len, kv_len, chunk_pages * page_size, max_chunks), chunk, state)
    # Padding queries saw nothing (l == 0): zeros, not 0 / 0.
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1)[..., None], 0.0)  # [NB, KVH, G, bq, Dh]
    out = out.transpose(0, 3, 1, 2, 4).reshape(*index.shape, num_heads, head_dim)
    target = jnp.where(real, index, num_tokens)  # padding queries are dropped
    return jnp.zeros(q.shape, q.dtype).at[target].set(out.astype(q.dtype), mode="drop")


def _gather(pages: jax.Array, layer: jax.Array, table: jax.Array) -> jax.Array:
    """pages [L, P, page_size, KVH, Dh], table [NB, cp] -> [NB, cp * page_size, KVH, Dh] float32."""
    got = pages.at[layer, table].get(mode="clip")  # [NB, cp, page_size, KVH, Dh]
    return got.reshape(table.shape[0], -1, *pages.shape[3:]).astype(_F32)


def _online_softmax_step(state, qb, keys, values, visible):
    """Folds one chunk into (m, l, acc). qb [NB, bq, KVH, G, Dh] (pre-scaled), keys / values
    [NB, cpos, KVH, Dh], visible [NB, bq, cpos]."""
    m, l, acc = state
    scores = jnp.einsum("bqkgd,bckd->bkgqc", qb, keys)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    # A query that has seen nothing yet keeps m = -inf: shift by 0 there, so exp gives 0, not NaN.
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    weights = jnp.exp(scores - shift[..., None])  # 0 where not visible
    rescale = jnp.exp(m - shift)
    # Positions past a sequence's length can hold anything, NaN included: zero the values too.
    seen = jnp.any(visible, axis=1)  # [NB, cpos]
    values = jnp.where(seen[:, :, None, None], values, 0.0)
    acc = acc * rescale[..., None] + jnp.einsum("bkgqc,bckd->bkgqd", weights, values)
    return m_new, l * rescale + weights.sum(axis=-1), acc
