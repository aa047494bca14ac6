"""The multi-LoRA contract, written once; every backend implements it.

For each token t with slot s = slot_ids[t] (slot 0 = "no adapter", an all-zero bank entry):

    lora_shrink:        h[t, :]   = x[t, :] @ a[s]                        a [S, D, R]   -> h [T, R]
    lora_expand:        y[t, :]  += h[t, :] @ b[s]                        b [S, R, O]   -> y [T, O]
    lora_expand_multi:  ys[g][t] += h[t, g*R:(g+1)*R] @ bs[g][s]          bs[g] [S, R, O_g]
    lora_group:         lora_shrink then lora_expand_multi, as one op (the model's LoRA seam)

Products accumulate in float32; h comes back in x.dtype and each y in its own dtype. A shrink for G
modules that read the same input stacks their A's along the rank axis (a [S, D, G*R]); G*R need not
be a power of two.

Backends: "pallas" (Triton kernels on GPU; `interpret=True` runs them on CPU), "pallas_tpu" (Mosaic
TPU kernels picking the slot by scalar prefetch; `interpret=True` runs them in TPU interpret mode on
CPU), "xla" (gather
a[slot_ids] + einsum), "ragged" (lax.ragged_dot over rows sorted by slot), "onehot" (one-hot
einsum), "loop" (Python loop over rows; tests only). `seg_len` (static) says that tokens come as
T = rows * seg_len with each contiguous run of seg_len tokens on one slot (prefill, SGMV); None
means every token may have its own slot (decode, BGMV). All three are static; everything else may
be traced, and nothing forces a host sync.

`layer=` (int32 scalar, may be traced) says that the bank is the whole stack over layers, a
[L, S, D, R] / b [L, S, R, O], and the op uses layer `layer`. The Triton kernels then read that
layer in place; the XLA backends index it (a slice XLA fuses into their gather). Slicing a layer
out of the bank before a `pallas_call` would copy every slot of it on every call.

`plan=` (from `lora_plan`, built once per step) carries the row grouping each backend needs, so
ops that share the step's slot_ids do not recompute it; without it each op builds its own. A
"pallas_tpu" plan carries only slot_ids (its kernels sort rows / build work items per call). The
pallas decode expand runs per row; tuning.py holds every kernel's block sizes.

Outside this contract (not yet wired into the engine, whose bank pads every slot to its max rank):
`paged.paged_shrink` / `paged.paged_expand` read each row's adapter at its true rank through a page
table over one page pool (S-LoRA's unified paging, adapter side); `paged_reference` checks them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.lora import common, expand, fused, group, reference, shrink, tpu, tuning, xla
from pallas_kernels.lora.plan import BACKENDS, Backend, LoraPlan, check_plan, lora_plan


def _check_backend(backend: Backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")


def _check_seg_len(num_tokens: int, seg_len: int | None) -> None:
    if seg_len is not None and (seg_len <= 0 or num_tokens % seg_len):
        raise ValueError(f"seg_len={seg_len} must be positive and divide the {num_tokens} tokens")


def _resolve_plan(
    plan: LoraPlan | None,
    slot_ids: jax.Array | None,
    *,
    backend: Backend,
    seg_len: int | None,
    num_tokens: int,
    num_slots: int,
) -> LoraPlan:
    _check_backend(backend)
    _check_seg_len(num_tokens, seg_len)
    if plan is None:
        if slot_ids is None:
            raise ValueError("need slot_ids or a plan")
        if slot_ids.shape != (num_tokens,):
            raise ValueError(f"slot_ids {slot_ids.shape} must be [T] with T={num_tokens}")
        return lora_plan(slot_ids, num_slots=num_slots, seg_len=seg_len, backend=backend)
    check_plan(plan, backend=backend, seg_len=seg_len, num_tokens=num_tokens, num_slots=num_slots)
    return plan


def _layer_of(bank: jax.Array, layer: jax.Array | None, ndim: int) -> jax.Array:
    """The layer's [S, ., .] bank for the backends that take one (XLA fuses the index into its gather)."""
    if layer is None:
        if bank.ndim != ndim:
            raise ValueError(f"bank {bank.shape} must have {ndim} axes without a layer index")
        return bank
    if bank.ndim != ndim + 1:
        raise ValueError(f"bank {bank.shape} must have {ndim + 1} axes (a leading layer axis) with a layer index")
    return jax.lax.dynamic_index_in_dim(bank, layer, axis=0, keepdims=False)


