"""LoRA shrink / expand as Pallas kernels for the Triton (GPU) backend, segmented and per-row.

Compute, for each segment g of rows sharing adapter slot s_g = seg_slots[g]:
    shrink: h[rows of g, :]  = x[rows of g, :] @ a[s_g]                       (accumulated in f32)
    expand: y[rows of g, :] += h[rows of g, c:c+R] @ b[s_g]                   (add fused, in place)
SGMV (prefill): segment g is rows seg_starts[g] .. seg_starts[g+1]-1, contiguous.
BGMV (decode): every row has its own slot; the wrapper groups rows by slot (a permutation `order`),
so a slot shared by many rows is read once per tile of rows, not once per row.

Slot 0 is the "no adapter" slot: its rows get h = 0 and y unchanged, and no bank entry is read.

Work decomposition: rows (in grouped order) are cut into aligned tiles of `block_rows`; a work item
is one (segment, tile) pair that overlaps, so there are at most ceil(T / block_rows) + G - 1 items.
Each program handles one item: it loads the tile's rows masked to the segment, the segment's
adapter block, and writes only its own rows. The grouping is plain XLA on small int arrays; a caller
that runs many ops over the same rows (a model step: every layer, every module group) builds it once
as `RowGroups` and passes it in.

Expand has a second decode form, per row (`impl="rows"`): program (row block, column block) reads
each row's own b[slot] columns with one gather load and needs no grouping at all. It wins when most
rows have their own adapter (nothing to share, no indirection, no wasted tile rows); the grouped form
wins when many rows share one. `tuning.py` picks one per token-count bucket (a static rule). Triton needs every operation on power-of-two sizes,
so the rank axis is padded to `rank_pad` by masked loads (the bank is never copied or padded).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning

_F32 = jnp.float32
MIN_DOT = 16  # Triton's smallest dot operand size along any axis.
MAX_RANK_PAD = 1024  # widest stacked rank one shrink launch takes (f32 accumulator in registers).


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pad_pow2(n: int, minimum: int = MIN_DOT) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


# -- work items (plain XLA on small int arrays) -------------------------------------------------


def work_items(seg_starts: jax.Array, seg_slots: jax.Array, num_tokens: int, block_rows: int):
    """(segment, tile) pairs covering every row of every non-empty segment.

    Args:
      seg_starts: [G + 1] int32, nondecreasing row offsets (segment g is [starts[g], starts[g+1])).
      seg_slots: [G] int32 slot of each segment.
      num_tokens: T, rows in x.
      block_rows: tile height.

    Returns:
      (tile, lo, hi, slot), each [I] int32 with I = ceil(T / block_rows) + G - 1: item i covers
      rows lo..hi-1 of tile `tile` with adapter `slot`. Unused items have lo == hi and slot 0.
    """
    num_segments = seg_slots.shape[0]
    num_items = pl.cdiv(num_tokens, block_rows) + num_segments - 1
    start, end = seg_starts[:-1], seg_starts[1:]
    first_tile, last_tile = start // block_rows, (end - 1) // block_rows
    tiles_per_seg = jnp.where(end > start, last_tile - first_tile + 1, 0)
    seg_ids = jnp.arange(num_segments)
    # Inclusive prefix sum as a [G, G] masked reduction: one fused kernel, not a scan.
    items_through = jnp.sum(jnp.where(seg_ids[None, :] <= seg_ids[:, None], tiles_per_seg[None, :], 0), axis=1)
    item = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.sum(items_through[None, :] <= item[:, None], axis=1)  # [I] segment of each item
    is_used = item < items_through[-1]
    seg = jnp.minimum(seg, num_segments - 1)
    tile = first_tile[seg] + item - (items_through[seg] - tiles_per_seg[seg])
    lo = jnp.maximum(start[seg], tile * block_rows)
    hi = jnp.minimum(end[seg], tile * block_rows + block_rows)
    zero = jnp.zeros_like(item)
    return (
        jnp.where(is_used, tile, zero).astype(jnp.int32),
        jnp.where(is_used, lo, zero).astype(jnp.int32),
        jnp.where(is_used, hi, zero).astype(jnp.int32),
        jnp.where(is_used, seg_slots[seg], zero).astype(jnp.int32),
    )


def group_rows_by_slot(slot_ids: jax.Array, max_segments: int):
    """Per-row slots -> (order, seg_starts, seg_slots): rows order[p] in order of slot, one segment per slot.

    Built from [T, T] comparisons rather than a sort and scans: for decode-sized T these fuse into a
    few small kernels, where argsort + cumsum cost several launches each.

    Args:
      slot_ids: [T] int32.
      max_segments: G, an upper bound on the number of distinct slots (min(S, T)).

    Returns:
      order [T] int32 (position -> row), seg_starts [G + 1] int32, seg_slots [G] int32.
    """
    num_tokens = slot_ids.shape[0]
    row = jnp.arange(num_tokens, dtype=jnp.int32)
    is_lower = slot_ids[None, :] < slot_ids[:, None]  # [t, u]: slot of u sorts before slot of t
    is_same_before = (slot_ids[None, :] == slot_ids[:, None]) & (row[None, :] < row[:, None])
    position = jnp.sum(is_lower | is_same_before, axis=1, dtype=jnp.int32)  # [T] grouped position of row t
    is_first = ~jnp.any(is_same_before, axis=1)  # [T] first row of its slot
    seg_of_row = jnp.sum(is_lower & is_first[None, :], axis=1, dtype=jnp.int32)  # [T] distinct slots before
    order = jnp.sum(jnp.where(position[None, :] == row[:, None], row[None, :], 0), axis=1, dtype=jnp.int32)
    seg = jnp.arange(max_segments + 1, dtype=jnp.int32)
    seg_starts = jnp.sum(seg_of_row[None, :] < seg[:, None], axis=1, dtype=jnp.int32)  # [G + 1]
    is_seg_head = is_first[None, :] & (seg_of_row[None, :] == seg[:-1, None])  # [G, T]
    seg_slots = jnp.sum(jnp.where(is_seg_head, slot_ids[None, :], 0), axis=1, dtype=jnp.int32)
    return order, seg_starts, seg_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowGroups:
    """Rows grouped by slot, and the (segment, tile) work items for each tile height used.

    order: [T] int32 grouped position -> row, or None when rows already come in segments (prefill).
    seg_starts: [G + 1] int32 segment offsets in grouped order; seg_slots: [G] int32 slot of each.
    items: block_rows -> (tile, lo, hi, slot), each [I] int32 (see `work_items`).
    """

    order: jax.Array | None
    seg_starts: jax.Array
    seg_slots: jax.Array
    items: dict[int, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]


def make_row_groups(
    slot_ids: jax.Array, *, num_slots: int, seg_len: int | None, block_rows: tuple[int, ...]
) -> RowGroups:
    """Groups the T rows of slot_ids [T] by slot (decode) or cuts them into runs of seg_len (prefill)."""
    num_tokens = slot_ids.shape[0]
    slot_ids = slot_ids.astype(jnp.int32)
    if seg_len is None:
        order, seg_starts, seg_slots = group_rows_by_slot(slot_ids, max(1, min(num_slots, num_tokens)))
    else:
        order = None
        seg_starts = jnp.arange(num_tokens // seg_len + 1, dtype=jnp.int32) * seg_len
        seg_slots = slot_ids[::seg_len]
    items = {br: work_items(seg_starts, seg_slots, num_tokens, br) for br in sorted(set(block_rows))}
    return RowGroups(order=order, seg_starts=seg_starts, seg_slots=seg_slots, items=items)


def _items_for(groups: RowGroups, num_tokens: int, block_rows: int):
    """The work items for this tile height: precomputed if the groups hold them, else built now."""
    if block_rows in groups.items:
        return groups.items[block_rows]
    return work_items(groups.seg_starts, groups.seg_slots, num_tokens, block_rows)


# -- kernel bodies ------------------------------------------------------------------------------


def _item_rows(item, tile_ref, lo_ref, hi_ref, order_ref, *, block_rows: int, num_tokens: int, has_order: bool):
    """Rows of work item `item`: (rows [BT] int32, in_item [BT] bool). Rows outside the item are T."""
    pos = tile_ref[item] * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # grouped positions
    in_item = (pos >= lo_ref[item]) & (pos < hi_ref[item])
    if has_order:
        rows = pltriton.load(order_ref.at[pos], mask=pos < num_tokens, other=num_tokens)
    else:
        rows = pos
    # An out-of-range row makes a stray access visible (and interpret mode drops such stores).
    return jnp.where(in_item, rows, num_tokens), in_item


def _dot(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jnp.dot(lhs, rhs.astype(lhs.dtype), preferred_element_type=_F32, precision=precision)


def _rank_product(h: jax.Array, b: jax.Array) -> jax.Array:
    """h [BT, RP] @ b [RP, BO] in f32: a tensor-core dot from 16 rows up, else multiply and sum over RP."""
    if h.shape[0] >= MIN_DOT:
        return _dot(h, b)
    return jnp.sum(h.astype(_F32)[:, :, None] * b.astype(_F32)[None, :, :], axis=1)


def _summed_partials(h_ref, at: tuple, mask: jax.Array, num_parts: int) -> jax.Array:
    """sum over k of h_ref[k][at] (f32 split-K partials of a shrink), masked loads summed as loaded."""
    h = pltriton.load(h_ref.at[(0,) + at], mask=mask, other=0)
    for k in range(1, num_parts):
        h = h + pltriton.load(h_ref.at[(k,) + at], mask=mask, other=0)
    return h


def _shrink_kernel(
    layer_ref,
    tile_ref,
    lo_ref,
    hi_ref,
    slot_ref,
    order_ref,
    x_ref,
    a_ref,
    h_ref,
    *,
    block_rows: int,
    block_k: int,
    k_per_split: int,
    rank_pad: int,
    hidden: int,
    rank: int,
    num_tokens: int,
    has_order: bool,
    is_split: bool,
):
    # tile/lo/hi/slot_ref: [I] int32 work items; order_ref: [T] int32 position -> row.
    # layer_ref: [1] int32; x_ref: [T, D]; a_ref: [L, S, D, R];
    # h_ref: [K, T, R] f32 partial sums if is_split else [T, R].
    item, split = pl.program_id(0), pl.program_id(1)  # read outside pl.when (interpret mode)
    slot, layer = slot_ref[item], layer_ref[0]
    cols = jnp.arange(rank_pad, dtype=jnp.int32)
    col_ok = cols < rank

    def item_rows():
        rows, in_item = _item_rows(
            item, tile_ref, lo_ref, hi_ref, order_ref, block_rows=block_rows, num_tokens=num_tokens, has_order=has_order
        )
        out_at = (split, rows[:, None], cols[None, :]) if is_split else (rows[:, None], cols[None, :])
        return rows, in_item, out_at, in_item[:, None] & col_ok[None, :]

    def multiply(step, acc, rows, in_item):  # acc: [BT, RP] f32
        ks = split * k_per_split + step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = ks < hidden
        x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=in_item[:, None] & k_ok[None, :], other=0)
        a = pltriton.load(
            a_ref.at[layer, slot, ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0
        )
        return acc + _dot(x, a)

    @pl.when(slot != 0)
    def _():
        rows, in_item, out_at, out_mask = item_rows()
        step = functools.partial(multiply, rows=rows, in_item=in_item)
        acc = lax.fori_loop(0, k_per_split // block_k, step, jnp.zeros((block_rows, rank_pad), _F32))
        pltriton.store(h_ref.at[out_at], acc.astype(h_ref.dtype), mask=out_mask)

    @pl.when((slot == 0) & (lo_ref[item] < hi_ref[item]))
    def _():  # no adapter: h = 0 without reading the bank
        _, _, out_at, out_mask = item_rows()
        pltriton.store(h_ref.at[out_at], jnp.zeros((block_rows, rank_pad), h_ref.dtype), mask=out_mask)


def _expand_kernel(
    layer_ref,
    tile_ref,
    lo_ref,
    hi_ref,
    slot_ref,
    order_ref,
    h_ref,
    b_ref,
    y_ref,
    out_ref,
    *,
    block_rows: int,
    block_out: int,
    out_steps: int,
    rank_pad: int,
    rank: int,
    h_col: int,
    out_dim: int,
    num_tokens: int,
    has_order: bool,
):
    # tile/lo/hi/slot_ref: [I] int32 work items; order_ref: [T] int32 position -> row.
    # h_ref: [T, C] (this module's columns are h_col .. h_col+R-1); layer_ref: [1] int32; b_ref: [L, S, R, O];
    # y_ref: [T, O] base output; out_ref: [T, O], the same buffer as y (aliased).
    # Program (item, j) covers output columns j*out_steps*block_out .. in out_steps pipelined steps.
    item, out_split = pl.program_id(0), pl.program_id(1)  # read outside pl.when (interpret mode)
    slot, layer = slot_ref[item], layer_ref[0]

    @pl.when(slot != 0)  # no adapter (or an unused item): y stays as it is, nothing is read
    def _():
        rows, in_item = _item_rows(
            item, tile_ref, lo_ref, hi_ref, order_ref, block_rows=block_rows, num_tokens=num_tokens, has_order=has_order
        )
        r = jnp.arange(rank_pad, dtype=jnp.int32)
        r_ok = r < rank
        h = pltriton.load(h_ref.at[rows[:, None], h_col + r[None, :]], mask=in_item[:, None] & r_ok[None, :], other=0)

        def add_block(step, carry):
            outs = (out_split * out_steps + step) * block_out + jnp.arange(block_out, dtype=jnp.int32)
            out_ok = outs < out_dim
            b = pltriton.load(
                b_ref.at[layer, slot, r[:, None], outs[None, :]], mask=r_ok[:, None] & out_ok[None, :], other=0
            )
            mask = in_item[:, None] & out_ok[None, :]
            at = (rows[:, None], outs[None, :])
            y = pltriton.load(y_ref.at[at], mask=mask, other=0)
            pltriton.store(out_ref.at[at], (y.astype(_F32) + _rank_product(h, b)).astype(out_ref.dtype), mask=mask)
            return carry

        lax.fori_loop(0, out_steps, add_block, 0)


def _expand_rows_kernel(
    layer_ref,
    slot_ref,
    h_ref,
    b_ref,
    y_ref,
    out_ref,
    *,
    block_rows: int,
    block_out: int,
    rank_pad: int,
    rank: int,
    h_col: int,
    out_dim: int,
    num_tokens: int,
):
    # layer_ref: [1] int32; slot_ref: [T] int32; h_ref: [T, C] (this module's columns h_col .. h_col+R-1);
    # b_ref: [L, S, R, O];
    # y_ref: [T, O] base output; out_ref: [T, O], aliased to y.
    # Program (i, j): rows i*BT .. and columns j*BO .., each row reading its own b[slot] columns.
    layer = layer_ref[0]
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    outs = pl.program_id(1) * block_out + jnp.arange(block_out, dtype=jnp.int32)
    slots = pltriton.load(slot_ref.at[rows], mask=rows < num_tokens, other=0)  # [BT]
    is_used = (rows < num_tokens) & (slots != 0)  # slot 0 rows read nothing and keep y
    r = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok, out_ok = r < rank, outs < out_dim
    h = pltriton.load(h_ref.at[rows[:, None], h_col + r[None, :]], mask=is_used[:, None] & r_ok[None, :], other=0)
    b_mask = is_used[:, None, None] & r_ok[None, :, None] & out_ok[None, None, :]
    b = pltriton.load(
        b_ref.at[layer, slots[:, None, None], r[None, :, None], outs[None, None, :]], mask=b_mask, other=0
    )
    mask = is_used[:, None] & out_ok[None, :]
    y = pltriton.load(y_ref.at[rows[:, None], outs[None, :]], mask=mask, other=0)
    delta = jnp.sum(h.astype(_F32)[:, :, None] * b.astype(_F32), axis=1)  # [BT, BO]
    pltriton.store(out_ref.at[rows[:, None], outs[None, :]], (y.astype(_F32) + delta).astype(out_ref.dtype), mask=mask)


def _expand_rows_multi_kernel(
    layer_ref,
    slot_ref,
    h_ref,
    *refs,
    num_modules: int,
    num_outputs: int,
    output_of: tuple[int, ...],
    col_offset: tuple[int, ...],
    block_rows: int,
    block_out: int,
    rank_pad: int,
    rank: int,
    out_dims: tuple[int, ...],
    first_block: tuple[int, ...],
    num_parts: int,
    num_tokens: int,
):
    # layer_ref: [1] int32; slot_ref: [T] int32; h_ref: [K, T, G*R] f32 split-K partial sums of the
    # group's shrink (summed here, as they are loaded); refs: G banks b_g [L, S, R, O_g], Y base
    # outputs y_k [T, W_k], then Y outputs aliased to the y_k. Module g writes columns
    # col_offset[g] .. col_offset[g] + O_g - 1 of output output_of[g] (Y = G with offsets 0: one
    # output per module; Y = 1: every module in its own columns of one fused output).
    # Program (i, j): rows i*BT .. and column block j of the concatenated outputs; module g owns
    # blocks first_block[g] .. first_block[g+1]-1, so one launch covers every module of the group.
    b_refs = refs[:num_modules]
    y_refs, out_refs = refs[num_modules : num_modules + num_outputs], refs[num_modules + num_outputs :]
    layer, j = layer_ref[0], pl.program_id(1)
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    slots = pltriton.load(slot_ref.at[rows], mask=rows < num_tokens, other=0)  # [BT]
    is_used = (rows < num_tokens) & (slots != 0)  # slot 0 rows read nothing and keep y
    r = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok = r < rank
    for g in range(num_modules):

        @pl.when((j >= first_block[g]) & (j < first_block[g + 1]))
        def _(g=g):
            outs = (j - first_block[g]) * block_out + jnp.arange(block_out, dtype=jnp.int32)
            out_ok = outs < out_dims[g]
            h_at = (rows[:, None], g * rank + r[None, :])
            h_mask = is_used[:, None] & r_ok[None, :]
            h = _summed_partials(h_ref, h_at, h_mask, num_parts)
            b_mask = is_used[:, None, None] & r_ok[None, :, None] & out_ok[None, None, :]
            b = pltriton.load(
                b_refs[g].at[layer, slots[:, None, None], r[None, :, None], outs[None, None, :]], mask=b_mask, other=0
            )
            mask = is_used[:, None] & out_ok[None, :]
            at = (rows[:, None], col_offset[g] + outs[None, :])
            y_ref, out_ref = y_refs[output_of[g]], out_refs[output_of[g]]
            y = pltriton.load(y_ref.at[at], mask=mask, other=0)
            delta = jnp.sum(h[:, :, None] * b.astype(_F32), axis=1)  # [BT, BO]; h is f32 already
            pltriton.store(out_ref.at[at], (y.astype(_F32) + delta).astype(out_ref.dtype), mask=mask)


def _expand_tiles_multi_kernel(
    layer_ref,
    tile_ref,
    lo_ref,
    hi_ref,
    slot_ref,
    order_ref,
    h_ref,
    *refs,
    num_modules: int,
    num_outputs: int,
    output_of: tuple[int, ...],
    col_offset: tuple[int, ...],
    block_rows: int,
    block_out: int,
    rank_pad: int,
    rank: int,
    out_dims: tuple[int, ...],
    first_block: tuple[int, ...],
    num_parts: int,
    num_tokens: int,
    has_order: bool,
):
    # The tile form of `_expand_rows_multi_kernel`: program (item, j) adds, for the rows of work item
    # `item` (rows grouped by slot, one slot per item), column block j of the concatenated outputs.
    # tile/lo/hi/slot_ref: [I] int32 work items; order_ref: [T] int32 grouped position -> row;
    # h_ref: [K, T, G*R] f32 split-K partials (summed here, then rounded to the bank's dtype: the
    # contract's h, as `lora_shrink` returns it); refs: G banks b_g [L, S, R, O_g], Y outputs y_k
    # [T, W_k], then Y outputs aliased to them. Why: each b[slot] column block is read once per
    # item (up to block_rows rows) instead of once per row, a tensor-core dot instead of a
    # multiply-and-sum; it pays when rows share adapters.
    b_refs = refs[:num_modules]
    y_refs, out_refs = refs[num_modules : num_modules + num_outputs], refs[num_modules + num_outputs :]
    item, j = pl.program_id(0), pl.program_id(1)  # read outside pl.when (interpret mode)
    slot, layer = slot_ref[item], layer_ref[0]
    r = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok = r < rank
    for g in range(num_modules):

        @pl.when((slot != 0) & (j >= first_block[g]) & (j < first_block[g + 1]))
        def _(g=g):
            rows, in_item = _item_rows(
                item,
                tile_ref,
                lo_ref,
                hi_ref,
                order_ref,
                block_rows=block_rows,
                num_tokens=num_tokens,
                has_order=has_order,
            )
            outs = (j - first_block[g]) * block_out + jnp.arange(block_out, dtype=jnp.int32)
            out_ok = outs < out_dims[g]
            h_at = (rows[:, None], g * rank + r[None, :])
            h_mask = in_item[:, None] & r_ok[None, :]
            h = _summed_partials(h_ref, h_at, h_mask, num_parts)
            b = pltriton.load(
                b_refs[g].at[layer, slot, r[:, None], outs[None, :]], mask=r_ok[:, None] & out_ok[None, :], other=0
            )
            at = (rows[:, None], col_offset[g] + outs[None, :])
            mask = in_item[:, None] & out_ok[None, :]
            y_ref, out_ref = y_refs[output_of[g]], out_refs[output_of[g]]
            y = pltriton.load(y_ref.at[at], mask=mask, other=0)
            delta = _dot(h.astype(b.dtype), b)  # [BT, BO] f32
            pltriton.store(out_ref.at[at], (y.astype(_F32) + delta).astype(out_ref.dtype), mask=mask)


# -- wrappers -----------------------------------------------------------------------------------


def check_column_spans(out_cols: tuple[int, ...], widths: tuple[int, ...], y_shape: tuple[int, ...]) -> None:
    """Module g of a fused output y [T, W] owns columns out_cols[g] .. out_cols[g] + widths[g] - 1:
    raises ValueError unless the spans are one per module, inside y, in order and disjoint (modules
    write their columns in place, so an overlap would race)."""
    if len(out_cols) != len(widths):
        raise ValueError(f"out_cols {out_cols} must give one column offset per bank ({len(widths)})")
    spans = [(c, c + w) for c, w in zip(out_cols, widths)]
    if len(y_shape) != 2 or any(lo < 0 or hi > y_shape[1] for lo, hi in spans):
        raise ValueError(f"column spans {spans} must lie inside y {tuple(y_shape)} [T, W]")
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        raise ValueError(f"column spans {spans} must be in order and must not overlap")


def _check_pow2(min_rows: int = MIN_DOT, **knobs: int) -> None:
    for name, value in knobs.items():
        if not _is_pow2(value):
            raise ValueError(f"{name}={value} must be a power of two (Triton works on power-of-two blocks)")
    if knobs.get("block_rows", min_rows) < min_rows:
        raise ValueError(f"block_rows={knobs['block_rows']} must be >= {min_rows} (Triton dot minimum)")


def _check_segments(seg_starts: jax.Array, seg_slots: jax.Array) -> None:
    if seg_slots.ndim != 1 or seg_starts.shape != (seg_slots.shape[0] + 1,):
        raise ValueError(f"seg_starts {seg_starts.shape} must be [G + 1] for seg_slots {seg_slots.shape} [G]")
    if seg_slots.shape[0] == 0:
        raise ValueError("need at least one segment")
    for name, arr in (("seg_starts", seg_starts), ("seg_slots", seg_slots)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} dtype {arr.dtype} must be an integer type")


def _check_shrink(x: jax.Array, a: jax.Array) -> None:
    """a: [S, D, R], or [L, S, D, R] with a layer index."""
    if x.ndim != 2 or a.ndim not in (3, 4) or a.shape[-2] != x.shape[1]:
        raise ValueError(f"shrink needs x [T, D] and a [(L,) S, D, R]; got x {x.shape}, a {a.shape}")
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(a.dtype, jnp.floating)):
        raise ValueError(f"x {x.dtype} and a {a.dtype} must be floating point")
    if _pad_pow2(a.shape[-1]) > MAX_RANK_PAD:
        raise ValueError(f"stacked rank {a.shape[-1]} pads to more than {MAX_RANK_PAD=}; use separate shrinks")


def _check_expand(y: jax.Array, h: jax.Array, b: jax.Array, h_col: int) -> None:
    if y.ndim != 2 or h.ndim != 2 or b.ndim not in (3, 4) or h.shape[0] != y.shape[0] or b.shape[-1] != y.shape[1]:
        raise ValueError(
            f"expand needs y [T, O], h [T, C], b [(L,) S, R, O]; got y {y.shape}, h {h.shape}, b {b.shape}"
        )
    if not 0 <= h_col <= h.shape[1] - b.shape[-2]:
        raise ValueError(f"h_col={h_col} + rank {b.shape[-2]} must fit in h's {h.shape[1]} columns")
    if _pad_pow2(b.shape[-2]) > MAX_RANK_PAD:
        raise ValueError(f"rank {b.shape[-2]} pads to more than {MAX_RANK_PAD=}")


# Largest [rows, rank_pad, block_out] product a multiply-and-sum expand keeps in registers.
MAX_PRODUCT_ELEMS = 16384
EXPAND_IMPLS = ("grouped", "rows")


def _shrink_call(
    x,
    a,
    layer,
    order,
    items,
    *,
    block_rows,
    block_k,
    split_k,
    num_warps,
    num_stages,
    interpret,
    keep_partials: bool = False,
):
    # a: [L, S, D, R]; layer: [1] int32. keep_partials: return the f32 split-K partial sums [K, T, R]
    # unreduced (K >= 1), for a consumer that sums them as it loads (saves a reduction launch).
    num_tokens, hidden = x.shape
    rank = a.shape[3]
    rank_pad = _pad_pow2(rank)
    block_k = min(block_k, _pad_pow2(hidden), max(MIN_DOT, 16384 // rank_pad))  # bound the a tile in registers
    split_k = max(1, min(split_k, pl.cdiv(hidden, block_k)))
    k_per_split = pl.cdiv(pl.cdiv(hidden, split_k), block_k) * block_k
    has_order = order is not None
    order = order if has_order else jnp.zeros((1,), jnp.int32)  # placeholder operand, never read
    is_split = split_k > 1 or keep_partials
    out_shape = (split_k, num_tokens, rank) if is_split else (num_tokens, rank)
    kernel = functools.partial(
        _shrink_kernel,
        block_rows=block_rows,
        block_k=block_k,
        k_per_split=k_per_split,
        rank_pad=rank_pad,
        hidden=hidden,
        rank=rank,
        num_tokens=num_tokens,
        has_order=has_order,
        is_split=is_split,
    )
    h = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, _F32 if is_split else x.dtype),
        grid=(items[0].shape[0], split_k),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="lora_shrink",
    )(layer, *items, order, x, a)
    if keep_partials:
        return h
    return h.sum(axis=0).astype(x.dtype) if is_split else h


def _product_block_out(block_out: int, block_rows: int, rank_pad: int, out_dim: int) -> int:
    if block_rows < MIN_DOT:  # multiply-and-sum: bound the [rows, rank, cols] product
        block_out = min(block_out, max(MIN_DOT, MAX_PRODUCT_ELEMS // (block_rows * rank_pad)))
    return min(block_out, _pad_pow2(out_dim))


def _expand_call(
    y, h, b, layer, order, items, *, h_col, block_rows, block_out, out_split, num_warps, num_stages, interpret
):
    # b: [L, S, R, O]; layer: [1] int32.
    num_tokens, out_dim = y.shape
    rank = b.shape[2]
    block_out = _product_block_out(block_out, block_rows, _pad_pow2(rank), out_dim)
    num_blocks = pl.cdiv(out_dim, block_out)
    out_split = max(1, min(out_split, num_blocks))
    out_steps = pl.cdiv(num_blocks, out_split)
    has_order = order is not None
    order = order if has_order else jnp.zeros((1,), jnp.int32)
    kernel = functools.partial(
        _expand_kernel,
        block_rows=block_rows,
        block_out=block_out,
        out_steps=out_steps,
        rank_pad=_pad_pow2(rank),
        rank=rank,
        h_col=h_col,
        out_dim=out_dim,
        num_tokens=num_tokens,
        has_order=has_order,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(items[0].shape[0], pl.cdiv(num_blocks, out_steps)),
        input_output_aliases={8: 0},  # y: rows without an adapter are never written
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="lora_expand",
    )(layer, *items, order, h, b, y)


def _expand_rows_call(y, h, b, layer, slot_ids, *, h_col, block_rows, block_out, num_warps, num_stages, interpret):
    # b: [L, S, R, O]; layer: [1] int32.
    num_tokens, out_dim = y.shape
    rank = b.shape[2]
    rank_pad = _pad_pow2(rank)
    block_out = _product_block_out(block_out, min(block_rows, MIN_DOT // 2), rank_pad, out_dim)
    kernel = functools.partial(
        _expand_rows_kernel,
        block_rows=block_rows,
        block_out=block_out,
        rank_pad=rank_pad,
        rank=rank,
        h_col=h_col,
        out_dim=out_dim,
        num_tokens=num_tokens,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(pl.cdiv(num_tokens, block_rows), pl.cdiv(out_dim, block_out)),
        input_output_aliases={4: 0},  # y: rows without an adapter are never written
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="lora_expand_rows",
    )(layer, slot_ids.astype(jnp.int32), h, b, y)


def _knobs(op: str, mode: str, num_tokens: int, given: dict) -> dict:
    knobs = tuning.lookup(op, mode, num_tokens)
    knobs.update({k: v for k, v in given.items() if v is not None})
    return knobs


_SHRINK_KNOBS = ("block_rows", "block_k", "split_k", "num_warps", "num_stages", "interpret")
_EXPAND_KNOBS = ("h_col", "block_rows", "block_out", "out_split", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_SHRINK_KNOBS)
def sgmv_shrink(
    x: jax.Array,
    a: jax.Array,
    seg_starts: jax.Array,
    seg_slots: jax.Array,
    *,
    block_rows: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Segmented shrink: h[i] = x[i] @ a[seg_slots[g]] for seg_starts[g] <= i < seg_starts[g + 1].

    Args:
      x: [T, D] float (bf16 or f32), the tokens.
      a: [S, D, R] adapter bank (R may stack several modules); slot 0 is "no adapter".
      seg_starts: [G + 1] int32, nondecreasing, seg_starts[0] = 0 and seg_starts[G] = T (empty
        segments allowed). Rows outside [seg_starts[0], seg_starts[G]) are left undefined.
      seg_slots: [G] int32 in [0, S).
      block_rows, block_k, split_k, num_warps, num_stages: tuning knobs (default: tuning.py).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      h: [T, R] in x.dtype, accumulated in f32; rows of slot 0 are exactly 0.
    """
    _check_segments(seg_starts, seg_slots)
    groups = RowGroups(
        order=None, seg_starts=seg_starts.astype(jnp.int32), seg_slots=seg_slots.astype(jnp.int32), items={}
    )
    return grouped_shrink(x, a, groups, mode="prefill", interpret=interpret, **_given(locals(), _SHRINK_KNOBS))


