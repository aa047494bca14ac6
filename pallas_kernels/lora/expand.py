"""LoRA expand as a Triton (GPU) Pallas kernel, segmented (prefill) and per-row (decode):

    y[rows of g, :] += h[rows of g, c:c+R] @ b[s_g]    for each segment g on slot s_g (add fused, in place)

SGMV (prefill, `sgmv_expand` / `grouped_expand`) uses the work items of `common`: b[slot] is read once
per tile of rows sharing it. BGMV (decode, `bgmv_expand` / `decode_expand`) runs per row: program
(row block, column block) reads each row's own b[slot] columns with one gather load and needs no
grouping at all. `grouped_expand(mode="decode")` (rows sorted by slot, then tiles) is a benchmark
candidate for decode (`benchmarks/kernels/lora.py`), which no row of tuning.py's decode table picks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora.common import (
    F32,
    MIN_DOT,
    RowGroups,
    check_expand,
    check_pow2,
    check_segments,
    given_knobs,
    items_for,
    layered,
    pad_pow2,
    rank_product,
    tuned_knobs,
    work_item_rows,
)

# Largest [rows, rank_pad, block_out] product a multiply-and-sum expand keeps in registers.
MAX_PRODUCT_ELEMS = 16384


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
        rows, in_item = work_item_rows(
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
            pltriton.store(out_ref.at[at], (y.astype(F32) + rank_product(h, b)).astype(out_ref.dtype), mask=mask)
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
    delta = jnp.sum(h.astype(F32)[:, :, None] * b.astype(F32), axis=1)  # [BT, BO]
    pltriton.store(out_ref.at[rows[:, None], outs[None, :]], (y.astype(F32) + delta).astype(out_ref.dtype), mask=mask)


def product_block_out(block_out: int, block_rows: int, rank_pad: int, out_dim: int) -> int:
    if block_rows < MIN_DOT:  # multiply-and-sum: bound the [rows, rank, cols] product
        block_out = min(block_out, max(MIN_DOT, MAX_PRODUCT_ELEMS // (block_rows * rank_pad)))
    return min(block_out, pad_pow2(out_dim))


def _expand_call(
    y, h, b, layer, order, items, *, h_col, block_rows, block_out, out_split, num_warps, num_stages, interpret
):
    # b: [L, S, R, O]; layer: [1] int32.
    num_tokens, out_dim = y.shape
    rank = b.shape[2]
    block_out = product_block_out(block_out, block_rows, pad_pow2(rank), out_dim)
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
        rank_pad=pad_pow2(rank),
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
    rank_pad = pad_pow2(rank)
    block_out = product_block_out(block_out, min(block_rows, MIN_DOT // 2), rank_pad, out_dim)
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


_EXPAND_KNOBS = ("h_col", "block_rows", "block_out", "out_split", "num_warps", "num_stages", "interpret")


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
    check_segments(seg_starts, seg_slots)
    groups = RowGroups(
        order=None, seg_starts=seg_starts.astype(jnp.int32), seg_slots=seg_slots.astype(jnp.int32), items={}
    )
    knobs = given_knobs(locals(), _EXPAND_KNOBS)
    return grouped_expand(y, h, b, groups, mode="prefill", h_col=h_col, interpret=interpret, **knobs)


_ROWS_KNOBS = ("h_col", "block_rows", "block_out", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_ROWS_KNOBS)
def bgmv_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    slot_ids: jax.Array,
    *,
    h_col: int = 0,
    block_rows: int | None = None,
    block_out: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Per-row expand: y[t] += h[t, c:c+R] @ b[slot_ids[t]].

    Each row reads its own b[slot] columns, with no grouping of rows by slot (under 16 rows per
    program the product is a multiply-and-sum, not a tensor-core dot).

    Args:
      y: [T, O] float base output; h: [T, C] float; b: [S, R, O] bank (slot 0 = no adapter);
      slot_ids: [T] int32 in [0, S); h_col: static first column of this module in h.
      block_rows, block_out, num_warps, num_stages: tuning knobs (default: tuning.py).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [T, O] in y.dtype; rows of slot 0 are y unchanged.
    """
    if slot_ids.shape != (y.shape[0],):
        raise ValueError(f"slot_ids {slot_ids.shape} must be [T] for y {y.shape}")
    knobs = given_knobs(locals(), _ROWS_KNOBS)
    return decode_expand(y, h, b, slot_ids, h_col=h_col, interpret=interpret, **knobs)


def decode_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    slot_ids: jax.Array,
    *,
    h_col: int = 0,
    interpret: bool = False,
    layer: jax.Array | None = None,
    **knobs,
) -> jax.Array:
    """`bgmv_expand` unjitted, for callers inside a step; with `layer`, b is the stacked bank
    [L, S, R, O] (see `grouped_shrink`)."""
    knobs = tuned_knobs("expand", "decode", y.shape[0], knobs)
    check_expand(y, h, b, h_col)
    b, layer = layered(b, layer)
    check_pow2(min_rows=1, block_rows=knobs["block_rows"], block_out=knobs["block_out"])
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
    """Expand over precomputed row groups; math, shapes and knobs as in `sgmv_expand`. With
    mode="decode" (rows grouped by slot) it is the decode candidate of `benchmarks/kernels/lora.py`:
    pass its knobs, as tuning.py's decode table holds the per-row kernel's.

    With `layer`, b is the stacked bank [L, S, R, O] (see `grouped_shrink`)."""
    check_expand(y, h, b, h_col)
    b, layer = layered(b, layer)
    knobs = {"out_split": 1, **tuned_knobs("expand", mode, y.shape[0], knobs)}
    check_pow2(min_rows=1, block_rows=knobs["block_rows"], block_out=knobs["block_out"])
    if y.shape[0] == 0:
        return y
    items = items_for(groups, y.shape[0], knobs["block_rows"])
    return _expand_call(y, h, b, layer, groups.order, items, h_col=h_col, interpret=interpret, **knobs)
