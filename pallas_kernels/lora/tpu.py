"""LoRA shrink / expand as Pallas TPU (Mosaic) kernels: the adapter is picked by scalar prefetch.

Compute, for each row t with adapter slot s (slot 0 = "no adapter"):
    shrink: h[t, :]  = x[t, :] @ a[s]                  x [T, D], a [S, D, R] -> h [T, R]  (f32 accumulation)
    expand: y[t, :] += h[t, c:c+R] @ b[s]              h [T, >=c+R], b [S, R, O], y [T, O] (add fused)

As in megablox `gmm`, the slot is an int32 array prefetched into SMEM (`PrefetchScalarGridSpec`) and
read by the BlockSpec index maps, so the pipeline DMAs exactly the adapter block a grid step needs:
`pl.BlockSpec((None, bk, R), lambda i, k, order, slots: (slots[i], k, 0))`.

BGMV (decode, every row may have its own slot): one row per grid step, rows visited in slot order
(a stable sort in the wrapper, prefetched as `order`). The TPU pipeline skips the copy when a block
index repeats on consecutive steps, so an adapter shared by many rows is read once, not once per
row (with the default full-D shrink block; a split D re-reads per row).
SGMV (prefill, segments of contiguous rows sharing a slot): the grid walks (segment, row tile)
work items, megablox style; consecutive items on one tile keep its output block resident and each
writes only its own rows. Empty segments produce no work item.

Slot 0 rows: h = 0 and y unchanged exactly; the kernel never computes with the bank's slot 0 (its
block is still fetched: rows are sorted, so that is one copy per step, not per row).

TPU block rules: the last two block dims must be divisible by (8, 128) or equal the array's dims.
Rows: BGMV views x, h, y as [T, 1, *] so a one-row block is legal; SGMV's `block_rows` must be a
multiple of 8 (or T is used). Columns: `block_k` / `block_o` default to the full D / O (legal for
any size, e.g. 2049); a given block must be a multiple of 128, and when it does not divide D or O
the wrapper zero-pads x and a (or h-side b and y) up to a multiple, which copies the bank per call:
in production pick a divisor or pad the bank at load. The expand slices h's columns c:c+R in XLA
(a [T, R] copy) because an R-wide block of a wider h breaks the 128-lane rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.lora.common import work_items

_F32 = jnp.float32
LANES, SUBLANES = 128, 8


def _interpret_mode(interpret: bool):
    # TPU interpret mode simulates Mosaic semantics (SMEM scalars, DMAs, NaN-filled uninitialized
    # memory, out-of-bounds reads raise) on CPU, unlike the generic `interpret=True`.
    return pltpu.InterpretParams() if interpret else False


def _dot(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    return jnp.dot(lhs, rhs.astype(lhs.dtype), preferred_element_type=_F32, precision=precision)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_axis(arr: jax.Array, axis: int, size: int) -> jax.Array:
    if arr.shape[axis] == size:
        return arr
    widths = [(0, 0)] * arr.ndim
    widths[axis] = (0, size - arr.shape[axis])
    return jnp.pad(arr, widths)


# -- kernel bodies ------------------------------------------------------------------------------


def _bgmv_shrink_kernel(order_ref, slot_ref, x_ref, a_ref, h_ref, acc_ref):
    # order_ref, slot_ref: [T] int32 SMEM, row and slot of each step in slot order.
    # x_ref: [1, BK]; a_ref: [BK, R] (a[slot]); h_ref: [1, R]; acc_ref: [1, R] f32 scratch.
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(slot_ref[i] != 0)
    def _():
        acc_ref[...] += _dot(x_ref[...], a_ref[...])

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        h_ref[...] = acc_ref[...].astype(h_ref.dtype)


def _bgmv_expand_kernel(order_ref, slot_ref, h_ref, b_ref, y_ref, out_ref):
    # order_ref, slot_ref: [T] int32 SMEM. h_ref: [1, R]; b_ref: [R, BO] (b[slot]); y_ref, out_ref: [1, BO].
    i = pl.program_id(1)
    is_base = slot_ref[i] == 0

    @pl.when(is_base)
    def _():
        out_ref[...] = y_ref[...]

    @pl.when(jnp.logical_not(is_base))
    def _():
        out_ref[...] = (y_ref[...].astype(_F32) + _dot(h_ref[...], b_ref[...])).astype(out_ref.dtype)


def _item_row_mask(tile_ref, lo_ref, hi_ref, item, block_rows: int) -> jax.Array:
    """[BT, 1] bool: rows of this tile that belong to work item `item`."""
    rows = tile_ref[item] * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    return (rows >= lo_ref[item]) & (rows < hi_ref[item])


def _sgmv_shrink_kernel(
    tile_ref, lo_ref, hi_ref, slot_ref, first_ref, x_ref, a_ref, h_ref, acc_ref, *, block_rows: int
):
    # tile/lo/hi/slot/first_ref: [I] int32 SMEM work items. x_ref: [BT, BK]; a_ref: [BK, R] (a[slot]);
    # h_ref: [BT, R], resident over the items of one tile; acc_ref: [BT, R] f32 scratch.
    item, k = pl.program_id(0), pl.program_id(1)

    @pl.when((first_ref[item] != 0) & (k == 0))
    def _():
        h_ref[...] = jnp.zeros_like(h_ref)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(slot_ref[item] != 0)
    def _():
        acc_ref[...] += _dot(x_ref[...], a_ref[...])

    @pl.when((k == pl.num_programs(1) - 1) & (slot_ref[item] != 0))
    def _():
        is_mine = _item_row_mask(tile_ref, lo_ref, hi_ref, item, block_rows)
        h_ref[...] = jnp.where(is_mine, acc_ref[...].astype(h_ref.dtype), h_ref[...])


def _sgmv_expand_kernel(
    tile_ref, lo_ref, hi_ref, slot_ref, first_ref, h_ref, b_ref, y_ref, out_ref, *, block_rows: int
):
    # tile/lo/hi/slot/first_ref: [I] int32 SMEM. h_ref: [BT, R]; b_ref: [R, BO] (b[slot]);
    # y_ref, out_ref: [BT, BO], out resident over the items of one tile.
    item = pl.program_id(1)

    @pl.when(first_ref[item] != 0)
    def _():
        out_ref[...] = y_ref[...]

    @pl.when(slot_ref[item] != 0)
    def _():
        is_mine = _item_row_mask(tile_ref, lo_ref, hi_ref, item, block_rows)
        y_new = (y_ref[...].astype(_F32) + _dot(h_ref[...], b_ref[...])).astype(out_ref.dtype)
        out_ref[...] = jnp.where(is_mine, y_new, out_ref[...])


# -- checks and block sizes ---------------------------------------------------------------------


def _block_cols(name: str, block: int | None, size: int) -> tuple[int, int]:
    """(block, padded size) for a lane axis of `size`: full width by default, else a multiple of 128."""
    if block is None or block >= size:
        return size, size
    if block <= 0 or block % LANES:
        raise ValueError(f"{name}={block} must be a positive multiple of {LANES} (TPU lane rule) or None")
    return block, _round_up(size, block)


def _check_shrink(x: jax.Array, a: jax.Array) -> None:
    if x.ndim != 2 or a.ndim != 3 or a.shape[1] != x.shape[1]:
        raise ValueError(f"shrink needs x [T, D] and a [S, D, R]; got x {x.shape}, a {a.shape}")


def _check_expand(y: jax.Array, h: jax.Array, b: jax.Array, h_col: int) -> None:
    if y.ndim != 2 or h.ndim != 2 or b.ndim != 3 or h.shape[0] != y.shape[0] or b.shape[2] != y.shape[1]:
        raise ValueError(f"expand needs y [T, O], h [T, R], b [S, R, O]; got y {y.shape}, h {h.shape}, b {b.shape}")
    if h_col < 0 or h_col + b.shape[1] > h.shape[1]:
        raise ValueError(f"h_col={h_col} + rank={b.shape[1]} must fit in h's {h.shape[1]} columns")


def _check_slots(slot_ids: jax.Array, num_tokens: int) -> None:
    if slot_ids.shape != (num_tokens,) or not jnp.issubdtype(slot_ids.dtype, jnp.integer):
        raise ValueError(f"slot_ids {slot_ids.shape} {slot_ids.dtype} must be [T] integer with T={num_tokens}")


def _check_segments(seg_starts: jax.Array, seg_slots: jax.Array) -> None:
    if seg_slots.ndim != 1 or seg_starts.shape != (seg_slots.shape[0] + 1,) or seg_slots.shape[0] == 0:
        raise ValueError(f"seg_starts {seg_starts.shape} must be [G + 1] for seg_slots {seg_slots.shape} [G], G >= 1")


def _block_rows(block_rows: int, num_tokens: int) -> int:
    if block_rows <= 0 or block_rows % SUBLANES:
        raise ValueError(f"block_rows={block_rows} must be a positive multiple of {SUBLANES} (TPU sublane rule)")
    return num_tokens if num_tokens <= block_rows else block_rows


# -- BGMV (decode): one row per step, rows in slot order ------------------------------------------


def _slot_order(slot_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    order = jnp.argsort(slot_ids, stable=True).astype(jnp.int32)  # step -> row
    return order, slot_ids[order]


@functools.partial(jax.jit, static_argnames=("block_k", "interpret"))
def bgmv_shrink(
    x: jax.Array, a: jax.Array, slot_ids: jax.Array, *, block_k: int | None = None, interpret: bool = False
) -> jax.Array:
    """Per-row shrink: h[t] = x[t] @ a[slot_ids[t]], the slot picked by scalar prefetch.

    Args:
      x: [T, D] bf16 or f32 tokens.
      a: [S, D, R] adapter bank (R may stack several modules); slot 0 is "no adapter".
      slot_ids: [T] int32 in [0, S).
      block_k: D per step; None = all of D (then rows sharing a slot read its adapter once).
      interpret: run in TPU interpret mode (CPU).

    Returns:
      h: [T, R] in x.dtype, accumulated in f32; rows of slot 0 are exactly 0.
    """
    _check_shrink(x, a)
    _check_slots(slot_ids, x.shape[0])
    (num_tokens, hidden), rank = x.shape, a.shape[2]
    if num_tokens == 0:
        return jnp.zeros((0, rank), x.dtype)
    block_k, hidden_pad = _block_cols("block_k", block_k, hidden)
    x3 = _pad_axis(x, 1, hidden_pad)[:, None, :]  # [T, 1, Dp]: a one-row block equals the full dim
    a = _pad_axis(a, 1, hidden_pad)
    order, slots = _slot_order(slot_ids.astype(jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_tokens, hidden_pad // block_k),
        in_specs=[
            pl.BlockSpec((None, 1, block_k), lambda i, k, order, slots: (order[i], 0, k)),
            pl.BlockSpec((None, block_k, rank), lambda i, k, order, slots: (slots[i], k, 0)),
        ],
        out_specs=pl.BlockSpec((None, 1, rank), lambda i, k, order, slots: (order[i], 0, 0)),
        scratch_shapes=[pltpu.VMEM((1, rank), _F32)],
    )
    h3 = pl.pallas_call(
        _bgmv_shrink_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, 1, rank), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_mode(interpret),
    )(order, slots, x3, a)
    return h3[:, 0, :]


@functools.partial(jax.jit, static_argnames=("h_col", "block_o", "interpret"))
def bgmv_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    slot_ids: jax.Array,
    *,
    h_col: int = 0,
    block_o: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Per-row expand: y[t] + h[t, h_col:h_col+R] @ b[slot_ids[t]], the slot picked by scalar prefetch.

    Args:
      y: [T, O] bf16 or f32 base output.
      h: [T, >= h_col + R] shrink output (several modules may be stacked along its columns).
      b: [S, R, O] adapter bank; slot 0 is "no adapter".
      slot_ids: [T] int32 in [0, S).
      h_col: static first column of this module's rank block in h.
      block_o: O per step; None = all of O.
      interpret: run in TPU interpret mode (CPU).

    Returns:
      [T, O] in y.dtype (f32 accumulation); rows of slot 0 equal y exactly.
    """
    _check_expand(y, h, b, h_col)
    _check_slots(slot_ids, y.shape[0])
    (num_tokens, out), rank = y.shape, b.shape[1]
    if num_tokens == 0:
        return y
    block_o, out_pad = _block_cols("block_o", block_o, out)
    h3 = h[:, h_col : h_col + rank][:, None, :]  # [T, 1, R]
    y3 = _pad_axis(y, 1, out_pad)[:, None, :]  # [T, 1, Op]
    b = _pad_axis(b, 2, out_pad)
    order, slots = _slot_order(slot_ids.astype(jnp.int32))
    # Column blocks outermost, rows inner: consecutive rows on one slot reuse the b block.
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(out_pad // block_o, num_tokens),
        in_specs=[
            pl.BlockSpec((None, 1, rank), lambda j, i, order, slots: (order[i], 0, 0)),
            pl.BlockSpec((None, rank, block_o), lambda j, i, order, slots: (slots[i], 0, j)),
            pl.BlockSpec((None, 1, block_o), lambda j, i, order, slots: (order[i], 0, j)),
        ],
        out_specs=pl.BlockSpec((None, 1, block_o), lambda j, i, order, slots: (order[i], 0, j)),
    )
    y_new = pl.pallas_call(
        _bgmv_expand_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(y3.shape, y.dtype),
        input_output_aliases={4: 0},  # y3 (after the 2 prefetched arrays, h3, b) is updated in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret_mode(interpret),
    )(order, slots, h3, b, y3)
    return y_new[:, 0, :out]


