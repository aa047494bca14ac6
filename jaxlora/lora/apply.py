"""The one seam where LoRA enters the model: per-row `y += scale * (x @ A[slot]) @ B[slot]`.

Contract (every backend computes exactly this; pallas_kernels documents the math of each op):

    for each token t with slot s = token_slots[t]:
        h[t]        = x[t] @ bank[group]["a"][s]                 # shrink, all modules of the group
        y_m[t]     += h[t, i*R:(i+1)*R] @ bank[group]["b"][m][s]  # expand, module m = modules[i]

Slot 0 is all-zero, so base-model rows come out unchanged. A paged bank (jaxlora.lora.paged_bank)
computes the same per module, reading each row's A and B at their true rank through page tables
(`pallas_kernels.lora.paged`); its slot 0 has rank 0. A unified bank (jaxlora.lora.unified_bank)
does too, reading them out of the KV pool's pages (`pallas_kernels.lora.unified`): the decoder
layer hands the group entries the pool it carries (`with_kv_pool`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxlora.config import LoraBackend
from jaxlora.kernels import StepKernels
from jaxlora.lora.bank import GROUPS
from jaxlora.lora.paged_bank import is_paged
from jaxlora.lora.unified_bank import UnifiedGroup, is_unified
from jaxlora.lora.unified_layout import FACTOR_ALIGN
from pallas_kernels.lora.common import make_row_groups
from pallas_kernels.lora.paged import paged_expand, paged_shrink
from pallas_kernels.lora.tuning import unified_expand_knobs, unified_shrink_knobs, unified_tiled_knobs
from pallas_kernels.lora.unified import module_widths, unified_expand, unified_shrink
from pallas_kernels.lora.unified_tiled import tiled_fits, unified_tiled_expand, unified_tiled_shrink
from pallas_kernels.lora.unified_xla import unified_expand_xla, unified_shrink_xla

# Unified bank, pallas: steps of at least this many token rows run the tiled kernels (rows grouped by
# slot, `tuning.unified_tiled_knobs`' rows a tile), smaller ones the per-row kernels (see
# `_unified_per_row`), which take a fused projection's whole group in one launch each way
# (`_unified_group`). The per-row kernels win at 256 rows, decode or mixed, the tiled ones at 512
# mixed rows; between the two it is unmeasured (benchmarks/DECISIONS.md#unified-tiled-from).
UNIFIED_TILED_MIN_TOKENS = 512

GROUP_MODULES: dict[str, tuple[str, ...]] = dict(GROUPS)


def apply_group(
    group: str,
    group_bank: dict | None,
    x: jax.Array,
    outputs: dict[str, jax.Array],
    token_slots: jax.Array,
    kernels: StepKernels,
    seg_len: int | None,
    *,
    plan: pallas_kernels.LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Adds each row's adapter term to the outputs of one module group.

    Args:
      group: group name from `bank.GROUPS` (fixes the order of modules along the rank axis).
      group_bank: the group's bank entries ({"a": [S, in, G*R], "b": {m: [S, R, out]}}), or None when
        no module of the group is targeted. With `layer`, the entries of every layer ([L, S, ...]).
      x: [N, in] the group's shared input, N = rows * tokens.
      outputs: module -> [N, out_m], the base projections of every module of the group.
      token_slots: [N] int32 slot of each token.
      seg_len: tokens per row when N is rows of equal length sharing a slot (prefill), else None.
      plan: `step_plan(...)` for these token_slots, built once per step; None builds one per op.
      layer: int32 scalar, this layer's index into a stacked group_bank (the kernels read it in place).

    Returns:
      `outputs` with the LoRA term added to every module the bank holds.
    """
    if group_bank is None:
        return outputs
    if true_rank := _true_rank(group_bank):
        per_module, ranks = true_rank
        modules = [m for m in GROUP_MODULES[group] if m in ranks]
        return {
            **outputs,
            **{m: per_module(group_bank, m, x, outputs[m], token_slots, kernels, layer, plan) for m in modules},
        }
    # Pytrees sort dict keys, so the rank-axis order comes from GROUPS, never from the dict.
    modules = tuple(m for m in GROUP_MODULES[group] if m in group_bank["b"])
    kw = dict(backend=kernels.lora.value, interpret=kernels.interpret, seg_len=seg_len, plan=plan, layer=layer)
    ys = pallas_kernels.lora_group(
        x,
        group_bank["a"],
        tuple(outputs[m] for m in modules),
        tuple(group_bank["b"][m] for m in modules),
        token_slots,
        **kw,
    )
    return {**outputs, **dict(zip(modules, ys))}


