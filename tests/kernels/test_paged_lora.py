"""The paged LoRA kernels (interpret mode) against the reference that rebuilds dense factors from the
page tables: every rank shape class, `rank_pattern`, shuffled tables, NaN-poisoned free pages and
masked rank-rows, base-model and rank-0 rows, every row on its own adapter, awkward widths."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora.paged import PagedLayout, paged_expand, paged_shrink
from pallas_kernels.lora.paged_reference import paged_expand_reference, paged_shrink_reference
from tests.kernels.kernel_data import random_array
from tests.kernels.paged_lora_data import nan_past_rank, paged_module
from tests.tolerances import assert_close

P = 8  # rank-rows per page
MAX_PAGES = 16  # rank 128


def _check_module(rng, module, ids, *, hidden, out, dtype):
    """Shrink then expand on `ids`, each against the reference, h NaN past each row's rank."""
    x = random_array(rng, (len(ids), hidden), dtype)
    y = random_array(rng, (len(ids), out), dtype)
    ids = jnp.asarray(ids, jnp.int32)
    h = paged_shrink(x, module.pool, module.a_table, module.ranks, ids, block=16, interpret=True)
    assert_close(h, paged_shrink_reference(x, module.pool, module.a_table, module.ranks, ids), dtype)
    h_in = nan_past_rank(h, module.ranks, ids)
    got = paged_expand(y, h_in, module.pool, module.b_table, module.ranks, ids, block=16, interpret=True)
    assert_close(got, paged_expand_reference(y, h_in, module.pool, module.b_table, module.ranks, ids), dtype)
    base = np.asarray(ids) < 0
    np.testing.assert_array_equal(np.asarray(got)[base], np.asarray(y)[base])
    return h


@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # float32: every rank, below
def test_every_rank_class_each_row_on_its_own_adapter(rng, dtype):
    """Ranks 1, P-1, P, P+1, 128, a random sample of 1..128 and 0; one row per adapter plus base rows."""
    sample = rng.choice(np.arange(2, 128), size=6, replace=False)
    ranks = [1, P - 1, P, P + 1, 128, 0, *sample.tolist()]
    module = paged_module(rng, ranks, hidden=37, out=29, page_rows=P, max_pages=MAX_PAGES, dtype=dtype)
    ids = rng.permutation([*range(len(ranks)), -1, -1])
    h = _check_module(rng, module, ids, hidden=37, out=29, dtype=dtype)
    rank_of_row = np.where(ids >= 0, np.asarray(ranks)[np.maximum(ids, 0)], 0)
    for t, r in enumerate(rank_of_row):  # exact zeros at and past the rank, nonzero below it
        assert not np.asarray(h[t, r:]).any()
        assert np.asarray(h[t, :r]).all()


def test_rank_pattern_and_rows_sharing_adapters(rng):
    """Per-module ranks of the same adapters (q and an MLP-like module of other widths), rows shuffled
    over adapters with repeats and base rows."""
    q_ranks, mlp_ranks = [16, 4, 64, 0, 9], [8, 33, 16, 2, 0]
    ids = rng.choice(np.arange(-1, 5), size=14)
    ids[:6] = [-1, 0, 1, 2, 3, 4]
    for ranks, hidden, out in ((q_ranks, 48, 48), (mlp_ranks, 19, 70)):
        module = paged_module(rng, ranks, hidden=hidden, out=out, page_rows=P, max_pages=9, dtype=jnp.float32)
        _check_module(rng, module, ids, hidden=hidden, out=out, dtype=jnp.float32)


def test_one_rank_row_per_page(rng):
    """P = 1, S-LoRA's own layout: one page per rank-row."""
    module = paged_module(rng, [3, 1, 5], hidden=21, out=17, page_rows=1, max_pages=6, dtype=jnp.float32)
    _check_module(rng, module, [2, -1, 0, 1, 2], hidden=21, out=17, dtype=jnp.float32)


def test_pools_exactly_each_factors_width(rng):
    """One pool per rank-row width: the shrink reads A^T pages from a pool exactly `hidden` wide and
    the expand B pages from one exactly `out` wide (no trailing columns to fall back on)."""
    hidden, out = 24, 40
    module = paged_module(rng, [5, 16, 0, 9], hidden=hidden, out=out, page_rows=P, max_pages=3, dtype=jnp.float32)
    a_pool, b_pool = module.pool[:, :, :hidden], module.pool[:, :, :out]
    ids = jnp.asarray([2, 0, -1, 1, 3, 1], jnp.int32)
    x = random_array(rng, (len(ids), hidden), jnp.float32)
    y = random_array(rng, (len(ids), out), jnp.float32)
    h = paged_shrink(x, a_pool, module.a_table, module.ranks, ids, block=16, interpret=True)
    assert_close(h, paged_shrink_reference(x, module.pool, module.a_table, module.ranks, ids), jnp.float32)
    got = paged_expand(y, h, b_pool, module.b_table, module.ranks, ids, block=16, interpret=True)
    want = paged_expand_reference(y, h, module.pool, module.b_table, module.ranks, ids)
    assert_close(got, want, jnp.float32)
    assert np.isfinite(np.asarray(got)).all()


def test_bad_operands_are_refused(rng):
    module = paged_module(rng, [4], hidden=16, out=16, page_rows=P, max_pages=2, dtype=jnp.float32)
    x, ids = random_array(rng, (3, 16), jnp.float32), jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        paged_shrink(x, module.pool[:, :6], module.a_table, module.ranks, ids, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        paged_shrink(jnp.ones((3, 64)), module.pool, module.a_table, module.ranks, ids, interpret=True)
    with pytest.raises(ValueError, match="adapter_ids"):
        paged_shrink(x, module.pool, module.a_table, module.ranks, ids[:2], interpret=True)
    with pytest.raises(ValueError, match="ranks"):
        paged_shrink(x, module.pool, module.a_table, module.ranks[:0], ids, interpret=True)


def test_rank_8_takes_an_eighth_of_rank_64s_bytes():
    """7B attention modules (4096 wide, bf16), rank-rows 8 to a page, tables sized for rank 128."""
    layout = PagedLayout(page_rows=8, width=4096, itemsize=2, max_pages=16)
    modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    small = layout.adapter_bytes({m: 8 for m in modules})
    large = layout.adapter_bytes({m: 64 for m in modules})
    assert small <= (1 / 8 + 0.05) * large
    mixed = layout.adapter_bytes({"q_proj": 8, "k_proj": 8, "v_proj": 64, "o_proj": 8})
    assert small < mixed < large
    mlp = PagedLayout(page_rows=8, width=4096, out_width=11008, itemsize=2, max_pages=16)  # gate_proj
    assert mlp.module_bytes(16) == 2 * 8 * (4096 + 11008) * 2 + 2 * 16 * 4


def test_every_rank_from_0_to_128(rng):
    """Ranks 0..128 at once, one row each plus base rows (shuffled), on narrow factors (two column
    blocks each) to keep the interpreter quick."""
    ranks = np.arange(0, 129)
    module = paged_module(rng, ranks, hidden=21, out=19, page_rows=P, max_pages=MAX_PAGES, dtype=jnp.float32)
    ids = rng.permutation([*range(129), -1, -1])
    _check_module(rng, module, ids, hidden=21, out=19, dtype=jnp.float32)
