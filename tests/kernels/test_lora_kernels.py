"""Triton LoRA kernels (interpret mode on CPU) against the loop reference.

Banks hold NaN in every unused slot, and in slot 0 for the kernels (which must never read it), so a
stray read shows. Shapes are fixed per test so the interpreter compiles each kernel once and slot
patterns vary as data.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.lora import common, expand, reference, xla
from tests.kernels.kernel_data import bank, random_array
from tests.tolerances import assert_close

NUM_TOKENS = 24  # not a multiple of the 16-row tile
NUM_SLOTS = NUM_TOKENS + 1


def slot_patterns(rng) -> dict[str, np.ndarray]:
    t = NUM_TOKENS
    return {
        "one_adapter": np.full(t, 3, np.int32),
        "several_with_base_rows": rng.choice([0, 2, 5, 9], t).astype(np.int32),
        "each_row_its_own": rng.permutation(np.arange(1, t + 1)).astype(np.int32),
        "all_base": np.zeros(t, np.int32),
    }


def _decode_expand(y, h, b, slots, *, grouped: bool = False, interpret: bool, **knobs):
    """The decode expand, or with `grouped` the benchmarks' candidate over rows grouped by slot."""
    if not grouped:
        return pk.bgmv_expand(y, h, b, slots, interpret=interpret, **knobs)
    groups = common.make_row_groups(slots, num_slots=b.shape[0], seg_len=None, block_rows=())
    return expand.grouped_expand(y, h, b, groups, mode="decode", interpret=interpret, **knobs)


