"""The TPU (Mosaic, scalar-prefetch) kernels, run in TPU interpret mode on CPU, against the loop reference.

Slot 0 of every bank is NaN here: the kernels must never compute with it, so slot-0 rows come out
exactly 0 (shrink) or exactly y (expand). Unused slots are NaN too; the reference sees slot 0 zeroed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.lora import reference, tpu
from tests.kernels.kernel_data import bank, random_array, zero_slot0
from tests.tolerances import assert_close

INTERPRET = True


def _check_slot0_rows(slot_ids, h, y_new, y) -> None:
    is_base = np.asarray(slot_ids) == 0
    np.testing.assert_array_equal(np.asarray(h, np.float32)[is_base], 0.0)
    np.testing.assert_array_equal(np.asarray(y_new, np.float32)[is_base], np.asarray(y, np.float32)[is_base])


# (dtype, hidden, rank, out, slot pattern, block_k, block_o): 576 / 2049 go through the padded
# 128-multiple blocks as well as the full-width default.
BGMV_CASES = [
    pytest.param(jnp.float32, 576, 16, 2049, "mixed", 128, 1024, id="f32-576-2049-padded-r16"),
    pytest.param(jnp.bfloat16, 2049, 1, 576, "own", None, None, id="bf16-2049-576-full-r1-own"),
    pytest.param(jnp.float32, 256, 64, 384, "one", None, 128, id="f32-256-384-r64-one"),
]


def _slots(rng, pattern: str, num_tokens: int, num_slots: int) -> np.ndarray:
    if pattern == "own":  # every row on its own adapter, plus one no-adapter row
        return np.concatenate([[0], rng.permutation(np.arange(1, num_slots))[: num_tokens - 1]]).astype(np.int32)
    if pattern == "one":
        return np.full(num_tokens, 3, np.int32)
    return rng.integers(0, 4, num_tokens).astype(np.int32)  # several adapters, repeated, with slot 0


@pytest.mark.parametrize("dtype, hidden, rank, out, pattern, block_k, block_o", BGMV_CASES)
def test_bgmv_matches_loop(rng, dtype, hidden, rank, out, pattern, block_k, block_o):
    num_tokens, num_slots = 9, 11
    slot_ids = jnp.asarray(_slots(rng, pattern, num_tokens, num_slots))
    x = random_array(rng, (num_tokens, hidden), dtype)
    y = random_array(rng, (num_tokens, out), dtype)
    a = bank(rng, num_slots, (hidden, rank), dtype, slot_ids, nan_slot0=True)
    b = bank(rng, num_slots, (rank, out), dtype, slot_ids, nan_slot0=True)

    h = tpu.bgmv_shrink(x, a, slot_ids, block_k=block_k, interpret=INTERPRET)
    h_ref = reference.shrink_loop(x, zero_slot0(a), slot_ids)
    assert_close(h, h_ref, dtype)
    # Expand from the reference h, so a shrink error cannot hide an expand error.
    y_new = tpu.bgmv_expand(y, h_ref, b, slot_ids, block_o=block_o, interpret=INTERPRET)
    assert_close(y_new, reference.expand_loop(y, h_ref, zero_slot0(b), slot_ids), dtype)
    _check_slot0_rows(slot_ids, h, y_new, y)


# (dtype, rank, seg_starts, seg_slots): T = 20 rows in tiles of 8, so segments straddle tiles.
SGMV_CASES = [
    pytest.param(jnp.float32, 16, [0, 3, 3, 11, 11, 20], [2, 5, 0, 7, 1], id="f32-r16-empty-segments"),
    pytest.param(jnp.bfloat16, 64, [0, 0, 20, 20], [4, 6, 2], id="bf16-r64-one-segment"),
]


@pytest.mark.parametrize("dtype, rank, seg_starts, seg_slots", SGMV_CASES)
def test_sgmv_matches_loop(rng, dtype, rank, seg_starts, seg_slots):
    num_tokens, hidden, out, num_slots = 20, 576, 2049, 8
    seg_starts, seg_slots = jnp.asarray(seg_starts, jnp.int32), jnp.asarray(seg_slots, jnp.int32)
    slot_ids = jnp.asarray(np.repeat(np.asarray(seg_slots), np.diff(np.asarray(seg_starts))))
    x = random_array(rng, (num_tokens, hidden), dtype)
    y = random_array(rng, (num_tokens, out), dtype)
    a = bank(rng, num_slots, (hidden, rank), dtype, slot_ids, nan_slot0=True)
    b = bank(rng, num_slots, (rank, out), dtype, slot_ids, nan_slot0=True)

    h = tpu.sgmv_shrink(x, a, seg_starts, seg_slots, block_rows=8, block_k=128, interpret=INTERPRET)
    h_ref = reference.shrink_loop(x, zero_slot0(a), slot_ids)
    assert_close(h, h_ref, dtype)
    y_new = tpu.sgmv_expand(y, h_ref, b, seg_starts, seg_slots, block_rows=8, block_o=1024, interpret=INTERPRET)
    assert_close(y_new, reference.expand_loop(y, h_ref, zero_slot0(b), slot_ids), dtype)
    _check_slot0_rows(slot_ids, h, y_new, y)


@pytest.mark.parametrize("seg_len", [None, 4])
def test_api_backend_with_plan(rng, seg_len):
    """lora_shrink + lora_expand_multi (stacked q/v-like ranks, h_col > 0) through backend="pallas_tpu"."""
    dtype, num_tokens, hidden, rank, outs, num_slots = jnp.float32, 12, 200, 8, (130, 72), 6
    units = num_tokens if seg_len is None else num_tokens // seg_len
    slot_ids = jnp.asarray(np.repeat(rng.integers(0, num_slots, units), num_tokens // units).astype(np.int32))
    x = random_array(rng, (num_tokens, hidden), dtype)
    a = bank(rng, num_slots, (hidden, 2 * rank), dtype, slot_ids)
    bs = tuple(bank(rng, num_slots, (rank, o), dtype, slot_ids) for o in outs)
    ys = tuple(random_array(rng, (num_tokens, o), dtype) for o in outs)

    def step(x, a, ys, bs, plan, backend):
        kw = dict(backend=backend, interpret=INTERPRET, seg_len=seg_len, plan=plan)
        h = pk.lora_shrink(x, a, None, **kw)
        return h, pk.lora_expand_multi(ys, h, bs, None, **kw)

    results = {}
    for backend in ("loop", "pallas_tpu"):
        plan = pk.lora_plan(slot_ids, num_slots=num_slots, seg_len=seg_len, backend=backend)
        results[backend] = jax.jit(functools.partial(step, backend=backend))(x, a, ys, bs, plan)
    (h, ys_new), (h_ref, ys_ref) = results["pallas_tpu"], results["loop"]
    assert_close(h, h_ref, dtype)
    for got, want in zip(ys_new, ys_ref):
        assert_close(got, want, dtype)


def test_lowers_for_tpu():
    """Mosaic accepts the block shapes (the (8, 128) rule), checked by lowering for TPU on CPU."""
    tokens, hidden, rank, out, slots = 20, 2049, 16, 576, 5
    spec = jax.ShapeDtypeStruct
    x, y = spec((tokens, hidden), jnp.bfloat16), spec((tokens, out), jnp.bfloat16)
    a, b = spec((slots, hidden, rank), jnp.bfloat16), spec((slots, rank, out), jnp.bfloat16)
    h, slot_ids = spec((tokens, 2 * rank), jnp.bfloat16), spec((tokens,), jnp.int32)
    starts, seg_slots = spec((4,), jnp.int32), spec((3,), jnp.int32)
    calls = [
        (functools.partial(tpu.bgmv_shrink, block_k=512), (x, a, slot_ids)),
        (functools.partial(tpu.bgmv_expand, h_col=rank, block_o=256), (y, h, b, slot_ids)),
        (functools.partial(tpu.sgmv_shrink, block_rows=16), (x, a, starts, seg_slots)),
        (functools.partial(tpu.sgmv_expand, h_col=rank, block_rows=8), (y, h, b, starts, seg_slots)),
    ]
    for fn, args in calls:
        assert "tpu_custom_call" in jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_bad_input_raises(rng):
    x = random_array(rng, (8, 256), jnp.float32)
    a = random_array(rng, (3, 256, 4), jnp.float32)
    b = random_array(rng, (3, 4, 256), jnp.float32)
    slot_ids = jnp.zeros(8, jnp.int32)
    starts, seg_slots = jnp.asarray([0, 8], jnp.int32), jnp.asarray([1], jnp.int32)
    with pytest.raises(ValueError, match="block_k=100"):
        tpu.bgmv_shrink(x, a, slot_ids, block_k=100)
    with pytest.raises(ValueError, match="block_rows=12"):
        tpu.sgmv_shrink(x, a, starts, seg_slots, block_rows=12)
    with pytest.raises(ValueError, match="shrink needs"):
        tpu.bgmv_shrink(x, a[:, :128], slot_ids)
    with pytest.raises(ValueError, match="h_col=2"):
        tpu.bgmv_expand(x, x[:, :4], b, slot_ids, h_col=2)
    with pytest.raises(ValueError, match="slot_ids"):
        tpu.bgmv_shrink(x, a, slot_ids[:5])
    with pytest.raises(ValueError, match="seg_starts"):
        tpu.sgmv_expand(x, x[:, :4], b, starts[:1], seg_slots)
    with pytest.raises(ValueError, match="plan"):
        plan = pk.lora_plan(slot_ids, num_slots=3, backend="xla")
        pk.lora_shrink(x, a, None, backend="pallas_tpu", plan=plan)
