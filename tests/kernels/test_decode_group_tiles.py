"""`group.decode_group` with the tile expand (b read once per work item) in interpret mode,
against the numpy row loop of test_lora_fused: NaN in slot 0 and in every unread layer, T not a
multiple of the tile, module widths not multiples of block_out, rank 5 padded to 16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.lora import api, common, group, tuning
from tests.kernels.kernel_data import random_array
from tests.kernels.test_lora_fused import LAYER, SLOT_PATTERNS, SLOTS, TOKENS, WIDTHS, _data, _poison, _reference
from tests.tolerances import assert_close

TILES = dict(block_out=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "dtype, fused_output, split_k",
    [(jnp.float32, False, 4), (jnp.bfloat16, True, 4), (jnp.bfloat16, False, 1)],
)
def test_tile_expand_matches_the_row_loop(rng, monkeypatch, dtype, fused_output, split_k):
    """split_k 4: the expand sums four float32 partials of D = 200 (the last one partly masked)."""
    for bucket in list(tuning.SHRINK_DECODE):
        shrink = dict(block_rows=16, block_k=64, split_k=split_k, num_warps=4, num_stages=1)
        monkeypatch.setitem(tuning.SHRINK_DECODE, bucket, shrink)
    x, a, bs = _data(rng, dtype)
    out_cols = (0, 72, 96) if fused_output else None
    ys = (
        (random_array(rng, (TOKENS, sum(WIDTHS)), dtype),)
        if fused_output
        else tuple(random_array(rng, (TOKENS, w), dtype) for w in WIDTHS)
    )

    @jax.jit
    def run(x, a, ys, bs, slots, layer):
        groups = common.make_row_groups(slots, num_slots=SLOTS, seg_len=None, block_rows=(16,))
        return group.decode_group(
            x, a, ys, bs, slots, groups, layer=layer, interpret=True, out_cols=out_cols, tiles=TILES
        )

    for name, pattern in SLOT_PATTERNS.items():
        slots = np.asarray(pattern(rng), np.int32)
        got = run(x, _poison(a), ys, tuple(_poison(b) for b in bs), jnp.asarray(slots), jnp.int32(LAYER))
        want = _reference(x, a[LAYER], ys, [b[LAYER] for b in bs], slots, out_cols)
        for g, w, y in zip(got, want, ys):
            assert g.dtype == y.dtype and g.shape == y.shape
            assert_close(g, jnp.asarray(w, dtype), dtype, err_msg=name)
            base = slots == 0
            np.testing.assert_array_equal(np.asarray(g)[base], np.asarray(y)[base], err_msg=name)


@pytest.mark.parametrize("rank", [16, 64])
def test_lora_group_takes_the_tile_expand_when_the_table_says_so(rng, monkeypatch, rank):
    """With tuning.py's decode group impl "split_tiles", lora_group on pallas runs the tile expand
    (into separate outputs and into one fused output) and agrees with the xla backend."""
    for rank_bucket in list(tuning.GROUP_DECODE):
        monkeypatch.setitem(
            tuning.GROUP_DECODE, rank_bucket, {1 << 30: dict(impl="split_tiles", block_rows=16, **TILES)}
        )
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return tiles_call(*args, **kwargs)

    tiles_call = group._expand_tiles_call
    monkeypatch.setattr(group, "_expand_tiles_call", counting)
    tokens, hidden, widths = 40, 96, (40, 24)
    x = random_array(rng, (tokens, hidden), jnp.float32)
    a = random_array(rng, (SLOTS, hidden, 2 * rank), jnp.float32, 0.1).at[0].set(0)
    bs = tuple(random_array(rng, (SLOTS, rank, w), jnp.float32, 0.1).at[0].set(0) for w in widths)
    ys = tuple(random_array(rng, (tokens, w), jnp.float32) for w in widths)
    slots = jnp.asarray(rng.choice([0, 1, 5, 5, 5], tokens).astype(np.int32))
    got = pk.lora_group(x, a, ys, bs, slots, backend="pallas", interpret=True)
    want = pk.lora_group(x, a, ys, bs, slots, backend="xla")
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32)
    fused_y = jnp.concatenate(ys, axis=1)
    (got_fused,) = pk.lora_group(x, a, (fused_y,), bs, slots, backend="pallas", interpret=True, out_cols=(0, 40))
    assert_close(got_fused, jnp.concatenate(want, axis=1), jnp.float32)
    assert len(calls) == 2
    assert api._tile_knobs("pallas", 4, tokens, rank) is None  # prefill segments keep their own kernels
    assert api._tile_knobs("xla", None, tokens, rank) is None


def test_tile_knobs_must_be_complete(rng):
    x, a, bs = _data(rng, jnp.float32)
    ys = tuple(random_array(rng, (TOKENS, w), jnp.float32) for w in WIDTHS)
    slots = jnp.ones(TOKENS, jnp.int32)
    groups = common.make_row_groups(slots, num_slots=SLOTS, seg_len=None, block_rows=(16,))
    args = (x, a[0], ys, tuple(b[0] for b in bs), slots, groups)
    with pytest.raises(ValueError, match="tile expand knobs"):
        group.decode_group(*args, interpret=True, tiles=dict(block_out=16))
    with pytest.raises(ValueError, match="tile expand knobs"):
        group.decode_group(*args, interpret=True, tiles=dict(TILES, split_k=2))
    with pytest.raises(ValueError, match="power of two"):
        group.decode_group(*args, interpret=True, tiles=dict(TILES, block_out=24))


@pytest.mark.parametrize("rank, tokens", [(16, 64), (16, 600), (32, 300), (8, 2048), (64, 600)])
def test_the_shipped_table_picks_the_expand_by_rank_and_rows(rng, monkeypatch, rank, tokens):
    """lora_group on pallas decode takes the tile expand exactly where tuning.py's measured table
    says split_tiles for (rank, T), with the plan's work items (none rebuilt per op)."""
    calls = []
    tiles_call = group._expand_tiles_call
    monkeypatch.setattr(group, "_expand_tiles_call", lambda *a, **k: calls.append(1) or tiles_call(*a, **k))
    hidden, out = 32, 24
    x = random_array(rng, (tokens, hidden), jnp.bfloat16)
    a = random_array(rng, (SLOTS, hidden, rank), jnp.bfloat16, 0.1).at[0].set(0)
    b = random_array(rng, (SLOTS, rank, out), jnp.bfloat16, 0.1).at[0].set(0)
    y = random_array(rng, (tokens, out), jnp.bfloat16)
    slots = jnp.asarray(rng.choice([0, 1, 5], tokens).astype(np.int32))
    plan = pk.lora_plan(slots, num_slots=SLOTS, backend="pallas")
    jax.eval_shape(lambda: pk.lora_group(x, a, (y,), (b,), None, backend="pallas", interpret=True, plan=plan))
    assert len(calls) == (tuning.lookup_group("decode", tokens, rank)["impl"] == "split_tiles")
    assert (rank, tokens) not in ((16, 600), (32, 300), (8, 2048)) or calls  # the measured wins
