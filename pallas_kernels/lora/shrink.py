"""LoRA shrink as a Triton (GPU) Pallas kernel, segmented (prefill) and per-row (decode):

    h[rows of g, :] = x[rows of g, :] @ a[s_g]         for each segment g on slot s_g (f32 accumulation)

SGMV (prefill): segment g is rows seg_starts[g] .. seg_starts[g+1]-1, contiguous. BGMV (decode): every
row has its own slot; rows are grouped by slot (a permutation `order`), so a slot shared by many rows
is read once per tile of rows. Work items and row groups: `common`.
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
    check_pow2,
    check_segments,
    check_shrink,
    dot_f32,
    given_knobs,
    items_for,
    layered,
    make_row_groups,
    pad_pow2,
    tuned_knobs,
    work_item_rows,
)


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
        rows, in_item = work_item_rows(
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
        return acc + dot_f32(x, a)

    @pl.when(slot != 0)
    def _():
        rows, in_item, out_at, out_mask = item_rows()
        step = functools.partial(multiply, rows=rows, in_item=in_item)
        acc = lax.fori_loop(0, k_per_split // block_k, step, jnp.zeros((block_rows, rank_pad), F32))
        pltriton.store(h_ref.at[out_at], acc.astype(h_ref.dtype), mask=out_mask)

    @pl.when((slot == 0) & (lo_ref[item] < hi_ref[item]))
    def _():  # no adapter: h = 0 without reading the bank
        _, _, out_at, out_mask = item_rows()
        pltriton.store(h_ref.at[out_at], jnp.zeros((block_rows, rank_pad), h_ref.dtype), mask=out_mask)


def shrink_call(
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
    rank_pad = pad_pow2(rank)
    block_k = min(block_k, pad_pow2(hidden), max(MIN_DOT, 16384 // rank_pad))  # bound the a tile in registers
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
        out_shape=jax.ShapeDtypeStruct(out_shape, F32 if is_split else x.dtype),
        grid=(items[0].shape[0], split_k),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="lora_shrink",
    )(layer, *items, order, x, a)
    if keep_partials:
        return h
    return h.sum(axis=0).astype(x.dtype) if is_split else h


_SHRINK_KNOBS = ("block_rows", "block_k", "split_k", "num_warps", "num_stages", "interpret")


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
    check_segments(seg_starts, seg_slots)
    groups = RowGroups(
        order=None, seg_starts=seg_starts.astype(jnp.int32), seg_slots=seg_slots.astype(jnp.int32), items={}
    )
    return grouped_shrink(x, a, groups, mode="prefill", interpret=interpret, **given_knobs(locals(), _SHRINK_KNOBS))


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
    check_shrink(x, a)
    if slot_ids.shape != (x.shape[0],):
        raise ValueError(f"slot_ids {slot_ids.shape} must be [T] for x {x.shape}")
    groups = make_row_groups(slot_ids, num_slots=a.shape[0], seg_len=None, block_rows=())
    return grouped_shrink(x, a, groups, mode="decode", interpret=interpret, **given_knobs(locals(), _SHRINK_KNOBS))


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
    check_shrink(x, a)
    a, layer = layered(a, layer)
    knobs = tuned_knobs("shrink", mode, x.shape[0], knobs)
    check_pow2(block_rows=knobs["block_rows"], block_k=knobs["block_k"])
    if x.shape[0] == 0:
        return jnp.zeros((0, a.shape[-1]), x.dtype)
    items = items_for(groups, x.shape[0], knobs["block_rows"])
    return shrink_call(x, a, layer, groups.order, items, interpret=interpret, **knobs)
