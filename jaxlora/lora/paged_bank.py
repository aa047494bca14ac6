"""The paged device adapter bank: every resident adapter at its TRUE rank, in pages of one pool per row width.

Layout (a plain nested dict, a pytree the pager donates to its writes):

    state["pools"][w]    [N_w, P, w]        one pool per distinct rank-row width w among the target
                                            modules' factors (A^T rows are in_m wide, B rows out_m
                                            wide: 7B on all seven modules has {4096, 11008}, q/k/v/o
                                            only {4096}, a GQA model adds k/v's out width);
                                            P = lora.page_rows rank-rows per page, every row its
                                            module's own width (no column is padding)
    state["tables"][m]   [2, L, S, M]       int32 page ids of slot s's module m at layer l: factor 0
                                            holds A^T's rank-rows (row r = a[l][:, r]) as ids into
                                            pools[in_m], factor 1 B's (row r = b[l][r, :]) as ids
                                            into pools[out_m]; M = ceil(max_rank / P)
    state["ranks"][m]    [S]                int32 true rank of module m in slot s (0: no LoRA)

Rank-row r of slot s's module m at layer l lies in page tables[m][f, l, s, r // P], row r % P, of
the pool of that factor's width: the layout `pallas_kernels.lora.paged` reads, one (pool, table,
ranks) triple per factor, the table sliced per layer. A module of rank r takes L * ceil(r / P)
pages in pools[in_m] and as many in pools[out_m], so an adapter's device bytes are its per-module
true-rank rows at their own widths (`rank_pattern` included), rounded up to whole pages of rows
only. Slot 0 keeps rank 0: the base model. Pages past a module's rank, and free pages, are never
read (the kernels mask them), whatever they hold. The PEFT scale is folded into B, as in the
padded bank.

Pool sizes (`num_pool_pages`): with `lora.pool_pages` None, pool w holds max_slots - 1 adapters at
max_rank on every target module (the padded bank's capacity, and its bytes). A given
`lora.pool_pages` counts pages summed over all pools and is split in proportion to that default
(largest remainder), i.e. in the page mix of a max-rank all-module adapter: pool_pages = k times
that adapter's page count holds exactly k of them. It must hold at least one.

The model reads a per-group view (`model_view`): {group: {"pools", "tables": {m}, "ranks": {m}}} with
the same pools in every group, so `jaxlora.lora.apply` finds a group's entries where the padded
bank keeps them and picks each factor's pool by its width (the operands' static shapes).
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


def factor_width(model: ModelConfig, module: str, factor: int) -> int:
    """The width of a rank-row of `module`'s factor: in_m for A^T (0), out_m for B (1)."""
    return model.module_shape(module)[factor]


def pool_widths(model: ModelConfig, lora: LoraConfig) -> tuple[int, ...]:
    """The pools' row widths, ascending: every distinct factor width among the target modules."""
    return tuple(sorted({factor_width(model, m, f) for m in lora.target_modules for f in range(FACTORS)}))


