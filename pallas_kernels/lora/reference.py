"""Reference LoRA shrink / expand for tests: naive on purpose, sharing no index math with the kernels.

`loop` (a Python loop over rows) is what every kernel and backend is checked against; `onehot`
(every row through every slot, then a one-hot pick) is a second, differently built check. The
production XLA backends (`xla`, `ragged`, the CPU default) are in `xla.py`.

Math (every backend computes exactly this; s = slot_ids[t]):
    shrink: h[t, :] = x[t, :] @ a[s]                   x [T, D], a [S, D, R] -> h [T, R]
    expand: y_new[t, :] = y[t, :] + h[t, :] @ b[s]     h [T, R], b [S, R, O], y [T, O] -> [T, O]
Products accumulate in float32; results come back in the dtype of x (shrink) or y (expand).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


# -- a Python loop over rows (tests only: T is unrolled) ------------------------------------------


def shrink_loop(x: jax.Array, a: jax.Array, slot_ids: jax.Array) -> jax.Array:
    rows = [jnp.dot(x[t].astype(_F32), a[slot_ids[t]].astype(_F32), precision=_HIGHEST) for t in range(x.shape[0])]
    return jnp.stack(rows).astype(x.dtype)


def expand_loop(y: jax.Array, h: jax.Array, b: jax.Array, slot_ids: jax.Array) -> jax.Array:
    rows = [
        y[t].astype(_F32) + jnp.dot(h[t].astype(_F32), b[slot_ids[t]].astype(_F32), precision=_HIGHEST)
        for t in range(y.shape[0])
    ]
    return jnp.stack(rows).astype(y.dtype)


# -- one-hot einsum -----------------------------------------------------------------------------


def shrink_onehot(x: jax.Array, a: jax.Array, slot_ids: jax.Array) -> jax.Array:
    onehot = jax.nn.one_hot(slot_ids, a.shape[0], dtype=x.dtype)  # [T, S]
    xa = jnp.einsum("td,sdr->tsr", x, a, preferred_element_type=_F32)  # every row through every slot
    return jnp.einsum("tsr,ts->tr", xa, onehot.astype(_F32)).astype(x.dtype)


def expand_onehot(y: jax.Array, h: jax.Array, b: jax.Array, slot_ids: jax.Array) -> jax.Array:
    onehot = jax.nn.one_hot(slot_ids, b.shape[0], dtype=h.dtype)  # [T, S]
    h_per_slot = jnp.einsum("tr,ts->tsr", h, onehot)  # zero outside each row's slot
    delta = jnp.einsum("tsr,sro->to", h_per_slot, b, preferred_element_type=_F32)
    return (y.astype(_F32) + delta).astype(y.dtype)