@functools.partial(jax.jit, static_argnames=_SHRINK_KNOBS)
def bgmv_shrink(
    x: jax.Array,
    a: jax.Array,
    slot_ids: jax.Array,
    *,
    block_rows: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Per-row shrink: h[t] = x[t] @ a[slot_ids[t]]; rows sharing a slot read its adapter once per tile.

    Args:
      x: [T, D] float (bf16 or f32).
      a: [S, D, R] adapter bank; slot 0 is "no adapter".
      slot_ids: [T] int32 in [0, S).
      block_rows, block_k, split_k, num_warps, num_stages: tuning knobs (default: tuning.py).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      h: [T, R] in x.dtype, accumulated in f32; rows of slot 0 are exactly 0.
    """
    _check_shrink(x, a)
    if slot_ids.shape != (x.shape[0],):
        raise ValueError(f"slot_ids {slot_ids.shape} must be [T] for x {x.shape}")
    groups = make_row_groups(slot_ids, num_slots=a.shape[0], seg_len=None, block_rows=())
    return grouped_shrink(x, a, groups, mode="decode", interpret=interpret, **_given(locals(), _SHRINK_KNOBS))


def grouped_shrink(
    x: jax.Array,
    a: jax.Array,
    groups: RowGroups,
    *,
    mode: str,
    interpret: bool = False,
    layer: jax.Array | None = None,
    **knobs: int | None,
) -> jax.Array:
    """Shrink over precomputed row groups (`make_row_groups`); `mode` ("decode" | "prefill") picks the tuning row.

    The math, shapes and knobs are those of `bgmv_shrink` / `sgmv_shrink`; a model step builds the
    groups once and reuses them in every layer. With `layer` (int32 scalar, may be traced), `a` is
    the whole stacked bank [L, S, D, R] and the kernel reads layer `layer` of it in place: slicing
    it first would copy every slot of that layer on each call.
    """
    _check_shrink(x, a)
    a, layer = _layered(a, layer)
    knobs = _knobs("shrink", mode, x.shape[0], knobs)
    _check_pow2(block_rows=knobs["block_rows"], block_k=knobs["block_k"])
    if x.shape[0] == 0:
        return jnp.zeros((0, a.shape[-1]), x.dtype)
    items = _items_for(groups, x.shape[0], knobs["block_rows"])
    return _shrink_call(x, a, layer, groups.order, items, interpret=interpret, **knobs)


@functools.partial(jax.jit, static_argnames=_EXPAND_KNOBS)
def sgmv_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    seg_starts: jax.Array,
    seg_slots: jax.Array,
    *,
    h_col: int = 0,
    block_rows: int | None = None,
    block_out: int | None = None,
    out_split: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Segmented expand: y[i] += h[i, c:c+R] @ b[seg_slots[g]] for seg_starts[g] <= i < seg_starts[g + 1].

    Args:
      y: [T, O] float, the base output (updated in place when donated or an intermediate).
      h: [T, C] float, shrink output; this module reads columns h_col .. h_col + R - 1.
      b: [S, R, O] adapter bank; slot 0 is "no adapter".
      seg_starts: [G + 1] int32 nondecreasing; seg_slots: [G] int32 in [0, S).
      h_col: static first column of this module in h (multi-module shrink).
      block_rows, block_out, out_split, num_warps, num_stages: tuning knobs (default: tuning.py).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [T, O] in y.dtype: y plus the LoRA term (f32 accumulate); rows of slot 0, or outside every
      segment, are y unchanged.
    """
    _check_segments(seg_starts, seg_slots)
    groups = RowGroups(
        order=None, seg_starts=seg_starts.astype(jnp.int32), seg_slots=seg_slots.astype(jnp.int32), items={}
    )
    knobs = _given(locals(), _EXPAND_KNOBS)
    return grouped_expand(y, h, b, groups, mode="prefill", h_col=h_col, interpret=interpret, **knobs)


@functools.partial(jax.jit, static_argnames=_EXPAND_KNOBS + ("impl",))
def bgmv_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    slot_ids: jax.Array,
    *,
    h_col: int = 0,
    impl: str | None = None,
    block_rows: int | None = None,
    block_out: int | None = None,
    out_split: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Per-row expand: y[t] += h[t, c:c+R] @ b[slot_ids[t]].

    Two implementations compute it (`impl`, default from tuning.py by token count): "grouped"
    sorts rows by slot so that each tile of rows sharing a slot reads b[slot] once; "rows" reads
    each row's own b[slot] columns, with no grouping. The choice is a static rule, benchmarked both
    ways in benchmarks/kernels/lora.py.

    Args:
      y: [T, O] float base output; h: [T, C] float; b: [S, R, O] bank (slot 0 = no adapter);
      slot_ids: [T] int32 in [0, S); h_col: static first column of this module in h.
      impl: "grouped" | "rows" (default: tuning.py).
      block_rows, block_out, out_split, num_warps, num_stages: tuning knobs (default: tuning.py);
        out_split applies to "grouped" only.
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [T, O] in y.dtype; rows of slot 0 are y unchanged.
    """
    if slot_ids.shape != (y.shape[0],):
        raise ValueError(f"slot_ids {slot_ids.shape} must be [T] for y {y.shape}")
    knobs = _given(locals(), _EXPAND_KNOBS + ("impl",))
    impl = knobs.get("impl") or tuning.lookup("expand", "decode", y.shape[0])["impl"]
    groups = None if impl == "rows" else make_row_groups(slot_ids, num_slots=b.shape[0], seg_len=None, block_rows=())
    return decode_expand(y, h, b, slot_ids, groups, h_col=h_col, interpret=interpret, **knobs)


def decode_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    slot_ids: jax.Array,
    groups: RowGroups | None,
    *,
    h_col: int = 0,
    interpret: bool = False,
    layer: jax.Array | None = None,
    **knobs,
) -> jax.Array:
    """`bgmv_expand` with the grouping precomputed (needed unless impl is "rows").

    With `layer`, b is the stacked bank [L, S, R, O] (see `grouped_shrink`)."""
    knobs = _knobs("expand", "decode", y.shape[0], knobs)
    if knobs["impl"] not in EXPAND_IMPLS:
        raise ValueError(f"impl={knobs['impl']!r} must be one of {EXPAND_IMPLS}")
    if knobs.pop("impl") == "grouped":
        return grouped_expand(y, h, b, groups, mode="decode", h_col=h_col, interpret=interpret, layer=layer, **knobs)
    _check_expand(y, h, b, h_col)
    b, layer = _layered(b, layer)
    knobs.pop("out_split", None)
    _check_pow2(min_rows=1, block_rows=knobs["block_rows"], block_out=knobs["block_out"])
    if y.shape[0] == 0:
        return y
    return _expand_rows_call(y, h, b, layer, slot_ids, h_col=h_col, interpret=interpret, **knobs)


def grouped_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    groups: RowGroups,
    *,
    mode: str,
    h_col: int = 0,
    interpret: bool = False,
    layer: jax.Array | None = None,
    **knobs: int | None,
) -> jax.Array:
    """Expand over precomputed row groups; math, shapes and knobs as in `sgmv_expand` / `bgmv_expand`.

    With `layer`, b is the stacked bank [L, S, R, O] (see `grouped_shrink`)."""
    _check_expand(y, h, b, h_col)
    b, layer = _layered(b, layer)
    knobs = {"out_split": 1, **_knobs("expand", mode, y.shape[0], knobs)}
    knobs.pop("impl", None)
    _check_pow2(min_rows=1, block_rows=knobs["block_rows"], block_out=knobs["block_out"])
    if y.shape[0] == 0:
        return y
    items = _items_for(groups, y.shape[0], knobs["block_rows"])
    return _expand_call(y, h, b, layer, groups.order, items, h_col=h_col, interpret=interpret, **knobs)


def check_group(
    x: jax.Array,
    a: jax.Array,
    ys: tuple[jax.Array, ...],
    bs: tuple[jax.Array, ...],
    layer: jax.Array | None,
    out_cols: tuple[int, ...] | None,
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Checks one module group's operands (`decode_group`'s Args); raises ValueError on a mismatch.

    Returns (rank, output_of, col_offset): module g writes columns col_offset[g] .. of ys[output_of[g]].
    """
    _check_shrink(x, a)
    if not bs or len(ys) != (1 if out_cols is not None else len(bs)):
        raise ValueError(f"need one bank per output (or one fused output); got {len(ys)} outputs, {len(bs)} banks")
    rank = bs[0].shape[-2]
    if a.shape[-1] != len(bs) * rank:
        raise ValueError(f"a {a.shape} must stack G={len(bs)} ranks of {rank}")
    ndim = 3 if layer is None else 4
    output_of = tuple(range(len(bs))) if out_cols is None else (0,) * len(bs)
    col_offset = (0,) * len(bs) if out_cols is None else tuple(out_cols)
    if out_cols is not None:
        check_column_spans(col_offset, tuple(b.shape[-1] for b in bs), ys[0].shape)
    for g, b in enumerate(bs):
        y = ys[output_of[g]]
        if (
            y.ndim != 2
            or y.shape[0] != x.shape[0]
            or b.ndim != ndim
            or b.shape[-2] != rank
            or (out_cols is None and b.shape[-1] != y.shape[1])
        ):
            raise ValueError(
                f"output {y.shape} [T, O] (columns from {col_offset[g]}) does not fit bank {b.shape} [(L,) S, R={rank}, O]"
            )
    return rank, output_of, col_offset


def decode_group(
    x: jax.Array,
    a: jax.Array,
    ys: tuple[jax.Array, ...],
    bs: tuple[jax.Array, ...],
    slot_ids: jax.Array,
    groups: RowGroups,
    *,
    layer: jax.Array | None = None,
    interpret: bool = False,
    out_cols: tuple[int, ...] | None = None,
    tiles: dict[str, int] | None = None,
) -> tuple[jax.Array, ...]:
    """One module group's whole LoRA term in decode, in two launches whatever the module count:

        ys[g][t] += (x[t] @ a[s])[g*R:(g+1)*R] @ bs[g][s],   s = slot_ids[t]

    The grouped shrink keeps its split-K partial sums in float32 and the per-row expand adds them up
    as it loads them, writing every module's output in one launch (column blocks of all modules in
    one grid). Against shrink + reduction + one expand per module this saves 1 + (G - 1) launches
    per group, which is what a decode-sized LoRA op costs (a few us each).

    Args:
      x: [T, D]; a: [S, D, G*R] (or [L, S, D, G*R] with `layer`); ys: G outputs [T, O_g];
      bs: G banks [S, R, O_g] (or [L, S, R, O_g]); slot_ids: [T] int32; groups: `make_row_groups`
      of slot_ids (decode) with the shrink's tile height.
      out_cols: None, or G static column offsets: then ys is one fused output [T, W] and module g
        updates its columns out_cols[g] .. out_cols[g] + O_g - 1 (the serving layout's q|k|v).
      tiles: None for the per-row expand (tuning.EXPAND_DECODE's knobs; h stays float32), or the
        tile expand's knobs {block_out, num_warps, num_stages}: program (work item, column block)
        over the shrink's work items, b read once per item, h rounded to the bank's dtype.

    Returns:
      the updated outputs (G, or the one fused output), each in its own dtype (f32 accumulation).
    """
    rank, output_of, col_offset = check_group(x, a, ys, bs, layer, out_cols)
    stacked = layer is not None
    a, layer = _layered(a, layer)
    bs = tuple(b if stacked else b[None] for b in bs)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return ys
    shrink = _knobs("shrink", "decode", num_tokens, {})
    _check_pow2(block_rows=shrink["block_rows"], block_k=shrink["block_k"])
    items = _items_for(groups, num_tokens, shrink["block_rows"])
    parts = _shrink_call(x, a, layer, groups.order, items, interpret=interpret, keep_partials=True, **shrink)
    if tiles is not None:
        return _expand_tiles_call(
            parts,
            bs,
            ys,
            layer,
            groups.order,
            items,
            rank,
            output_of,
            col_offset,
            shrink["block_rows"],
            interpret,
            **tiles,
        )
    expand = _knobs("expand", "decode", num_tokens, {})
    rank_pad = _pad_pow2(rank)
    out_dims = tuple(b.shape[-1] for b in bs)
    block_rows = expand["block_rows"] if expand.get("impl") == "rows" else 1
    block_out = _product_block_out(expand["block_out"], min(block_rows, MIN_DOT // 2), rank_pad, max(out_dims))
    _check_pow2(min_rows=1, block_rows=block_rows, block_out=block_out)
    blocks = [pl.cdiv(o, block_out) for o in out_dims]
    first_block = tuple(int(sum(blocks[:g])) for g in range(len(blocks) + 1))
    kernel = functools.partial(
        _expand_rows_multi_kernel,
        num_modules=len(bs),
        num_outputs=len(ys),
        output_of=output_of,
        col_offset=col_offset,
        block_rows=block_rows,
        block_out=block_out,
        rank_pad=rank_pad,
        rank=rank,
        out_dims=out_dims,
        first_block=first_block,
        num_parts=parts.shape[0],
        num_tokens=num_tokens,
    )
    first_y = 3 + len(bs)  # operands: layer, slot_ids, partials, banks, outputs
    return tuple(
        pl.pallas_call(
            kernel,
            out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in ys),
            grid=(pl.cdiv(num_tokens, block_rows), first_block[-1]),
            input_output_aliases={first_y + g: g for g in range(len(ys))},  # rows without an adapter keep y
            compiler_params=pltriton.CompilerParams(num_warps=expand["num_warps"], num_stages=expand["num_stages"]),
            interpret=interpret,
            name="lora_decode_expand_group",
        )(layer, slot_ids.astype(jnp.int32), parts, *bs, *ys)
    )


TILE_KNOBS = ("block_out", "num_warps", "num_stages")


def _expand_tiles_call(
    parts, bs, ys, layer, order, items, rank, output_of, col_offset, block_rows, interpret, **knobs
) -> tuple[jax.Array, ...]:
    """`decode_group`'s tile expand: parts [K, T, G*R] f32 into the G modules' columns of ys."""
    if set(knobs) != set(TILE_KNOBS):
        raise ValueError(f"tile expand knobs must be exactly {TILE_KNOBS}; got {sorted(knobs)}")
    rank_pad = _pad_pow2(rank)
    out_dims = tuple(b.shape[-1] for b in bs)
    # The b tile [rank_pad, block_out] is a dot operand: bound it like the shrink's a tile.
    block_out = min(knobs["block_out"], _pad_pow2(max(out_dims)), max(MIN_DOT, 16384 // rank_pad))
    _check_pow2(block_rows=block_rows, block_out=block_out)
    blocks = [pl.cdiv(o, block_out) for o in out_dims]
    first_block = tuple(int(sum(blocks[:g])) for g in range(len(blocks) + 1))
    has_order = order is not None
    order = order if has_order else jnp.zeros((1,), jnp.int32)  # placeholder operand, never read
    kernel = functools.partial(
        _expand_tiles_multi_kernel,
        num_modules=len(bs),
        num_outputs=len(ys),
        output_of=output_of,
        col_offset=col_offset,
        block_rows=block_rows,
        block_out=block_out,
        rank_pad=rank_pad,
        rank=rank,
        out_dims=out_dims,
        first_block=first_block,
        num_parts=parts.shape[0],
        num_tokens=parts.shape[1],
        has_order=has_order,
    )
    first_y = 7 + len(bs)  # operands: layer, 4 work-item arrays, order, partials, banks, outputs
    return tuple(
        pl.pallas_call(
            kernel,
            out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in ys),
            grid=(items[0].shape[0], first_block[-1]),
            input_output_aliases={first_y + g: g for g in range(len(ys))},  # rows without an adapter keep y
            compiler_params=pltriton.CompilerParams(num_warps=knobs["num_warps"], num_stages=knobs["num_stages"]),
            interpret=interpret,
            name="lora_decode_expand_tiles",
        )(layer, *items, order, parts, *bs, *ys)
    )


def _layered(bank: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """bank [S, ...] without a layer, or [L, S, ...] with one -> ([L, S, ...], layer as [1] int32)."""
    if layer is None:
        if bank.ndim != 3:
            raise ValueError(f"bank {bank.shape} must be [S, ., .] without a layer index")
        return bank[None], jnp.zeros((1,), jnp.int32)
    if bank.ndim != 4:
        raise ValueError(f"bank {bank.shape} must be [L, S, ., .] with a layer index")
    return bank, jnp.reshape(layer, (1,)).astype(jnp.int32)


def _given(scope: dict, names: tuple[str, ...]) -> dict:
    """The tuning knobs a caller set explicitly (None means: take tuning.py's)."""
    return {n: scope[n] for n in names if n not in ("h_col", "interpret") and scope[n] is not None}
