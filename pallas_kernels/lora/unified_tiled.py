"""The unified-pool LoRA kernels over tiles of rows that share an adapter (SGMV-style), for steps
where many rows read the same adapter: a prefill chunk of one sequence, or a decode batch on few
adapters.

The per-row kernels (`unified`) give each token row its own programs, so a 2,048-token prefill of
one rank-64 adapter reads that adapter's factors 2,048 times. Here rows are grouped by slot (the
step's `common.RowGroups`, built once per step by `lora_plan`), cut into tiles of `block_rows`,
and one program per (segment, tile) work item reads a chunk of the slot's factor once for the whole
tile and multiplies on the tensor cores:

    unified_tiled_shrink:  program (item, rank block): h[rows, block] = x[rows] @ A^T[block]^T,
        looping over the input width chunk by chunk; blocks at or past the rank store zeros.
    unified_tiled_expand:  program (item, output chunk): y[rows, chunk] += h[rows, :rank] @ B[:, chunk],
        looping over the slot's rank blocks only.

Storage, offsets, `align` and chunks are the per-row kernels' (`unified.load_chunks`): every load is
a chunk of a rank-row, masked to the slot's rank, so nothing outside the slot's factors is read.
Tensor-core dots need 16 along every axis: chunks, block_rows and rank_block of at least 16
(`tiled_fits` says whether a width allows it). Triton on GPU; interpret=True runs them on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora.common import F32, MIN_DOT, RowGroups, dot_f32, items_for, work_item_rows
from pallas_kernels.lora.unified import check_unified, checked_knobs, chunk_size, flat_pool, load_chunks, segment_size

_KNOBS = ("max_rank", "align", "block_rows", "block", "rank_block", "num_warps", "interpret")


def tiled_fits(width: int, k: jax.Array, align: int, block: int = 128) -> bool:
    """Whether a factor `width` wide in pool `k` loads in chunks a tensor-core dot takes (>= 16)."""
    return chunk_size(width, segment_size(k), align, block) >= MIN_DOT


def _item_slot(slot_ref, ranks_ref, offs_ref, item):
    """(slot, rank, offset) of work item `item`; an unused item (slot 0, no rows) or a base slot has rank 0
    through the tables, and its rows mask every store."""
    slot = slot_ref[item]
    safe = jnp.maximum(slot, 0)
    return safe, jnp.where(slot >= 0, ranks_ref[safe], 0), offs_ref[safe]


def _shrink_kernel(
    tile_ref, lo_ref, hi_ref, slot_ref, order_ref, ranks_ref, offs_ref, pages_ref, layer_ref, x_ref, k_ref, v_ref, h_ref,
    *, seg, hidden, chunk, rank_block, max_rank, block_rows, num_tokens, has_order,
):  # fmt: skip
    # x_ref [T, D]; h_ref [T, max_rank]; program (work item, rank block).
    item, blk, layer = pl.program_id(0), pl.program_id(1), layer_ref[0]
    rows, in_item = work_item_rows(
        item, tile_ref, lo_ref, hi_ref, order_ref, block_rows=block_rows, num_tokens=num_tokens, has_order=has_order
    )
    slot, rank, offset = _item_slot(slot_ref, ranks_ref, offs_ref, item)
    rs = blk * rank_block + jnp.arange(rank_block, dtype=jnp.int32)
    r_ok = rs < rank
    row_chunks = hidden // chunk
    first = offset // chunk + rs * row_chunks
    cc = jnp.arange(chunk, dtype=jnp.int32)

    def k_step(s, acc):  # acc [block_rows, rank_block] f32
        x = pltriton.load(x_ref.at[rows[:, None], s * chunk + cc[None, :]], mask=in_item[:, None], other=0)
        a = load_chunks(k_ref, v_ref, pages_ref, slot, layer, first + s, r_ok, seg=seg, chunk=chunk, dtype=x.dtype)
        return acc + dot_f32(x, a.T)

    active = (blk * rank_block < rank) & (lo_ref[item] < hi_ref[item])
    steps = jnp.where(active, jnp.int32(row_chunks), jnp.int32(0))
    acc = lax.fori_loop(jnp.int32(0), steps, k_step, jnp.zeros((block_rows, rank_block), F32))
    mask = in_item[:, None] & (rs < max_rank)[None, :]
    pltriton.store(h_ref.at[rows[:, None], rs[None, :]], acc.astype(h_ref.dtype), mask=mask)


def _expand_kernel(
    tile_ref, lo_ref, hi_ref, slot_ref, order_ref, ranks_ref, offs_ref, pages_ref, layer_ref, y_ref, h_ref, k_ref, v_ref,
    o_ref, *, seg, out, chunk, rank_block, rank_cols, block_rows, num_tokens, has_order,
):  # fmt: skip
    # y_ref/o_ref [T, O] (aliased); h_ref [T, C]; program (work item, output chunk).
    item, col, layer = pl.program_id(0), pl.program_id(1), layer_ref[0]
    rows, in_item = work_item_rows(
        item, tile_ref, lo_ref, hi_ref, order_ref, block_rows=block_rows, num_tokens=num_tokens, has_order=has_order
    )
    slot, rank, offset = _item_slot(slot_ref, ranks_ref, offs_ref, item)
    rr = jnp.arange(rank_block, dtype=jnp.int32)
    row_chunks = out // chunk
    cols = col * chunk + jnp.arange(chunk, dtype=jnp.int32)

    def rank_step(i, acc):  # acc [block_rows, chunk] f32
        rs = i * rank_block + rr
        r_ok = (rs < rank) & (rs < rank_cols)
        h = pltriton.load(h_ref.at[rows[:, None], rs[None, :]], mask=in_item[:, None] & r_ok[None, :], other=0)
        first = offset // chunk + rs * row_chunks + col
        b = load_chunks(k_ref, v_ref, pages_ref, slot, layer, first, r_ok, seg=seg, chunk=chunk, dtype=h.dtype)
        return acc + dot_f32(h, b)

    steps = jnp.where(lo_ref[item] < hi_ref[item], (rank + rank_block - 1) // rank_block, 0).astype(jnp.int32)
    acc = lax.fori_loop(jnp.int32(0), steps, rank_step, jnp.zeros((block_rows, chunk), F32))
    at = o_ref.at[rows[:, None], cols[None, :]]
    y = pltriton.load(y_ref.at[rows[:, None], cols[None, :]], mask=in_item[:, None], other=0).astype(F32)
    pltriton.store(at, (y + acc).astype(o_ref.dtype), mask=in_item[:, None])


def _item_tables(groups: RowGroups, num_tokens: int, block_rows: int):
    tile, lo, hi, slot = items_for(groups, num_tokens, block_rows)
    order = groups.order if groups.order is not None else jnp.zeros((1,), jnp.int32)
    return (tile, lo, hi, slot, order.astype(jnp.int32)), groups.order is not None


def _checked(width: int, k: jax.Array, align: int, block: int, block_rows: int, rank_block: int) -> int:
    checked_knobs(align, block, rank_block)
    chunk = chunk_size(width, segment_size(k), align, block)
    if min(chunk, block_rows, rank_block) < MIN_DOT:
        raise ValueError(
            f"tiles need chunks ({chunk}: the power of two shared by width {width}, E {segment_size(k)} and "
            f"align {align}), block_rows ({block_rows}) and rank_block ({rank_block}) of at least {MIN_DOT}"
        )
    return chunk


@functools.partial(jax.jit, static_argnames=_KNOBS)
def unified_tiled_shrink(
    x: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer: jax.Array,
    pages: jax.Array,
    offsets: jax.Array,
    ranks: jax.Array,
    groups: RowGroups,
    *,
    max_rank: int,
    align: int,
    block_rows: int = 16,
    block: int = 128,
    rank_block: int = 16,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """h[t] = x[t] @ A for the A of row t's slot, per tile of rows sharing the slot (module doc).

    Args:
      x: [T, D] float; k, v, layer, pages, offsets, ranks, max_rank, align: as `unified.unified_shrink`.
      groups: the rows grouped by slot (`common.make_row_groups` of the [T] slot ids, its num_slots
        counting every distinct id, -1 included: rows of a slot past that count get no work item
        and are left unwritten). A slot of rank 0, or -1, gives h = 0.
      block_rows: rows a tile holds; block: most elements a load moves; rank_block: rank-rows a
        program takes (powers of two, at least 16 each with the chunk).

    Returns:
      h: [T, max_rank] in x.dtype, accumulated in f32; columns at and past a row's rank are 0.
    """
    num_tokens, hidden = x.shape
    check_unified(x, k, v, pages, offsets, ranks, jnp.zeros((num_tokens,), jnp.int32))
    chunk = _checked(hidden, k, align, block, block_rows, rank_block)
    items, has_order = _item_tables(groups, num_tokens, block_rows)
    kernel = functools.partial(
        _shrink_kernel,
        seg=segment_size(k),
        hidden=hidden,
        chunk=chunk,
        rank_block=rank_block,
        max_rank=max_rank,
        block_rows=block_rows,
        num_tokens=num_tokens,
        has_order=has_order,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, max_rank), x.dtype),
        grid=(items[0].shape[0], pl.cdiv(max_rank, rank_block)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lora_unified_tiled_shrink",
    )(*items, *_tables(ranks, offsets, pages, layer), x, flat_pool(k), flat_pool(v))


@functools.partial(jax.jit, static_argnames=_KNOBS[1:])
def unified_tiled_expand(
    y: jax.Array,
    h: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer: jax.Array,
    pages: jax.Array,
    offsets: jax.Array,
    ranks: jax.Array,
    groups: RowGroups,
    *,
    align: int,
    block_rows: int = 16,
    block: int = 128,
    rank_block: int = 16,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """y[t] + h[t, :rank] @ B for the B of row t's slot, per tile of rows sharing the slot.

    Args:
      y: [T, O] float; h: [T, C] the shrink's result; the rest as `unified_tiled_shrink` (offsets: B's).

    Returns:
      [T, O] in y.dtype, the delta accumulated in f32; rows of rank-0 slots unchanged.
    """
    num_tokens, out = y.shape
    check_unified(y, k, v, pages, offsets, ranks, jnp.zeros((num_tokens,), jnp.int32))
    if h.ndim != 2 or h.shape[0] != num_tokens:
        raise ValueError(f"h {h.shape} must be [T, C] for y {y.shape}")
    chunk = _checked(out, k, align, block, block_rows, rank_block)
    items, has_order = _item_tables(groups, num_tokens, block_rows)
    kernel = functools.partial(
        _expand_kernel,
        seg=segment_size(k),
        out=out,
        chunk=chunk,
        rank_block=rank_block,
        rank_cols=h.shape[1],
        block_rows=block_rows,
        num_tokens=num_tokens,
        has_order=has_order,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(items[0].shape[0], out // chunk),
        input_output_aliases={9: 0},  # y: every row is in one work item; aliasing keeps any other intact
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lora_unified_tiled_expand",
    )(*items, *_tables(ranks, offsets, pages, layer), y, h, flat_pool(k), flat_pool(v))


def _tables(ranks, offsets, pages, layer) -> tuple[jax.Array, ...]:
    i32 = jnp.int32
    return ranks.astype(i32), offsets.astype(i32), pages.astype(i32), jnp.reshape(layer, (1,)).astype(i32)
