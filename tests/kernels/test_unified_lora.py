"""The unified-pool LoRA kernels (interpret mode), which read adapters out of the KV cache's pages,
against the reference that concatenates each slot's segments: every rank 0-128, `rank_pattern`
(modules of other widths and ranks in one run), rank-rows straddling K/V segments and pages,
shuffled pages, NaN in free pages, gaps and tails, the other layer's values, base-model and rank-0
rows, every row on its own slot, rows sharing slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora.common import make_row_groups
from pallas_kernels.lora.unified import unified_expand, unified_shrink
from pallas_kernels.lora.unified_reference import factor, unified_expand_reference, unified_shrink_reference
from pallas_kernels.lora.unified_tiled import tiled_fits, unified_tiled_expand, unified_tiled_shrink
from pallas_kernels.lora.unified_xla import unified_expand_xla, unified_shrink_xla
from tests.kernels.kernel_data import random_array
from tests.kernels.paged_lora_data import nan_past_rank
from tests.kernels.unified_lora_data import unified_pool
from tests.tolerances import assert_close

LAYER = 1  # of 2: layer 0 holds other values


def _check(rng, pool, module, ids, *, hidden, out, max_rank, dtype, rank_block=8, block=16, **shrink_knobs):
    """Shrink then expand of `module` on rows `ids`, the kernels and the XLA path each against the
    reference. shrink_knobs: k_splits, unroll."""
    x = random_array(rng, (len(ids), hidden), dtype)
    y = random_array(rng, (len(ids), out), dtype)
    ids = jnp.asarray(ids, jnp.int32)
    layer = jnp.int32(LAYER)
    a_args = (pool.k, pool.v, layer, pool.pages, module.a_offsets, module.ranks, ids)
    knobs = dict(align=pool.align, block=block, rank_block=rank_block, interpret=True)
    h = unified_shrink(x, *a_args, max_rank=max_rank, **knobs, **shrink_knobs)
    h_want = unified_shrink_reference(x, *a_args, max_rank=max_rank)
    assert_close(h, h_want, dtype)
    h_in = nan_past_rank(h, module.ranks, ids)
    b_args = (pool.k, pool.v, layer, pool.pages, module.b_offsets, module.ranks, ids)
    got = unified_expand(y, h_in, *b_args, **knobs)
    want = unified_expand_reference(y, h_in, *b_args)
    assert_close(got, want, dtype)
    if shrink_knobs.get("k_splits", 1) > 1:  # the splits' partial sums, added by the expand
        parts = unified_shrink(x, *a_args, max_rank=max_rank, **knobs, **shrink_knobs, partials=True)
        assert parts.shape == (len(ids), shrink_knobs["k_splits"], max_rank) and parts.dtype == jnp.float32
        assert_close(jnp.sum(parts, axis=1).astype(dtype), h_want, dtype)
        # Columns past a row's rank, in every part, are never read: NaN there must not show.
        poisoned = jnp.stack([nan_past_rank(parts[:, i], module.ranks, ids) for i in range(parts.shape[1])], axis=1)
        got_parts = unified_expand(y, poisoned, *b_args, **knobs)
        assert_close(got_parts, unified_expand_reference(y, h_want, *b_args), dtype)
    for align in (1, pool.align):  # element by element, and in the chunks the offsets allow
        assert_close(unified_shrink_xla(x, *a_args, max_rank=max_rank, align=align), h_want, dtype)
        assert_close(unified_expand_xla(y, h_in, *b_args, align=align), want, dtype)
    base = np.asarray(ids) < 0
    np.testing.assert_array_equal(np.asarray(got)[base], np.asarray(y)[base])
    return h


def test_the_reference_reads_back_the_factors_written(rng):
    """The reference's factors are the generator's: the layout is checked independently of both."""
    pool = unified_pool(rng, [[3, 17], [0, 5], [9, 0]], [(21, 13), (11, 30)])
    for module in pool.modules:
        for s, rank in enumerate(np.asarray(module.ranks)):
            for offsets, rows in ((module.a_offsets, module.a[s]), (module.b_offsets, module.b[s])):
                got = factor(
                    pool.k, pool.v, LAYER, np.asarray(pool.pages[s]), int(offsets[s]), int(rank), rows.shape[2]
                )
                np.testing.assert_array_equal(got, rows[LAYER])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rank_classes_and_rank_pattern_each_row_on_its_own_slot(rng, dtype):
    """Ranks 1, 7, 8, 9, 128, 0 and a random sample, one row per slot plus base rows, for two modules
    of other widths and other ranks in the same runs."""
    first = [1, 7, 8, 9, 128, 0, *rng.choice(np.arange(2, 128), size=4, replace=False).tolist()]
    second = rng.permutation(first).tolist()
    widths = [(37, 29), (19, 70)]
    pool = unified_pool(rng, list(zip(first, second, strict=True)), widths, dtype=dtype)
    ids = rng.permutation([*range(len(first)), -1, -1])
    for module, (hidden, out) in zip(pool.modules, widths, strict=True):
        h = _check(rng, pool, module, ids, hidden=hidden, out=out, max_rank=128, dtype=dtype)
        ranks = np.asarray(module.ranks)
        for t, s in enumerate(ids):  # exact zeros at and past the rank, nonzero below it
            r = ranks[s] if s >= 0 else 0
            assert not np.asarray(h[t, r:]).any()
            assert np.asarray(h[t, :r]).all()


@pytest.mark.parametrize("k_splits, unroll", [(1, 1), (2, 1), (4, 1), (8, 1), (1, 4), (4, 4), (2, 2)])
def test_whole_chunks_straddling_segments_and_pages(rng, k_splits, unroll):
    """Widths with a large power of two (224, 160 on 64-element segments, offsets on 32): the kernels
    load 32-element chunks, rank-rows cross K/V segments and pages mid-row, ranks mixed with base
    rows; the shrink's seven chunks a rank-row split over programs, ceil(7 / k_splits) each (2: 4
    and 3; 4: 2, 2, 2 and 1; 8: one each, the last idle), and unrolled in a loop step with a tail
    (4: a step of four, then three single chunks)."""
    pool = unified_pool(rng, [[r] for r in (1, 6, 16, 31, 0, 64)], [(224, 160)], align=32)
    ids = rng.permutation([0, 1, 2, 3, 4, 5, -1, 3, 5])
    kw = dict(k_splits=k_splits, unroll=unroll)
    _check(rng, pool, pool.modules[0], ids, hidden=224, out=160, max_rank=64, dtype=jnp.bfloat16, block=32, **kw)


def test_every_rank_from_0_to_128(rng):
    """Ranks 0..128 at once, one row each plus base rows (shuffled), narrow factors to keep the
    interpreter quick; rank_block 16 (a row's last block partly past its rank)."""
    ranks = np.arange(0, 129)
    pool = unified_pool(rng, [[r] for r in ranks], [(21, 19)], page_size=8, kv_heads=1, head_dim=16)
    ids = rng.permutation([*range(129), -1, -1])
    _check(rng, pool, pool.modules[0], ids, hidden=21, out=19, max_rank=128, dtype=jnp.float32, rank_block=16)


def test_rows_sharing_slots_and_a_narrow_h(rng):
    """Rows repeat slots; h only as wide as the largest rank used (the expand reads no further)."""
    pool = unified_pool(rng, [[16], [4], [0], [33], [2]], [(48, 40)])
    ids = rng.choice(np.arange(-1, 5), size=14)
    ids[:6] = [-1, 0, 1, 2, 3, 4]
    _check(rng, pool, pool.modules[0], ids, hidden=48, out=40, max_rank=33, dtype=jnp.float32)


def test_the_xla_path_gathers_per_row_when_rows_are_fewer_than_slots(rng):
    """Three rows on ten slots (the XLA path gathers each row's factor, not every slot's)."""
    pool = unified_pool(rng, [[r] for r in (5, 0, 17, 3, 9, 1, 30, 2, 8, 4)], [(21, 19)])
    module, ids = pool.modules[0], jnp.asarray([6, -1, 2], jnp.int32)
    x, y = random_array(rng, (3, 21), jnp.float32), random_array(rng, (3, 19), jnp.float32)
    layer = jnp.int32(LAYER)
    a_args = (pool.k, pool.v, layer, pool.pages, module.a_offsets, module.ranks, ids)
    h = unified_shrink_xla(x, *a_args, max_rank=32)
    assert_close(h, unified_shrink_reference(x, *a_args, max_rank=32), jnp.float32)
    b_args = (pool.k, pool.v, layer, pool.pages, module.b_offsets, module.ranks, ids)
    h_in = nan_past_rank(h, module.ranks, ids)
    assert_close(unified_expand_xla(y, h_in, *b_args), unified_expand_reference(y, h_in, *b_args), jnp.float32)


def test_bad_operands_are_refused(rng):
    pool = unified_pool(rng, [[4]], [(16, 16)])
    m = pool.modules[0]
    x, ids, layer = random_array(rng, (3, 16), jnp.float32), jnp.zeros((3,), jnp.int32), jnp.int32(0)
    with pytest.raises(ValueError, match="one KV pool"):
        unified_shrink(x, pool.k, pool.v[:, :1], layer, pool.pages, m.a_offsets, m.ranks, ids, max_rank=8, align=8)
    with pytest.raises(ValueError, match="adapter_ids"):
        unified_shrink(x, pool.k, pool.v, layer, pool.pages, m.a_offsets, m.ranks, ids[:2], max_rank=8, align=8)
    with pytest.raises(ValueError, match="ranks"):
        unified_shrink(x, pool.k, pool.v, layer, pool.pages, m.a_offsets, m.ranks[:0], ids, max_rank=8, align=8)
    with pytest.raises(ValueError, match="integer"):
        unified_shrink(
            x, pool.k, pool.v, layer, pool.pages.astype(jnp.float32), m.a_offsets, m.ranks, ids, max_rank=8, align=8
        )
    with pytest.raises(ValueError, match="powers of two"):
        unified_shrink(
            x, pool.k, pool.v, layer, pool.pages, m.a_offsets, m.ranks, ids, max_rank=8, align=8, rank_block=6
        )
    with pytest.raises(ValueError, match="power of two"):
        unified_shrink_xla(x, pool.k, pool.v, layer, pool.pages, m.a_offsets, m.ranks, ids, max_rank=8, align=3)
    with pytest.raises(ValueError, match="power of two"):
        unified_shrink(x, pool.k, pool.v, layer, pool.pages, m.a_offsets, m.ranks, ids, max_rank=8, align=8, k_splits=3)
    with pytest.raises(ValueError, match=r"\[T, P, C\]"):
        unified_expand(
            x, x[:, None, :3].repeat(3, 1), pool.k, pool.v, layer, pool.pages, m.b_offsets, m.ranks, ids, align=8
        )
    with pytest.raises(ValueError, match=r"must be \[T, C\]"):
        unified_expand(x, x[:1], pool.k, pool.v, layer, pool.pages, m.b_offsets, m.ranks, ids, align=8)


def test_a_pool_of_more_than_two_billion_elements_traces():
    """A GPU-sized pool (2^31 elements and more over its layers; each layer indexes in int32): both
    paths trace, and a layer too large for int32 indices is refused with a clear error."""
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pool = sd((30, 70_000, 16, 3, 64), jnp.bfloat16)  # 6.5e9 elements; a layer 1.07e9
    tables = (sd((), i32), sd((8, 40), i32), sd((8,), i32), sd((8,), i32), sd((5,), i32))
    x, y, h = sd((5, 576), jnp.bfloat16), sd((5, 1536), jnp.bfloat16), sd((5, 64), jnp.bfloat16)
    for shrink, expand in ((unified_shrink_xla, unified_expand_xla), (unified_shrink, unified_expand)):
        kw = {} if shrink is unified_shrink_xla else dict(align=128)
        assert jax.eval_shape(
            lambda x, k, v, *t: shrink(x, k, v, *t, max_rank=64, **kw), x, pool, pool, *tables
        ).shape == (
            5,
            64,
        )
        assert jax.eval_shape(lambda y, h, k, v, *t: expand(y, h, k, v, *t, **kw), y, h, pool, pool, *tables).shape == (
            5,
            1536,
        )
    huge = sd((2, 150_000, 16, 8, 128), jnp.bfloat16)  # a layer of 2.5e9 elements
    with pytest.raises(ValueError, match="int32"):
        jax.eval_shape(lambda x, k, v, *t: unified_shrink_xla(x, k, v, *t, max_rank=64), x, huge, huge, *tables)


def _check_tiled(rng, pool, module, ids, *, hidden, out, max_rank, dtype, block_rows=16):
    """The tiled kernels on rows grouped by slot, against the reference (h exact zeros past ranks)."""
    x = random_array(rng, (len(ids), hidden), dtype)
    y = random_array(rng, (len(ids), out), dtype)
    ids = jnp.asarray(ids, jnp.int32)
    groups = make_row_groups(ids, num_slots=pool.pages.shape[0] + 1, seg_len=None, block_rows=(block_rows,))
    common = (pool.k, pool.v, jnp.int32(LAYER), pool.pages)
    knobs = dict(align=pool.align, block_rows=block_rows, interpret=True)
    h = unified_tiled_shrink(x, *common, module.a_offsets, module.ranks, groups, max_rank=max_rank, **knobs)
    h_want = unified_shrink_reference(x, *common, module.a_offsets, module.ranks, ids, max_rank=max_rank)
    assert_close(h, h_want, dtype)
    ranks = np.asarray(module.ranks)
    for t, s in enumerate(np.asarray(ids)):  # exact zeros at and past the rank
        assert not np.asarray(h[t, ranks[s] if s >= 0 else 0 :]).any()
    h_in = nan_past_rank(h, module.ranks, ids)
    got = unified_tiled_expand(y, h_in, *common, module.b_offsets, module.ranks, groups, **knobs)
    assert_close(got, unified_expand_reference(y, h_in, *common, module.b_offsets, module.ranks, ids), dtype)
    base = np.asarray(ids) < 0
    np.testing.assert_array_equal(np.asarray(got)[base], np.asarray(y)[base])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tiled_kernels_on_prefill_runs_and_decode_rows(rng, dtype):
    """Runs of rows sharing a slot (prefill chunks of 1-40 rows, tiles cut mid-run), single rows on
    their own slots, base rows and rank-0 slots, shuffled; ranks 1-128 with rank-rows crossing
    segments and pages, NaN in every gap, free page and tail."""
    ranks = [1, 16, 33, 128, 0, 8, 64, 5]
    pool = unified_pool(rng, [[r, (r * 7) % 50] for r in ranks], [(96, 160), (48, 80)], align=16)
    runs = [(2, 40), (6, 17), (-1, 5), (3, 1), (0, 3), (4, 2), (7, 19), (1, 1), (5, 1)]
    ids = np.concatenate([np.full(n, s) for s, n in runs])
    ids = np.concatenate([ids[:30], rng.permutation(ids[30:])])  # a run, then rows in any order
    for module, (hidden, out) in zip(pool.modules, [(96, 160), (48, 80)], strict=True):
        _check_tiled(rng, pool, module, ids, hidden=hidden, out=out, max_rank=128, dtype=dtype)


def test_tiled_kernels_refuse_chunks_too_small_for_a_dot(rng):
    pool = unified_pool(rng, [[4]], [(24, 40)], align=8)
    m, x = pool.modules[0], random_array(rng, (5, 24), jnp.float32)
    groups = make_row_groups(jnp.zeros((5,), jnp.int32), num_slots=2, seg_len=None, block_rows=(16,))
    assert not tiled_fits(24, pool.k, 8)
    with pytest.raises(ValueError, match="at least 16"):
        unified_tiled_shrink(
            x, pool.k, pool.v, jnp.int32(0), pool.pages, m.a_offsets, m.ranks, groups, max_rank=8, align=8
        )


def test_the_engines_shrink_knobs_come_from_the_tuning_table(monkeypatch):
    from pallas_kernels.lora import tuning

    monkeypatch.setitem(tuning.UNIFIED_SHRINK, 64, dict(k_splits=4, unroll=4, num_stages=1, rank_block=16))
    monkeypatch.setitem(tuning.UNIFIED_SHRINK, 1 << 30, dict(k_splits=8, unroll=2, num_stages=3, rank_block=32))
    monkeypatch.setitem(tuning.UNIFIED_EXPAND, 1 << 30, dict(block=256, rank_block=8, num_warps=8))
    assert tuning.unified_shrink_knobs(40) == dict(k_splits=4, unroll=4, num_stages=1, rank_block=16)
    assert tuning.unified_shrink_knobs(65) == dict(k_splits=8, unroll=2, num_stages=3, rank_block=32)
    assert tuning.unified_expand_knobs(65) == dict(block=256, rank_block=8, num_warps=8)


@pytest.mark.parametrize(
    "dtype, k_splits, unroll, outs, max_rank, rank_block, align",
    [
        (jnp.bfloat16, 1, 1, (96, 32, 64), 16, 8, 16),
        (jnp.float32, 4, 2, (96, 32, 64), 16, 8, 16),
        (jnp.bfloat16, 2, 3, (96, 32, 64), 16, 8, 16),
        (jnp.float32, 2, 1, (12, 20, 4), 13, 8, 4),  # widths of other powers of two; blocks past max_rank
        (jnp.float32, 1, 2, (24, 40), 5, 16, 8),  # two modules (gate/up); a rank block wider than max_rank
    ],
)
def test_a_group_of_modules_in_one_launch_each_way(rng, dtype, k_splits, unroll, outs, max_rank, rank_block, align):
    """q/k/v-like modules sharing x (outputs side by side in one y, as the serving layout's fused
    projection holds them), each slot with its own rank per module (0 included), base rows: one shrink
    and one expand for the group equal the reference module by module, and NaN past each module's
    rank in every part of h is never read. Rank blocks reaching past max_rank must not write into the
    next module's columns."""
    hidden = 64
    module_ranks = [[5, 0, 3], [16, 8, 1], [0, 0, 0], [1, 12, 16], [9, 2, 0]]
    module_ranks = [[min(r, max_rank) for r in ranks[: len(outs)]] for ranks in module_ranks]
    module_ranks[1][0] = max_rank  # a module at the full max_rank
    pool = unified_pool(rng, module_ranks, [(hidden, o) for o in outs], align=align)
    ids = jnp.asarray(rng.permutation([0, 1, 2, 3, 4, -1, 3, 1]), jnp.int32)
    x = random_array(rng, (len(ids), hidden), dtype)
    y = random_array(rng, (len(ids), sum(outs)), dtype)
    columns = tuple(sum(outs[:i]) for i in range(len(outs)))
    stack = lambda name: jnp.stack([getattr(m, name) for m in pool.modules], axis=1)  # noqa: E731
    common = (pool.k, pool.v, jnp.int32(LAYER), pool.pages)
    knobs = dict(align=pool.align, block=16, rank_block=rank_block, interpret=True)
    parts = unified_shrink(
        x, *common, stack("a_offsets"), stack("ranks"), ids, max_rank=max_rank, k_splits=k_splits, unroll=unroll,
        partials=k_splits > 1, **knobs,
    )  # fmt: skip
    width = len(outs) * max_rank
    assert parts.shape == ((len(ids), width) if k_splits == 1 else (len(ids), k_splits, width))
    summed = parts if k_splits == 1 else jnp.sum(parts, axis=1).astype(dtype)
    want_y = []
    for m, module in enumerate(pool.modules):
        a_args = (*common, module.a_offsets, module.ranks, ids)
        h_want = unified_shrink_reference(x, *a_args, max_rank=max_rank)
        assert_close(summed[:, m * max_rank : (m + 1) * max_rank], h_want, dtype)
        b_args = (*common, module.b_offsets, module.ranks, ids)
        want_y.append(unified_expand_reference(y[:, columns[m] : columns[m] + outs[m]], h_want, *b_args))
    # Columns past each module's rank, in every part, must not be read.
    poisoned = parts
    for m, module in enumerate(pool.modules):
        cols = slice(m * max_rank, (m + 1) * max_rank)
        if k_splits == 1:
            poisoned = poisoned.at[:, cols].set(nan_past_rank(parts[:, cols], module.ranks, ids))
        else:
            for p in range(k_splits):
                poisoned = poisoned.at[:, p, cols].set(nan_past_rank(parts[:, p, cols], module.ranks, ids))
    got = unified_expand(y, poisoned, *common, stack("b_offsets"), stack("ranks"), ids, columns=columns, **knobs)
    assert_close(got, jnp.concatenate(want_y, axis=1), dtype)
    base = np.asarray(ids) < 0
    np.testing.assert_array_equal(np.asarray(got)[base], np.asarray(y)[base])


def test_a_group_refuses_columns_that_do_not_fit(rng):
    pool = unified_pool(rng, [[4, 4]], [(16, 16), (16, 16)])
    offs = jnp.stack([m.b_offsets for m in pool.modules], axis=1)
    ranks = jnp.stack([m.ranks for m in pool.modules], axis=1)
    y, h, ids = random_array(rng, (3, 32), jnp.float32), jnp.zeros((3, 16)), jnp.zeros((3,), jnp.int32)
    args = (pool.k, pool.v, jnp.int32(0), pool.pages, offs, ranks, ids)
    with pytest.raises(ValueError, match="2 modules need 2 columns"):
        unified_expand(y, h, *args, align=8)
    with pytest.raises(ValueError, match="ascend"):
        unified_expand(y, h, *args, align=8, columns=(0, 40))
    with pytest.raises(ValueError, match=r"\[S\] or \[S, G\]"):
        unified_expand(y, h, *args[:4], offs, ranks[:, :1], ids, align=8, columns=(0, 16))
    # The XLA path and the tiled kernels take one module a call: [S, G] tables are refused by name.
    with pytest.raises(ValueError, match="one module a call"):
        unified_expand_xla(y, h, *args)
    groups = make_row_groups(ids, num_slots=2, seg_len=None, block_rows=(16,))
    with pytest.raises(ValueError, match="one module a call"):
        unified_tiled_expand(y, h, *args[:6], groups, align=8)
