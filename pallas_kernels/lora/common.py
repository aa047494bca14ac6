"""What the Triton LoRA kernels (`shrink`, `expand`, `group`, `fused`) share.

Work decomposition: rows (grouped by slot for decode, in prefill segments as they come) are cut into
aligned tiles of `block_rows`; a work item is one (segment, tile) pair that overlaps, so there are at
most ceil(T / block_rows) + G - 1 items. Each program handles one item: it loads the tile's rows
masked to the segment, the segment's adapter block, and writes only its own rows. The grouping is
plain XLA on small int arrays; a caller that runs many ops over the same rows (a model step: every
layer, every module group) builds it once as `RowGroups` and passes it in.

Slot 0 is the "no adapter" slot: its rows get h = 0 and y unchanged, and no bank entry is read.
Triton needs every operation on power-of-two sizes, so the rank axis is padded to `rank_pad` by
masked loads (the bank is never copied or padded).

Here: the row grouping (`work_items`, `group_rows_by_slot`, `RowGroups`), the in-kernel helpers every
body uses, the operand checks, and the tuning-table lookup of default knobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora import tuning

F32 = jnp.float32
MIN_DOT = 16  # Triton's smallest dot operand size along any axis.
MAX_RANK_PAD = 1024  # widest stacked rank one shrink launch takes (f32 accumulator in registers).


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pad_pow2(n: int, minimum: int = MIN_DOT) -> int:
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


def items_for(groups: RowGroups, num_tokens: int, block_rows: int):
    """The work items for this tile height: precomputed if the groups hold them, else built now."""
    if block_rows in groups.items:
        return groups.items[block_rows]
    return work_items(groups.seg_starts, groups.seg_slots, num_tokens, block_rows)


# -- in-kernel helpers ---------------------------------------------------------------------------


def work_item_rows(item, tile_ref, lo_ref, hi_ref, order_ref, *, block_rows: int, num_tokens: int, has_order: bool):
    """Rows of work item `item`: (rows [BT] int32, in_item [BT] bool). Rows outside the item are T."""
    pos = tile_ref[item] * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # grouped positions
    in_item = (pos >= lo_ref[item]) & (pos < hi_ref[item])
    if has_order:
        rows = pltriton.load(order_ref.at[pos], mask=pos < num_tokens, other=num_tokens)
    else:
        rows = pos
    # An out-of-range row makes a stray access visible (and interpret mode drops such stores).
    return jnp.where(in_item, rows, num_tokens), in_item


def dot_f32(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jnp.dot(lhs, rhs.astype(lhs.dtype), preferred_element_type=F32, precision=precision)


def rank_product(h: jax.Array, b: jax.Array) -> jax.Array:
    """h [BT, RP] @ b [RP, BO] in f32: a tensor-core dot from 16 rows up, else multiply and sum over RP."""
    if h.shape[0] >= MIN_DOT:
        return dot_f32(h, b)
    return jnp.sum(h.astype(F32)[:, :, None] * b.astype(F32)[None, :, :], axis=1)


def summed_partials(h_ref, at: tuple, mask: jax.Array, num_parts: int) -> jax.Array:
    """sum over k of h_ref[k][at] (f32 split-K partials of a shrink), masked loads summed as loaded."""
    h = pltriton.load(h_ref.at[(0,) + at], mask=mask, other=0)
    for k in range(1, num_parts):
        h = h + pltriton.load(h_ref.at[(k,) + at], mask=mask, other=0)
    return h


# -- operand checks and knobs ----------------------------------------------------------------------


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


def check_pow2(min_rows: int = MIN_DOT, **knobs: int) -> None:
    for name, value in knobs.items():
        if not is_pow2(value):
            raise ValueError(f"{name}={value} must be a power of two (Triton works on power-of-two blocks)")
    if knobs.get("block_rows", min_rows) < min_rows:
        raise ValueError(f"block_rows={knobs['block_rows']} must be >= {min_rows} (Triton dot minimum)")


def check_segments(seg_starts: jax.Array, seg_slots: jax.Array) -> None:
    if seg_slots.ndim != 1 or seg_starts.shape != (seg_slots.shape[0] + 1,):
        raise ValueError(f"seg_starts {seg_starts.shape} must be [G + 1] for seg_slots {seg_slots.shape} [G]")
    if seg_slots.shape[0] == 0:
        raise ValueError("need at least one segment")
    for name, arr in (("seg_starts", seg_starts), ("seg_slots", seg_slots)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} dtype {arr.dtype} must be an integer type")


def check_shrink(x: jax.Array, a: jax.Array) -> None:
    """a: [S, D, R], or [L, S, D, R] with a layer index."""
    if x.ndim != 2 or a.ndim not in (3, 4) or a.shape[-2] != x.shape[1]:
        raise ValueError(f"shrink needs x [T, D] and a [(L,) S, D, R]; got x {x.shape}, a {a.shape}")
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(a.dtype, jnp.floating)):
        raise ValueError(f"x {x.dtype} and a {a.dtype} must be floating point")
    if pad_pow2(a.shape[-1]) > MAX_RANK_PAD:
        raise ValueError(f"stacked rank {a.shape[-1]} pads to more than {MAX_RANK_PAD=}; use separate shrinks")


def check_expand(y: jax.Array, h: jax.Array, b: jax.Array, h_col: int) -> None:
    if y.ndim != 2 or h.ndim != 2 or b.ndim not in (3, 4) or h.shape[0] != y.shape[0] or b.shape[-1] != y.shape[1]:
        raise ValueError(
            f"expand needs y [T, O], h [T, C], b [(L,) S, R, O]; got y {y.shape}, h {h.shape}, b {b.shape}"
        )
    if not 0 <= h_col <= h.shape[1] - b.shape[-2]:
        raise ValueError(f"h_col={h_col} + rank {b.shape[-2]} must fit in h's {h.shape[1]} columns")
    if pad_pow2(b.shape[-2]) > MAX_RANK_PAD:
        raise ValueError(f"rank {b.shape[-2]} pads to more than {MAX_RANK_PAD=}")


# Largest [rows, rank_pad, block_out] product a multiply-and-sum expand keeps in registers.
def tuned_knobs(op: str, mode: str, num_tokens: int, given: dict) -> dict:
    knobs = tuning.lookup(op, mode, num_tokens)
    knobs.update({k: v for k, v in given.items() if v is not None})
    return knobs


def layered(bank: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """bank [S, ...] without a layer, or [L, S, ...] with one -> ([L, S, ...], layer as [1] int32)."""
    if layer is None:
        if bank.ndim != 3:
            raise ValueError(f"bank {bank.shape} must be [S, ., .] without a layer index")
        return bank[None], jnp.zeros((1,), jnp.int32)
    if bank.ndim != 4:
        raise ValueError(f"bank {bank.shape} must be [L, S, ., .] with a layer index")
    return bank, jnp.reshape(layer, (1,)).astype(jnp.int32)


def given_knobs(scope: dict, names: tuple[str, ...]) -> dict:
    """The tuning knobs a caller set explicitly (None means: take tuning.py's)."""
    return {n: scope[n] for n in names if n not in ("h_col", "interpret") and scope[n] is not None}