class TestTritonKernels:
    INTERPRET = True

    # The decode expand on every shape, and the benchmarks' grouped candidate (rows sorted by slot,
    # `grouped_expand(mode="decode")`) on some, also below 16 rows per tile, where it multiplies and
    # sums instead of a tensor-core dot.
    ROWS, GROUPED = dict(block_rows=4), dict(grouped=True, block_rows=16, block_out=128)
    GROUPED_SMALL = dict(grouped=True, block_rows=4, block_out=128, out_split=2)

    @pytest.mark.parametrize(
        "hidden, rank, out_dim, dtype, expand_knobs",
        [
            (576, 1, 1536, jnp.float32, (ROWS,)),
            (1536, 8, 576, jnp.bfloat16, (ROWS, GROUPED_SMALL)),
            (2049, 16, 2049, jnp.float32, (ROWS, GROUPED)),
            (4096, 64, 576, jnp.bfloat16, (ROWS,)),
            (576, 128, 576, jnp.bfloat16, (GROUPED, dict(block_rows=1))),
        ],
    )
    def test_bgmv_matches_loop(self, rng, hidden, rank, out_dim, dtype, expand_knobs):
        x = random_array(rng, (NUM_TOKENS, hidden), dtype)
        y = random_array(rng, (NUM_TOKENS, out_dim), dtype)
        for name, slots in slot_patterns(rng).items():
            a = bank(rng, NUM_SLOTS, (hidden, rank), dtype, slots, nan_slot0=True)
            b = bank(rng, NUM_SLOTS, (rank, out_dim), dtype, slots, nan_slot0=True)
            slots = jnp.asarray(slots)
            h_ref = reference.shrink_loop(x, jnp.nan_to_num(a.at[0].set(0)), slots)
            y_ref = reference.expand_loop(y, h_ref, jnp.nan_to_num(b.at[0].set(0)), slots)
            h = pk.bgmv_shrink(x, a, slots, interpret=self.INTERPRET)
            assert_close(h, h_ref, dtype)
            base = np.asarray(slots) == 0
            np.testing.assert_array_equal(np.asarray(h, np.float32)[base], 0, err_msg=name)
            for knobs in expand_knobs:
                y_new = _decode_expand(y, h_ref, b, slots, interpret=self.INTERPRET, **knobs)
                assert_close(y_new, y_ref, dtype)
                np.testing.assert_array_equal(np.asarray(y_new)[base], np.asarray(y)[base], err_msg=f"{name} {knobs}")

    @pytest.mark.parametrize("dtype", [jnp.bfloat16])  # f32 segments: the hypothesis test below
    def test_sgmv_with_empty_segments(self, rng, dtype):
        hidden, rank, out_dim = 576, 16, 300
        starts = jnp.array([0, 5, 5, 17, 17, NUM_TOKENS], jnp.int32)  # two empty segments
        seg_slots = jnp.array([4, 7, 0, 9, 2], jnp.int32)
        tokens = jnp.repeat(seg_slots, jnp.diff(starts), total_repeat_length=NUM_TOKENS)
        a = bank(rng, NUM_SLOTS, (hidden, rank), dtype, [4, 9, 2], nan_slot0=True)  # slot 7: empty, NaN
        b = bank(rng, NUM_SLOTS, (rank, out_dim), dtype, [4, 9, 2], nan_slot0=True)
        x = random_array(rng, (NUM_TOKENS, hidden), dtype)
        y = random_array(rng, (NUM_TOKENS, out_dim), dtype)
        h_ref = reference.shrink_loop(x, jnp.nan_to_num(a), tokens)
        assert_close(pk.sgmv_shrink(x, a, starts, seg_slots, interpret=self.INTERPRET), h_ref, dtype)
        y_ref = reference.expand_loop(y, h_ref, jnp.nan_to_num(b), tokens)
        assert_close(pk.sgmv_expand(y, h_ref, b, starts, seg_slots, interpret=self.INTERPRET), y_ref, dtype)

    def test_multi_module_reads_only_its_columns(self, rng):
        dtype, hidden, rank = jnp.float32, 576, 16
        outs = (576, 192, 64)
        slots = jnp.asarray(rng.choice([0, 1, 3], NUM_TOKENS).astype(np.int32))
        a = bank(rng, NUM_SLOTS, (hidden, 3 * rank), dtype, [1, 3])  # G*R = 48: padded to 64 inside
        bs = tuple(bank(rng, NUM_SLOTS, (rank, o), dtype, [1, 3]) for o in outs)
        x = random_array(rng, (NUM_TOKENS, hidden), dtype)
        ys = tuple(random_array(rng, (NUM_TOKENS, o), dtype) for o in outs)
        h = pk.lora_shrink(x, a, slots, backend="pallas", interpret=self.INTERPRET)
        assert_close(h, reference.shrink_loop(x, jnp.nan_to_num(a), slots), dtype)
        got = pk.lora_expand_multi(ys, h, bs, slots, backend="pallas", interpret=self.INTERPRET)
        for g, (y, b, y_new) in enumerate(zip(ys, bs, got)):
            h_g = h[:, g * rank : (g + 1) * rank]
            assert_close(y_new, reference.expand_loop(y, h_g, jnp.nan_to_num(b), slots), dtype)
        # A NaN in another module's columns of h must not leak into this module's output.
        h_poisoned = h.at[:, rank:].set(jnp.nan)
        y0 = pk.lora_expand(ys[0], h_poisoned[:, :rank], bs[0], slots, backend="pallas", interpret=self.INTERPRET)
        only_first = pk.bgmv_expand(ys[0], h_poisoned, bs[0], slots, h_col=0, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(only_first), np.asarray(y0))

    @settings(max_examples=12, deadline=None)
    @given(data=st.data())
    def test_sgmv_random_segmentations(self, data):
        num_segments, hidden, rank, out_dim = 6, 64, 8, 32
        cuts = sorted(
            data.draw(st.lists(st.integers(0, NUM_TOKENS), min_size=num_segments - 1, max_size=num_segments - 1))
        )
        starts = jnp.array([0, *cuts, NUM_TOKENS], jnp.int32)
        seg_slots = jnp.array(
            data.draw(st.lists(st.integers(0, 7), min_size=num_segments, max_size=num_segments)), jnp.int32
        )
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        tokens = jnp.repeat(seg_slots, jnp.diff(starts), total_repeat_length=NUM_TOKENS)
        a = bank(rng, 8, (hidden, rank), jnp.float32, range(8))
        b = bank(rng, 8, (rank, out_dim), jnp.float32, range(8))
        x = random_array(rng, (NUM_TOKENS, hidden), jnp.float32)
        y = random_array(rng, (NUM_TOKENS, out_dim), jnp.float32)
        h_ref = xla.shrink_xla(x, a, tokens)
        assert_close(pk.sgmv_shrink(x, a, starts, seg_slots, interpret=self.INTERPRET), h_ref, jnp.float32)
        assert_close(
            pk.sgmv_expand(y, h_ref, b, starts, seg_slots, interpret=self.INTERPRET),
            xla.expand_xla(y, h_ref, b, tokens),
            jnp.float32,
        )


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=8, max_size=8), block_rows=st.sampled_from([16, 32]))
def test_work_items_cover_every_row_once(lengths, block_rows):
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = 8 * 40  # fixed, so the example shapes never change (no recompiles)
    seg_slots = np.arange(1, len(lengths) + 1, dtype=np.int32)
    tile, lo, hi, slot = map(
        np.asarray, common.work_items(jnp.asarray(starts), jnp.asarray(seg_slots), num_tokens, block_rows)
    )
    covered = np.zeros(num_tokens, int)
    for t, l, h, s in zip(tile, lo, hi, slot):
        if l < h:
            assert t * block_rows <= l and h <= (t + 1) * block_rows  # inside its tile
            assert np.all(seg_slots[np.searchsorted(starts, np.arange(l, h), side="right") - 1] == s)
            covered[l:h] += 1
    np.testing.assert_array_equal(covered[: starts[-1]], 1)


@settings(max_examples=15, deadline=None)
@given(slots=st.lists(st.integers(0, 9), min_size=40, max_size=40))
def test_group_rows_by_slot_is_a_stable_sort(slots):
    slots = np.asarray(slots, np.int32)
    order, starts, seg_slots = map(np.asarray, common.group_rows_by_slot(jnp.asarray(slots), min(10, len(slots))))
    np.testing.assert_array_equal(order, np.argsort(slots, kind="stable"))
    distinct = np.unique(slots)
    np.testing.assert_array_equal(seg_slots[: len(distinct)], distinct)
    np.testing.assert_array_equal(np.diff(starts)[: len(distinct)], [np.sum(slots == s) for s in distinct])
