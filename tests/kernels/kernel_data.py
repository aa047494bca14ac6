"""Shared data builders for the kernel tests: random (never zero) inputs, NaN where nothing may read.

Results are compared with `tests.tolerances.assert_close` (the one tolerance table)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def random_array(rng: np.random.Generator, shape, dtype, scale: float = 1.0):
    """Normal values shifted away from zero, so an unwritten output or a skipped term shows."""
    values = rng.standard_normal(shape) * scale
    values = np.where(np.abs(values) < 0.05 * scale, 0.05 * scale, values)
    return jnp.asarray(values, dtype)


def bank(rng, num_slots: int, shape, dtype, used_slots, *, nan_slot0: bool = False):
    """[S, *shape] bank: random in used slots, NaN in every other slot; slot 0 zero (or NaN)."""
    scale = 1.0 / np.sqrt(shape[0])
    full = np.full((num_slots, *shape), np.nan, np.float32)
    for s in set(int(s) for s in np.asarray(used_slots)) - {0}:
        full[s] = np.asarray(random_array(rng, shape, jnp.float32, scale))
    full[0] = np.nan if nan_slot0 else 0.0
    return jnp.asarray(full, dtype)


def zero_slot0(arr):
    return arr.at[0].set(0)
