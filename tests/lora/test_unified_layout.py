"""Adapters in the KV cache's pages (S-LoRA's unified pool): the layout's bytes follow true ranks, and
an adapter packed, given pages by the KV page table and written into the pool is read back by the
unified kernels (interpret mode) as x @ A @ B of its own weights, module by module, `rank_pattern`
included, next to another adapter and with every other page NaN."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.common import LLAMA2_7B
from jaxlora.config import TARGET_MODULES, LoraConfig, ModelConfig
from jaxlora.engine.kv_pages import PageTable
from jaxlora.lora.paged_bank import page_counts
from jaxlora.lora.unified_bank import init_unified_tables, slot_rows, write_slot
from jaxlora.lora.unified_layout import (
    FACTOR_ALIGN,
    adapter_layout,
    adapter_nbytes,
    max_adapter_pages,
    pack_run,
    segment_elems,
    write_adapter_pages,
)
from pallas_kernels.lora.unified import unified_expand, unified_shrink
from tests.factories import tiny_config
from tests.tolerances import assert_close

PAGE_SIZE = 4


def _weights(rng, model: ModelConfig, ranks: dict[str, int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for m, r in ranks.items():
        if r:
            d_in, d_out = model.module_shape(m)
            a = rng.standard_normal((model.num_layers, d_in, r)).astype(np.float32) / np.sqrt(d_in)
            b = rng.standard_normal((model.num_layers, r, d_out)).astype(np.float32) / np.sqrt(r)
            out[m] = (a, b)
    return out


def test_an_adapters_bytes_follow_its_ranks():
    """7B shape, 16-position pages: rank 8 on q/k/v/o takes an eighth of rank 64's pages; a mixed
    `rank_pattern` lies in between; all seven modules at rank 16 take ten pages (160 positions' KV)."""
    lora = LoraConfig(max_slots=8, max_rank=64, target_modules=TARGET_MODULES)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    size = lambda ranks: adapter_nbytes(adapter_layout(ranks, LLAMA2_7B, lora, 16), LLAMA2_7B, 16, 2)
    small, large = size(dict.fromkeys(attention, 8)), size(dict.fromkeys(attention, 64))
    assert small <= (1 / 8 + 0.05) * large
    assert small < size({"q_proj": 8, "k_proj": 8, "v_proj": 64, "o_proj": 8}) < large
    assert adapter_layout(dict.fromkeys(TARGET_MODULES, 16), LLAMA2_7B, lora, 16).num_pages == 10
    assert (
        max_adapter_pages(LLAMA2_7B, lora, 16)
        == adapter_layout(dict.fromkeys(TARGET_MODULES, 64), LLAMA2_7B, lora, 16).num_pages
    )


def test_layout_offsets_are_aligned_consecutive_and_checked():
    """Factors in module order, each at the first FACTOR_ALIGN multiple after the one before (the
    kernels' chunks never straddle a segment), with gaps under FACTOR_ALIGN elements."""
    model = tiny_config()
    lora = LoraConfig(max_slots=4, max_rank=8, target_modules=("q_proj", "k_proj", "down_proj"))
    layout = adapter_layout({"q_proj": 3, "down_proj": 7}, model, lora, PAGE_SIZE)
    q_in, q_out = model.module_shape("q_proj")
    d_in, d_out = model.module_shape("down_proj")
    up = lambda n: -(-n // FACTOR_ALIGN) * FACTOR_ALIGN
    q_b = up(3 * q_in)
    d_a = up(q_b + 3 * q_out)
    d_b = up(d_a + 7 * d_in)
    assert layout.offsets == {"q_proj": (0, q_b), "down_proj": (d_a, d_b)}
    assert layout.run_elems == d_b + 7 * d_out
    assert layout.run_elems - (3 * (q_in + q_out) + 7 * (d_in + d_out)) < 3 * FACTOR_ALIGN
    assert (3 * q_in) % FACTOR_ALIGN, "the tiny model's widths must exercise a gap"
    assert layout.num_pages == -(-layout.run_elems // (2 * segment_elems(model, PAGE_SIZE)))
    assert layout.ranks["k_proj"] == 0
    with pytest.raises(ValueError, match="max_rank"):
        adapter_layout({"q_proj": 9}, model, lora, PAGE_SIZE)
    assert page_counts(5) == (1, 2, 4, 5)


def test_adapters_written_into_kv_pages_are_read_back_by_the_kernels():
    rng = np.random.default_rng(7)
    model = tiny_config(num_kv_heads=1, head_dim=8)  # 32-element segments: rank-rows straddle them
    lora = LoraConfig(max_slots=4, max_rank=8, target_modules=TARGET_MODULES)
    first = {"q_proj": 8, "k_proj": 3, "v_proj": 0, "o_proj": 5, "gate_proj": 1, "up_proj": 7, "down_proj": 8}
    second = dict.fromkeys(TARGET_MODULES, 2)
    adapters = {"first": (1, first, _weights(rng, model, first)), "second": (3, second, _weights(rng, model, second))}
    num_pages = 3 + sum(adapter_layout(r, model, lora, PAGE_SIZE).num_pages for _, r, _ in adapters.values())
    table = PageTable(num_pages, PAGE_SIZE, max_pages_per_seq=2)
    table.grow(0, 5)  # a sequence's KV pages first: adapters take what is left
    shape = (model.num_layers, num_pages, PAGE_SIZE, model.num_kv_heads, model.head_dim)
    k, v = jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan)
    max_pages = max_adapter_pages(model, lora, PAGE_SIZE)
    tables = init_unified_tables(lora, max_pages)
    for name, (slot, ranks, weights) in adapters.items():
        layout = adapter_layout(ranks, model, lora, PAGE_SIZE)
        page_ids = table.take_for(name, layout.num_pages)
        assert not set(page_ids.tolist()) & set(table.pages_of(0))
        k, v = write_adapter_pages(
            (k, v), jnp.asarray(page_ids), jnp.asarray(pack_run(weights, layout, model, PAGE_SIZE, np.float32))
        )
        tables = write_slot(tables, np.int32(slot), slot_rows(layout, page_ids, lora, max_pages))
    table.check()

    ids = np.asarray([1, -1, 3, 1, 0, 3], np.int32)  # slot 0: rank 0 everywhere (the base model)
    for layer in range(model.num_layers):
        for m in TARGET_MODULES:
            d_in, d_out = model.module_shape(m)
            x = jnp.asarray(rng.standard_normal((len(ids), d_in)), jnp.float32)
            y = jnp.asarray(rng.standard_normal((len(ids), d_out)), jnp.float32)
            common = (k, v, jnp.int32(layer), tables["pages"])
            off, rk = tables["offsets"][m], tables["ranks"][m]
            kw = dict(align=FACTOR_ALIGN, block=16, interpret=True)
            h = unified_shrink(x, *common, off[:, 0], rk, jnp.asarray(ids), max_rank=8, **kw)
            got = unified_expand(y, h, *common, off[:, 1], rk, jnp.asarray(ids), **kw)
            want = np.asarray(y).copy()
            for t, s in enumerate(ids):
                name = {1: "first", 3: "second"}.get(int(s))
                if name and m in adapters[name][2]:
                    a, b = adapters[name][2][m]
                    want[t] += np.asarray(x[t]) @ a[layer] @ b[layer]
            assert_close(got, want, jnp.float32, err_msg=f"{m} layer {layer}")
    assert table.give_back("first") == adapter_layout(first, model, lora, PAGE_SIZE).num_pages
    table.check()