def max_pages_per_module(lora: LoraConfig) -> int:
    """M: page-table entries per slot, layer and factor (a module at max_rank fills them all)."""
    return -(-lora.max_rank // lora.page_rows)


def adapter_pages(module_ranks: Mapping[str, int], model: ModelConfig, lora: LoraConfig) -> dict[int, int]:
    """Pages an adapter with these per-module ranks takes in each pool, {width: pages} (every pool)."""
    pages = dict.fromkeys(pool_widths(model, lora), 0)
    for m, r in module_ranks.items():
        for f in range(FACTORS):
            pages[factor_width(model, m, f)] += model.num_layers * -(-r // lora.page_rows)
    return pages


def pages_nbytes(pages: Mapping[int, int], page_rows: int, itemsize: int) -> int:
    """Bytes of {width: page count}."""
    return sum(n * page_rows * w * itemsize for w, n in pages.items())


def full_adapter_pages(model: ModelConfig, lora: LoraConfig) -> dict[int, int]:
    """Pages per pool of an adapter at max_rank on every target module (the largest there is)."""
    return adapter_pages(dict.fromkeys(lora.target_modules, lora.max_rank), model, lora)


def default_pool_pages(model: ModelConfig, lora: LoraConfig) -> dict[int, int]:
    """The pools of `lora.pool_pages` None: max_slots - 1 adapters at max_rank on every target module."""
    return {w: (lora.max_slots - 1) * n for w, n in full_adapter_pages(model, lora).items()}


def num_pool_pages(model: ModelConfig, lora: LoraConfig) -> dict[int, int]:
    """Pages of each pool, {width: pages}. A given `lora.pool_pages` (pages summed over all pools) is
    split in proportion to the default (largest remainder, so the counts sum to it exactly); it must
    hold at least one adapter at max_rank on every target module."""
    if lora.pool_pages is None:
        return default_pool_pages(model, lora)
    full = full_adapter_pages(model, lora)
    total = sum(full.values())
    if lora.pool_pages < total:
        raise ValueError(
            f"lora.pool_pages={lora.pool_pages} must hold at least one adapter at max_rank={lora.max_rank} on "
            f"every target module: {total} pages"
        )
    exact = {w: lora.pool_pages * n / total for w, n in full.items()}
    pages = {w: int(x) for w, x in exact.items()}
    by_remainder = sorted(full, key=lambda w: (pages[w] - exact[w], w))
    for w in by_remainder[: lora.pool_pages - sum(pages.values())]:
        pages[w] += 1
    return pages


def init_paged_bank(model: ModelConfig, lora: LoraConfig, dtype: jnp.dtype, *, fill: float = 0.0) -> PagedState:
    """An empty paged bank: every slot at rank 0, every page free. `fill` sets the free pages'
    values (tests fill them with NaN: a read of a page an adapter does not own would show)."""
    S, L, M = lora.max_slots, model.num_layers, max_pages_per_module(lora)
    return {
        "pools": {w: jnp.full((n, lora.page_rows, w), fill, dtype) for w, n in num_pool_pages(model, lora).items()},
        "tables": {m: jnp.zeros((FACTORS, L, S, M), jnp.int32) for m in lora.target_modules},
        "ranks": {m: jnp.zeros((S,), jnp.int32) for m in lora.target_modules},
    }


def model_view(state: PagedState, lora: LoraConfig) -> dict[str, dict]:
    """The bank as the model reads it: per group, the shared pools and the group's modules' tables."""
    return {
        group: {
            "pools": state["pools"],
            "tables": {m: state["tables"][m] for m in modules},
            "ranks": {m: state["ranks"][m] for m in modules},
        }
        for group, modules in bank_groups(lora)
    }


def is_paged(bank: Mapping | None) -> bool:
    """Whether `bank` (a model view, or one group of it) is a paged bank's."""
    if not bank:
        return False
    return "pools" in bank or any(isinstance(v, Mapping) and "pools" in v for v in bank.values())


def module_ranks(weights: Weights, lora: LoraConfig) -> dict[str, int]:
    """Every target module's rank in the adapter (0 for the modules it leaves alone)."""
    return {m: weights[m][0].shape[-1] if m in weights else 0 for m in lora.target_modules}


def pack_flat(
    weights: Weights, model: ModelConfig, lora: LoraConfig, dtype: np.dtype
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """An adapter's host copy: ONE 1-D buffer in `dtype` holding its pages pool by pool (ascending
    width), and {width: [n_w, P, w] view of it}, n_w = `adapter_pages`[w] (every pool, maybe empty).

    Order within a pool (the order `table_rows` gives the page ids in): target modules in canonical
    order, then factor (A^T, B), layer, page, of the factors that are that pool's width. Rows past
    a module's rank are zero.
    """
    P, ranks = lora.page_rows, module_ranks(weights, lora)
    counts = adapter_pages(ranks, model, lora)
    flat = np.zeros(pages_nbytes(counts, P, 1), dtype)
    pages, offset = {}, 0
    for w, n in counts.items():
        pages[w] = flat[offset : offset + n * P * w].reshape(n, P, w)
        offset += n * P * w
    cursor = dict.fromkeys(counts, 0)
    for m, r in ranks.items():
        if not r:
            continue
        a, b = weights[m]  # a [L, in, r], b [L, r, out]
        per = -(-r // P)
        for rows in (np.swapaxes(a, 1, 2), b):  # [L, r, width]
            w, n = rows.shape[2], model.num_layers * per
            padded = np.zeros((model.num_layers, per * P, w), np.float32)
            padded[:, :r] = rows
            pages[w][cursor[w] : cursor[w] + n] = padded.reshape(n, P, w)
            cursor[w] += n
    return flat, pages


def pack_pages(weights: Weights, model: ModelConfig, lora: LoraConfig, dtype: np.dtype) -> dict[int, np.ndarray]:
    """An adapter's pages per pool, {width: [n_w, P, w]} (`pack_flat`'s views)."""
    return pack_flat(weights, model, lora, dtype)[1]


def table_rows(
    ranks: Mapping[str, int], page_ids: Mapping[int, np.ndarray], model: ModelConfig, lora: LoraConfig
) -> dict[str, np.ndarray]:
    """The page-table rows of one slot, {m: [2, L, M] int32}, for pages laid out as `pack_flat`'s
    and placed at `page_ids` {width: [n_w]} (pools absent: no pages). Unused entries are 0 (never
    read: past the rank)."""
    M, P, L = max_pages_per_module(lora), lora.page_rows, model.num_layers
    rows, cursor = {}, dict.fromkeys(page_ids, 0)
    for m in lora.target_modules:
        row = np.zeros((FACTORS, L, M), np.int32)
        per = -(-ranks.get(m, 0) // P)
        for f in range(FACTORS):
            if per:
                w = factor_width(model, m, f)
                ids = np.asarray(page_ids[w][cursor[w] : cursor[w] + L * per])
                if len(ids) != L * per:
                    raise ValueError(f"too few page ids for pool {w}")
                row[f, :, :per] = ids.reshape(L, per)
                cursor[w] += L * per
        rows[m] = row
    if any(cursor[w] != len(ids) for w, ids in page_ids.items()):
        raise ValueError(f"page ids { ({w: len(i) for w, i in page_ids.items()}) } for an adapter of {cursor} pages")
    return rows


def _write_pool(pool: jax.Array, page_ids, pages) -> jax.Array:
    # Out-of-range page ids (padding, the warm-up's) are dropped, not clamped.
    return pool.at[page_ids].set(pages.astype(pool.dtype), mode="drop")


def _write_slot(slot_state: tuple[dict, dict], slot, rows, ranks) -> tuple[dict, dict]:
    # An out-of-range slot (the warm-up's) is dropped.
    tables, old = slot_state
    tables = {m: t.at[:, :, slot].set(rows[m], mode="drop") for m, t in tables.items()}
    return tables, {m: r.at[slot].set(ranks[m], mode="drop") for m, r in old.items()}


# Donated: pages and table rows are written in place. One pool write per (pool, page count): the
# pager pads each count to a power of two, so a few programs per pool, all compiled at warm-up; the
# pools are written separately so the programs add up over pools rather than multiply.
write_pool = jax.jit(_write_pool, donate_argnums=0)
write_slot = jax.jit(_write_slot, donate_argnums=0)


def write_adapter(state: PagedState, slot, page_ids: Mapping, pages: Mapping, rows, ranks) -> PagedState:
    """`pages[w]` into pool w at `page_ids[w]` (pools absent: untouched), then slot `slot`'s table rows
    and ranks. Every array of `state` is donated."""
    pools = dict(state["pools"])
    for w, ids in page_ids.items():
        pools[w] = write_pool(pools[w], ids, pages[w])
    tables, new_ranks = write_slot((state["tables"], state["ranks"]), slot, rows, ranks)
    return {"pools": pools, "tables": tables, "ranks": new_ranks}


@functools.cache
def page_counts(max_pages: int) -> tuple[int, ...]:
    """The page counts a page write is compiled for: powers of two below `max_pages`, then it (the
    paged bank pads each write's count to one, `padded_size`; the unified bank cuts its adapters'
    pages into runs of them, `page_runs`)."""
    sizes, n = [], 1
    while n < max_pages:
        sizes.append(n)
        n *= 2
    return (*sizes, max_pages)


def write_sizes(model: ModelConfig, lora: LoraConfig) -> dict[int, tuple[int, ...]]:
    """The page counts `write_pool` is compiled for, per pool: powers of two up to the largest
    adapter's pages in that pool."""
    return {w: page_counts(n) for w, n in full_adapter_pages(model, lora).items()}


def page_runs(num_pages: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """`num_pages` cut into runs of compiled page counts, largest first (greedy: 75 pages over sizes
    1, 2, 4, ..., 64, 76 are runs of 64, 8, 2 and 1), so that each run is written without padding."""
    if num_pages < 1 or num_pages > max(sizes):
        raise ValueError(f"{num_pages} pages: need 1 to {max(sizes)}")
    runs, left = [], num_pages
    while left:
        runs.append(max(s for s in sizes if s <= left))
        left -= runs[-1]
    return tuple(runs)


def padded_size(num_pages: int, sizes: tuple[int, ...]) -> int:
    """The smallest compiled page count that holds `num_pages`."""
    return next(s for s in sizes if s >= num_pages)


def build_paged_bank(
    model: ModelConfig, lora: LoraConfig, adapters: list[Weights], dtype: jnp.dtype = jnp.float32, *, fill: float = 0.0
) -> PagedState:
    """A paged bank holding `adapters` in slots 1, 2, ... on consecutive pages of each pool (tests,
    benchmarks; the serving path allocates pages through `jaxlora.adapters.paged_pager`)."""
    state = init_paged_bank(model, lora, dtype, fill=fill)
    next_page = dict.fromkeys(state["pools"], 0)
    if len(adapters) >= lora.max_slots:
        raise ValueError(f"{len(adapters)} adapters need more than max_slots - 1 = {lora.max_slots - 1} slots")
    for slot, weights in enumerate(adapters, start=1):
        pages = {w: p for w, p in pack_pages(weights, model, lora, np.dtype(dtype)).items() if len(p)}
        ids = {w: np.arange(next_page[w], next_page[w] + len(p), dtype=np.int32) for w, p in pages.items()}
        for w, i in ids.items():
            if i[-1] >= state["pools"][w].shape[0]:
                raise ValueError(f"pool {w}'s {state['pools'][w].shape[0]} pages cannot hold these adapters")
            next_page[w] += len(i)
        ranks = module_ranks(weights, lora)
        rows = table_rows(ranks, ids, model, lora)
        state = write_adapter(state, np.int32(slot), ids, pages, rows, {m: np.int32(r) for m, r in ranks.items()})
    return state
