"""The interface the model calls: every backend computes the same thing; bad input raises ValueError."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.kernels.kernel_data import assert_close, random_array


@pytest.mark.parametrize("seg_len", [None, 4])
def test_backends_agree(rng, seg_len):
    dtype, tokens, hidden, rank, outs, slots_n = jnp.bfloat16, 16, 96, 8, (40, 24), 5
    x = random_array(rng, (tokens, hidden), dtype)
    a = random_array(rng, (slots_n, hidden, 2 * rank), dtype, 0.1).at[0].set(0)
    bs = tuple(random_array(rng, (slots_n, rank, o), dtype, 0.3).at[0].set(0) for o in outs)
    ys = tuple(random_array(rng, (tokens, o), dtype) for o in outs)
    units = tokens if seg_len is None else tokens // seg_len
    slots = jnp.asarray(np.repeat(rng.integers(0, slots_n, units), tokens // units).astype(np.int32))

    def run(backend, interpret=False):
        fn = jax.jit(lambda x, a, ys, bs, s: (lambda h: (h, pk.lora_expand_multi(
            ys, h, bs, s, backend=backend, interpret=interpret, seg_len=seg_len)))(
            pk.lora_shrink(x, a, s, backend=backend, interpret=interpret, seg_len=seg_len)))
        return fn(x, a, ys, bs, slots)

    h_ref, ys_ref = run("loop")
    for backend, interpret in [("xla", False), ("ragged", False), ("onehot", False), ("pallas", True)]:
        h, ys_new = run(backend, interpret)
        assert_close(h, h_ref, dtype)
        for got, want in zip(ys_new, ys_ref):
            assert_close(got, want, dtype)


def test_bad_input_raises(rng):
    x = random_array(rng, (8, 16), jnp.float32)
    a = random_array(rng, (3, 16, 4), jnp.float32)
    slots = jnp.zeros(8, jnp.int32)
    with pytest.raises(ValueError, match="backend"):
        pk.lora_shrink(x, a, slots, backend="cuda")
    with pytest.raises(ValueError, match="seg_len"):
        pk.lora_shrink(x, a, slots, backend="xla", seg_len=3)
    with pytest.raises(ValueError, match="shrink needs"):
        pk.lora_shrink(x, a[:, :8], slots, backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="G\\*R"):
        pk.lora_expand_multi((x, x), x[:, :5], (a[:, :2, :16], a[:, :2, :16]), slots, backend="xla")
    with pytest.raises(ValueError, match="h_col"):
        pk.bgmv_expand(x, x[:, :4], random_array(rng, (3, 4, 16), jnp.float32), slots, h_col=2, interpret=True)
