"""A module group's whole LoRA term in ONE Triton launch: shrink and expand fused per work item.

Compute, for the G modules of one group (their A's stacked along the rank axis, a [.., D, G*R]):

    ys[g][t] += (x[t] @ a[s][:, g*R:(g+1)*R]) @ bs[g][s],     s = the slot of row t

Why: a decode-sized LoRA op is launch-bound. The split form (`group.decode_group`) is two
launches a group, eight a layer, and on the H200 each costs a few microseconds whatever its work
(a step of 64 rows on slot 0 only, where the kernels read nothing, ran 1.15 ms slower than the
bank-free step over 32 layers). Fusing the shrink into the expand halves the launches. What makes
it cheap: the shrink of one work item is tiny (h is [block_rows, R]), so each program computes it
itself, keeps it in registers, and multiplies it straight into its share of the output columns.

Work decomposition: the rows (grouped by slot, `common.RowGroups`) are cut into (segment, tile)
work items of `block_rows` rows sharing one slot. Program (item, g, c) handles item `item`, module g,
and the c-th of `col_split` runs of module g's output column blocks: it reads A's module-g columns
once (its own shrink) and B[g]'s columns of its run once. So HBM reads each used adapter once per
tile of rows, like the split form; `col_split` > 1 buys parallelism for small batches at the cost of
re-reading A (from L2) once per extra run. Rows of slot 0 (and unused items) read nothing and keep y.

h is rounded to x's dtype between the two products, as `lora_shrink` returns it (the contract's h).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora import common, group, tuning
from pallas_kernels.lora.common import MIN_DOT, RowGroups

_F32 = jnp.float32
KNOBS = ("block_rows", "block_k", "block_out", "col_split", "num_warps", "num_stages")


def _both(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    """a & b where both exist; a mask that is statically all-true is None (unmasked loads vectorize)."""
    if a is None or b is None:
        return a if b is None else b
    return a & b


def _kernel(
    layer_ref,
    tile_ref,
    lo_ref,
    hi_ref,
    slot_ref,
    order_ref,
    x_ref,
    a_ref,
    *refs,
    num_modules: int,
    num_outputs: int,
    output_of: tuple[int, ...],
    col_offset: tuple[int, ...],
    out_dims: tuple[int, ...],
    steps: tuple[int, ...],
    block_rows: int,
    block_k: int,
    block_out: int,
    rank: int,
    rank_pad: int,
    hidden: int,
    num_tokens: int,
    has_order: bool,
):
    # layer_ref: [1] int32; tile/lo/hi/slot_ref: [I] int32 work items; order_ref: [T] int32 grouped
    # position -> row; x_ref: [T, D]; a_ref: [L, S, D, G*R]; refs: G banks b_g [L, S, R, O_g], Y base
    # outputs [T, W_y], then Y outputs aliased to them. Module g owns columns col_offset[g] ..
    # col_offset[g] + O_g - 1 of output output_of[g]; this program covers `steps[g]` of its column
    # blocks, starting at block c * steps[g].
    b_refs = refs[:num_modules]
    y_refs, out_refs = refs[num_modules : num_modules + num_outputs], refs[num_modules + num_outputs :]
    item, module, run = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # outside pl.when (interpret)
    slot, layer = slot_ref[item], layer_ref[0]
    r = jnp.arange(rank_pad, dtype=jnp.int32)
    r_ok = (r < rank) if rank < rank_pad else None

    for g in range(num_modules):

        @pl.when((slot != 0) & (module == g))
        def _(g=g):
            rows, in_item = common.work_item_rows(
                item,
                tile_ref,
                lo_ref,
                hi_ref,
                order_ref,
                block_rows=block_rows,
                num_tokens=num_tokens,
                has_order=has_order,
            )
            h = _shrink(x_ref, a_ref, layer, slot, rows, in_item, g * rank + r, r_ok, block_k, hidden)
            h = h.astype(x_ref.dtype)  # the contract's h: rounded as lora_shrink returns it
            y_ref, out_ref = y_refs[output_of[g]], out_refs[output_of[g]]

            def add_block(step, carry):
                outs = (run * steps[g] + step) * block_out + jnp.arange(block_out, dtype=jnp.int32)
                out_ok = outs < out_dims[g]
                b = pltriton.load(
                    b_refs[g].at[layer, slot, r[:, None], outs[None, :]],
                    mask=_both(None if r_ok is None else r_ok[:, None], out_ok[None, :]),
                    other=0,
                )  # out_ok always exists: a run may end past the module's columns
                at = (rows[:, None], col_offset[g] + outs[None, :])
                mask = in_item[:, None] & out_ok[None, :]
                y = pltriton.load(y_ref.at[at], mask=mask, other=0)
                delta = common.dot_f32(h, b)  # [BT, BO] f32
                pltriton.store(out_ref.at[at], (y.astype(_F32) + delta).astype(out_ref.dtype), mask=mask)
                return carry

            jax.lax.fori_loop(0, steps[g], add_block, 0)


def _shrink(x_ref, a_ref, layer, slot, rows, in_item, a_cols, r_ok, block_k: int, hidden: int) -> jax.Array:
    """x[rows] @ a[layer, slot][:, a_cols] -> [BT, RP] f32, over D in steps of block_k."""

    def step(i, acc):
        ks = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = (ks < hidden) if hidden % block_k else None
        x = pltriton.load(
            x_ref.at[rows[:, None], ks[None, :]],
            mask=_both(in_item[:, None], None if k_ok is None else k_ok[None, :]),
            other=0,
        )
        a_mask = _both(None if k_ok is None else k_ok[:, None], None if r_ok is None else r_ok[None, :])
        a = pltriton.load(
            a_ref.at[layer, slot, ks[:, None], a_cols[None, :]], mask=a_mask, other=None if a_mask is None else 0
        )
        return acc + common.dot_f32(x, a)

    acc = jnp.zeros((in_item.shape[0], a_cols.shape[0]), _F32)
    return jax.lax.fori_loop(0, pl.cdiv(hidden, block_k), step, acc)


def fused_group(
    x: jax.Array,
    a: jax.Array,
    ys: tuple[jax.Array, ...],
    bs: tuple[jax.Array, ...],
    groups: RowGroups,
    *,
    mode: str,
    layer: jax.Array | None = None,
    out_cols: tuple[int, ...] | None = None,
    interpret: bool = False,
    **knobs: int | None,
) -> tuple[jax.Array, ...]:
    """One module group's LoRA term in one launch (see the module doc).

    Args:
      x: [T, D] float; a: [S, D, G*R] (or [L, S, D, G*R] with `layer`); ys: G outputs [T, O_g], or
        one fused output [T, W] with `out_cols`; bs: G banks [S, R, O_g] (or [L, S, R, O_g]).
      groups: `common.make_row_groups` of the step's slots (decode: grouped by slot; prefill:
        segments), holding work items for `block_rows` or not (then they are built here).
      mode: "decode" | "prefill", the tuning row (`tuning.lookup_group(mode, T, R)`).
      layer: int32 scalar (may be traced) selecting the layer of stacked banks, read in place.
      out_cols: None, or G static column offsets of the modules in one fused output.
      interpret: run in the Pallas interpreter (CPU).
      knobs: block_rows, block_k, block_out, col_split, num_warps, num_stages (default: tuning.py).

    Returns:
      the updated outputs (G, or the one fused output), each in its own dtype (f32 accumulation);
      rows of slot 0 are unchanged.
    """
    rank, output_of, col_offset = group.check_group(x, a, ys, bs, layer, out_cols)
    knobs = _knobs(mode, x.shape[0], rank, knobs)
    stacked = layer is not None
    a, layer = common.layered(a, layer)
    bs = tuple(b if stacked else b[None] for b in bs)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return tuple(ys)
    items = common.items_for(groups, num_tokens, knobs["block_rows"])
    return _call(x, a, ys, bs, layer, groups.order, items, rank, output_of, col_offset, interpret, **knobs)


def _knobs(mode: str, num_tokens: int, rank: int, given: dict) -> dict:
    knobs = tuning.lookup_group(mode, num_tokens, rank)
    knobs.update({k: v for k, v in given.items() if v is not None})
    knobs.pop("impl", None)
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown fused-group knobs {sorted(unknown)}; known: {KNOBS}")
    common.check_pow2(
        block_rows=knobs["block_rows"], block_k=knobs["block_k"], block_out=max(MIN_DOT, knobs["block_out"])
    )
    if knobs["block_out"] < MIN_DOT or knobs["col_split"] < 1:
        raise ValueError(f"block_out={knobs['block_out']} must be >= {MIN_DOT} and col_split >= 1")
    return knobs


def _call(x, a, ys, bs, layer, order, items, rank, output_of, col_offset, interpret, **knobs):
    num_tokens, hidden = x.shape
    rank_pad = common.pad_pow2(rank)
    out_dims = tuple(b.shape[-1] for b in bs)
    # The B tile [rank_pad, block_out] is staged in shared memory per pipeline stage: bound it as
    # the A tile is (rank 256 at block_out 256 asked the H200 for 268 KB of its 227).
    block_out = min(knobs["block_out"], common.pad_pow2(max(out_dims)), max(MIN_DOT, 32768 // rank_pad))
    block_k = min(knobs["block_k"], common.pad_pow2(hidden), max(MIN_DOT, 16384 // rank_pad))
    col_split = max(1, min(knobs["col_split"], max(pl.cdiv(o, block_out) for o in out_dims)))
    steps = tuple(pl.cdiv(pl.cdiv(o, block_out), col_split) for o in out_dims)
    has_order = order is not None
    order = order if has_order else jnp.zeros((1,), jnp.int32)  # placeholder operand, never read
    kernel = functools.partial(
        _kernel,
        num_modules=len(bs),
        num_outputs=len(ys),
        output_of=output_of,
        col_offset=col_offset,
        out_dims=out_dims,
        steps=steps,
        block_rows=knobs["block_rows"],
        block_k=block_k,
        block_out=block_out,
        rank=rank,
        rank_pad=rank_pad,
        hidden=hidden,
        num_tokens=num_tokens,
        has_order=has_order,
    )
    first_y = 8 + len(bs)  # operands: layer, 4 work-item arrays, order, x, a, banks, outputs
    return tuple(
        pl.pallas_call(
            kernel,
            out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in ys),
            grid=(items[0].shape[0], len(bs), col_split),
            input_output_aliases={first_y + k: k for k in range(len(ys))},  # rows without an adapter keep y
            compiler_params=pltriton.CompilerParams(num_warps=knobs["num_warps"], num_stages=knobs["num_stages"]),
            interpret=interpret,
            name="lora_group_fused",
        )(layer, *items, order, x, a, *bs, *ys)
    )
