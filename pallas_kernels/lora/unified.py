"""LoRA shrink and expand that read each row's adapter out of the KV cache's pages (S-LoRA's unified
pool), at its true rank.

Storage (`jaxlora.lora.unified_layout`): the KV pool's k and v, [L, N, page_size, kv_heads,
head_dim]; a page id names one K segment and one V segment of E = page_size * kv_heads * head_dim
elements per layer. An adapter holds whole pages; at layer l its weights are one run of elements
laid end to end over its segments, segment 2i = k[l, pages[i]], segment 2i + 1 = v[l, pages[i]]. A
module's factor is `rank` rank-rows of `width` elements starting at `offset` in the run (A^T rows
are the input wide, B rows the output wide). So element o of the run is at

    page = pages[adapter, (o // E) // 2],   half = (o // E) % 2  (0: k, 1: v),   index o % E

and a rank-row may straddle two segments. Operands, per launch (one module, one factor, one layer):

    k, v      [L, N, page_size, kv_heads, head_dim]   the KV pool (flattened per layer, not copied)
    layer     int32 scalar                            which layer's segments
    pages     [S, MP]    int32 page ids of each slot's run (entries past its pages never read)
    offsets   [S]        int32 where this factor starts in the slot's run
    ranks     [S]        int32 this module's rank per slot (0: no LoRA on it)
    adapter_ids [T]      int32 slot of each token row, -1 for the base model (delta 0)

Kernels (MBGMV-style: programs per token row, so a decode batch puts many adapters in one launch).
A row's work is proportional to its rank:

    unified_shrink:  h[t, r] = sum_k x[t, k] * A^T[r, k]        r < rank; h[t, r >= rank] = 0
        program (row, rank block, input split): the block's rank-rows over 1/k_splits of the input
        width, `unroll` chunks a loop step (independent loads in flight: a decode program is bound by
        the latency of its dependent page-lookup-then-load chain, not by bytes); the splits' partial
        sums are added after the launch, or by the expand as it reads them (`partials`). Blocks at
        and past the row's rank only store zeros.
    unified_expand:  y[t, o] + sum_r h[t, r] * B[r, o]           r < rank
        program (row, output chunk): loops over the row's rank blocks only.

Loads move whole chunks: a chunk is `chunk` consecutive elements of a rank-row, chunk the largest
power of two dividing the width, E and `align` (at most `block`). The caller promises every offset
is a multiple of `align` (`jaxlora.lora.unified_layout` aligns each factor's start to
FACTOR_ALIGN), so rank-rows start at chunk multiples, a segment boundary never falls inside a
chunk, and a chunk's address is page * E + (chunk index mod E / chunk) * chunk: one page lookup a
chunk, and loads the compiler can vectorize (contiguous, and aligned by construction). Loads are
masked to the row's rank: free pages, other adapters' pages, a run's gaps and its last page's tail
are never read, whatever they hold. Triton on GPU; interpret=True runs them on CPU.
`unified_reference` computes the same by concatenating segments.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora.common import F32, is_pow2

_EXPAND_KNOBS = ("align", "block", "rank_block", "num_warps", "interpret")
_SHRINK_KNOBS = ("max_rank", *_EXPAND_KNOBS, "k_splits", "unroll", "num_stages", "partials")


def check_unified(x_or_y, k, v, pages, offsets, ranks, adapter_ids) -> None:
    """Clear errors for operands the kernels cannot take."""
    if k.ndim != 5 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must be one KV pool [L, N, page, heads, dim]"
        )
    if pages.ndim != 2 or offsets.shape != (pages.shape[0],) or ranks.shape != (pages.shape[0],):
        raise ValueError(f"pages {pages.shape} must be [S, MP], offsets {offsets.shape} and ranks {ranks.shape} [S]")
    if x_or_y.ndim != 2 or adapter_ids.shape != (x_or_y.shape[0],):
        raise ValueError(f"adapter_ids {adapter_ids.shape} must be [T] for rows {x_or_y.shape}")
    for name, arr in (("pages", pages), ("offsets", offsets), ("ranks", ranks), ("adapter_ids", adapter_ids)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {arr.dtype}")
    if k.shape[1] * segment_size(k) >= 2**31:  # indices are per layer: the pool's total may be larger
        raise ValueError(f"a layer of the pool ({k.shape[1]} pages of {segment_size(k)} elements) must index in int32")


def segment_size(pool: jax.Array) -> int:
    """E: elements of one page's K (or V) segment at one layer."""
    return math.prod(pool.shape[2:])


