"""Reference for the paged LoRA kernels (`paged`): rebuild each adapter's dense factors from the pool
by walking its page table on the host, then multiply densely. Shares no index math with the kernels:
an adapter's rank-rows are its listed pages stacked end to end, cut at its rank."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def dense_factors(pool, table, ranks, cols: int) -> np.ndarray:
    """[N, C, cols] float32: adapter n's rank-rows (A^T or B), zero past its rank; C = M * P.

    pool [num_pages, P, W]; table [N, M] page ids; ranks [N]."""
    pool, table, ranks = np.asarray(pool, np.float32), np.asarray(table), np.asarray(ranks)
    max_rank = table.shape[1] * pool.shape[1]
    dense = np.zeros((table.shape[0], max_rank, cols), np.float32)
    for n in range(table.shape[0]):
        rows = []
        for page_id in table[n]:
            if len(rows) >= ranks[n]:
                break
            rows.extend(pool[page_id, :, :cols])
        dense[n, : ranks[n]] = np.stack(rows[: ranks[n]]) if ranks[n] else dense[n, :0]
    return dense


def paged_shrink_reference(x, pool, table, ranks, adapter_ids) -> jnp.ndarray:
    """h [T, M * P] = x @ A_n per row (f32 products, x.dtype result); adapter -1 gives 0."""
    a_t = dense_factors(pool, table, ranks, x.shape[1])  # [N, C, D]
    ids = np.asarray(adapter_ids)
    h = np.zeros((x.shape[0], a_t.shape[1]), np.float32)
    for t, n in enumerate(ids):
        if n >= 0:
            h[t] = np.einsum("d,cd->c", np.asarray(x[t], np.float32), a_t[n])
    return jnp.asarray(h, x.dtype)


def paged_expand_reference(y, h, pool, table, ranks, adapter_ids) -> jnp.ndarray:
    """y + h[:, :rank] @ B_n per row (f32), y.dtype; adapter -1 leaves the row."""
    b = dense_factors(pool, table, ranks, y.shape[1])  # [N, C, O]
    ids = np.asarray(adapter_ids)
    out = np.asarray(y, np.float32).copy()
    hf = np.asarray(h, np.float32)
    for t, n in enumerate(ids):
        if n >= 0:
            r = int(np.asarray(ranks)[n])
            out[t] += np.einsum("c,co->o", hf[t, :r], b[n, :r])
    return jnp.asarray(out, y.dtype)
