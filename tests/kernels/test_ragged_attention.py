"""The ragged paged-attention kernel against its reference: interpret mode on CPU, CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import ragged_paged_attention
from pallas_kernels.attention.ragged import q_block_schedule
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.kernels.paged_data import ragged_batch
from tests.tolerances import assert_close

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)

# (q_len, kv_len) per sequence.
CASES = {
    # SmolLM2's heads: decode mid-page and right after a page boundary, a whole prompt in one chunk
    # (kv_len == q_len), a chunk continuing a cached prefix, a sequence not in this step; padding.
    "gqa_9_3_mixed": dict(
        seqs=[(1, 37), (1, 17), (23, 23), (13, 50), (0, 20)],
        num_tokens=48,
        heads=9,
        kv_heads=3,
        head_dim=64,
        page_size=16,
        pages_per_seq=4,
        block_q=16,
        block_k=32,
    ),
    # page_size 8: decode of a first token (position 0), chunks off page boundaries, an empty
    # sequence with no pages at all; one padding row between sequences.
    "gqa_8_2_page8": dict(
        seqs=[(5, 5), (1, 9), (17, 41), (0, 0), (1, 1)],
        num_tokens=32,
        heads=8,
        kv_heads=2,
        head_dim=32,
        page_size=8,
        pages_per_seq=6,
        block_q=16,
        block_k=16,
        gap=1,
    ),
    # Multi-head, decode only: one q-block per sequence; contexts of 1..70 in 64-position blocks.
    "mha_decode_only": dict(
        seqs=[(1, 70), (1, 1), (1, 64), (1, 65), (1, 33), (1, 16)],
        num_tokens=8,
        heads=4,
        kv_heads=4,
        head_dim=16,
        page_size=16,
        pages_per_seq=5,
        block_q=16,
        block_k=64,
    ),
    # Chunks spanning several q-blocks of 32 with a partial last block; four query heads per KV head.
    "long_chunks": dict(
        seqs=[(40, 40), (33, 70), (1, 12)],
        num_tokens=96,
        heads=4,
        kv_heads=1,
        head_dim=16,
        page_size=8,
        pages_per_seq=9,
        block_q=32,
        block_k=16,
        gap=3,
    ),
}


def _run_case(rng, case: dict, dtype):
    """Kernel outputs of every layer, computed in a scan over layers (the layer index traced, as in
    the model), and the reference's, both [L, T, H, Dh]."""
    case = dict(case)
    knobs = dict(block_q=case.pop("block_q"), block_k=case.pop("block_k"))
    batch = ragged_batch(rng, dtype=dtype, **case)
    q, k, v, _, *per_seq = batch.args(0)

    @jax.jit
    def over_layers(q, k, v, per_seq):
        def attend(_, layer):
            return None, ragged_paged_attention(q, k, v, layer, *per_seq, interpret=True, **knobs)

        return jax.lax.scan(attend, None, jnp.arange(k.shape[0], dtype=jnp.int32))[1]

    refs = [ragged_paged_attention_reference(*batch.args(layer)) for layer in range(k.shape[0])]
    return batch, over_layers(q, k, v, per_seq), jnp.stack(refs)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(rng, name):
    batch, out, ref = _run_case(rng, CASES[name], jnp.float32)
    assert out.shape == ref.shape and out.dtype == batch.q.dtype
    assert np.isfinite(np.asarray(out)).all(), "a NaN page, offset or padding row was read"
    assert_close(out, ref, "float32")
    assert not np.asarray(out)[:, ~batch.is_token].any(), "padding rows must be zero"


