"""Random adapters stored at true rank in a shuffled page pool, NaN wherever a kernel must not read.

Pages are handed out in shuffled order; free pages, the rank-rows of an adapter's last page past its
rank, and the pool's columns past a factor's width hold NaN; table entries past an adapter's pages
are garbage ints (out of range too); page 0 is always free (NaN).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests.kernels.kernel_data import random_array


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedModule:
    """One module's LoRA of N adapters in one pool."""

    pool: jax.Array  # [num_pages, P, W]
    a_table: jax.Array  # [N, M] int32 pages of A^T rank-rows
    b_table: jax.Array  # [N, M] int32 pages of B rank-rows
    ranks: jax.Array  # [N] int32


def paged_module(rng, ranks, *, hidden: int, out: int, page_rows: int, max_pages: int, dtype, spare: int = 3):
    """Adapters of `ranks` (A^T rows `hidden` wide, B rows `out` wide) in a shuffled, NaN-poisoned pool."""
    ranks = np.asarray(ranks, np.int32)
    need = [-(-int(r) // page_rows) for r in ranks]
    width = max(hidden, out) + 3  # columns past a factor's width: poison
    num_pages = 1 + 2 * sum(need) + spare
    pool = np.full((num_pages, page_rows, width), np.nan, np.float32)
    free = rng.permutation(np.arange(1, num_pages))  # page 0 stays free
    tables = rng.integers(-50, num_pages + 50, size=(2, len(ranks), max_pages)).astype(np.int32)
    taken = 0
    for n, r in enumerate(ranks):
        for f, cols in enumerate((hidden, out)):
            rows = np.asarray(random_array(rng, (int(r), cols), jnp.float32, 1.0 / np.sqrt(cols)))
            for j in range(need[n]):
                page = free[taken]
                taken += 1
                tables[f, n, j] = page
                chunk = rows[j * page_rows : (j + 1) * page_rows]
                pool[page, : len(chunk), :cols] = chunk
    return PagedModule(
        pool=jnp.asarray(pool, dtype),
        a_table=jnp.asarray(tables[0]),
        b_table=jnp.asarray(tables[1]),
        ranks=jnp.asarray(ranks),
    )


def nan_past_rank(h, ranks, adapter_ids):
    """h with NaN in every column at or past its row's rank (what the expand must not read)."""
    ranks, ids = np.asarray(ranks), np.asarray(adapter_ids)
    row_rank = np.where(ids >= 0, ranks[np.maximum(ids, 0)], 0)
    cols = np.arange(h.shape[1])
    return jnp.where(jnp.asarray(cols[None, :] < row_rank[:, None]), h, jnp.nan)
