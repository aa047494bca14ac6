"""The production XLA backends of the LoRA contract in `api.py`: "xla" (gather a[slot] per token,
or per segment in prefill, then einsum; the default on CPU) and "ragged" (`lax.ragged_dot` over
rows sorted by slot). Both are checked against the naive `reference.py` loop like the kernels are.

Math (s = slot_ids[t]):
    shrink: h[t, :] = x[t, :] @ a[s]                   x [T, D], a [S, D, R] -> h [T, R]
    expand: y_new[t, :] = y[t, :] + h[t, :] @ b[s]     h [T, R], b [S, R, O], y [T, O] -> [T, O]
Products accumulate in float32; results come back in the dtype of x (shrink) or y (expand).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


# -- XLA gather + einsum ------------------------------------------------------------------------


def shrink_xla(x: jax.Array, a: jax.Array, slot_ids: jax.Array, seg_len: int | None = None) -> jax.Array:
    if seg_len is not None:
        # Prefill: gather one adapter per segment, not per token.
        xs = x.reshape(-1, seg_len, x.shape[1])  # [N, L, D]
        a_seg = a[slot_ids[::seg_len]]  # [N, D, R]
        h = jnp.einsum("nld,ndr->nlr", xs, a_seg, preferred_element_type=_F32)
        return h.reshape(x.shape[0], -1).astype(x.dtype)
    h = jnp.einsum("td,tdr->tr", x, a[slot_ids], preferred_element_type=_F32)  # a[slot_ids]: [T, D, R]
    return h.astype(x.dtype)


def expand_xla(y: jax.Array, h: jax.Array, b: jax.Array, slot_ids: jax.Array, seg_len: int | None = None) -> jax.Array:
    if seg_len is not None:
        hs = h.reshape(-1, seg_len, h.shape[1])  # [N, L, R]
        b_seg = b[slot_ids[::seg_len]]  # [N, R, O]
        delta = jnp.einsum("nlr,nro->nlo", hs, b_seg, preferred_element_type=_F32).reshape(y.shape)
    else:
        delta = jnp.einsum("tr,tro->to", h, b[slot_ids], preferred_element_type=_F32)  # b[slot_ids]: [T, R, O]
    return (y.astype(_F32) + delta).astype(y.dtype)


# -- lax.ragged_dot over rows sorted by slot -----------------------------------------------------


def sort_by_slot(slot_ids: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """slot_ids [T] -> (rows in stable slot order [T], rows per slot [S])."""
    order = jnp.argsort(slot_ids, stable=True)
    group_sizes = jnp.bincount(slot_ids, length=num_slots).astype(jnp.int32)
    return order, group_sizes


def shrink_ragged(x: jax.Array, a: jax.Array, slot_ids: jax.Array, sort: tuple | None = None) -> jax.Array:
    order, group_sizes = sort if sort is not None else sort_by_slot(slot_ids, a.shape[0])
    h_sorted = lax.ragged_dot(x[order], a, group_sizes, preferred_element_type=_F32)
    h = jnp.zeros_like(h_sorted).at[order].set(h_sorted)
    return h.astype(x.dtype)


def expand_ragged(
    y: jax.Array, h: jax.Array, b: jax.Array, slot_ids: jax.Array, sort: tuple | None = None
) -> jax.Array:
    order, group_sizes = sort if sort is not None else sort_by_slot(slot_ids, b.shape[0])
    delta_sorted = lax.ragged_dot(h[order], b, group_sizes, preferred_element_type=_F32)
    delta = jnp.zeros_like(delta_sorted).at[order].set(delta_sorted)
    return (y.astype(_F32) + delta).astype(y.dtype)
