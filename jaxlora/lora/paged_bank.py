"""The paged device adapter bank: every resident adapter at its TRUE rank, in pages of one pool.

Layout (a plain nested dict, a pytree the pager donates to its writes):

    state["pool"]        [num_pages, P, W]  P = lora.page_rows rank-rows per page; W = the widest
                                            side of any target module (narrower rows leave the
                                            trailing columns unread)
    state["tables"][m]   [2, L, S, M]       int32 page ids of slot s's module m at layer l: factor 0
                                            holds A^T's rank-rows (row r = a[l][:, r], in_m wide),
                                            factor 1 B's (row r = b[l][r, :], out_m wide);
                                            M = ceil(max_rank / P)
    state["ranks"][m]    [S]                int32 true rank of module m in slot s (0: no LoRA)

Rank-row r of slot s's module m at layer l lies in page tables[m][f, l, s, r // P], row r % P: the
layout `pallas_kernels.lora.paged` reads, one (table, ranks) pair per module, the table sliced per
layer. A module of rank r takes 2 * L * ceil(r / P) pages, so an adapter's device bytes follow its
own ranks (`rank_pattern` included), not the bank's max rank. Slot 0 keeps rank 0: the base model.
Pages past a module's rank, and free pages, are never read (the kernels mask them), whatever they
hold. The PEFT scale is folded into B, as in the padded bank.

The model reads a per-group view (`model_view`): {group: {"pool", "tables": {m}, "ranks": {m}}} with
the same pool in every group, so `jaxlora.lora.apply` finds a group's entries where the padded
bank keeps them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.lora.bank import bank_groups

PagedState = dict[str, dict]
Weights = Mapping[str, tuple[np.ndarray, np.ndarray]]

FACTORS = 2  # A^T, then B


def pool_width(model: ModelConfig, lora: LoraConfig) -> int:
    """W: the widest rank-row any target module has (its input or its output width)."""
    return max(max(model.module_shape(m)) for m in lora.target_modules)


def max_pages_per_module(lora: LoraConfig) -> int:
    """M: page-table entries per slot, layer and factor (a module at max_rank fills them all)."""
    return -(-lora.max_rank // lora.page_rows)


def module_pages(rank: int, num_layers: int, page_rows: int) -> int:
    """Pages one module of `rank` takes: both factors, every layer."""
    return FACTORS * num_layers * -(-rank // page_rows)


def adapter_pages(module_ranks: Mapping[str, int], num_layers: int, page_rows: int) -> int:
    """Pages an adapter with these per-module ranks takes in the pool."""
    return sum(module_pages(r, num_layers, page_rows) for r in module_ranks.values())


def default_pool_pages(model: ModelConfig, lora: LoraConfig) -> int:
    """The pool of `lora.pool_pages` None: max_slots - 1 adapters at max_rank on every target module."""
    full = {m: lora.max_rank for m in lora.target_modules}
    return (lora.max_slots - 1) * adapter_pages(full, model.num_layers, lora.page_rows)


def num_pool_pages(model: ModelConfig, lora: LoraConfig) -> int:
    return lora.pool_pages if lora.pool_pages is not None else default_pool_pages(model, lora)


def init_paged_bank(model: ModelConfig, lora: LoraConfig, dtype: jnp.dtype, *, fill: float = 0.0) -> PagedState:
    """An empty paged bank: every slot at rank 0, every page free. `fill` sets the free pages'
    values (tests fill them with NaN: a read of a page an adapter does not own would show)."""
    S, L, M = lora.max_slots, model.num_layers, max_pages_per_module(lora)
    pages = num_pool_pages(model, lora)
    return {
        "pool": jnp.full((pages, lora.page_rows, pool_width(model, lora)), fill, dtype),
        "tables": {m: jnp.zeros((FACTORS, L, S, M), jnp.int32) for m in lora.target_modules},
        "ranks": {m: jnp.zeros((S,), jnp.int32) for m in lora.target_modules},
    }


def model_view(state: PagedState, lora: LoraConfig) -> dict[str, dict]:
    """The bank as the model reads it: per group, the shared pool and the group's modules' tables."""
    return {
        group: {
            "pool": state["pool"],
            "tables": {m: state["tables"][m] for m in modules},
            "ranks": {m: state["ranks"][m] for m in modules},
        }
        for group, modules in bank_groups(lora)
    }


def is_paged(bank: Mapping | None) -> bool:
    """Whether `bank` (a model view, or one group of it) is a paged bank's."""
    if not bank:
        return False
    return "pool" in bank or any(isinstance(v, Mapping) and "pool" in v for v in bank.values())


def module_ranks(weights: Weights, lora: LoraConfig) -> dict[str, int]:
    """Every target module's rank in the adapter (0 for the modules it leaves alone)."""
    return {m: weights[m][0].shape[-1] if m in weights else 0 for m in lora.target_modules}


