"""Ragged paged attention over a flat token batch, as a Pallas kernel for the Triton (GPU) backend.

For sequence s, its i-th token of this step (flat index q_start[s] + i, 0 <= i < q_len[s]) sits at
absolute position p = kv_len[s] - q_len[s] + i and attends to positions 0..p of s, with
G = H // KVH query heads per KV head:

    out[q_start[s] + i, h] = softmax(q[q_start[s] + i, h] @ K_s[:p + 1, h // G]^T * Dh^-0.5) @ V_s[:p + 1, h // G]

where position t of s lives in page block_tables[s, t // page_size] at offset t % page_size of
k_pages[layer] / v_pages[layer]. Flat indices no sequence covers are padding and come out zero.

One step mixes decode tokens (q_len 1) and prompt chunks (causal inside the chunk, full over the
cached prefix) with no padding between them. The wrapper cuts every sequence's tokens into q-blocks
of `block_q` queries (a sequence of n tokens owns cdiv(n, block_q) of them) and hands each program
(q-block, query head) its sequence, first flat row, number of valid rows and first position. The grid
is static: cdiv(T, block_q) + S q-blocks bound the count for any split of T tokens over S sequences;
programs past the real count do nothing, and the output starts as zeros (aliased), so padding rows
stay zero.

A program walks its sequence's positions in blocks of `block_k` up to the causal limit of its last
query, gathering keys and values through the block table (masked loads: a position the program may
not see is never read, so NaN in unused pages or past kv_len never enters a result), with the flash
recurrence (online softmax) in float32. A decode token is one valid row of its q-block: tensor-core
rows are wasted, but attention is memory-bound and each (sequence, query head) reads its keys and
values exactly once. The G programs sharing a KV head read the same blocks next to each other in
the grid, so for grouped-query models the repeats are mostly L2 hits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32
_I32 = jnp.int32
_NEG = -1e30  # finite: exp(_NEG - m) underflows to 0 without the NaN that -inf - -inf gives
_MIN_DOT = 16  # Triton's tensor-core dot needs M, N, K >= 16


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.partial(jax.jit, static_argnames=("num_blocks", "block_q"))
def q_block_schedule(
    q_start: jax.Array, q_len: jax.Array, kv_len: jax.Array, *, num_blocks: int, block_q: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Which queries each of `num_blocks` q-blocks handles (jnp, runs inside the jitted step).

    Sequence s owns cdiv(q_len[s], block_q) consecutive q-blocks; q-block j of s covers its queries
    j*block_q .. min((j+1)*block_q, q_len[s]) - 1. Blocks past the total get zero rows.

    Returns four [num_blocks] int32 arrays: the block's sequence, the flat index of its first query,
    its number of valid queries (0 = idle), and the absolute position of its first query.
    """
    q_len = jnp.maximum(q_len.astype(_I32), 0)
    blocks = (q_len + block_q - 1) // block_q  # [S]
    ends = jnp.cumsum(blocks)  # [S], exclusive end of each sequence's q-blocks
    b = jnp.arange(num_blocks, dtype=_I32)
    # The sequence of block b: how many sequences' blocks end at or before b ([NB, S] compares).
    seq = jnp.minimum(jnp.sum(ends[None, :] <= b[:, None], axis=1), q_len.shape[0] - 1).astype(_I32)
    first = (b - (ends[seq] - blocks[seq])) * block_q  # first query index inside the sequence
    rows = jnp.where(b < ends[-1], jnp.clip(q_len[seq] - first, 0, block_q), 0).astype(_I32)
    row0 = (q_start.astype(_I32)[seq] + first).astype(_I32)
    pos0 = (kv_len.astype(_I32)[seq] - q_len[seq] + first).astype(_I32)
    return seq, row0, rows, pos0


