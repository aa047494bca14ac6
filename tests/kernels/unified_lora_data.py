"""Random adapters stored in a KV pool's pages as unified runs, NaN wherever a kernel must not read.

Each slot's run holds, per module, a gap, A^T's rank-rows, a gap, B's rank-rows (gaps of random
length, NaN, each factor starting at a multiple of `align` as the kernels require); its pages come from a shuffled free list; free pages, the gaps and each run's last
page's tail hold NaN; page-table entries past a slot's pages are garbage ints (out of range too);
page 0 is always free. Every layer holds different values, so a read of the wrong layer shows. The
true factors are kept, to check the reference against them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests.kernels.kernel_data import random_array


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnifiedModule:
    """One module's factors of every slot, by their place in the runs."""

    a_offsets: jax.Array  # [S] int32
    b_offsets: jax.Array  # [S] int32
    ranks: jax.Array  # [S] int32
    a: list  # per slot: [L, r, hidden] float32 A^T rank-rows (what the run holds)
    b: list  # per slot: [L, r, out] float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnifiedPool:
    k: jax.Array  # [L, N, page_size, kv_heads, head_dim]
    v: jax.Array
    pages: jax.Array  # [S, MP] int32
    modules: list[UnifiedModule]
    align: int  # every offset is a multiple of it (the kernels' `align`)


def unified_pool(
    rng,
    module_ranks,
    widths,
    *,
    layers=2,
    page_size=4,
    kv_heads=2,
    head_dim=8,
    max_pages=None,
    dtype=jnp.float32,
    spare=3,
    align=8,
) -> UnifiedPool:
    """Slots with `module_ranks[s][j]` the rank of module j (widths[j] = (hidden, out)) in a KV pool of
    segments page_size * kv_heads * head_dim long (default 64: rank-rows straddle segments)."""
    seg = page_size * kv_heads * head_dim
    runs, offsets, factors = [], [], []
    for ranks in module_ranks:
        parts, offs, facs, cursor = [], [], [], 0
        for r, (hidden, out) in zip(ranks, widths, strict=True):
            pair_offs, pair = [], []
            for cols in (hidden, out):
                gap = -cursor % align + align * int(rng.integers(0, 3))
                parts.append(np.full((layers, gap), np.nan, np.float32))
                cursor += gap
                rows = np.asarray(random_array(rng, (layers, int(r), cols), jnp.float32, 1.0 / np.sqrt(cols)))
                parts.append(rows.reshape(layers, -1))
                pair_offs.append(cursor)
                pair.append(rows)
                cursor += int(r) * cols
            offs.append(pair_offs)
            facs.append(pair)
        runs.append(np.concatenate(parts, axis=1) if parts else np.zeros((layers, 0), np.float32))
        offsets.append(offs)
        factors.append(facs)
    need = [-(-run.shape[1] // (2 * seg)) for run in runs]
    max_pages = max_pages or max(max(need), 1)
    num_pages = 1 + sum(need) + spare
    k = np.full((layers, num_pages, seg), np.nan, np.float32)
    v = np.full((layers, num_pages, seg), np.nan, np.float32)
    free = rng.permutation(np.arange(1, num_pages))
    pages = rng.integers(-50, num_pages + 50, size=(len(runs), max_pages)).astype(np.int32)
    taken = 0
    for s, run in enumerate(runs):
        padded = np.full((layers, need[s] * 2 * seg), np.nan, np.float32)
        padded[:, : run.shape[1]] = run
        for i in range(need[s]):
            page = free[taken]
            taken += 1
            pages[s, i] = page
            k[:, page] = padded[:, (2 * i) * seg : (2 * i + 1) * seg]
            v[:, page] = padded[:, (2 * i + 1) * seg : (2 * i + 2) * seg]
    modules = []
    for j in range(len(widths)):
        modules.append(
            UnifiedModule(
                a_offsets=jnp.asarray([o[j][0] for o in offsets], jnp.int32),
                b_offsets=jnp.asarray([o[j][1] for o in offsets], jnp.int32),
                ranks=jnp.asarray([ranks[j] for ranks in module_ranks], jnp.int32),
                a=[f[j][0] for f in factors],
                b=[f[j][1] for f in factors],
            )
        )
    shape = (layers, num_pages, page_size, kv_heads, head_dim)
    return UnifiedPool(
        k=jnp.asarray(k.reshape(shape), dtype),
        v=jnp.asarray(v.reshape(shape), dtype),
        pages=jnp.asarray(pages),
        modules=modules,
        align=align,
    )