# -- SGMV (prefill): (segment, row tile) work items ----------------------------------------------


def _tpu_work_items(seg_starts: jax.Array, seg_slots: jax.Array, num_tokens: int, block_rows: int):
    """(tile, lo, hi, slot, is_first) [I] int32; unused tail items repeat the last used tile, empty.

    A TPU output block is written back when its index changes and never re-read, so a tile must be
    visited in one run of consecutive steps: the unused items stay on the last tile instead of tile 0.
    """
    tile, lo, hi, slot = work_items(seg_starts, seg_slots, num_tokens, block_rows)
    num_used = jnp.sum(hi > lo)
    last = jnp.maximum(num_used - 1, 0)
    is_used = jnp.arange(tile.shape[0]) < num_used
    tile = jnp.where(is_used, tile, tile[last])
    slot = jnp.where(is_used, slot, 0)
    is_first = jnp.concatenate([jnp.ones((1,), bool), tile[1:] != tile[:-1]]).astype(jnp.int32)
    return tile, lo, hi, slot, is_first


@functools.partial(jax.jit, static_argnames=("block_rows", "block_k", "interpret"))
def sgmv_shrink(
    x: jax.Array,
    a: jax.Array,
    seg_starts: jax.Array,
    seg_slots: jax.Array,
    *,
    block_rows: int = 128,
    block_k: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Segmented shrink: h[i] = x[i] @ a[seg_slots[g]] for seg_starts[g] <= i < seg_starts[g + 1].

    Args:
      x: [T, D] bf16 or f32 tokens.
      a: [S, D, R] adapter bank; slot 0 is "no adapter".
      seg_starts: [G + 1] int32, nondecreasing, seg_starts[0] = 0 and seg_starts[G] = T (empty
        segments allowed; traced values are not checked). Rows outside are left undefined.
      seg_slots: [G] int32 in [0, S).
      block_rows: rows per tile, a multiple of 8 (T itself when T is smaller).
      block_k: D per step; None = all of D.
      interpret: run in TPU interpret mode (CPU).

    Returns:
      h: [T, R] in x.dtype, accumulated in f32; rows of slot 0 are exactly 0.
    """
    _check_shrink(x, a)
    _check_segments(seg_starts, seg_slots)
    (num_tokens, hidden), rank = x.shape, a.shape[2]
    if num_tokens == 0:
        return jnp.zeros((0, rank), x.dtype)
    block_rows = _block_rows(block_rows, num_tokens)
    block_k, hidden_pad = _block_cols("block_k", block_k, hidden)
    x = _pad_axis(x, 1, hidden_pad)
    a = _pad_axis(a, 1, hidden_pad)
    items = _tpu_work_items(seg_starts.astype(jnp.int32), seg_slots.astype(jnp.int32), num_tokens, block_rows)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(items[0].shape[0], hidden_pad // block_k),
        in_specs=[
            pl.BlockSpec((block_rows, block_k), lambda i, k, tile, lo, hi, slot, first: (tile[i], k)),
            pl.BlockSpec((None, block_k, rank), lambda i, k, tile, lo, hi, slot, first: (slot[i], k, 0)),
        ],
        out_specs=pl.BlockSpec((block_rows, rank), lambda i, k, tile, lo, hi, slot, first: (tile[i], 0)),
        scratch_shapes=[pltpu.VMEM((block_rows, rank), _F32)],
    )
    return pl.pallas_call(
        functools.partial(_sgmv_shrink_kernel, block_rows=block_rows),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, rank), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_mode(interpret),
    )(*items, x, a)


@functools.partial(jax.jit, static_argnames=("h_col", "block_rows", "block_o", "interpret"))
def sgmv_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    seg_starts: jax.Array,
    seg_slots: jax.Array,
    *,
    h_col: int = 0,
    block_rows: int = 128,
    block_o: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Segmented expand: y[i] + h[i, h_col:h_col+R] @ b[seg_slots[g]] for rows i of segment g.

    Args:
      y: [T, O] bf16 or f32 base output.
      h: [T, >= h_col + R] shrink output.
      b: [S, R, O] adapter bank; slot 0 is "no adapter".
      seg_starts, seg_slots: as in `sgmv_shrink`; rows outside every segment come back as y.
      h_col: static first column of this module's rank block in h.
      block_rows: rows per tile, a multiple of 8 (T itself when T is smaller).
      block_o: O per step; None = all of O.
      interpret: run in TPU interpret mode (CPU).

    Returns:
      [T, O] in y.dtype (f32 accumulation); rows of slot 0 equal y exactly.
    """
    _check_expand(y, h, b, h_col)
    _check_segments(seg_starts, seg_slots)
    (num_tokens, out), rank = y.shape, b.shape[1]
    if num_tokens == 0:
        return y
    block_rows = _block_rows(block_rows, num_tokens)
    block_o, out_pad = _block_cols("block_o", block_o, out)
    h = h[:, h_col : h_col + rank]
    y_pad = _pad_axis(y, 1, out_pad)
    b = _pad_axis(b, 2, out_pad)
    items = _tpu_work_items(seg_starts.astype(jnp.int32), seg_slots.astype(jnp.int32), num_tokens, block_rows)
    # Column blocks outermost: the items of one tile stay consecutive, so its out block stays resident.
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(out_pad // block_o, items[0].shape[0]),
        in_specs=[
            pl.BlockSpec((block_rows, rank), lambda j, i, tile, lo, hi, slot, first: (tile[i], 0)),
            pl.BlockSpec((None, rank, block_o), lambda j, i, tile, lo, hi, slot, first: (slot[i], 0, j)),
            pl.BlockSpec((block_rows, block_o), lambda j, i, tile, lo, hi, slot, first: (tile[i], j)),
        ],
        out_specs=pl.BlockSpec((block_rows, block_o), lambda j, i, tile, lo, hi, slot, first: (tile[i], j)),
    )
    y_new = pl.pallas_call(
        functools.partial(_sgmv_expand_kernel, block_rows=block_rows),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(y_pad.shape, y.dtype),
        input_output_aliases={7: 0},  # y_pad (after the 5 prefetched arrays, h, b) is updated in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret_mode(interpret),
    )(*items, h, b, y_pad)
    return y_new[:, :out]