def test_matches_reference_in_bfloat16(rng):
    batch, out, ref = _run_case(rng, CASES["gqa_8_2_page8"], jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16")


def test_schedule_hands_each_sequence_its_q_blocks():
    # Sequences of 20, 0, 1 and 16 tokens with block_q 16: blocks 0-1 are sequence 0 (16 + 4 rows),
    # block 2 sequence 2 (its decode token), block 3 sequence 3; blocks 4.. are idle.
    q_start = jnp.array([5, 99, 0, 30], jnp.int32)
    q_len = jnp.array([20, 0, 1, 16], jnp.int32)
    kv_len = jnp.array([50, 7, 9, 16], jnp.int32)
    seq, row0, rows, pos0 = (np.asarray(a) for a in q_block_schedule(q_start, q_len, kv_len, num_blocks=7, block_q=16))
    np.testing.assert_array_equal(rows, [16, 4, 1, 16, 0, 0, 0])
    np.testing.assert_array_equal(seq[:4], [0, 0, 2, 3])
    np.testing.assert_array_equal(row0[:4], [5, 21, 0, 30])
    np.testing.assert_array_equal(pos0[:4], [30, 46, 8, 0])


@pytest.mark.parametrize("block_q", [16, 64])
def test_static_grid_bounds_every_split(rng, block_q):
    """cdiv(T, block_q) + S q-blocks cover any split of T tokens over S sequences; a decode-only step
    gives every sequence one q-block, so its keys and values are read once per head."""
    num_tokens, num_seqs = 300, 24
    num_blocks = -(-num_tokens // block_q) + num_seqs
    # The most q-blocks: every sequence one token past a multiple of block_q.
    longest = (num_tokens - num_seqs) // block_q
    splits = [np.array([block_q + 1] * longest + [1] * (num_seqs - longest))]
    for _ in range(30):
        total = rng.integers(0, num_tokens + 1)
        cuts = np.sort(rng.integers(0, total + 1, num_seqs - 1))
        splits.append(np.diff(np.concatenate([[0], cuts, [total]])))  # zeros included
    for q_len in splits:
        q_start = np.concatenate([[0], np.cumsum(q_len)[:-1]])
        _, _, rows, _ = q_block_schedule(
            jnp.asarray(q_start, jnp.int32),
            jnp.asarray(q_len, jnp.int32),
            jnp.asarray(q_len, jnp.int32),
            num_blocks=num_blocks,
            block_q=block_q,
        )
        assert int(np.asarray(rows).sum()) == int(q_len.sum()), (q_len, block_q)
    decode = jnp.ones((num_seqs,), jnp.int32)
    _, _, rows, _ = q_block_schedule(jnp.arange(num_seqs), decode, decode, num_blocks=num_seqs + 1, block_q=block_q)
    np.testing.assert_array_equal(rows, [1] * num_seqs + [0])


def test_bad_inputs_are_refused(rng):
    batch = ragged_batch(
        rng, seqs=[(2, 5)], num_tokens=4, heads=4, kv_heads=2, head_dim=16, page_size=4, pages_per_seq=2
    )
    q, k, v, layer, q_start, q_len, kv_len, tables = batch.args(0)
    call = lambda *a, **kw: ragged_paged_attention(*a, interpret=True, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="block_k=48 must be a power of two"):
        call(q, k, v, layer, q_start, q_len, kv_len, tables, block_k=48)
    with pytest.raises(ValueError, match="block_q=8 must be a power of two >= 16"):
        call(q, k, v, layer, q_start, q_len, kv_len, tables, block_q=8)
    with pytest.raises(ValueError, match="does not fit"):
        call(q[:, :3], k, v, layer, q_start, q_len, kv_len, tables)
    with pytest.raises(ValueError, match="head_dim=8"):
        call(q[..., :8], k[..., :8], v[..., :8], layer, q_start, q_len, kv_len, tables)
    with pytest.raises(ValueError, match="kv_len"):
        call(q, k, v, layer, q_start, q_len, jnp.ones((2,), jnp.int32), tables)
    with pytest.raises(ValueError, match="block_tables"):
        call(q, k, v, layer, q_start, q_len, kv_len, tables[0])
    with pytest.raises(ValueError, match="S >= 1"):
        call(q, k, v, layer, q_start[:0], q_len[:0], kv_len[:0], tables[:0])
    with pytest.raises(ValueError, match="dtype"):
        call(q.astype(jnp.bfloat16), k, v, layer, q_start, q_len, kv_len, tables)


def _lower_for_cuda(*, num_tokens, heads, kv_heads, head_dim, page_size, num_seqs, pages_per_seq, **knobs) -> str:
    sd = jax.ShapeDtypeStruct
    pages = sd((2, num_seqs * pages_per_seq, page_size, kv_heads, head_dim), jnp.bfloat16)
    per_seq = sd((num_seqs,), jnp.int32)
    args = (
        sd((num_tokens, heads, head_dim), jnp.bfloat16),
        pages,
        pages,
        sd((), jnp.int32),
        per_seq,
        per_seq,
        per_seq,
        sd((num_seqs, pages_per_seq), jnp.int32),
    )
    fn = lambda *a: ragged_paged_attention(*a, **knobs)  # noqa: E731
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "shape",
    [
        dict(heads=32, kv_heads=32, head_dim=128),  # Llama-2-7B
        dict(heads=9, kv_heads=3, head_dim=64),  # SmolLM2-135M
    ],
)
@pytest.mark.parametrize("knobs", [dict(), dict(block_q=64, block_k=128, num_warps=8, num_stages=3)])
def test_lowers_for_cuda(shape, knobs):
    text = _lower_for_cuda(num_tokens=512, page_size=16, num_seqs=256, pages_per_seq=64, **shape, **knobs)
    assert text.count("__gpu$xla.gpu.triton") == 1
