"""Reference for the unified-pool LoRA kernels (`unified`): on the host, lay each slot's segments end
to end (k then v of each listed page, at the layer) into one array, cut the factor out of it at its
offset and reshape it to [rank, width], then multiply densely. Shares no index math with the kernels
(no division of offsets into segments and pages)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def run_of(k, v, layer: int, page_ids) -> np.ndarray:
    """The run of a slot holding `page_ids`, at `layer`: its segments concatenated, float32."""
    k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
    parts = [half[layer, p].reshape(-1) for p in page_ids for half in (k, v)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.float32)


def factor(k, v, layer: int, page_ids, offset: int, rank: int, width: int) -> np.ndarray:
    """[rank, width] float32: the rank-rows of one factor, read from the slot's run."""
    per_page = 2 * int(np.prod(np.shape(k)[2:]))
    run = run_of(k, v, layer, list(page_ids)[: -(-(offset + rank * width) // per_page)])
    return run[offset : offset + rank * width].reshape(rank, width)


def unified_shrink_reference(x, k, v, layer, pages, offsets, ranks, adapter_ids, *, max_rank: int) -> jnp.ndarray:
    """h [T, max_rank] = x @ A of each row's slot (f32 products, x.dtype); slot -1 gives 0."""
    x32, layer = np.asarray(x, np.float32), int(layer)
    pages, offsets, ranks = np.asarray(pages), np.asarray(offsets), np.asarray(ranks)
    h = np.zeros((x32.shape[0], max_rank), np.float32)
    for t, s in enumerate(np.asarray(adapter_ids)):
        if s >= 0 and ranks[s]:
            a_t = factor(k, v, layer, pages[s], int(offsets[s]), int(ranks[s]), x32.shape[1])
            h[t, : ranks[s]] = a_t @ x32[t]
    return jnp.asarray(h, x.dtype)


def unified_expand_reference(y, h, k, v, layer, pages, offsets, ranks, adapter_ids) -> jnp.ndarray:
    """y + h[:, :rank] @ B of each row's slot (f32), y.dtype; slot -1 leaves the row."""
    out, layer = np.asarray(y, np.float32).copy(), int(layer)
    h32 = np.asarray(h, np.float32)
    pages, offsets, ranks = np.asarray(pages), np.asarray(offsets), np.asarray(ranks)
    for t, s in enumerate(np.asarray(adapter_ids)):
        if s >= 0 and ranks[s]:
            b = factor(k, v, layer, pages[s], int(offsets[s]), int(ranks[s]), out.shape[1])
            out[t] += h32[t, : ranks[s]] @ b
    return jnp.asarray(out, y.dtype)
