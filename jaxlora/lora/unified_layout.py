"""S-LoRA's unified pages: an adapter's weights stored IN the KV cache's pages, at true rank.

The KV pool (`jaxlora.model.kv_cache.PagedKVCache`, whose (k, v) `write_adapter_pages` takes) is

    k, v   [L, num_pages, page_size, num_kv_heads, head_dim]

and a KV page id names, for every layer l, one K segment k[l, page] and one V segment v[l, page] of
E = page_size * num_kv_heads * head_dim elements each. An adapter is given whole KV pages by the
same allocator as sequences (`jaxlora.engine.kv_pages.PageTable.take_for`), and its layer-l weights
fill the layer-l segments of those pages, so memory moves between KV and adapters page by page and
an adapter costs what its ranks weigh:

    per layer, an adapter is one run of elements laid end to end over its segments, in the order
        segment 2i = k[l, pages[i]], segment 2i + 1 = v[l, pages[i]]
    and the run holds, for each target module m (canonical order) with rank r_m > 0,
        A^T's rank-rows [r_m, in_m]  at offsets[m][0]   (row r = A[:, r])
        B's rank-rows   [r_m, out_m] at offsets[m][1]   (row r = B[r, :])
    i.e. element `o` of the run lies in segment o // E at o % E. A rank-row may straddle two
    segments. Each factor starts at a multiple of FACTOR_ALIGN elements, so the kernels load whole
    aligned chunks (a factor of a 4096-wide model needs no gap; other widths leave gaps of under
    FACTOR_ALIGN elements); nothing else is padded but the last page's tail.

An adapter of per-layer size S = sum_m r_m (in_m + out_m) (plus the gaps) takes ceil(S / 2E) pages (`UnifiedLayout`);
all layers use the same page ids, as a sequence's KV does. The kernels (`pallas_kernels.lora.unified`)
read a row's factor through (pages, offset, rank); the device bank holds only those small tables
(`jaxlora.lora.unified_bank`), the weights are the KV pool's. The adapter's dtype is the pool's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jaxlora.config import LoraConfig, ModelConfig

# Elements: each factor's start in the run is a multiple of this (the kernels' `align`). A power of
# two; 128 bf16 elements are 256 bytes, whole vector loads for every thread of a chunk.
FACTOR_ALIGN = 128

Weights = Mapping[str, tuple[np.ndarray, np.ndarray]]  # module -> (a [L, in, r], b [L, r, out])


def segment_elems(model: ModelConfig, page_size: int) -> int:
    """E: elements of one layer's K (or V) half of a KV page."""
    return page_size * model.num_kv_heads * model.head_dim


@dataclasses.dataclass(frozen=True)
class UnifiedLayout:
    """Where one adapter's factors lie in its per-layer run, and the KV pages the run takes.

    Attributes:
      ranks: every target module's rank (0: untouched).
      offsets: {module: (A^T offset, B offset)} in elements of the run, for modules of rank > 0.
      run_elems: S, the run's length (elements per layer).
      num_pages: KV pages the adapter takes: ceil(S / 2E).
    """

    ranks: dict[str, int]
    offsets: dict[str, tuple[int, int]]
    run_elems: int
    num_pages: int


def adapter_layout(
    module_ranks: Mapping[str, int], model: ModelConfig, lora: LoraConfig, page_size: int
) -> UnifiedLayout:
    """The layout of an adapter with these per-module ranks (`rank_pattern` included)."""
    ranks = {m: int(module_ranks.get(m, 0)) for m in lora.target_modules}
    offsets, cursor = {}, 0
    for m, r in ranks.items():
        if r < 0 or r > lora.max_rank:
            raise ValueError(f"{m}: rank {r} is outside [0, max_rank={lora.max_rank}]")
        if not r:
            continue
        width_in, width_out = model.module_shape(m)
        a_off = _align(cursor)
        b_off = _align(a_off + r * width_in)
        offsets[m] = (a_off, b_off)
        cursor = b_off + r * width_out
    per_page = 2 * segment_elems(model, page_size)
    return UnifiedLayout(ranks=ranks, offsets=offsets, run_elems=cursor, num_pages=-(-cursor // per_page))


def _align(offset: int) -> int:
    return -(-offset // FACTOR_ALIGN) * FACTOR_ALIGN


def max_adapter_pages(model: ModelConfig, lora: LoraConfig, page_size: int) -> int:
    """MP: pages of the largest adapter (max_rank on every target module), the page-table width."""
    return adapter_layout(dict.fromkeys(lora.target_modules, lora.max_rank), model, lora, page_size).num_pages


def adapter_nbytes(layout: UnifiedLayout, model: ModelConfig, page_size: int, itemsize: int) -> int:
    """Device bytes the adapter's pages take in the KV pool, every layer."""
    return layout.num_pages * 2 * segment_elems(model, page_size) * model.num_layers * itemsize


def pack_run(weights: Weights, layout: UnifiedLayout, model: ModelConfig, page_size: int, dtype) -> np.ndarray:
    """The adapter's pages as the KV pool holds them: [L, num_pages, 2, page_size, kv_heads, head_dim]
    in `dtype` ([:, i, 0] goes to k[:, pages[i]], [:, i, 1] to v[:, pages[i]]); zeros past the run."""
    L, E = model.num_layers, segment_elems(model, page_size)
    run = np.zeros((L, layout.num_pages * 2 * E), dtype)
    for m, (a_off, b_off) in layout.offsets.items():
        a, b = weights[m]  # a [L, in, r], b [L, r, out]
        r = layout.ranks[m]
        if a.shape[-1] != r or b.shape[-2] != r:
            raise ValueError(f"{m}: factors {a.shape} / {b.shape} are not of the layout's rank {r}")
        run[:, a_off : a_off + a.shape[1] * r] = np.swapaxes(a, 1, 2).reshape(L, -1)
        run[:, b_off : b_off + r * b.shape[2]] = np.asarray(b).reshape(L, -1)
    return run.reshape(L, layout.num_pages, 2, page_size, model.num_kv_heads, model.head_dim)


def _write_pages(kv: tuple[jax.Array, jax.Array], page_ids: jax.Array, packed: jax.Array):
    # kv: the pool's (k, v); out-of-range ids (warm-up's writes past the pool) are dropped, not clamped.
    k, v = kv
    k = k.at[:, page_ids].set(packed[:, :, 0].astype(k.dtype), mode="drop")
    v = v.at[:, page_ids].set(packed[:, :, 1].astype(v.dtype), mode="drop")
    return k, v


# Donated: the pages are written into the pool in place. Callers write runs of a few page counts
# (`jaxlora.lora.paged_bank.page_counts` up to MP, `page_runs`) so that every write program is
# compiled at warm-up.
write_adapter_pages = jax.jit(_write_pages, donate_argnums=0)
