"""The naive references and the XLA backends, checked by hand and against the loop reference (which
shares no code with the kernels or the backends)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora import reference, xla
from tests.kernels.kernel_data import random_array
from tests.tolerances import assert_close


def test_hand_computed_case():
    # x = [[1, 2], [3, 4]], slots [1, 0]; a[1] = [[1, 0], [1, 1]] -> h[0] = [1+2, 2] = [3, 2], h[1] = 0.
    # b[1] = [[1, 1, 0], [0, 1, 2]] -> delta[0] = [3, 3+2, 4] = [3, 5, 4]; y = 10 everywhere.
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    a = jnp.stack([jnp.zeros((2, 2)), jnp.array([[1.0, 0.0], [1.0, 1.0]])])
    b = jnp.stack([jnp.zeros((2, 3)), jnp.array([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]])])
    slots = jnp.array([1, 0], jnp.int32)
    y = jnp.full((2, 3), 10.0)
    for shrink, expand in [
        (reference.shrink_loop, reference.expand_loop),
        (xla.shrink_xla, xla.expand_xla),
        (reference.shrink_onehot, reference.expand_onehot),
        (xla.shrink_ragged, xla.expand_ragged),
    ]:
        h = shrink(x, a, slots)
        np.testing.assert_array_equal(h, [[3.0, 2.0], [0.0, 0.0]])
        np.testing.assert_array_equal(expand(y, h, b, slots), [[13.0, 15.0, 14.0], [10.0, 10.0, 10.0]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seg_len", [None, 4])
def test_references_agree(rng, dtype, seg_len):
    num_tokens, hidden, rank, out_dim, num_slots = 16, 40, 8, 24, 6
    x = random_array(rng, (num_tokens, hidden), dtype)
    a = random_array(rng, (num_slots, hidden, rank), dtype, 0.2).at[0].set(0)
    b = random_array(rng, (num_slots, rank, out_dim), dtype, 0.3).at[0].set(0)
    y = random_array(rng, (num_tokens, out_dim), dtype)
    if seg_len is None:
        slots = jnp.asarray(rng.integers(0, num_slots, num_tokens), jnp.int32)
    else:
        slots = jnp.repeat(jnp.asarray(rng.integers(0, num_slots, num_tokens // seg_len), jnp.int32), seg_len)
    h_ref = reference.shrink_loop(x, a, slots)
    y_ref = reference.expand_loop(y, h_ref, b, slots)
    assert_close(xla.shrink_xla(x, a, slots, seg_len), h_ref, dtype)
    assert_close(xla.expand_xla(y, h_ref, b, slots, seg_len), y_ref, dtype)
    for shrink, expand in [
        (reference.shrink_onehot, reference.expand_onehot),
        (xla.shrink_ragged, xla.expand_ragged),
    ]:
        assert_close(shrink(x, a, slots), h_ref, dtype)
        assert_close(expand(y, h_ref, b, slots), y_ref, dtype)
