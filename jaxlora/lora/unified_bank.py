"""The device side of a unified bank (`lora.bank: unified`): small tables that say where each slot's
adapter lies in the KV pool's pages (`jaxlora.lora.unified_layout`), and the view the model reads.

    tables["pages"]       [S, MP]      int32 KV page ids of slot s's run (entries past its pages unread)
    tables["offsets"][m]  [S, 2]       int32 A^T and B offsets of module m in the slot's run
    tables["ranks"][m]    [S]          int32 rank of module m in slot s (0: no LoRA on it; slot 0: base)

The weights themselves are the KV pool's: the model view (`model_view`) is one `UnifiedGroup` per
module group, whose `pool` the decoder layer fills with the (k, v) it carries (`with_kv_pool`), so a
LoRA kernel reads the pool as it stands at that point of the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import LoraConfig
from jaxlora.lora.bank import GROUPS, bank_groups
from jaxlora.lora.unified_layout import UnifiedLayout

Tables = dict  # {"pages": [S, MP], "offsets": {m: [S, 2]}, "ranks": {m: [S]}}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnifiedGroup:
    """One module group's entries of a unified bank, as the model reads them.

    pages [S, MP], offsets {m: [S, 2]}, ranks {m: [S]} (the group's modules); pool: the KV pool's
    (k, v), each [L, N, page_size, kv_heads, head_dim], None until the layer sets it; max_rank: the
    width of the shrink's output (static). stacked: the same tables over every module of the group
    in `bank.GROUPS` order, a module the bank does not target at rank 0: (A^T offsets [S, G],
    B offsets [S, G], ranks [S, G]), for the kernels that take a group in one launch; None until
    `with_stacked_tables` (once a step, in the step's program) sets it.
    """

    pages: jax.Array
    offsets: dict[str, jax.Array]
    ranks: dict[str, jax.Array]
    pool: tuple[jax.Array, jax.Array] | None
    max_rank: int = dataclasses.field(metadata=dict(static=True))
    stacked: tuple[jax.Array, jax.Array, jax.Array] | None = None


def init_unified_tables(lora: LoraConfig, max_pages: int) -> Tables:
    """Every slot at rank 0, no pages."""
    S = lora.max_slots
    return {
        "pages": jnp.zeros((S, max_pages), jnp.int32),
        "offsets": {m: jnp.zeros((S, 2), jnp.int32) for m in lora.target_modules},
        "ranks": {m: jnp.zeros((S,), jnp.int32) for m in lora.target_modules},
    }


def model_view(tables: Tables, lora: LoraConfig) -> dict[str, UnifiedGroup]:
    """The bank as the model reads it: one UnifiedGroup per module group, pool not yet set."""
    return {
        group: UnifiedGroup(
            pages=tables["pages"],
            offsets={m: tables["offsets"][m] for m in modules},
            ranks={m: tables["ranks"][m] for m in modules},
            pool=None,
            max_rank=lora.max_rank,
        )
        for group, modules in bank_groups(lora)
    }


def is_unified(bank) -> bool:
    """Whether `bank` (a model view, or one group of it) is a unified bank's."""
    if isinstance(bank, UnifiedGroup):
        return True
    return isinstance(bank, dict) and any(isinstance(g, UnifiedGroup) for g in bank.values())


def with_kv_pool(bank: dict, k: jax.Array, v: jax.Array) -> dict:
    """`bank` with every unified group reading the KV pool (k, v); any other bank unchanged."""
    if not is_unified(bank):
        return bank
    return {g: dataclasses.replace(entries, pool=(k, v)) for g, entries in bank.items()}


def with_stacked_tables(bank: dict) -> dict:
    """`bank` with every unified group's `stacked` tables set (UnifiedGroup); any other bank unchanged.
    Traced once a step, not once a layer: the layers share them."""
    if not is_unified(bank):
        return bank
    return {g: dataclasses.replace(entries, stacked=_stack(g, entries)) for g, entries in bank.items()}


def _stack(group: str, entries: UnifiedGroup) -> tuple[jax.Array, jax.Array, jax.Array]:
    num_slots, modules = entries.pages.shape[0], dict(GROUPS)[group]
    offsets = jnp.stack([entries.offsets.get(m, jnp.zeros((num_slots, 2), jnp.int32)) for m in modules], axis=1)
    ranks = jnp.stack([entries.ranks.get(m, jnp.zeros((num_slots,), jnp.int32)) for m in modules], axis=1)
    return offsets[..., 0], offsets[..., 1], ranks  # [S, G, 2] -> A^T's, B's; [S, G]


def slot_rows(layout: UnifiedLayout | None, page_ids: np.ndarray, lora: LoraConfig, max_pages: int) -> dict:
    """One slot's table entries for an adapter of `layout` placed at `page_ids` ([num_pages] int); a
    reset slot (layout None: rank 0 everywhere, no pages) for None."""
    page_ids = np.asarray(page_ids, np.int32)
    pages = np.zeros((max_pages,), np.int32)
    if layout is None:
        offsets, ranks = {}, {}
    else:
        if page_ids.shape != (layout.num_pages,):
            raise ValueError(f"{len(page_ids)} page ids for an adapter of {layout.num_pages} pages")
        pages[: layout.num_pages] = page_ids
        offsets, ranks = layout.offsets, layout.ranks
    return {
        "pages": pages,
        "offsets": {m: np.asarray(offsets.get(m, (0, 0)), np.int32) for m in lora.target_modules},
        "ranks": {m: np.int32(ranks.get(m, 0)) for m in lora.target_modules},
    }


def _write_slot(tables: Tables, slot, rows: dict) -> Tables:
    # An out-of-range slot (the warm-up's) is dropped.
    return jax.tree.map(lambda t, r: t.at[slot].set(r, mode="drop"), tables, rows)


# Donated: a slot's rows are written in place (one program: every slot write has the same shapes).
write_slot = jax.jit(_write_slot, donate_argnums=0)
