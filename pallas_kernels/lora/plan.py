"""Per-step LoRA metadata, built once and shared by every shrink / expand of a model step.

Which rows use which slot is the same in every layer and every module group of one step, so the
row grouping each backend needs (sort order, segments, the kernels' (segment, tile) work items) is
computed once by `lora_plan` and passed to `lora_shrink` / `lora_expand` / `lora_expand_multi` as
`plan=`. Without a plan each op builds its own, which costs a few small XLA ops per call.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from pallas_kernels.lora import common, tuning, xla

# The LoRA backends `api.py` dispatches to (its docstring says what each is); "onehot" and "loop"
# are the naive references, for tests. jaxlora's `LoraBackend` is the subset a model serves with.
Backend = typing.Literal["pallas", "xla", "ragged", "onehot", "loop", "pallas_tpu"]
BACKENDS: tuple[str, ...] = typing.get_args(Backend)


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """What the ops of one step need to know about its rows, per backend.

    slot_ids: [T] int32 slot of each token.
    groups: pallas only: rows grouped by slot (decode) or cut into segments (prefill), with the
      kernels' work items for the tile heights tuning.py uses at this T (`common.RowGroups`).
    sort_order: ragged only: [T] int32 rows in stable slot order.
    group_sizes: ragged only: [S] int32 rows per slot.
    backend, seg_len, num_slots: static; the ops check that they match their own arguments.
    """

    slot_ids: jax.Array
    groups: common.RowGroups | None
    sort_order: jax.Array | None
    group_sizes: jax.Array | None
    backend: Backend = _static()
    seg_len: int | None = _static()
    num_slots: int = _static()

    @property
    def num_tokens(self) -> int:
        return self.slot_ids.shape[0]


def _tile_heights(num_tokens: int, seg_len: int | None) -> tuple[int, ...]:
    mode = "decode" if seg_len is None else "prefill"
    heights = [tuning.lookup("shrink", mode, num_tokens)["block_rows"]]
    if seg_len is not None:  # the decode expand runs per row, on no work items
        heights.append(tuning.lookup("expand", mode, num_tokens)["block_rows"])
    heights.extend(tuning.group_tile_heights(mode, num_tokens))
    return tuple(heights)


def lora_plan(slot_ids: jax.Array, *, num_slots: int, seg_len: int | None = None, backend: Backend) -> LoraPlan:
    """Builds the step's metadata for `backend` from slot_ids [T] int32 in [0, num_slots).

    Args:
      slot_ids: [T] int32 slot of each token (may be traced).
      num_slots: static S, slots in the bank (bounds the number of distinct slots).
      seg_len: static; tokens come as runs of seg_len sharing a slot (prefill), or None (decode).
      backend: as in `lora_shrink`.

    Returns:
      a LoraPlan pytree: pass it through jit / scan like any array argument.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if slot_ids.ndim != 1:
        raise ValueError(f"slot_ids {slot_ids.shape} must be [T]")
    num_tokens = slot_ids.shape[0]
    if seg_len is not None and (seg_len <= 0 or num_tokens % seg_len):
        raise ValueError(f"seg_len={seg_len} must be positive and divide the {num_tokens} tokens")
    if num_slots <= 0:
        raise ValueError(f"num_slots={num_slots} must be positive")
    slot_ids = slot_ids.astype(jnp.int32)
    groups = sort_order = group_sizes = None
    if backend == "pallas" and num_tokens:
        groups = common.make_row_groups(
            slot_ids, num_slots=num_slots, seg_len=seg_len, block_rows=_tile_heights(num_tokens, seg_len)
        )
    elif backend == "ragged":
        sort_order, group_sizes = xla.sort_by_slot(slot_ids, num_slots)
    return LoraPlan(
        slot_ids=slot_ids,
        groups=groups,
        sort_order=sort_order,
        group_sizes=group_sizes,
        backend=backend,
        seg_len=seg_len,
        num_slots=num_slots,
    )


def check_plan(plan: LoraPlan, *, backend: Backend, seg_len: int | None, num_tokens: int, num_slots: int) -> None:
    """Raises ValueError when a plan was built for other rows or another backend than this op's."""
    got = (plan.backend, plan.seg_len, plan.num_tokens, plan.num_slots)
    want = (backend, seg_len, num_tokens, num_slots)
    if got != want:
        raise ValueError(f"plan (backend, seg_len, tokens, slots)={got} does not match this op's {want}")