def apply_group_fused(
    group: str,
    group_bank: dict | None,
    x: jax.Array,
    y: jax.Array,
    columns: tuple[int, ...],
    token_slots: jax.Array,
    kernels: StepKernels,
    seg_len: int | None,
    *,
    plan: pallas_kernels.LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """`apply_group` for a fused projection (jaxlora.model.fused): y [N, W] holds every module of the
    group, module GROUP_MODULES[group][i] in the columns from columns[i]; the LoRA term of each
    module the bank holds is added in those columns. Returns the updated y."""
    if group_bank is None:
        return y
    modules = GROUP_MODULES[group]
    if true_rank := _true_rank(group_bank):
        widths = module_widths(columns, y.shape[1])
        if is_unified(group_bank) and _unified_per_row(group_bank, x, widths, kernels, plan, layer):
            return _unified_group(group_bank, x, y, columns, token_slots, kernels, layer)
        per_module, ranks = true_rank
        for i, m in enumerate(modules):
            if m in ranks:
                cols = slice(columns[i], columns[i] + widths[i])
                part = per_module(group_bank, m, x, y[:, cols], token_slots, kernels, layer, plan)
                y = y.at[:, cols].set(part)
        return y
    held = [i for i, m in enumerate(modules) if m in group_bank["b"]]
    (y,) = pallas_kernels.lora_group(
        x,
        group_bank["a"],
        (y,),
        tuple(group_bank["b"][modules[i]] for i in held),
        token_slots,
        backend=kernels.lora.value,
        interpret=kernels.interpret,
        seg_len=seg_len,
        plan=plan,
        layer=layer,
        out_cols=tuple(columns[i] for i in held),
    )
    return y


def _true_rank(group_bank) -> tuple[Callable, dict] | None:
    """(the per-module term, the group's ranks by module) of a paged or unified bank's group; None
    for a padded bank's."""
    if is_unified(group_bank):
        return _unified_module, group_bank.ranks
    if is_paged(group_bank):
        return _paged_module, group_bank["ranks"]
    return None


def _paged_module(
    group_bank: dict,
    module: str,
    x: jax.Array,
    y: jax.Array,
    token_slots: jax.Array,
    kernels: StepKernels,
    layer: jax.Array | None,
    plan: pallas_kernels.LoraPlan | None = None,  # unused: the paged kernels read page tables per row
) -> jax.Array:
    """y [N, out] + each row's term of `module` from a paged bank's group entries (tables [2, L, S, M],
    or [2, S, M] without `layer`); slot s of the page tables is the row's adapter. A^T's pages lie in
    the pool of x's width (in_m), B's in the pool of y's width (out_m): one pool per row width."""
    tables = group_bank["tables"][module] if layer is None else group_bank["tables"][module][:, layer]
    pools, ranks = group_bank["pools"], group_bank["ranks"][module]
    h = paged_shrink(x, pools[x.shape[-1]], tables[0], ranks, token_slots, interpret=kernels.interpret)
    return paged_expand(y, h, pools[y.shape[-1]], tables[1], ranks, token_slots, interpret=kernels.interpret)


def _unified_module(
    group_bank: UnifiedGroup,
    module: str,
    x: jax.Array,
    y: jax.Array,
    token_slots: jax.Array,
    kernels: StepKernels,
    layer: jax.Array | None,
    plan: pallas_kernels.LoraPlan | None = None,
) -> jax.Array:
    """y [N, out] + each row's term of `module`, read out of the KV pool's pages at `layer` through
    the unified bank's tables; slot s of the tables is the row's adapter.

    With the pallas backend: the tiled kernels (rows grouped by slot, `step_plan`'s groups; each
    adapter chunk read once per tile of rows) from UNIFIED_TILED_MIN_TOKENS rows up, where prefill
    runs share adapters, and the per-row kernels below it (decode batches, a program per row), or
    where a width's chunks are too narrow for tensor-core dots (a fused projection's group takes
    those in one launch each way instead: `_unified_group`). Otherwise the XLA gather
    (`pallas_kernels.lora.unified_xla`: no ragged_dot form)."""
    k, v = _pool(group_bank, layer)
    common = (k, v, layer, group_bank.pages)
    (a_off, b_off), ranks = group_bank.offsets[module].T, group_bank.ranks[module]
    if kernels.lora is not LoraBackend.PALLAS:
        h = unified_shrink_xla(x, *common, a_off, ranks, token_slots, max_rank=group_bank.max_rank, align=FACTOR_ALIGN)
        return unified_expand_xla(y, h, *common, b_off, ranks, token_slots, align=FACTOR_ALIGN)
    if _unified_per_row(group_bank, x, (y.shape[1],), kernels, plan, layer):
        return _unified_per_row_term(group_bank, x, y, (a_off, b_off, ranks), (0,), token_slots, kernels, layer)
    kw = dict(align=FACTOR_ALIGN, interpret=kernels.interpret, **unified_tiled_knobs(x.shape[0]))
    h = unified_tiled_shrink(x, *common, a_off, ranks, plan.groups, max_rank=group_bank.max_rank, **kw)
    return unified_tiled_expand(y, h, *common, b_off, ranks, plan.groups, **kw)


def _pool(group_bank: UnifiedGroup, layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    if group_bank.pool is None or layer is None:
        raise ValueError("a unified bank reads the KV pool at a layer: the decoder layer must pass both")
    return group_bank.pool


def _unified_per_row(
    group_bank: UnifiedGroup,
    x: jax.Array,
    outs: tuple[int, ...],
    kernels: StepKernels,
    plan: pallas_kernels.LoraPlan | None,
    layer: jax.Array | None,
) -> bool:
    """Whether the pallas backend runs a unified term (modules of output widths `outs`, sharing x) on
    the per-row kernels (decode batches, a program per row): below UNIFIED_TILED_MIN_TOKENS rows, or
    where a width's chunks are too narrow for the tiled kernels' tensor-core dots. False for the XLA
    backend and for steps the tiled kernels take (rows grouped by slot in `plan`: prefill runs share
    adapters)."""
    if kernels.lora is not LoraBackend.PALLAS:
        return False
    groups = plan.groups if plan is not None else None
    if groups is not None and (plan.num_tokens != x.shape[0] or plan.num_slots != group_bank.pages.shape[0]):
        raise ValueError(
            f"the step's plan ({plan.num_tokens} rows, {plan.num_slots} slots) is not for these "
            f"{x.shape[0]} rows on {group_bank.pages.shape[0]} slots"
        )
    k, _ = _pool(group_bank, layer)
    tiled = (
        groups is not None
        and x.shape[0] >= UNIFIED_TILED_MIN_TOKENS
        and all(tiled_fits(width, k, FACTOR_ALIGN) for width in (x.shape[1], *outs))
    )
    return not tiled


def _unified_group(
    group_bank: UnifiedGroup,
    x: jax.Array,
    y: jax.Array,
    columns: tuple[int, ...],
    token_slots: jax.Array,
    kernels: StepKernels,
    layer: jax.Array | None,
) -> jax.Array:
    """y [N, W] + every module's term of a fused group (module GROUP_MODULES[group][i] in the columns
    from columns[i]): one per-row shrink and one expand for the whole group, through the stacked
    tables (`unified_bank.with_stacked_tables`)."""
    if group_bank.stacked is None:
        raise ValueError("a unified group's stacked tables are set once a step (unified_bank.with_stacked_tables)")
    return _unified_per_row_term(group_bank, x, y, group_bank.stacked, columns, token_slots, kernels, layer)


def _unified_per_row_term(group_bank, x, y, tables, columns, token_slots, kernels, layer) -> jax.Array:
    """The per-row kernels on tables (A^T offsets, B offsets, ranks), each [S] (one module) or [S, G]
    (a group in y's columns): the shrink's serial loop cut over programs (tuning table), the expand
    adding their partial sums."""
    a_off, b_off, ranks = tables
    common = (*_pool(group_bank, layer), layer, group_bank.pages)
    kw = dict(align=FACTOR_ALIGN, interpret=kernels.interpret)
    shrink, expand = unified_shrink_knobs(x.shape[0]), unified_expand_knobs(x.shape[0])
    h = unified_shrink(
        x, *common, a_off, ranks, token_slots, max_rank=group_bank.max_rank, partials=True, **kw, **shrink
    )
    return unified_expand(y, h, *common, b_off, ranks, token_slots, columns=tuple(columns), **kw, **expand)


def step_plan(
    bank: dict | None, token_slots: jax.Array, kernels: StepKernels, seg_len: int | None
) -> pallas_kernels.LoraPlan | None:
    """The row grouping shared by every LoRA op of one step (all layers, all groups); None without a bank.

    bank leaves are stacked over layers, [L, S, ...], so axis 1 is the slot count. A unified bank's
    plan holds only the tiled kernels' groups (pallas, from UNIFIED_TILED_MIN_TOKENS rows up).
    """
    if not bank or is_paged(bank):
        return None  # the paged kernels read each row's page table themselves
    if is_unified(bank):
        return _unified_plan(bank, token_slots, kernels, seg_len)
    num_slots = jax.tree.leaves(bank)[0].shape[1]
    return pallas_kernels.lora_plan(token_slots, num_slots=num_slots, seg_len=seg_len, backend=kernels.lora.value)


def _unified_plan(
    bank: dict, token_slots: jax.Array, kernels: StepKernels, seg_len: int | None
) -> pallas_kernels.LoraPlan | None:
    num_tokens = token_slots.shape[0]
    if kernels.lora is not LoraBackend.PALLAS or num_tokens < UNIFIED_TILED_MIN_TOKENS:
        return None
    num_slots = next(iter(bank.values())).pages.shape[0]
    slots = token_slots.astype(jnp.int32)
    tile_rows = unified_tiled_knobs(num_tokens)["block_rows"]
    groups = make_row_groups(slots, num_slots=num_slots, seg_len=seg_len, block_rows=(tile_rows,))
    return pallas_kernels.LoraPlan(
        slot_ids=slots,
        groups=groups,
        sort_order=None,
        group_sizes=None,
        backend="pallas",
        seg_len=seg_len,
        num_slots=num_slots,
    )


def token_slots_for(slot_ids: jax.Array, tokens_per_row: int) -> jax.Array:
    """[rows] slot ids -> [rows * tokens_per_row] slot of every token (rows are contiguous)."""
    return jnp.repeat(
        slot_ids.astype(jnp.int32), tokens_per_row, total_repeat_length=slot_ids.shape[0] * tokens_per_row
    )