def lora_shrink(
    x: jax.Array,
    a: jax.Array,
    slot_ids: jax.Array | None,
    *,
    backend: Backend,
    interpret: bool = False,
    seg_len: int | None = None,
    plan: LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """h[t] = x[t] @ a[slot_ids[t]].

    Args:
      x: [T, D] bf16 or f32 tokens.
      a: [S, D, R] adapter bank (R may stack several modules), slot 0 all zero; [L, S, D, R] with `layer`.
      slot_ids: [T] int32 in [0, S) (may be None when a plan is given).
      backend: "pallas" | "pallas_tpu" | "xla" | "ragged" | "onehot" | "loop".
      interpret: pallas / pallas_tpu only, run the kernel in the (TPU) interpreter on CPU.
      seg_len: static; tokens come in contiguous runs of seg_len sharing a slot (prefill).
      plan: `lora_plan(slot_ids, num_slots=S, seg_len=seg_len, backend=backend)`, built once per step.
      layer: int32 scalar; `a` is then the whole stacked bank (see the module doc).

    Returns:
      h: [T, R] in x.dtype (f32 accumulation).
    """
    plan = _resolve_plan(plan, slot_ids, backend=backend, seg_len=seg_len, num_tokens=x.shape[0], num_slots=a.shape[-3])
    if backend == "pallas":
        if x.shape[0] == 0:
            return jnp.zeros((0, a.shape[-1]), x.dtype)
        mode = "decode" if seg_len is None else "prefill"
        return shrink.grouped_shrink(x, a, plan.groups, mode=mode, interpret=interpret, layer=layer)
    return _SHRINK[backend](x, _layer_of(a, layer, 3), plan, interpret)


def _shrink_tpu(x: jax.Array, a: jax.Array, plan: LoraPlan, interpret: bool) -> jax.Array:
    if plan.seg_len is None:
        return tpu.bgmv_shrink(x, a, plan.slot_ids, interpret=interpret)
    return tpu.sgmv_shrink(x, a, *_tpu_segments(plan.slot_ids, plan.seg_len), interpret=interpret)


# The shrink of each backend that takes one layer's bank [S, D, R]: (x, a, plan, interpret) -> h.
_SHRINK: dict[str, Callable[[jax.Array, jax.Array, LoraPlan, bool], jax.Array]] = {
    "pallas_tpu": _shrink_tpu,
    "xla": lambda x, a, plan, _: xla.shrink_xla(x, a, plan.slot_ids, plan.seg_len),
    "ragged": lambda x, a, plan, _: xla.shrink_ragged(x, a, plan.slot_ids, (plan.sort_order, plan.group_sizes)),
    "onehot": lambda x, a, plan, _: reference.shrink_onehot(x, a, plan.slot_ids),
    "loop": lambda x, a, plan, _: reference.shrink_loop(x, a, plan.slot_ids),
}


def _tpu_segments(slot_ids: jax.Array, seg_len: int) -> tuple[jax.Array, jax.Array]:
    """Prefill runs of seg_len tokens -> (seg_starts [N + 1], seg_slots [N]) for the TPU SGMV kernels."""
    num_segments = slot_ids.shape[0] // seg_len
    return jnp.arange(num_segments + 1, dtype=jnp.int32) * seg_len, slot_ids[::seg_len]


def _expand_one(y, h, b, plan: LoraPlan, h_col, *, backend, interpret, seg_len, layer=None):
    if backend == "pallas":
        if y.shape[0] == 0:
            return y
        if seg_len is None:
            return expand.decode_expand(y, h, b, plan.slot_ids, h_col=h_col, interpret=interpret, layer=layer)
        return expand.grouped_expand(
            y, h, b, plan.groups, mode="prefill", h_col=h_col, interpret=interpret, layer=layer
        )
    b = _layer_of(b, layer, 3)
    if backend == "pallas_tpu":
        return _expand_tpu(y, h, b, plan, h_col, interpret)
    return _EXPAND[backend](y, h[:, h_col : h_col + b.shape[1]], b, plan)


def _expand_tpu(y: jax.Array, h: jax.Array, b: jax.Array, plan: LoraPlan, h_col: int, interpret: bool) -> jax.Array:
    if plan.seg_len is None:
        return tpu.bgmv_expand(y, h, b, plan.slot_ids, h_col=h_col, interpret=interpret)
    segments = _tpu_segments(plan.slot_ids, plan.seg_len)
    return tpu.sgmv_expand(y, h, b, *segments, h_col=h_col, interpret=interpret)


# The expand of each XLA / reference backend: (y, h [T, R] (this module's columns), b [S, R, O], plan) -> y.
_EXPAND: dict[str, Callable[[jax.Array, jax.Array, jax.Array, LoraPlan], jax.Array]] = {
    "xla": lambda y, h, b, plan: xla.expand_xla(y, h, b, plan.slot_ids, plan.seg_len),
    "ragged": lambda y, h, b, plan: xla.expand_ragged(y, h, b, plan.slot_ids, (plan.sort_order, plan.group_sizes)),
    "onehot": lambda y, h, b, plan: reference.expand_onehot(y, h, b, plan.slot_ids),
    "loop": lambda y, h, b, plan: reference.expand_loop(y, h, b, plan.slot_ids),
}


def lora_expand(
    y: jax.Array,
    h: jax.Array,
    b: jax.Array,
    slot_ids: jax.Array | None,
    *,
    backend: Backend,
    interpret: bool = False,
    seg_len: int | None = None,
    plan: LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """y_new[t] = y[t] + h[t] @ b[slot_ids[t]].

    Args:
      y: [T, O] base output (bf16 or f32).
      h: [T, R] shrink output.
      b: [S, R, O] adapter bank, slot 0 all zero; [L, S, R, O] with `layer`.
      slot_ids: [T] int32 in [0, S) (may be None when a plan is given).
      backend, interpret, seg_len, plan, layer: as in `lora_shrink`.

    Returns:
      [T, O] in y.dtype (f32 accumulation); rows on slot 0 equal y.
    """
    if h.ndim != 2 or b.ndim != (3 if layer is None else 4) or h.shape[1] != b.shape[-2]:
        raise ValueError(f"h {h.shape} must be [T, R] for b {b.shape} [(L,) S, R, O]")
    plan = _resolve_plan(plan, slot_ids, backend=backend, seg_len=seg_len, num_tokens=y.shape[0], num_slots=b.shape[-3])
    return _expand_one(y, h, b, plan, 0, backend=backend, interpret=interpret, seg_len=seg_len, layer=layer)


def lora_expand_multi(
    ys: tuple[jax.Array, ...],
    h: jax.Array,
    bs: tuple[jax.Array, ...],
    slot_ids: jax.Array | None,
    *,
    backend: Backend,
    interpret: bool = False,
    seg_len: int | None = None,
    plan: LoraPlan | None = None,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """ys_new[g][t] = ys[g][t] + h[t, g*R:(g+1)*R] @ bs[g][slot_ids[t]], for the G modules of one shrink.

    Args:
      ys: G base outputs, ys[g] [T, O_g].
      h: [T, G*R], the stacked shrink output.
      bs: G banks, bs[g] [S, R, O_g] ([L, S, R, O_g] with `layer`), each with the same R.
      slot_ids: [T] int32 in [0, S) (may be None when a plan is given).
      backend, interpret, seg_len, plan, layer: as in `lora_shrink`.

    Returns:
      tuple of G arrays, [T, O_g] in ys[g].dtype.
    """
    _check_backend(backend)
    if len(ys) != len(bs) or not ys:
        raise ValueError(f"need one bank per output and at least one; got {len(ys)} outputs, {len(bs)} banks")
    rank, ndim = bs[0].shape[-2], 3 if layer is None else 4
    if any(b.ndim != ndim or b.shape[-2] != rank for b in bs) or h.ndim != 2 or h.shape[1] != len(bs) * rank:
        raise ValueError(f"h {h.shape} must be [T, G*R] for G={len(bs)} banks of rank {[b.shape for b in bs]}")
    plan = _resolve_plan(
        plan, slot_ids, backend=backend, seg_len=seg_len, num_tokens=h.shape[0], num_slots=bs[0].shape[-3]
    )
    return tuple(
        _expand_one(y, h, b, plan, g * rank, backend=backend, interpret=interpret, seg_len=seg_len, layer=layer)
        for g, (y, b) in enumerate(zip(ys, bs))
    )


def lora_group(
    x: jax.Array,
    a: jax.Array,
    ys: tuple[jax.Array, ...],
    bs: tuple[jax.Array, ...],
    slot_ids: jax.Array | None,
    *,
    backend: Backend,
    interpret: bool = False,
    seg_len: int | None = None,
    plan: LoraPlan | None = None,
    layer: jax.Array | None = None,
    out_cols: tuple[int, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """ys_new[g][t] = ys[g][t] + (x[t] @ a[s])[g*R:(g+1)*R] @ bs[g][s], s = slot_ids[t]: a module group's LoRA term.

    The same as `lora_shrink` followed by `lora_expand_multi`. On "pallas" where tuning.py's group
    impl is "fused", it runs as one launch for the whole group (`fused`); otherwise in decode
    (seg_len None) as two launches for the whole group (`group.decode_group`: the shrink's
    float32 split-K partials go straight to one expand launch over every module): per row, with h
    not rounded to x.dtype in between, or per work item where the impl is "split_tiles".

    Args:
      x: [T, D]; a: [S, D, G*R]; ys: G outputs [T, O_g]; bs: G banks [S, R, O_g] (a leading L axis
        on a and bs with `layer`); slot_ids, backend, interpret, seg_len, plan, layer: as in `lora_shrink`.
      out_cols: None, or G static column offsets: ys is then one fused output (y,) [T, W] and module
        g's output is its columns out_cols[g] .. out_cols[g] + O_g - 1 (jaxlora.model.fused).

    Returns:
      tuple of G arrays, [T, O_g] in ys[g].dtype; with out_cols, the one updated fused output (y_new,).
    """
    _check_backend(backend)
    if _fused_group_applies(backend, seg_len, x.shape[0], bs[0].shape[-2] if bs else 0):
        plan = _resolve_plan(
            plan, slot_ids, backend=backend, seg_len=seg_len, num_tokens=x.shape[0], num_slots=a.shape[-3]
        )
        mode = "decode" if seg_len is None else "prefill"
        out_cols = None if out_cols is None else tuple(out_cols)
        return fused.fused_group(
            x, a, tuple(ys), tuple(bs), plan.groups, mode=mode, layer=layer, out_cols=out_cols, interpret=interpret
        )
    if out_cols is not None:
        return (_group_fused(x, a, ys, bs, slot_ids, backend, interpret, seg_len, plan, layer, tuple(out_cols)),)
    if _decode_group_applies(backend, seg_len, x.shape[0]):
        return _decode_group(x, a, tuple(ys), tuple(bs), slot_ids, plan, backend, interpret, layer, None)
    kw = dict(backend=backend, interpret=interpret, seg_len=seg_len, layer=layer)
    h = lora_shrink(x, a, slot_ids, plan=plan, **kw)
    return lora_expand_multi(tuple(ys), h, tuple(bs), slot_ids, plan=plan, **kw)


def _fused_group_applies(backend: str, seg_len: int | None, num_tokens: int, rank: int) -> bool:
    """Whether a group's LoRA term runs as one launch (`fused.fused_group`): Pallas, and
    tuning.py's group impl at this T and bank rank is "fused"."""
    if backend != "pallas" or num_tokens <= 0 or rank <= 0:
        return False
    mode = "decode" if seg_len is None else "prefill"
    return tuning.lookup_group(mode, num_tokens, rank)["impl"] == "fused"


def _decode_group_applies(backend: str, seg_len: int | None, num_tokens: int) -> bool:
    """Whether a group's LoRA term runs as `group.decode_group` (two launches for the group):
    Pallas and one token per row."""
    return backend == "pallas" and seg_len is None and num_tokens > 0


def _decode_group(x, a, ys, bs, slot_ids, plan, backend, interpret, layer, out_cols) -> tuple[jax.Array, ...]:
    """`group.decode_group` with the step's plan (built here if not given) and tuning.py's
    expand for this T and bank rank: per row, or per work item ("split_tiles")."""
    plan = _resolve_plan(plan, slot_ids, backend=backend, seg_len=None, num_tokens=x.shape[0], num_slots=a.shape[-3])
    tiles = _tile_knobs(backend, None, x.shape[0], bs[0].shape[-2])
    return group.decode_group(
        x, a, ys, bs, plan.slot_ids, plan.groups, layer=layer, interpret=interpret, out_cols=out_cols, tiles=tiles
    )


def _tile_knobs(backend: str, seg_len: int | None, num_tokens: int, rank: int) -> dict[str, int] | None:
    """The tile expand's knobs where tuning.py's decode group impl at this T and bank rank is
    "split_tiles" (`group.decode_group` with b read once per work item), else None (per row)."""
    if backend != "pallas" or seg_len is not None or num_tokens <= 0 or rank <= 0:
        return None
    row = tuning.lookup_group("decode", num_tokens, rank)
    if row["impl"] != "split_tiles":
        return None
    return {k: int(row[k]) for k in group.TILE_KNOBS}


def _group_fused(x, a, ys, bs, slot_ids, backend, interpret, seg_len, plan, layer, out_cols) -> jax.Array:
    """`lora_group` into one fused output: y [T, W] with module g in columns out_cols[g] .. + O_g.

    The Pallas decode kernel writes the columns in place (one launch for the group); every other
    path runs the per-module ops on column slices of y and writes them back (XLA updates in place).
    """
    if len(ys) != 1 or not bs:
        raise ValueError(f"a fused output takes one y and at least one bank; got {len(ys)} outputs, {len(bs)} banks")
    (y,) = ys
    common.check_column_spans(out_cols, tuple(b.shape[-1] for b in bs), y.shape)
    spans = [(c, c + b.shape[-1]) for c, b in zip(out_cols, bs)]
    if _decode_group_applies(backend, seg_len, x.shape[0]):
        (y,) = _decode_group(x, a, (y,), tuple(bs), slot_ids, plan, backend, interpret, layer, out_cols)
        return y
    views = tuple(y[:, lo:hi] for lo, hi in spans)
    kw = dict(backend=backend, interpret=interpret, seg_len=seg_len, layer=layer)
    h = lora_shrink(x, a, slot_ids, plan=plan, **kw)
    for (lo, _), new in zip(spans, lora_expand_multi(views, h, tuple(bs), slot_ids, plan=plan, **kw)):
        y = jax.lax.dynamic_update_slice_in_dim(y, new, lo, axis=1)
    return y