def _kernel(
    layer_ref,
    seq_ref,
    row0_ref,
    rows_ref,
    pos0_ref,
    bt_ref,
    q_ref,
    k_ref,
    v_ref,
    _zeros_ref,
    o_ref,
    *,
    block_q: int,
    block_k: int,
    head_dim: int,
    group: int,
    page_size: int,
    num_tokens: int,
    max_positions: int,
    scale: float,
):
    # layer_ref: [1] int32; seq_ref / row0_ref / rows_ref / pos0_ref: [NB] int32 (the q-block schedule);
    # bt_ref: [S, pages_per_seq] int32; q_ref / o_ref: [T, H, Dh]; k_ref / v_ref: [L, P, page_size, KVH, Dh].
    # _zeros_ref is the zero-filled buffer o_ref aliases: padding rows keep its zeros.
    blk, h = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[blk]

    @pl.when(rows > 0)
    def _():
        seq, row0, pos0 = seq_ref[blk], row0_ref[blk], pos0_ref[blk]
        i = jnp.arange(block_q, dtype=_I32)
        d = jnp.arange(head_dim, dtype=_I32)
        flat = row0 + i  # [BQ] flat token index of each query row
        is_row = (i < rows) & (flat < num_tokens)
        q = pltriton.load(q_ref.at[flat[:, None], h, d[None, :]], mask=is_row[:, None], other=0)  # [BQ, Dh]
        pos = pos0 + i  # [BQ] absolute position of each query
        # Keys 0..limit-1 are what the last valid query sees; the clamp keeps reads inside the
        # block-table row even when a caller passes kv_len past its capacity.
        limit = jnp.minimum(pos0 + rows, max_positions)
        at_kv = functools.partial(
            _kv_block,
            layer=layer_ref[0],
            seq=seq,
            kvh=h // group,
            d=d,
            bt_ref=bt_ref,
            block_k=block_k,
            page_size=page_size,
            limit=limit,
        )

        def step(j, carry):
            m, l, acc = carry
            t, k = at_kv(j, k_ref)
            s = _dot(q, k, contract_rhs=1) * scale  # [BQ, BK] f32
            s = jnp.where(t[None, :] <= pos[:, None], s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp(s - m_new[:, None])  # masked scores give exp(_NEG - m) = 0
            alpha = jnp.exp(m - m_new)
            _, v = at_kv(j, v_ref)
            pv = _dot(p.astype(v.dtype), v, contract_rhs=0)  # [BQ, Dh] f32
            return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

        init = (jnp.full((block_q,), _NEG, _F32), jnp.zeros((block_q,), _F32), jnp.zeros((block_q, head_dim), _F32))
        _, l, acc = lax.fori_loop(0, pl.cdiv(limit, block_k), step, init)
        out = acc / jnp.where(is_row, l, 1.0)[:, None]  # valid rows see position 0, so l >= 1
        pltriton.store(o_ref.at[flat[:, None], h, d[None, :]], out.astype(o_ref.dtype), mask=is_row[:, None])


def _dot(lhs: jax.Array, rhs: jax.Array, *, contract_rhs: int) -> jax.Array:
    """lhs [M, K] times rhs ([K, N], or [N, K] with contract_rhs=1) in float32 on the tensor cores."""
    # Triton's default for float32 operands is TF32 (10-bit mantissa): ask for full precision.
    precision = lax.Precision.HIGHEST if lhs.dtype == _F32 else None
    return lax.dot_general(
        lhs, rhs, (((1,), (contract_rhs,)), ((), ())), precision=precision, preferred_element_type=_F32
    )


def _kv_block(j, pages_ref, *, layer, seq, kvh, d, bt_ref, block_k: int, page_size: int, limit):
    """Positions t of KV block j [BK] and their keys or values [BK, Dh], gathered through the block table.

    Positions at or past `limit` are not read (zeros): their pages may be garbage or NaN.
    """
    t = j * block_k + jnp.arange(block_k, dtype=_I32)
    is_read = t < limit
    page = pltriton.load(bt_ref.at[seq, lax.div(t, page_size)], mask=is_read, other=0)  # [BK]
    offset = lax.rem(t, page_size)
    at = (layer, page[:, None], offset[:, None], kvh, d[None, :])
    return t, pltriton.load(pages_ref.at[at], mask=is_read[:, None], other=0)


def _check(q, k_pages, v_pages, q_start, q_len, kv_len, block_tables, block_q: int, block_k: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"q {q.shape} must be [T, H, Dh]")
    num_heads, head_dim = q.shape[1:]
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [L, P, page_size, KVH, Dh]")
    num_kv, page_dim = k_pages.shape[3:]
    if page_dim != head_dim or num_heads % num_kv:
        raise ValueError(
            f"q {q.shape} [T, H, Dh] does not fit the pages {k_pages.shape} [L, P, page_size, KVH, Dh] "
            "with H a multiple of KVH"
        )
    if not q.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(f"q, k_pages and v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    num_seqs = q_len.shape[0] if q_len.ndim == 1 else -1
    if num_seqs < 1:
        raise ValueError(f"q_len {q_len.shape} must be [S] with S >= 1")
    for name, arr in (("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        if arr.shape != (num_seqs,):
            raise ValueError(f"{name} {arr.shape} must be [S] like q_len {q_len.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {block_tables.shape} must be [S, pages_per_seq] with S={num_seqs}")
    for name, value in (("head_dim", head_dim), ("block_q", block_q), ("block_k", block_k)):
        if not _is_pow2(value) or value < _MIN_DOT:
            raise ValueError(
                f"{name}={value} must be a power of two >= {_MIN_DOT} "
                "(Triton works on power-of-two blocks; its dot needs M, N, K >= 16)"
            )


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "num_warps", "num_stages", "interpret"))
def ragged_paged_attention(
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
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Attention of a flat batch of decode tokens and prompt chunks over a paged KV cache.

    Args:
      q: [T, H, Dh] queries of the flat token batch (RoPE applied).
      k_pages, v_pages: [L, P, page_size, KVH, Dh], every layer's key / value pages. The keys and
        values of this step's tokens must already be written.
      layer: int32 scalar (may be traced, e.g. a scan's layer index).
      q_start: [S] int32, flat index of sequence s's first token in this step.
      q_len: [S] int32, tokens of s in this step (0: s is not in this step).
      kv_len: [S] int32, context length of s after this step (cached prefix + q_len); at most
        pages_per_seq * page_size.
      block_tables: [S, pages_per_seq] int32 page ids; entries at or past cdiv(kv_len, page_size)
        are never read.
      block_q: queries per q-block (power of two >= 16).
      block_k: KV positions per loop step (power of two >= 16).
      num_warps, num_stages: Triton compiler parameters.
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [T, H, Dh] in q.dtype (float32 softmax and accumulation); zeros at padding tokens.
    """
    _check(q, k_pages, v_pages, q_start, q_len, kv_len, block_tables, block_q, block_k)
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv = k_pages.shape[2], k_pages.shape[3]
    num_seqs, pages_per_seq = block_tables.shape
    num_blocks = pl.cdiv(num_tokens, block_q) + num_seqs
    schedule = q_block_schedule(q_start, q_len, kv_len, num_blocks=num_blocks, block_q=block_q)
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        block_k=block_k,
        head_dim=head_dim,
        group=num_heads // num_kv,
        page_size=page_size,
        num_tokens=num_tokens,
        max_positions=pages_per_seq * page_size,
        scale=head_dim**-0.5,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_blocks, num_heads),
        input_output_aliases={9: 0},  # the zeros: padding rows are never written
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        jnp.reshape(layer, (1,)).astype(_I32),
        *schedule,
        block_tables.astype(_I32),
        q,
        k_pages,
        v_pages,
        jnp.zeros_like(q),
    )
