"""The decode-attention kernel against the dense reference: interpret mode on CPU, CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import decode_attention
from pallas_kernels.reference import decode_attention_reference

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)


def _data(seed, *, layers, rows, max_len, kv_heads, heads, head_dim, batch, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shape = (layers, rows, max_len, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((batch, heads, head_dim)) * 2, dtype)
    return q, k, v


@pytest.mark.parametrize(
    "shape",
    [
        # awkward length (37, not a block multiple), GQA group 3, fewer batch rows than cache rows
        dict(layers=3, rows=5, max_len=37, kv_heads=2, heads=6, head_dim=16, batch=4, block_t=16),
        # multi-head (no grouping), lengths past the end (idle rows) clamp to the whole row
        dict(layers=2, rows=4, max_len=64, kv_heads=4, heads=4, head_dim=32, batch=4, block_t=32),
    ],
)
def test_matches_reference_on_random_lengths(shape):
    block_t = shape.pop("block_t")
    q, k, v = _data(0, **shape)
    rng = np.random.default_rng(1)
    lengths = jnp.asarray(rng.integers(1, shape["max_len"] + 4, shape["batch"]), jnp.int32)
    lengths = lengths.at[0].set(1)  # one key only: softmax of a single score is 1
    for layer in (0, shape["layers"] - 1):
        out = decode_attention(q, k, v, jnp.int32(layer), lengths, block_t=block_t, interpret=True)
        ref = decode_attention_reference(q, k, v, layer, lengths)
        np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(
        out[0], jnp.repeat(v[layer, 0, 0], shape["heads"] // shape["kv_heads"], axis=0), atol=1e-6
    )


def test_positions_past_the_length_are_never_read():
    q, k, v = _data(2, layers=1, rows=2, max_len=32, kv_heads=1, heads=2, head_dim=16, batch=2)
    lengths = jnp.array([5, 20], jnp.int32)
    poisoned_k = k.at[:, 0, 5:].set(jnp.nan).at[:, 1, 20:].set(jnp.nan)
    poisoned_v = v.at[:, 0, 5:].set(jnp.nan).at[:, 1, 20:].set(jnp.nan)
    out = decode_attention(q, poisoned_k, poisoned_v, jnp.int32(0), lengths, block_t=16, interpret=True)
    np.testing.assert_allclose(out, decode_attention_reference(q, k, v, 0, lengths), atol=2e-6, rtol=2e-6)


def test_bf16_inside_a_scan_over_layers():
    """The layer index is traced (a scan's counter), as in the model."""
    q, k, v = _data(3, layers=3, rows=3, max_len=24, kv_heads=2, heads=4, head_dim=16, batch=3, dtype=jnp.bfloat16)
    lengths = jnp.array([24, 7, 13], jnp.int32)

    def body(_, layer):
        return None, decode_attention(q, k, v, layer, lengths, block_t=16, interpret=True)

    _, outs = jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))
    for layer in range(3):
        ref = decode_attention_reference(q, k, v, layer, lengths)
        np.testing.assert_allclose(outs[layer].astype(np.float32), ref.astype(np.float32), atol=2e-2, rtol=2e-2)


def test_bad_shapes_are_refused():
    q, k, v = _data(4, layers=1, rows=2, max_len=16, kv_heads=2, heads=4, head_dim=16, batch=2)
    lengths = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, v, jnp.int32(0), lengths, block_t=24, interpret=True)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, k, v, jnp.int32(0), jnp.ones((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q[:, :3], k, v, jnp.int32(0), lengths, interpret=True)


def test_lowers_for_cuda():
    q, k, v = _data(5, layers=2, rows=8, max_len=256, kv_heads=8, heads=32, head_dim=128, batch=8, dtype=jnp.bfloat16)
    fn = lambda q, k, v, layer, n: decode_attention(q, k, v, layer, n)  # noqa: E731
    layer, lengths = jnp.int32(1), jnp.full((8,), 9, jnp.int32)
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(fn).trace(q, k, v, layer, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