def pack_pages(weights: Weights, model: ModelConfig, lora: LoraConfig, dtype: np.dtype) -> np.ndarray:
    """An adapter's host copy: its rank-rows as pool pages [n, P, W] in `dtype`, n = `adapter_pages`.

    Order (the order `table_rows` gives the pages ids in): target modules in canonical order, then
    factor (A^T, B), layer, page. Rows past a module's rank and columns past its width are zero.
    """
    P, W = lora.page_rows, pool_width(model, lora)
    ranks = module_ranks(weights, lora)
    out = np.zeros((adapter_pages(ranks, model.num_layers, P), P, W), dtype)
    n = 0
    for m, r in ranks.items():
        if not r:
            continue
        a, b = weights[m]  # a [L, in, r], b [L, r, out]
        for rows in (np.swapaxes(a, 1, 2), b):  # [L, r, width]
            per = -(-r // P)
            padded = np.zeros((model.num_layers, per * P, rows.shape[2]), np.float32)
            padded[:, :r] = rows
            out[n : n + model.num_layers * per, :, : rows.shape[2]] = padded.reshape(-1, P, rows.shape[2])
            n += model.num_layers * per
    return out


def table_rows(
    ranks: Mapping[str, int], page_ids: np.ndarray, num_layers: int, lora: LoraConfig
) -> dict[str, np.ndarray]:
    """The page-table rows of one slot, {m: [2, L, M] int32}, for pages laid out as `pack_pages`'s
    and placed at `page_ids` [n]. Unused entries are 0 (never read: past the rank)."""
    M, P = max_pages_per_module(lora), lora.page_rows
    rows, n = {}, 0
    for m in lora.target_modules:
        row = np.zeros((FACTORS, num_layers, M), np.int32)
        per = -(-ranks.get(m, 0) // P)
        for f in range(FACTORS):
            row[f, :, :per] = np.asarray(page_ids[n : n + num_layers * per]).reshape(num_layers, per)
            n += num_layers * per
        rows[m] = row
    if n != len(page_ids):
        raise ValueError(f"{len(page_ids)} page ids for an adapter of {n} pages")
    return rows


def _write(state: PagedState, slot, page_ids, pages, rows, ranks) -> PagedState:
    # Out-of-range page ids (padding) and slots (the warm-up's) are dropped, not clamped.
    pool = state["pool"].at[page_ids].set(pages.astype(state["pool"].dtype), mode="drop")
    tables = {m: t.at[:, :, slot].set(rows[m], mode="drop") for m, t in state["tables"].items()}
    new_ranks = {m: r.at[slot].set(ranks[m], mode="drop") for m, r in state["ranks"].items()}
    return {"pool": pool, "tables": tables, "ranks": new_ranks}


# The state is donated: pages and table rows are written in place. One program per page count
# (the pager pads the count to a power of two, so a few programs, all compiled at warm-up).
write_adapter = jax.jit(_write, donate_argnums=0)


@functools.cache
def _padded_sizes(max_pages: int) -> tuple[int, ...]:
    sizes, n = [], 1
    while n < max_pages:
        sizes.append(n)
        n *= 2
    return (*sizes, max_pages)


def write_sizes(model: ModelConfig, lora: LoraConfig) -> tuple[int, ...]:
    """The page counts `write_adapter` is compiled for: powers of two up to the largest adapter's."""
    full = {m: lora.max_rank for m in lora.target_modules}
    return _padded_sizes(adapter_pages(full, model.num_layers, lora.page_rows))


def padded_size(num_pages: int, sizes: tuple[int, ...]) -> int:
    """The smallest compiled page count that holds `num_pages`."""
    return next(s for s in sizes if s >= num_pages)


def build_paged_bank(
    model: ModelConfig, lora: LoraConfig, adapters: list[Weights], dtype: jnp.dtype = jnp.float32, *, fill: float = 0.0
) -> PagedState:
    """A paged bank holding `adapters` in slots 1, 2, ... on consecutive pages (tests, benchmarks;
    the serving path allocates pages through `jaxlora.adapters.paged_pager`)."""
    state, next_page = init_paged_bank(model, lora, dtype, fill=fill), 0
    if len(adapters) >= lora.max_slots:
        raise ValueError(f"{len(adapters)} adapters need more than max_slots - 1 = {lora.max_slots - 1} slots")
    for slot, weights in enumerate(adapters, start=1):
        pages = pack_pages(weights, model, lora, np.dtype(dtype))
        ids = np.arange(next_page, next_page + len(pages), dtype=np.int32)
        if ids.size and ids[-1] >= state["pool"].shape[0]:
            raise ValueError(f"the pool's {state['pool'].shape[0]} pages cannot hold these adapters")
        next_page += len(pages)
        ranks = module_ranks(weights, lora)
        rows = table_rows(ranks, ids, model.num_layers, lora)
        state = write_adapter(state, np.int32(slot), ids, pages, rows, {m: np.int32(r) for m, r in ranks.items()})
    return state
