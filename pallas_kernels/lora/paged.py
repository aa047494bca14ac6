"""LoRA shrink and expand that read each row's adapter through a page table, at its true rank.

Storage (S-LoRA's unified paging, adapter side). A page pool holds rank-rows of adapter modules
(the engine keeps one pool per rank-row width, jaxlora.lora.paged_bank; each kernel is handed the
pool of its factor's width, which may be exactly that width):

    pool   [num_pages, page_rows, width]   page_rows (P) rank-rows per page, each `width` wide
    table  [num_adapters, max_pages]       int32 page ids of one module's rank-rows, in rank order
    ranks  [num_adapters]                  int32 true rank of that module (0: no LoRA on it)

Both factors are stored as rank-rows so one page layout serves both products: the shrink reads A
transposed (rank-row r of A^T is A[:, r], `hidden` wide) and the expand reads B (rank-row r is
B[r, :], `out` wide); a module keeps one table for A^T and one for B. Rank-row r of an adapter lives
in page table[n, r // P], row r % P. A rank-r module takes ceil(r / P) pages, so its bytes grow with
its rank rather than a bank's max rank; `rank_pattern` adapters are just different `ranks` (and
tables) per module. Rows of width < `width` leave the pool's trailing columns unread, and the rows of
an adapter's last page past its rank are masked, never read.

Kernels (MBGMV-style, one program per token row; decode batches put many adapters in one step):
row t on adapter n = adapter_ids[t] (-1: the base model, delta 0) loops over only the
ceil(ranks[n] / P) pages its rank needs, so the work per row is proportional to that row's rank.

    paged_shrink:  h[t, r] = sum_k x[t, k] * A^T_n[r, k]       r < ranks[n]; h[t, r >= ranks[n]] = 0
    paged_expand:  y[t, o] + sum_r h[t, r] * B_n[r, o]          r < ranks[n]

Triton on GPU (interpret=True runs them on CPU). The engine reads a paged bank through them
(`lora.bank: paged`, jaxlora.lora.paged_bank). Their twins in `unified` read adapters out of the KV
cache's own pages instead (`lora.bank: unified`: one allocator for adapters and KV).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora.common import F32, is_pow2, pad_pow2

_KNOBS = ("block", "num_warps", "interpret")


def check_paged(
    x_or_h: jax.Array, pool: jax.Array, table: jax.Array, ranks: jax.Array, adapter_ids: jax.Array, *, cols: int
) -> None:
    """Clear errors for operand shapes the kernels cannot take (`cols`: the width the rank-rows use)."""
    if pool.ndim != 3:
        raise ValueError(f"pool {pool.shape} must be [num_pages, page_rows, width]")
    if not is_pow2(pool.shape[1]):
        raise ValueError(f"page_rows={pool.shape[1]} must be a power of two (Triton block sizes)")
    if cols > pool.shape[2]:
        raise ValueError(f"rank-rows {cols} wide do not fit the pool's width {pool.shape[2]}")
    if table.ndim != 2 or ranks.shape != (table.shape[0],):
        raise ValueError(
            f"table {table.shape} must be [num_adapters, max_pages] and ranks {ranks.shape} [num_adapters]"
        )
    if x_or_h.ndim != 2 or adapter_ids.shape != (x_or_h.shape[0],):
        raise ValueError(f"adapter_ids {adapter_ids.shape} must be [T] for rows {x_or_h.shape}")
    for name, arr in (("table", table), ("ranks", ranks), ("adapter_ids", adapter_ids)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {arr.dtype}")


def _row_pages(ids_ref, ranks_ref, row, page_rows: int):
    """(adapter, rank, pages) of `row`; a row with adapter -1 (or rank 0) has no pages."""
    adapter = ids_ref[row]
    has = adapter >= 0
    rank = jnp.where(has, ranks_ref[jnp.maximum(adapter, 0)], 0)
    return jnp.maximum(adapter, 0), rank, (rank + page_rows - 1) // page_rows


def _shrink_kernel(ids_ref, ranks_ref, table_ref, x_ref, pool_ref, h_ref, *, page_rows, block, hidden, max_rank):
    # ids_ref: [T]; ranks_ref: [N]; table_ref: [N, M]; x_ref: [T, D]; pool_ref: [NP, P, W]; h_ref: [T, M*P].
    row = pl.program_id(0)
    adapter, rank, num_pages = _row_pages(ids_ref, ranks_ref, row, page_rows)
    prow = jnp.arange(page_rows, dtype=jnp.int32)

    def page(j, carry):
        page_id = table_ref[adapter, j]
        r_ok = j * page_rows + prow < rank

        def k_step(s, acc):  # acc: [P] f32
            ks = s * block + jnp.arange(block, dtype=jnp.int32)
            k_ok = ks < hidden
            x = pltriton.load(x_ref.at[row, ks], mask=k_ok, other=0).astype(F32)
            a = pltriton.load(
                pool_ref.at[page_id, prow[:, None], ks[None, :]], mask=r_ok[:, None] & k_ok[None, :], other=0
            )
            return acc + jnp.sum(a.astype(F32) * x[None, :], axis=1)

        acc = lax.fori_loop(0, pl.cdiv(hidden, block), k_step, jnp.zeros((page_rows,), F32))
        # Whole page: its masked rank-rows are exact zeros (a masked A row loads as 0).
        pltriton.store(h_ref.at[row, j * page_rows + prow], acc.astype(h_ref.dtype))
        return carry

    lax.fori_loop(0, num_pages, page, 0)
    # Columns past the row's pages, disjoint from the page stores (no write-after-write race).
    cols = jnp.arange(pad_pow2(max_rank, 1), dtype=jnp.int32)
    rest = (cols >= num_pages * page_rows) & (cols < max_rank)
    pltriton.store(h_ref.at[row, cols], jnp.zeros(cols.shape, h_ref.dtype), mask=rest)


def _expand_kernel(ids_ref, ranks_ref, table_ref, y_ref, h_ref, pool_ref, o_ref, *, page_rows, block, out, rank_cols):
    # y_ref/o_ref: [T, O]; h_ref: [T, C]; pool_ref: [NP, P, W]; program (row, column block).
    row, col_block = pl.program_id(0), pl.program_id(1)
    adapter, rank, num_pages = _row_pages(ids_ref, ranks_ref, row, page_rows)
    os = col_block * block + jnp.arange(block, dtype=jnp.int32)
    o_ok = os < out
    prow = jnp.arange(page_rows, dtype=jnp.int32)

    def page(j, acc):  # acc: [block] f32
        page_id = table_ref[adapter, j]
        rs = j * page_rows + prow
        r_ok = (rs < rank) & (rs < rank_cols)
        h = pltriton.load(h_ref.at[row, rs], mask=r_ok, other=0).astype(F32)
        b = pltriton.load(pool_ref.at[page_id, prow[:, None], os[None, :]], mask=r_ok[:, None] & o_ok[None, :], other=0)
        return acc + jnp.sum(h[:, None] * b.astype(F32), axis=0)

    acc = lax.fori_loop(0, num_pages, page, jnp.zeros((block,), F32))
    y = pltriton.load(y_ref.at[row, os], mask=o_ok, other=0).astype(F32)
    pltriton.store(o_ref.at[row, os], (y + acc).astype(o_ref.dtype), mask=o_ok)


@functools.partial(jax.jit, static_argnames=_KNOBS)
def paged_shrink(
    x: jax.Array,
    pool: jax.Array,
    table: jax.Array,
    ranks: jax.Array,
    adapter_ids: jax.Array,
    *,
    block: int = 128,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """h[t] = x[t] @ A_n for n = adapter_ids[t], A_n read as rank-rows (A^T) through `table`.

    Args:
      x: [T, D] float.
      pool: [num_pages, P, W] page pool, W >= D; P a power of two.
      table: [N, M] int32 page ids of each adapter's A^T rank-rows (only the first ceil(rank / P) read).
      ranks: [N] int32 true ranks, 0 <= rank <= M * P (not checked on device: a larger rank reads
        past the table row).
      adapter_ids: [T] int32 in [-1, N); -1 is the base model.
      block: hidden columns per step (power of two); num_warps: Triton warps.
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      h: [T, M * P] in x.dtype, accumulated in f32; columns at and past a row's rank are 0.
    """
    check_paged(x, pool, table, ranks, adapter_ids, cols=x.shape[1])
    if not is_pow2(block):
        raise ValueError(f"block={block} must be a power of two")
    num_tokens, hidden = x.shape
    page_rows, max_rank = pool.shape[1], table.shape[1] * pool.shape[1]
    kernel = functools.partial(
        _shrink_kernel, page_rows=page_rows, block=min(block, pad_pow2(hidden)), hidden=hidden, max_rank=max_rank
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, max_rank), x.dtype),
        grid=(num_tokens,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lora_paged_shrink",
    )(adapter_ids.astype(jnp.int32), ranks.astype(jnp.int32), table.astype(jnp.int32), x, pool)


@functools.partial(jax.jit, static_argnames=_KNOBS)
def paged_expand(
    y: jax.Array,
    h: jax.Array,
    pool: jax.Array,
    table: jax.Array,
    ranks: jax.Array,
    adapter_ids: jax.Array,
    *,
    block: int = 128,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """y[t] + h[t, :rank] @ B_n for n = adapter_ids[t], B_n read as rank-rows through `table`.

    Args:
      y: [T, O] float, the base output.
      h: [T, C] the shrink's result (C >= the largest rank used; columns past a row's rank unread).
      pool: [num_pages, P, W] page pool, W >= O; P a power of two.
      table: [N, M] int32 page ids of each adapter's B rank-rows.
      ranks: [N] int32 true ranks; adapter_ids: [T] int32 in [-1, N), -1 leaves the row unchanged.
      block: output columns per program (power of two); num_warps: Triton warps.
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [T, O] in y.dtype, the delta accumulated in f32.
    """
    check_paged(y, pool, table, ranks, adapter_ids, cols=y.shape[1])
    if h.ndim != 2 or h.shape[0] != y.shape[0]:
        raise ValueError(f"h {h.shape} must be [T, C] for y {y.shape}")
    if not is_pow2(block):
        raise ValueError(f"block={block} must be a power of two")
    num_tokens, out = y.shape
    block = min(block, pad_pow2(out))
    kernel = functools.partial(_expand_kernel, page_rows=pool.shape[1], block=block, out=out, rank_cols=h.shape[1])
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(num_tokens, pl.cdiv(out, block)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lora_paged_expand",
    )(adapter_ids.astype(jnp.int32), ranks.astype(jnp.int32), table.astype(jnp.int32), y, h, pool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedLayout:
    """What one adapter module costs in the pools (and its page-table rows), for byte accounting.

    A^T's pages are `width` wide and B's `out_width` wide (default: `width`): with one pool per
    rank-row width (jaxlora.lora.paged_bank) each factor's pages are its own width."""

    page_rows: int  # P, rank-rows per page
    width: int  # W, elements per A^T rank-row (the module's input width)
    itemsize: int  # bytes per element
    max_pages: int  # M, page-table entries per adapter per factor
    out_width: int | None = None  # elements per B rank-row (the output width); None: `width`

    def pages(self, rank: int) -> int:
        return -(-rank // self.page_rows)

    def module_bytes(self, rank: int) -> int:
        """Device bytes of one module at `rank`: A^T and B pages plus their two int32 table rows."""
        widths = self.width + (self.width if self.out_width is None else self.out_width)
        return self.pages(rank) * self.page_rows * widths * self.itemsize + 2 * self.max_pages * 4

    def adapter_bytes(self, module_ranks: dict[str, int]) -> int:
        """Device bytes of an adapter with these per-module ranks (`rank_pattern` included)."""
        return sum(self.module_bytes(r) for r in module_ranks.values())