def flat_pool(pool: jax.Array) -> jax.Array:
    # [L, N, page, heads, dim] -> [L, N * E]: a bitcast of the row-major pool, no copy.
    return pool.reshape(pool.shape[0], -1)


def chunk_size(width: int, seg: int, align: int, block: int) -> int:
    """Elements a load moves at once: the largest power of two dividing width, E and align, at most block."""
    g = math.gcd(math.gcd(width, seg), align)
    return min(g & -g, block)


def _row(ids_ref, ranks_ref, offs_ref, row):
    """(slot, rank, offset) of token row `row`; a base-model row (-1) has rank 0."""
    slot = ids_ref[row]
    safe = jnp.maximum(slot, 0)
    return safe, jnp.where(slot >= 0, ranks_ref[safe], 0), offs_ref[safe]


def load_chunks(k_ref, v_ref, pages_ref, slot, layer, first, ok, *, seg: int, chunk: int, dtype=F32):
    """[R, chunk] in `dtype`: chunk `first[r]` (in chunks from the run's start) of `slot`'s run at `layer`,
    row r; 0 where not ok[r]. One page lookup a chunk; the element index is page * E + a chunk
    multiple + arange(chunk), contiguous and chunk-aligned, so the loads vectorize."""
    per_seg = seg // chunk
    segment = first // per_seg
    page = pltriton.load(pages_ref.at[slot, segment // 2], mask=ok, other=0)
    base = page * seg + (first % per_seg) * chunk
    index = base[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    in_v = (segment % 2 == 1)[:, None]
    ok = ok[:, None]
    from_k = pltriton.load(k_ref.at[layer, index], mask=ok & ~in_v, other=0)
    from_v = pltriton.load(v_ref.at[layer, index], mask=ok & in_v, other=0)
    return jnp.where(in_v, from_v, from_k).astype(dtype)


def _shrink_kernel(
    ids_ref,
    ranks_ref,
    offs_ref,
    pages_ref,
    layer_ref,
    x_ref,
    k_ref,
    v_ref,
    h_ref,
    *,
    seg,
    hidden,
    chunk,
    rank_block,
    max_rank,
    k_splits,
    unroll,
):
    # x_ref [T, D]; k_ref/v_ref [L, N * E]; h_ref [T, max_rank], or with k_splits > 1 the f32 partial
    # sums flattened [T, k_splits * max_rank]; program (token row, rank block, input split).
    row, blk, split, layer = pl.program_id(0), pl.program_id(1), pl.program_id(2), layer_ref[0]
    slot, rank, offset = _row(ids_ref, ranks_ref, offs_ref, row)
    rs = blk * rank_block + jnp.arange(rank_block, dtype=jnp.int32)
    r_ok = rs < rank
    row_chunks = hidden // chunk
    per_split = -(-row_chunks // k_splits)  # the last split with chunks takes the rest; any after it none
    start = split * per_split
    first = offset // chunk + rs * row_chunks + start  # [rank_block] chunk index of the split's start

    def load(s):  # chunk `start + s` of x ([chunk]) and of the block's rank-rows ([rank_block, chunk])
        x = pltriton.load(x_ref.at[row, pl.ds((start + s) * chunk, chunk)])
        return x, load_chunks(k_ref, v_ref, pages_ref, slot, layer, first + s, r_ok, seg=seg, chunk=chunk)

    def add(acc, x, a):  # acc [rank_block, chunk] f32: reduced once, after the loop
        return acc + a * x.astype(F32)[None, :]

    def unrolled(i, acc):  # `unroll` chunks, every load issued before the first is used
        loaded = [load(i * unroll + u) for u in range(unroll)]
        for x, a in loaded:
            acc = add(acc, x, a)
        return acc

    # A block at or past the rank runs no steps and stores zeros (h's exact zeros past the rank).
    count = jnp.clip(row_chunks - start, 0, per_split)
    count = jnp.where(blk * rank_block < rank, count, 0).astype(jnp.int32)
    acc = lax.fori_loop(0, count // unroll, unrolled, jnp.zeros((rank_block, chunk), F32))
    done = (count // unroll) * unroll
    acc = lax.fori_loop(0, count - done, lambda i, acc: add(acc, *load(done + i)), acc)
    total = jnp.sum(acc, axis=1)
    if k_splits == 1:
        pltriton.store(h_ref.at[row, rs], total.astype(h_ref.dtype), mask=rs < max_rank)
    else:
        pltriton.store(h_ref.at[row, split * max_rank + rs], total, mask=rs < max_rank)


def _expand_kernel(
    ids_ref,
    ranks_ref,
    offs_ref,
    pages_ref,
    layer_ref,
    y_ref,
    h_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    seg,
    out,
    chunk,
    rank_block,
    rank_cols,
    parts,
):
    # y_ref/o_ref [T, O]; h_ref [T, parts * C] (parts > 1: the shrink's partial sums, added here);
    # program (token row, output chunk).
    row, col, layer = pl.program_id(0), pl.program_id(1), layer_ref[0]
    slot, rank, offset = _row(ids_ref, ranks_ref, offs_ref, row)
    rr = jnp.arange(rank_block, dtype=jnp.int32)
    row_chunks = out // chunk

    def rank_step(i, acc):  # acc [chunk] f32
        rs = i * rank_block + rr
        r_ok = (rs < rank) & (rs < rank_cols)
        if parts == 1:
            h = pltriton.load(h_ref.at[row, rs], mask=r_ok, other=0).astype(F32)
        else:
            index = jnp.arange(parts, dtype=jnp.int32)[:, None] * rank_cols + rs[None, :]
            h = jnp.sum(pltriton.load(h_ref.at[row, index], mask=r_ok[None, :], other=0).astype(F32), axis=0)
        first = offset // chunk + rs * row_chunks + col
        b = load_chunks(k_ref, v_ref, pages_ref, slot, layer, first, r_ok, seg=seg, chunk=chunk)
        return acc + jnp.sum(h[:, None] * b, axis=0)

    acc = lax.fori_loop(0, (rank + rank_block - 1) // rank_block, rank_step, jnp.zeros((chunk,), F32))
    cols = pl.ds(col * chunk, chunk)
    y = pltriton.load(y_ref.at[row, cols]).astype(F32)
    pltriton.store(o_ref.at[row, cols], (y + acc).astype(o_ref.dtype))


def checked_knobs(align: int, block: int, rank_block: int) -> None:
    if not is_pow2(align) or not is_pow2(block) or not is_pow2(rank_block):
        raise ValueError(f"align={align}, block={block} and rank_block={rank_block} must be powers of two")


@functools.partial(jax.jit, static_argnames=_SHRINK_KNOBS)
def unified_shrink(
    x: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer: jax.Array,
    pages: jax.Array,
    offsets: jax.Array,
    ranks: jax.Array,
    adapter_ids: jax.Array,
    *,
    max_rank: int,
    align: int,
    block: int = 128,
    rank_block: int = 16,
    num_warps: int = 4,
    interpret: bool = False,
    k_splits: int = 1,
    unroll: int = 1,
    num_stages: int = 1,
    partials: bool = False,
) -> jax.Array:
    """h[t] = x[t] @ A for the A of row t's slot, read as rank-rows from the KV pool (module doc).

    Args:
      x: [T, D] float, D the module's input width (A^T's rank-rows are D wide).
      k, v: [L, N, page_size, kv_heads, head_dim] the KV pool holding the runs.
      layer: int32 scalar, the layer whose segments hold this A.
      pages, offsets, ranks, adapter_ids: the module doc's tables (offsets: A^T's).
      max_rank: columns of h (static); ranks above it are not checked on device.
      align: a power of two every offset is a multiple of (the caller's promise: the loads assume it).
      block: most elements a load moves; rank_block: rank-rows a program takes (powers of two).
      k_splits: programs that share a rank block's input width, a power of two (each takes
        ceil(chunks / k_splits) of the width's chunks in turn: the last split with any takes the
        rest, any after it none and store zeros); unroll: chunks a loop
        step loads (a shorter loop takes the rest).
      num_stages: Triton's software pipelining of the loop's loads (1: none).
      partials: with k_splits > 1, return the splits' f32 partial sums [T, k_splits, max_rank]
        unadded, for `unified_expand` to add as it reads them (no launch to add them).

    Returns:
      h: [T, max_rank] in x.dtype, accumulated in f32; columns at and past a row's rank are 0 (or
      the partial sums, as above).
    """
    check_unified(x, k, v, pages, offsets, ranks, adapter_ids)
    checked_knobs(align, block, rank_block)
    if not is_pow2(k_splits) or unroll < 1:
        raise ValueError(f"k_splits={k_splits} must be a power of two and unroll={unroll} >= 1")
    num_tokens, hidden = x.shape
    chunk = chunk_size(hidden, segment_size(k), align, block)
    kernel = functools.partial(
        _shrink_kernel,
        seg=segment_size(k),
        hidden=hidden,
        chunk=chunk,
        rank_block=rank_block,
        max_rank=max_rank,
        k_splits=k_splits,
        unroll=unroll,
    )
    shape = (num_tokens, max_rank) if k_splits == 1 else (num_tokens, k_splits * max_rank)
    h = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, x.dtype if k_splits == 1 else F32),
        grid=(num_tokens, pl.cdiv(max_rank, rank_block), k_splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="lora_unified_shrink",
    )(*_tables(adapter_ids, ranks, offsets, pages, layer), x, flat_pool(k), flat_pool(v))
    if k_splits == 1:
        return h
    h = h.reshape(num_tokens, k_splits, max_rank)
    return h if partials else jnp.sum(h, axis=1).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=_EXPAND_KNOBS)
def unified_expand(
    y: jax.Array,
    h: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer: jax.Array,
    pages: jax.Array,
    offsets: jax.Array,
    ranks: jax.Array,
    adapter_ids: jax.Array,
    *,
    align: int,
    block: int = 128,
    rank_block: int = 16,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """y[t] + h[t, :rank] @ B for the B of row t's slot, read as rank-rows from the KV pool.

    Args:
      y: [T, O] float, the base output (B's rank-rows are O wide).
      h: [T, C] the shrink's result (columns at and past a row's rank are never read), or its
        partial sums [T, P, C] (`unified_shrink(partials=True)`, P a power of two), added here.
      k, v, layer, pages, offsets, ranks, adapter_ids, align: as `unified_shrink` (offsets: B's).
      block: most output columns a program takes (a chunk); rank_block: rank-rows per step.

    Returns:
      [T, O] in y.dtype, the delta accumulated in f32; base-model rows unchanged.
    """
    check_unified(y, k, v, pages, offsets, ranks, adapter_ids)
    checked_knobs(align, block, rank_block)
    if h.ndim not in (2, 3) or h.shape[0] != y.shape[0] or (h.ndim == 3 and not is_pow2(h.shape[1])):
        raise ValueError(f"h {h.shape} must be [T, C] or [T, P, C] (P a power of two) for y {y.shape}")
    num_tokens, out = y.shape
    parts = 1 if h.ndim == 2 else h.shape[1]
    rank_cols = h.shape[-1]
    h = h.reshape(num_tokens, parts * rank_cols)
    chunk = chunk_size(out, segment_size(k), align, block)
    kernel = functools.partial(
        _expand_kernel,
        seg=segment_size(k),
        out=out,
        chunk=chunk,
        rank_block=rank_block,
        rank_cols=rank_cols,
        parts=parts,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(num_tokens, out // chunk),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lora_unified_expand",
    )(*_tables(adapter_ids, ranks, offsets, pages, layer), y, h, flat_pool(k), flat_pool(v))


def _tables(adapter_ids, ranks, offsets, pages, layer) -> tuple[jax.Array, ...]:
    i32 = jnp.int32
    return (
        adapter_ids.astype(i32),
        ranks.astype(i32),
        offsets.astype(i32),
        pages.astype(i32),
        jnp.reshape(layer, (1,)).astype(i32),
    )
