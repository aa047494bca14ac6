"""The unified-pool LoRA shrink and expand in plain XLA: a gather of the factors out of the KV pool,
then batched products. Same operands and results as `unified` (see its module doc for the layout);
the engine's path where the Pallas kernels are not asked for (CPU by default), and the baseline the
kernels are timed against.

    factor[n, r, c] = run_n[offset_n + r * width + c]     r < max_rank, c < width  (0 past the rank)
    unified_shrink_xla:  h[t, r]  = sum_c x[t, c] * factor[slot_t, r, c]
    unified_expand_xla:  y[t, o] + sum_r h[t, r] * factor[slot_t, r, o]

The gather reads the pool in place ((layer, chunk) pairs into its [L, N * E / c, c] view, c elements
a chunk as the kernels load them), so it neither copies a layer out of the pool nor blocks the step's
in-place KV writes. It gathers per slot when
there are no more slots than token rows and the products over every slot stay small (every slot's
factor once, S x max_rank x width elements gathered, then [T, S, ...] products of which each row
keeps its own), else per token row (T x max_rank x width).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.lora.common import is_pow2
from pallas_kernels.lora.unified import check_unified, chunk_size

F32 = jnp.float32
# The largest [T, S, max(rank, width)] product the per-slot gather may build (float32: 64 MB).
PER_SLOT_MAX_ELEMENTS = 2**24


def _check_align(align: int) -> None:
    if not is_pow2(align):
        raise ValueError(f"align={align} must be a power of two")


def _row_ranks(ranks, adapter_ids) -> jax.Array:
    """[T] each token row's rank (0 for the base model, -1)."""
    return jnp.where(adapter_ids >= 0, ranks[jnp.maximum(adapter_ids, 0)], 0)


def _factors(k, v, layer, pages, offsets, rank, rows: int, width: int, align: int) -> jax.Array:
    """[n, rows, width] float32 factors of the runs whose page rows, offsets and ranks are `pages`
    [n, MP], `offsets` [n] and `rank` [n]; 0 past each rank.

    Read in chunks of c elements, c the largest power of two dividing the width, a segment and
    `align` (which every offset is a multiple of): a chunk never crosses a segment, so one index a
    chunk picks it out of the pool's [L, N * E / c, c] view, and the gather moves c elements at a
    time instead of one (c = 1 when align is 1)."""
    seg = math.prod(k.shape[2:])
    c = chunk_size(width, seg, align, block=1 << 30)
    r = jnp.arange(rows, dtype=jnp.int32)
    j = jnp.arange(width // c, dtype=jnp.int32)
    offs = offsets[:, None, None] + r[None, :, None] * width + j[None, None, :] * c  # [n, rows, width / c]
    valid = (r[None, :] < rank[:, None])[:, :, None]
    segment = jnp.where(valid, offs // seg, 0)
    page = jnp.take_along_axis(pages, (segment // 2).reshape(len(pages), -1), axis=1, mode="clip")
    # Chunk indices within one layer ([L, N * E / c, c] views): int32 holds them (check_unified),
    # where a flat index over every layer would not for a pool of 2^31 elements or more.
    index = (page.reshape(segment.shape) * seg + offs % seg) // c
    from_k = k.reshape(k.shape[0], -1, c).at[layer, index].get(mode="fill", fill_value=0)
    from_v = v.reshape(v.shape[0], -1, c).at[layer, index].get(mode="fill", fill_value=0)
    picked = jnp.where((segment % 2 == 1)[..., None], from_v, from_k).reshape(*offs.shape[:2], width)
    return jnp.where(valid, picked.astype(F32), 0.0)


def _per_row(k, v, layer, pages, offsets, ranks, adapter_ids, rows: int, width: int, align: int):
    """(factors, per_slot, slot): every slot's factors [S, rows, width] (per_slot, when S <= T), else
    every token row's [T, rows, width]; slot [T] each row's slot (-1 rows: slot 0, masked by callers)."""
    num_rows, num_slots = adapter_ids.shape[0], pages.shape[0]
    slot = jnp.maximum(adapter_ids, 0)
    if num_slots <= num_rows and num_rows * num_slots * max(rows, width) <= PER_SLOT_MAX_ELEMENTS:
        return _factors(k, v, layer, pages, offsets, ranks, rows, width, align), True, slot
    rank = _row_ranks(ranks, adapter_ids)
    return _factors(k, v, layer, pages[slot], offsets[slot], rank, rows, width, align), False, slot


def unified_shrink_xla(
    x, k, v, layer, pages, offsets, ranks, adapter_ids, *, max_rank: int, align: int = 1
) -> jax.Array:
    """`unified.unified_shrink` through XLA: h [T, max_rank] in x.dtype, 0 at and past each rank.
    align: a power of two every offset is a multiple of (the caller's promise; 1 promises nothing)."""
    check_unified(x, k, v, pages, offsets, ranks, adapter_ids)
    _check_align(align)
    a_t, per_slot, slot = _per_row(k, v, layer, pages, offsets, ranks, adapter_ids, max_rank, x.shape[1], align)
    xf = x.astype(F32)
    if per_slot:
        every = jnp.einsum("tc,src->tsr", xf, a_t)
        h = jnp.take_along_axis(every, slot[:, None, None], axis=1)[:, 0]
        h = jnp.where((adapter_ids >= 0)[:, None], h, 0.0)
    else:
        h = jnp.einsum("tc,trc->tr", xf, a_t)
    return h.astype(x.dtype)


def unified_expand_xla(y, h, k, v, layer, pages, offsets, ranks, adapter_ids, *, align: int = 1) -> jax.Array:
    """`unified.unified_expand` through XLA: y + h[:, :rank] @ B per row, in y.dtype (align: as the
    shrink's)."""
    check_unified(y, k, v, pages, offsets, ranks, adapter_ids)
    _check_align(align)
    if h.ndim != 2 or h.shape[0] != y.shape[0]:
        raise ValueError(f"h {h.shape} must be [T, C] for y {y.shape}")
    # Columns at and past a row's rank are not read (they may hold anything, NaN included).
    live = jnp.arange(h.shape[1])[None, :] < _row_ranks(ranks, adapter_ids)[:, None]
    hf = jnp.where(live, h.astype(F32), 0.0)
    b, per_slot, slot = _per_row(k, v, layer, pages, offsets, ranks, adapter_ids, h.shape[1], y.shape[1], align)
    if per_slot:
        every = jnp.einsum("tr,sro->tso", hf, b)
        delta = jnp.take_along_axis(every, slot[:, None, None], axis=1)[:, 0]
    else:
        delta = jnp.einsum("tr,tro->to", hf, b)
    return (y.astype(F32) + delta).astype(y.dtype)
