"""The model's XLA ragged-attention path (query blocks of one sequence each, the context read in
chunks of pages with an online softmax) against the per-token reference, on the kernel tests'
poisoned batches: NaN in unused pages, offsets past kv_len and padding rows, garbage table entries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention_reference, ragged_paged_attention_xla
from pallas_kernels.attention.ragged_xla import num_chunks
from tests.kernels.paged_data import ragged_batch
from tests.kernels.test_ragged_attention import CASES
from tests.tolerances import assert_close

# (q_len, kv_len) per sequence; page_size 8, so a chunk of chunk_pages pages holds 8 * chunk_pages
# positions.
CHUNK_CASES = {
    # A wide table (64 pages, 512 positions) holding short contexts: the loop stops after the
    # longest; the table's entries past each sequence's pages are garbage.
    "long_table_short_context": dict(
        seqs=[(1, 5), (3, 9), (1, 1), (0, 400)], num_tokens=8, heads=4, kv_heads=2, head_dim=16, pages_per_seq=64
    ),
    # Contexts over several chunks of 2 pages (16 positions): 70 is 5 chunks, the last one partial.
    "several_chunks": dict(
        seqs=[(1, 70), (2, 50), (1, 3)], num_tokens=6, heads=4, kv_heads=1, head_dim=16, pages_per_seq=10
    ),
    # Contexts ending exactly at a chunk boundary (16 and 32 with 2-page chunks) and one past it.
    "boundary_at_kv_len": dict(
        seqs=[(1, 32), (16, 16), (1, 33)], num_tokens=24, heads=2, kv_heads=2, head_dim=8, pages_per_seq=6
    ),
    # A whole prompt, a chunk continuing a cached prefix, decodes, a sequence outside the step.
    "mixed_prefill_decode": dict(
        seqs=[(20, 20), (13, 61), (1, 48), (1, 17), (0, 30)],
        num_tokens=40,
        heads=6,
        kv_heads=2,
        head_dim=16,
        pages_per_seq=12,
        gap=1,
    ),
}


def _check(batch, **knobs) -> None:
    for layer in range(batch.k_pages.shape[0]):
        out = ragged_paged_attention_xla(*batch.args(layer), **knobs)
        assert np.isfinite(np.asarray(out)).all(), "a NaN page, offset or padding row was read"
        assert_close(out, ragged_paged_attention_reference(*batch.args(layer)), "float32")
        assert not np.asarray(out)[~batch.is_token].any(), "padding rows must be zero"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_q", [1, 16])
@pytest.mark.parametrize("chunk_pages", [1, 16])
def test_xla_path_matches_reference(rng, name, block_q, chunk_pages):
    case = {k: v for k, v in CASES[name].items() if k not in ("block_q", "block_k")}
    _check(ragged_batch(rng, **case), block_q=block_q, chunk_pages=chunk_pages)


@pytest.mark.parametrize("name", list(CHUNK_CASES))
@pytest.mark.parametrize("chunk_pages", [1, 2, 3])
def test_chunked_context_matches_reference(rng, name, chunk_pages):
    _check(ragged_batch(rng, page_size=8, **CHUNK_CASES[name]), block_q=8, chunk_pages=chunk_pages)


def test_bfloat16_pages(rng):
    batch = ragged_batch(rng, page_size=8, dtype=jnp.bfloat16, **CHUNK_CASES["mixed_prefill_decode"])
    out = ragged_paged_attention_xla(*batch.args(1), chunk_pages=2)
    assert out.dtype == jnp.bfloat16
    ref = ragged_paged_attention_reference(*batch.args(1))
    assert_close(out.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16")


def test_num_chunks_covers_the_longest_context_in_the_step():
    q_len = jnp.array([1, 0, 5, 1], jnp.int32)
    # Sequence 1 has no token in the step: its kv_len (here beyond the table) does not count.
    kv_len = jnp.array([17, 4000, 32, 1], jnp.int32)
    assert int(num_chunks(q_len, kv_len, 16, 8)) == 2  # 32 positions: two chunks of 16, exactly
    assert int(num_chunks(q_len, kv_len.at[2].set(33), 16, 8)) == 3
    assert int(num_chunks(q_len, kv_len.at[0].set(10_000), 16, 8)) == 8  # never past the table
    assert int(num_chunks(jnp.zeros(4, jnp.int32), kv_len, 16, 8)) == 0  # an empty step reads nothing


def test_bad_knobs_are_refused(rng):
    batch = ragged_batch(rng, page_size=8, **CHUNK_CASES["several_chunks"])
    with pytest.raises(ValueError, match="chunk_pages=0"):
        ragged_paged_attention_xla(*batch.args(0), chunk_pages=0)
