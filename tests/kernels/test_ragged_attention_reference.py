"""The ragged paged-attention reference, checked by hand and against a Python loop over tokens."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.kernels.paged_data import ragged_batch
from tests.tolerances import assert_close


def test_hand_computed_case():
    # One head, Dh = 2 (scale 1/sqrt(2)), page_size 1. Sequence 0 is a two-token prompt (kv_len 2)
    # at flat rows 0-1: position 0 lives in page 2, position 1 in page 0; page 1 is NaN.
    # q = [sqrt(2), 0], so a score is k[0]: keys [0, 5] and [ln 3, 7] score 0 and ln 3.
    # Row 0 (position 0) sees only v0 = [4, 8].
    # Row 1 (position 1) weighs 1/4, 3/4: 1/4 [4, 8] + 3/4 [8, -4] = [1 + 6, 2 - 3] = [7, -1].
    # Row 2 is padding -> 0. Sequence 1 has no tokens and a garbage table.
    nan = math.nan
    k = jnp.array([[[[[math.log(3), 7.0]]], [[[nan, nan]]], [[[0.0, 5.0]]]]])  # [L=1, P=3, 1, 1, 2]
    v = jnp.array([[[[[8.0, -4.0]]], [[[nan, nan]]], [[[4.0, 8.0]]]]])
    q = jnp.array([[[math.sqrt(2), 0.0]], [[math.sqrt(2), 0.0]], [[nan, nan]]])  # [T=3, H=1, 2]
    out = ragged_paged_attention_reference(
        q,
        k,
        v,
        jnp.int32(0),
        q_start=jnp.array([0, 7], jnp.int32),
        q_len=jnp.array([2, 0], jnp.int32),
        kv_len=jnp.array([2, 0], jnp.int32),
        block_tables=jnp.array([[2, 0], [1, -9]], jnp.int32),
    )
    np.testing.assert_allclose(out[:, 0], [[4.0, 8.0], [7.0, -1.0], [0.0, 0.0]], rtol=1e-6, atol=1e-6)


def loop_reference(batch, layer: int) -> np.ndarray:
    """Sequence by sequence, token by token, position by position, in float64."""
    q = np.asarray(batch.q, np.float64)
    k, v = (np.asarray(p[layer], np.float64) for p in (batch.k_pages, batch.v_pages))
    tables = np.asarray(batch.block_tables)
    page_size = k.shape[1]
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k.shape[2]
    out = np.zeros_like(q)
    for s, (start, n, length) in enumerate(zip(*(np.asarray(a) for a in (batch.q_start, batch.q_len, batch.kv_len)))):
        for i in range(n):
            position = length - n + i
            keys = np.stack([k[tables[s, t // page_size], t % page_size] for t in range(position + 1)])
            values = np.stack([v[tables[s, t // page_size], t % page_size] for t in range(position + 1)])
            for h in range(num_heads):
                scores = keys[:, h // group] @ q[start + i, h] / math.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                out[start + i, h] = (weights / weights.sum()) @ values[:, h // group]
    return out


@pytest.mark.parametrize("heads, kv_heads, page_size", [(9, 3, 8), (4, 4, 16), (8, 2, 5)])
def test_matches_the_loop_on_random_batches(rng, heads, kv_heads, page_size):
    # Decode at positions 0 and mid-page, a whole prompt, a chunk after a cached prefix, an empty
    # sequence; padding rows between sequences and at the end.
    seqs = [(1, 1), (1, 19), (11, 11), (6, 30), (0, 13)]
    batch = ragged_batch(
        rng,
        seqs=seqs,
        num_tokens=26,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=8,
        page_size=page_size,
        pages_per_seq=7,
        gap=1,
    )
    for layer in (0, 1):
        out = ragged_paged_attention_reference(*batch.args(layer))
        assert_close(out, loop_reference(batch, layer), "float32")
        assert not np.asarray(out)[~batch.is_token].any(), "padding rows must be zero"
