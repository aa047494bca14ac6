"""The one-launch group kernel (`lora.fused`) in interpret mode against a numpy loop over rows.

Banks hold NaN in slot 0 and in every layer but the one read, so a stray read shows; shapes are
awkward (T not a multiple of the tile, D not a multiple of block_k, module widths not multiples of
block_out, a rank that is not a power of two)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.lora import common, fused, tuning
from tests.kernels.kernel_data import random_array
from tests.tolerances import assert_close

TOKENS, HIDDEN, RANK, SLOTS, LAYERS, LAYER = 37, 200, 5, 9, 2, 1
WIDTHS = (72, 24, 40)
SMALL = dict(block_rows=16, block_k=64, block_out=16, col_split=2, num_warps=4, num_stages=1)


def _reference(x, a, ys, bs, slots, out_cols):
    """numpy, row by row in float64: output of module g += (x[t] @ a[s])[g*R:(g+1)*R] @ bs[g][s]."""
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    outs = [np.asarray(y, np.float64).copy() for y in ys]
    for t, s in enumerate(np.asarray(slots)):
        if s == 0:
            continue
        h = x[t] @ a[s]
        for g, b in enumerate(bs):
            term = h[g * RANK : (g + 1) * RANK] @ np.asarray(b, np.float64)[s]
            if out_cols is None:
                outs[g][t] += term
            else:
                outs[0][t, out_cols[g] : out_cols[g] + term.shape[0]] += term
    return outs


def _data(rng, dtype):
    x = random_array(rng, (TOKENS, HIDDEN), dtype)
    a = random_array(rng, (LAYERS, SLOTS, HIDDEN, len(WIDTHS) * RANK), dtype, 0.2)
    bs = tuple(random_array(rng, (LAYERS, SLOTS, RANK, w), dtype, 0.3) for w in WIDTHS)
    return x, a, bs


def _poison(bank):
    """NaN in slot 0 (never read) and in every layer but LAYER."""
    bank = bank.at[:, 0].set(jnp.nan)
    return bank.at[jnp.arange(LAYERS) != LAYER].set(jnp.nan)


SLOT_PATTERNS = {
    "each_row_its_own": lambda rng: rng.permutation(np.arange(TOKENS)) % (SLOTS - 1) + 1,
    "shared_with_base_rows": lambda rng: rng.choice([0, 2, 2, 5, 7], TOKENS),
    "one_chunk_and_decode_rows": lambda rng: np.concatenate([np.full(25, 4), rng.choice([0, 1, 6], TOKENS - 25)]),
    "all_base": lambda rng: np.zeros(TOKENS, int),
}


@pytest.mark.parametrize("fused_output", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_group_matches_the_row_loop(rng, dtype, fused_output):
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
        return fused.fused_group(
            x, a, ys, bs, groups, mode="decode", layer=layer, out_cols=out_cols, interpret=True, **SMALL
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


def test_fused_group_on_prefill_segments(rng):
    """Prefill rows come in runs of seg_len sharing a slot: no grouping order, one item per tile."""
    dtype, seg_len = jnp.float32, 4
    tokens = 36
    x, a, bs = _data(rng, dtype)
    x = x[:tokens]
    ys = tuple(random_array(rng, (tokens, w), dtype) for w in WIDTHS)
    slots = np.repeat(rng.choice([0, 3, 3, 8], tokens // seg_len), seg_len).astype(np.int32)
    groups = common.make_row_groups(jnp.asarray(slots), num_slots=SLOTS, seg_len=seg_len, block_rows=())
    got = fused.fused_group(
        x, a[LAYER], ys, tuple(b[LAYER] for b in bs), groups, mode="prefill", interpret=True, **SMALL
    )
    want = _reference(x, a[LAYER], ys, [b[LAYER] for b in bs], slots, None)
    for g, w in zip(got, want):
        assert_close(g, jnp.asarray(w, dtype), dtype)


@pytest.mark.parametrize("seg_len", [None, 3])
def test_lora_group_takes_the_fused_launch_when_the_table_says_so(rng, monkeypatch, seg_len):
    """With tuning.py's group impl set to "fused", lora_group on pallas runs `fused_group` (one
    launch) and agrees with the xla backend; a wide rank (64, padded inside) and one module."""
    table = tuning.GROUP_DECODE if seg_len is None else tuning.GROUP_PREFILL
    for rank_bucket in list(table):
        monkeypatch.setitem(table, rank_bucket, {1 << 30: dict(impl="fused", **SMALL)})
    calls = []
    monkeypatch.setattr(fused, "_call", _counting(fused._call, calls))
    tokens, hidden, rank, out = 24, 96, 64, 40
    x = random_array(rng, (tokens, hidden), jnp.float32)
    a = random_array(rng, (SLOTS, hidden, rank), jnp.float32, 0.1).at[0].set(0)
    b = random_array(rng, (SLOTS, rank, out), jnp.float32, 0.1).at[0].set(0)
    y = random_array(rng, (tokens, out), jnp.float32)
    units = tokens if seg_len is None else tokens // seg_len
    slots = jnp.asarray(np.repeat(rng.choice([0, 1, 5], units), tokens // units).astype(np.int32))
    kw = dict(seg_len=seg_len)
    (got,) = pk.lora_group(x, a, (y,), (b,), slots, backend="pallas", interpret=True, **kw)
    (want,) = pk.lora_group(x, a, (y,), (b,), slots, backend="xla", **kw)
    assert len(calls) == 1
    assert_close(got, want, jnp.float32)


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


def test_bad_knobs_raise(rng):
    x, a, bs = _data(rng, jnp.float32)
    ys = tuple(random_array(rng, (TOKENS, w), jnp.float32) for w in WIDTHS)
    groups = common.make_row_groups(jnp.zeros(TOKENS, jnp.int32), num_slots=SLOTS, seg_len=None, block_rows=())
    args = (x, a[0], ys, tuple(b[0] for b in bs), groups)
    with pytest.raises(ValueError, match="power of two"):
        fused.fused_group(*args, mode="decode", interpret=True, **{**SMALL, "block_k": 96})
    with pytest.raises(ValueError, match="block_rows"):
        fused.fused_group(*args, mode="decode", interpret=True, **{**SMALL, "block_rows": 8})
    with pytest.raises(ValueError, match="col_split"):
        fused.fused_group(*args, mode="decode", interpret=True, **{**SMALL, "col_split": 0})
    with pytest.raises(ValueError, match="unknown fused-group knobs"):
        fused.fused_group(*args, mode="decode", interpret=True, split_k=2)
    with pytest.raises(ValueError, match="stack G=3 ranks"):
        fused.fused_group(x, a[0][..., :-1], ys, tuple(b[0] for b in bs), groups, mode="decode", interpret=True)


@pytest.mark.parametrize("rank, tokens", [(16, 64), (16, 1100), (64, 64), (64, 300), (128, 1100)])
def test_the_shipped_table_picks_the_launch_by_rank_and_rows(rng, monkeypatch, rank, tokens):
    """lora_group on pallas decode takes the one-launch kernel exactly where tuning.py's measured
    table says fused for (rank, T), and the step plan already holds that kernel's work items."""
    calls = []
    monkeypatch.setattr(fused, "_call", _counting(fused._call, calls))
    monkeypatch.setattr(common, "work_items", _counting(common.work_items, items_built := []))
    hidden, out = 32, 24
    x = random_array(rng, (tokens, hidden), jnp.bfloat16)
    a = random_array(rng, (SLOTS, hidden, rank), jnp.bfloat16, 0.1).at[0].set(0)
    b = random_array(rng, (SLOTS, rank, out), jnp.bfloat16, 0.1).at[0].set(0)
    y = random_array(rng, (tokens, out), jnp.bfloat16)
    slots = jnp.asarray(rng.choice([0, 1, 5], tokens).astype(np.int32))
    plan = pk.lora_plan(slots, num_slots=SLOTS, backend="pallas")
    planned = len(items_built)
    jax.eval_shape(lambda: pk.lora_group(x, a, (y,), (b,), None, backend="pallas", interpret=True, plan=plan))
    assert len(calls) == (tuning.lookup_group("decode", tokens, rank)["impl"] == "fused")
    assert len(items_built) == planned  # no work items rebuilt per op
