"""The interface the model calls: every backend computes the same thing; bad input raises ValueError."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.lora import common, group, tuning
from tests.kernels.kernel_data import random_array
from tests.tolerances import assert_close


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
        # The plan is built outside the jitted ops and passed in as a pytree, as the model does.
        def step(x, a, ys, bs, plan):
            kw = dict(backend=backend, interpret=interpret, seg_len=seg_len, plan=plan)
            h = pk.lora_shrink(x, a, None, **kw)
            return h, pk.lora_expand_multi(ys, h, bs, None, **kw)

        plan = jax.jit(lambda s: pk.lora_plan(s, num_slots=slots_n, seg_len=seg_len, backend=backend))(slots)
        return jax.jit(step)(x, a, ys, bs, plan)

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


def test_plan_must_match_the_op(rng):
    x = random_array(rng, (8, 16), jnp.float32)
    a = random_array(rng, (3, 16, 4), jnp.float32)
    slots = jnp.asarray([0, 1, 2, 1, 1, 0, 2, 2], jnp.int32)
    plan = pk.lora_plan(slots, num_slots=3, backend="xla")
    with pytest.raises(ValueError, match="plan"):
        pk.lora_shrink(x, a, None, backend="ragged", plan=plan)  # built for another backend
    with pytest.raises(ValueError, match="plan"):
        pk.lora_shrink(x, a, None, backend="xla", seg_len=4, plan=plan)
    with pytest.raises(ValueError, match="plan"):
        pk.lora_shrink(x[:4], a, None, backend="xla", plan=plan)
    with pytest.raises(ValueError, match="slot_ids or a plan"):
        pk.lora_shrink(x, a, None, backend="xla")
    with pytest.raises(ValueError, match="backend"):
        pk.lora_plan(slots, num_slots=3, backend="cuda")
    np.testing.assert_array_equal(
        pk.lora_shrink(x, a, None, backend="xla", plan=plan), pk.lora_shrink(x, a, slots, backend="xla")
    )


def test_pallas_plan_holds_the_tables_work_items(rng):
    slots = jnp.asarray(rng.integers(0, 5, 40), jnp.int32)
    plan = pk.lora_plan(slots, num_slots=5, backend="pallas")
    assert tuning.lookup("shrink", "decode", 40)["block_rows"] in plan.groups.items
    np.testing.assert_array_equal(plan.groups.order, np.argsort(np.asarray(slots), kind="stable"))
    leaves = jax.tree.leaves(plan)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)  # static fields stay out of the pytree


@pytest.mark.parametrize("seg_len", [None, 4])
def test_stacked_bank_with_a_layer_index_reads_that_layer(rng, seg_len):
    """bank [L, S, ...] + layer (traced) equals passing bank[layer], on every backend; other layers
    hold NaN so a read of the wrong layer shows."""
    dtype, tokens, hidden, rank, outs, slots_n, layers = jnp.float32, 16, 40, 4, (24, 8), 6, 3
    x = random_array(rng, (tokens, hidden), dtype)
    a = random_array(rng, (layers, slots_n, hidden, 2 * rank), dtype, 0.1).at[:, 0].set(0)
    bs = tuple(random_array(rng, (layers, slots_n, rank, o), dtype, 0.3).at[:, 0].set(0) for o in outs)
    ys = tuple(random_array(rng, (tokens, o), dtype) for o in outs)
    units = tokens if seg_len is None else tokens // seg_len
    slots = jnp.asarray(np.repeat(rng.integers(0, slots_n, units), tokens // units).astype(np.int32))
    layer = 1
    poison = lambda arr: arr.at[jnp.arange(layers) != layer].set(jnp.nan)  # noqa: E731
    a_poisoned, bs_poisoned = poison(a), tuple(poison(b) for b in bs)
    for backend, interpret in [("xla", False), ("ragged", False), ("pallas", True)]:
        kw = dict(backend=backend, interpret=interpret, seg_len=seg_len)

        @jax.jit
        def stacked(x, a, ys, bs, layer):
            h = pk.lora_shrink(x, a, slots, layer=layer, **kw)
            return h, pk.lora_expand_multi(ys, h, bs, slots, layer=layer, **kw)

        h, got = stacked(x, a_poisoned, ys, bs_poisoned, jnp.int32(layer))
        h_want = pk.lora_shrink(x, a[layer], slots, **kw)
        want = pk.lora_expand_multi(ys, h_want, tuple(b[layer] for b in bs), slots, **kw)
        assert_close(h, h_want, dtype)
        for g, w in zip(got, want):
            assert_close(g, w, dtype)
    with pytest.raises(ValueError, match="axes"):
        pk.lora_shrink(x, a[0], slots, backend="xla", layer=jnp.int32(0))


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_group_matches_the_loop_reference(rng, stacked, dtype):
    """lora_group on pallas decode (shrink partials + one expand launch for all modules) against
    the loop reference: awkward widths, three modules of unequal width, base rows, repeated slots."""
    tokens, hidden, rank, outs, slots_n, layers = 19, 72, 5, (40, 24, 9), 7, 2
    x = random_array(rng, (tokens, hidden), dtype)
    a = random_array(rng, (layers, slots_n, hidden, 3 * rank), dtype, 0.2).at[:, 0].set(0)
    bs = tuple(random_array(rng, (layers, slots_n, rank, o), dtype, 0.3).at[:, 0].set(0) for o in outs)
    ys = tuple(random_array(rng, (tokens, o), dtype) for o in outs)
    slots = jnp.asarray(rng.choice([0, 1, 3, 3, 4, 6], tokens).astype(np.int32))
    layer = 1
    if stacked:
        got = jax.jit(
            lambda x, a, ys, bs, layer: pk.lora_group(
                x, a, ys, bs, slots, backend="pallas", interpret=True, layer=layer
            )
        )(x, a, ys, bs, jnp.int32(layer))
    else:
        got = pk.lora_group(x, a[layer], ys, tuple(b[layer] for b in bs), slots, backend="pallas", interpret=True)
    h = pk.lora_shrink(x.astype(jnp.float32), a[layer].astype(jnp.float32), slots, backend="loop")
    want = pk.lora_expand_multi(
        tuple(y.astype(jnp.float32) for y in ys),
        h,
        tuple(b[layer].astype(jnp.float32) for b in bs),
        slots,
        backend="loop",
    )
    for g, w, y in zip(got, want, ys):
        assert g.dtype == y.dtype
        assert_close(g, w.astype(dtype), dtype)
    base_rows = np.asarray(slots) == 0
    for g, y in zip(got, ys):
        np.testing.assert_array_equal(np.asarray(g)[base_rows], np.asarray(y)[base_rows])


def _fused_reference(x, a, y, bs, slots, out_cols):
    """numpy, row by row: y[t, c_g:c_g+O_g] += (x[t] @ a[s])[g*R:(g+1)*R] @ bs[g][s], in float64."""
    x, a, y = (np.asarray(v, np.float64) for v in (x, a, y))
    bs = [np.asarray(b, np.float64) for b in bs]
    rank = bs[0].shape[1]
    out = y.copy()
    for t, s in enumerate(np.asarray(slots)):
        if s == 0:
            continue
        h = x[t] @ a[s]
        for g, (c, b) in enumerate(zip(out_cols, bs)):
            out[t, c : c + b.shape[2]] += h[g * rank : (g + 1) * rank] @ b[s]
    return out


@pytest.mark.parametrize("seg_len", [None, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_group_into_one_fused_output_matches_numpy(rng, seg_len, dtype):
    """lora_group with out_cols (the serving layout's q|k|v in one matrix) on every backend against a
    numpy loop: modules of unequal, awkward widths; a module of the fused matrix the bank does not hold
    (its columns must stay exactly as they were); base rows unchanged; a stacked bank read at a traced
    layer whose other layers are NaN."""
    tokens, hidden, rank, slots_n, layers = 21, 72, 5, 7, 2
    widths = (40, 9, 24)  # q, k, v; the bank holds q and v only
    held, cols = (0, 2), (0, 40, 49)
    x = random_array(rng, (tokens, hidden), dtype)
    a = random_array(rng, (layers, slots_n, hidden, 2 * rank), dtype, 0.2).at[:, 0].set(0)
    bs = tuple(random_array(rng, (layers, slots_n, rank, widths[g]), dtype, 0.3).at[:, 0].set(0) for g in held)
    y = random_array(rng, (tokens, sum(widths)), dtype)
    units = tokens if seg_len is None else tokens // seg_len
    slots = jnp.asarray(np.repeat(rng.choice([0, 1, 3, 3, 4, 6], units), tokens // units).astype(np.int32))
    layer = 1
    poison = lambda arr: arr.at[jnp.arange(layers) != layer].set(jnp.nan)  # noqa: E731
    out_cols = tuple(cols[g] for g in held)
    want = _fused_reference(x, a[layer], y, [b[layer] for b in bs], slots, out_cols)
    for backend, interpret in [("pallas", True), ("xla", False), ("ragged", False), ("onehot", False), ("loop", False)]:

        @jax.jit
        def run(x, a, y, bs, layer):
            return pk.lora_group(
                x,
                a,
                (y,),
                bs,
                slots,
                backend=backend,
                interpret=interpret,
                seg_len=seg_len,
                layer=layer,
                out_cols=out_cols,
            )

        (got,) = run(x, poison(a), y, tuple(poison(b) for b in bs), jnp.int32(layer))
        assert got.dtype == y.dtype and got.shape == y.shape
        assert_close(got, jnp.asarray(want, dtype), dtype, err_msg=backend)
        k_cols = slice(cols[1], cols[2])  # not held: bit for bit
        np.testing.assert_array_equal(np.asarray(got)[:, k_cols], np.asarray(y)[:, k_cols], err_msg=backend)
        base_rows = np.asarray(slots) == 0
        np.testing.assert_array_equal(np.asarray(got)[base_rows], np.asarray(y)[base_rows], err_msg=backend)


def test_fused_output_bad_columns_raise(rng):
    x = random_array(rng, (8, 16), jnp.float32)
    a = random_array(rng, (3, 16, 8), jnp.float32)
    bs = tuple(random_array(rng, (3, 4, 10), jnp.float32) for _ in range(2))
    y = random_array(rng, (8, 20), jnp.float32)
    slots = jnp.zeros(8, jnp.int32)
    with pytest.raises(ValueError, match="inside y"):
        pk.lora_group(x, a, (y,), bs, slots, backend="xla", out_cols=(0, 11))
    with pytest.raises(ValueError, match="overlap"):
        pk.lora_group(x, a, (y,), bs, slots, backend="xla", out_cols=(5, 0))
    with pytest.raises(ValueError, match="one y"):
        pk.lora_group(x, a, (y, y), bs, slots, backend="xla", out_cols=(0, 10))
    with pytest.raises(ValueError, match="one column offset per bank"):
        pk.lora_group(x, a, (y,), bs, slots, backend="xla", out_cols=(0,))
    # The Pallas decode wrapper writes the spans in place, so it refuses an overlap on its own too.
    groups = common.make_row_groups(slots, num_slots=3, seg_len=None, block_rows=(16,))
    with pytest.raises(ValueError, match="overlap"):
        group.decode_group(x, a, (y,), bs, slots, groups, interpret=True, out_cols=(5, 0))


def test_backend_names_are_listed_once():
    """The model's backends are a subset of the kernels' ones; loop and onehot are test references."""
    from jaxlora.config import LoraBackend

    assert pk.BACKENDS == ("pallas", "xla", "ragged", "onehot", "loop", "pallas_tpu")
    assert {b.value for b in LoraBackend} == set(pk.BACKENDS) - {"onehot", "loop", "pallas_tpu"}
    with pytest.raises(ValueError, match="must be one of"):
        pk.lora_plan(jnp.zeros(4, jnp.int32), num_slots=2, backend="gather")
