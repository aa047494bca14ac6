"""One module group's LoRA term in decode as two Triton launches, whatever the module count:

    ys[g][t] += (x[t] @ a[s])[g*R:(g+1)*R] @ bs[g][s],   s = slot_ids[t]

The grouped shrink (`shrink`) keeps its split-K partial sums in float32, and one expand launch over
every module's column blocks sums them as it loads them: per row (`_expand_rows_multi_kernel`), or
per work item with b read once per item (`_expand_tiles_multi_kernel`, tuning.py's "split_tiles").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora.common import (
    F32,
    MIN_DOT,
    RowGroups,
    check_column_spans,
    check_pow2,
    check_shrink,
    dot_f32,
    items_for,
    layered,
    pad_pow2,
    summed_partials,
    tuned_knobs,
    work_item_rows,
)
from pallas_kernels.lora.expand import product_block_out
from pallas_kernels.lora.shrink import shrink_call


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
            h = summed_partials(h_ref, h_at, h_mask, num_parts)
            b_mask = is_used[:, None, None] & r_ok[None, :, None] & out_ok[None, None, :]
            b = pltriton.load(
                b_refs[g].at[layer, slots[:, None, None], r[None, :, None], outs[None, None, :]], mask=b_mask, other=0
            )
            mask = is_used[:, None] & out_ok[None, :]
            at = (rows[:, None], col_offset[g] + outs[None, :])
            y_ref, out_ref = y_refs[output_of[g]], out_refs[output_of[g]]
            y = pltriton.load(y_ref.at[at], mask=mask, other=0)
            delta = jnp.sum(h[:, :, None] * b.astype(F32), axis=1)  # [BT, BO]; h is f32 already
            pltriton.store(out_ref.at[at], (y.astype(F32) + delta).astype(out_ref.dtype), mask=mask)


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
            rows, in_item = work_item_rows(
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
            h = summed_partials(h_ref, h_at, h_mask, num_parts)
            b = pltriton.load(
                b_refs[g].at[layer, slot, r[:, None], outs[None, :]], mask=r_ok[:, None] & out_ok[None, :], other=0
            )
            at = (rows[:, None], col_offset[g] + outs[None, :])
            mask = in_item[:, None] & out_ok[None, :]
            y_ref, out_ref = y_refs[output_of[g]], out_refs[output_of[g]]
            y = pltriton.load(y_ref.at[at], mask=mask, other=0)
            delta = dot_f32(h.astype(b.dtype), b)  # [BT, BO] f32
            pltriton.store(out_ref.at[at], (y.astype(F32) + delta).astype(out_ref.dtype), mask=mask)


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
    check_shrink(x, a)
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
    a, layer = layered(a, layer)
    bs = tuple(b if stacked else b[None] for b in bs)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return ys
    shrink = tuned_knobs("shrink", "decode", num_tokens, {})
    check_pow2(block_rows=shrink["block_rows"], block_k=shrink["block_k"])
    items = items_for(groups, num_tokens, shrink["block_rows"])
    parts = shrink_call(x, a, layer, groups.order, items, interpret=interpret, keep_partials=True, **shrink)
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
    expand = tuned_knobs("expand", "decode", num_tokens, {})
    rank_pad = pad_pow2(rank)
    out_dims = tuple(b.shape[-1] for b in bs)
    block_rows = expand["block_rows"]
    block_out = product_block_out(expand["block_out"], min(block_rows, MIN_DOT // 2), rank_pad, max(out_dims))
    check_pow2(min_rows=1, block_rows=block_rows, block_out=block_out)
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
    rank_pad = pad_pow2(rank)
    out_dims = tuple(b.shape[-1] for b in bs)
    # The b tile [rank_pad, block_out] is a dot operand: bound it like the shrink's a tile.
    block_out = min(knobs["block_out"], pad_pow2(max(out_dims)), max(MIN_DOT, 16384 // rank_pad))
    check_pow2(block_rows=block_rows, block_out=block_out)
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
