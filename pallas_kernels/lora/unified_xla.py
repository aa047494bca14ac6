"""The unified-pool LoRA shrink and expand in plain XLA: one gather of every row's factor out of the
KV pool, then a batched product. Same operands and results as `unified` (see its module doc for the
layout); the engine's path where the Pallas kernels are not asked for (CPU by default), and the
baseline the kernels are timed against.

    factor[t, r, c] = run_t[offset_t + r * width + c]     r < max_rank, c < width  (0 past the rank)
    unified_shrink_xla:  h[t, r]  = sum_c x[t, c] * factor[t, r, c]
    unified_expand_xla:  y[t, o] + sum_r h[t, r] * factor[t, r, o]

The gather reads the pool in place (flat indices into the whole [L, N, ...] array, the layer folded
in), so it neither copies a layer out of the pool nor blocks the step's in-place KV writes. It
materializes [T, max_rank, width]: fine for CPU batches; the kernels avoid it on GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.lora.unified import check_unified

F32 = jnp.float32


def _row_ranks(ranks, adapter_ids) -> jax.Array:
    """[T] each token row's rank (0 for the base model, -1)."""
    return jnp.where(adapter_ids >= 0, ranks[jnp.maximum(adapter_ids, 0)], 0)


def _factor(k, v, layer, pages, offsets, ranks, adapter_ids, rows: int, width: int) -> jax.Array:
    """[T, rows, width] float32: each token row's factor rank-rows, 0 past its rank (and for -1)."""
    seg = math.prod(k.shape[2:])
    per_layer = k.shape[1] * seg
    slot = jnp.maximum(adapter_ids, 0)
    rank = _row_ranks(ranks, adapter_ids)
    r = jnp.arange(rows, dtype=jnp.int32)
    c = jnp.arange(width, dtype=jnp.int32)
    offs = offsets[slot][:, None, None] + r[None, :, None] * width + c[None, None, :]  # [T, rows, width]
    valid = (r[None, :] < rank[:, None])[:, :, None]
    segment = jnp.where(valid, offs // seg, 0)
    page = jnp.take_along_axis(pages[slot], (segment // 2).reshape(len(slot), -1), axis=1, mode="clip")
    index = layer * per_layer + page.reshape(segment.shape) * seg + offs % seg
    from_k = jnp.take(k.reshape(-1), index, mode="fill", fill_value=0)
    from_v = jnp.take(v.reshape(-1), index, mode="fill", fill_value=0)
    picked = jnp.where(segment % 2 == 1, from_v, from_k)
    return jnp.where(valid, picked.astype(F32), 0.0)


def unified_shrink_xla(x, k, v, layer, pages, offsets, ranks, adapter_ids, *, max_rank: int) -> jax.Array:
    """`unified.unified_shrink` through XLA: h [T, max_rank] in x.dtype, 0 at and past each rank."""
    check_unified(x, k, v, pages, offsets, ranks, adapter_ids)
    a_t = _factor(k, v, layer, pages, offsets, ranks, adapter_ids, max_rank, x.shape[1])
    return jnp.einsum("tc,trc->tr", x.astype(F32), a_t).astype(x.dtype)


def unified_expand_xla(y, h, k, v, layer, pages, offsets, ranks, adapter_ids) -> jax.Array:
    """`unified.unified_expand` through XLA: y + h[:, :rank] @ B per row, in y.dtype."""
    check_unified(y, k, v, pages, offsets, ranks, adapter_ids)
    if h.ndim != 2 or h.shape[0] != y.shape[0]:
        raise ValueError(f"h {h.shape} must be [T, C] for y {y.shape}")
    b = _factor(k, v, layer, pages, offsets, ranks, adapter_ids, h.shape[1], y.shape[1])
    # Columns at and past a row's rank are not read (they may hold anything, NaN included).
    live = jnp.arange(h.shape[1])[None, :] < _row_ranks(ranks, adapter_ids)[:, None]
    hf = jnp.where(live, h.astype(F32), 0.0)
    delta = jnp.einsum("tr,tro->to", hf, b)
    return (y.astype(F32) + delta).astype(y.dtype)
