"""LoRA shrink and expand that read each row's adapter out of the KV cache's pages (S-LoRA's unified
pool), at its true rank.

Storage (`jaxlora.lora.unified_layout`): the KV pool's k and v, [L, N, page_size, kv_heads,
head_dim]; a page id names one K segment and one V segment of E = page_size * kv_heads * head_dim
elements per layer. An adapter holds whole pages; at layer l its weights are one run of elements
laid end to end over its segments, segment 2i = k[l, pages[i]], segment 2i + 1 = v[l, pages[i]]. A
module's factor is `rank` rank-rows of `width` elements starting at `offset` in the run (A^T rows
are the input wide, B rows the output wide). So element o of the run is at

    page = pages[adapter, (o // E) // 2],   half = (o // E) % 2  (0: k, 1: v),   index o % E

and a rank-row may straddle two segments. Operands, per launch (one factor of one module, or of a
group's modules, at one layer):

    k, v      [L, N, page_size, kv_heads, head_dim]   the KV pool (flattened per layer, not copied)
    layer     int32 scalar                            which layer's segments
    pages     [S, MP]    int32 page ids of each slot's run (entries past its pages never read)
    offsets   [S]        int32 where this factor starts in the slot's run
              or [S, G]  the factor of each of G modules of a group (below)
    ranks     [S]        int32 this module's rank per slot (0: no LoRA on it), or [S, G]
    adapter_ids [T]      int32 slot of each token row, -1 for the base model (delta 0)

A group: the modules that share x (q/k/v, gate/up) in one launch each way, with [S, G] tables. The
shrink writes module m's h into columns m * max_rank onward; the expand takes y holding every
module's output side by side (the serving layout's fused projection; `columns` says where module m's
begins) and adds each column chunk's module's term. One launch a group instead of one a module: a
decode step's LoRA time is mostly per-launch cost.

Kernels (MBGMV-style: programs per token row, so a decode batch puts many adapters in one launch).
A row's work is proportional to its rank:

    unified_shrink:  h[t, r] = sum_k x[t, k] * A^T[r, k]        r < rank; h[t, r >= rank] = 0
        program (row, module and rank block, input split): the block's rank-rows over 1/k_splits of
        the input width, `unroll` chunks a loop step (independent loads in flight: a decode program is bound by
        the latency of its dependent page-lookup-then-load chain, not by bytes); the splits' partial
        sums are added after the launch, or by the expand as it reads them (`partials`). Blocks at
        and past the row's rank only store zeros.
    unified_expand:  y[t, o] + sum_r h[t, r] * B[r, o]           r < rank
        program (row, output chunk): loops over the row's rank blocks only (of the chunk's module).

Loads move whole chunks: a chunk is `chunk` consecutive elements of a rank-row, chunk the largest
power of two dividing the width (every module's, in a group), E and `align` (at most `block`). The
caller promises every offset is a multiple of `align` (`jaxlora.lora.unified_layout` aligns each factor's start to
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

_KNOBS = ("align", "block", "rank_block", "num_warps", "interpret")
_SHRINK_KNOBS = ("max_rank", *_KNOBS, "k_splits", "unroll", "num_stages", "partials")
_EXPAND_KNOBS = (*_KNOBS, "columns")


def check_unified(x_or_y, k, v, pages, offsets, ranks, adapter_ids, *, group: bool = False) -> None:
    """Clear errors for operands the kernels cannot take; group: [S, G] tables allowed (these
    per-row kernels), else [S] only (the tiled kernels, the XLA path: one module a call)."""
    if k.ndim != 5 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must be one KV pool [L, N, page, heads, dim]"
        )
    if (
        pages.ndim != 2
        or offsets.shape != ranks.shape
        or offsets.ndim not in ((1, 2) if group else (1,))
        or offsets.shape[0] != pages.shape[0]
        or 0 in offsets.shape
    ):
        tables = "both [S] or [S, G]" if group else "both [S] (one module a call)"
        raise ValueError(
            f"pages {pages.shape} must be [S, MP], offsets {offsets.shape} and ranks {ranks.shape} {tables}"
        )
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


def _row(ids_ref, ranks_ref, offs_ref, row, module):
    """(slot, rank, offset) of token row `row` in `module` (tables [S, G]); a base-model row (-1) has
    rank 0."""
    slot = ids_ref[row]
    safe = jnp.maximum(slot, 0)
    return safe, jnp.where(slot >= 0, ranks_ref[safe, module], 0), offs_ref[safe, module]


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
    modules,
):
    # x_ref [T, D]; tables [S, G]; k_ref/v_ref [L, N * E]; h_ref [T, G * max_rank], or with k_splits > 1
    # the f32 partial sums flattened [T, k_splits * G * max_rank]; program (token row, module * rank
    # blocks + rank block, input split).
    row, split, layer = pl.program_id(0), pl.program_id(2), layer_ref[0]
    blocks = pl.cdiv(max_rank, rank_block)
    module, blk = pl.program_id(1) // blocks, pl.program_id(1) % blocks
    slot, rank, offset = _row(ids_ref, ranks_ref, offs_ref, row, module)
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
    cols = split * (modules * max_rank) + module * max_rank + rs
    pltriton.store(h_ref.at[row, cols], total.astype(h_ref.dtype), mask=rs < max_rank)


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
    columns,
    widths,
    chunk,
    rank_block,
    rank_cols,
    parts,
):
    # y_ref/o_ref [T, O], module m in columns[m] .. + widths[m]; tables [S, G]; h_ref
    # [T, parts * G * C] (parts > 1: the shrink's partial sums, added here); program (token row,
    # output chunk).
    row, col, layer = pl.program_id(0), pl.program_id(1), layer_ref[0]
    module, start, width = _chunk_module(col * chunk, columns, widths)
    slot, rank, offset = _row(ids_ref, ranks_ref, offs_ref, row, module)
    rr = jnp.arange(rank_block, dtype=jnp.int32)
    row_chunks = width // chunk  # B's rank-rows are the module's output wide
    local = (col * chunk - start) // chunk
    h_cols = module * rank_cols + jnp.arange(parts, dtype=jnp.int32)[:, None] * (len(columns) * rank_cols)

    def rank_step(i, acc):  # acc [chunk] f32
        rs = i * rank_block + rr
        r_ok = (rs < rank) & (rs < rank_cols)
        h = pltriton.load(h_ref.at[row, h_cols + rs[None, :]], mask=r_ok[None, :], other=0).astype(F32)
        h = jnp.sum(h, axis=0)  # the shrink's partial sums (one part: the sum of one)
        first = offset // chunk + rs * row_chunks + local
        b = load_chunks(k_ref, v_ref, pages_ref, slot, layer, first, r_ok, seg=seg, chunk=chunk)
        return acc + jnp.sum(h[:, None] * b, axis=0)

    acc = lax.fori_loop(0, (rank + rank_block - 1) // rank_block, rank_step, jnp.zeros((chunk,), F32))
    cols = pl.ds(col * chunk, chunk)
    y = pltriton.load(y_ref.at[row, cols]).astype(F32)
    pltriton.store(o_ref.at[row, cols], (y + acc).astype(o_ref.dtype))


def _chunk_module(first_col, columns: tuple[int, ...], widths: tuple[int, ...]):
    """(module, its first column, its width) of the output column `first_col` (int32 scalars): columns
    ascend, so the last start at or below it wins. Static tables, a compare per module."""
    module, start, width = jnp.int32(0), jnp.int32(columns[0]), jnp.int32(widths[0])
    for m in range(1, len(columns)):
        inside = first_col >= columns[m]
        module = jnp.where(inside, m, module)
        start = jnp.where(inside, columns[m], start)
        width = jnp.where(inside, widths[m], width)
    return module, start, width


def module_widths(columns: tuple[int, ...], out: int) -> tuple[int, ...]:
    """The output widths of the modules whose columns start at `columns` in an output `out` wide;
    ValueError unless they start at 0 and ascend."""
    columns = tuple(int(c) for c in columns)
    ends = (*columns[1:], out)
    if not columns or columns[0] != 0 or any(e <= c for c, e in zip(columns, ends, strict=True)):
        raise ValueError(f"columns {columns} must start at 0 and ascend below the output width {out}")
    return tuple(e - c for c, e in zip(columns, ends, strict=True))


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
      pages, offsets, ranks, adapter_ids: the module doc's tables (offsets: A^T's); offsets and
        ranks [S, G] for a group of G modules sharing x (one launch).
      max_rank: columns of h per module (static); ranks above it are not checked on device.
      align: a power of two every offset is a multiple of (the caller's promise: the loads assume it).
      block: most elements a load moves; rank_block: rank-rows a program takes (powers of two).
      k_splits: programs that share a rank block's input width, a power of two (each takes
        ceil(chunks / k_splits) of the width's chunks in turn: the last split with any takes the
        rest, any after it none and store zeros); unroll: chunks a loop
        step loads (a shorter loop takes the rest).
      num_stages: Triton's software pipelining of the loop's loads (1: none).
      partials: with k_splits > 1, return the splits' f32 partial sums [T, k_splits, G * max_rank]
        (G = 1 for [S] tables) unadded, for `unified_expand` to add as it reads them (no launch
        to add them).

    Returns:
      h: [T, max_rank] in x.dtype, accumulated in f32; columns at and past a row's rank are 0 (or
      the partial sums, as above). A group's: [T, G * max_rank] (module m in columns m * max_rank
      onward), or its partial sums [T, k_splits, G * max_rank].
    """
    check_unified(x, k, v, pages, offsets, ranks, adapter_ids, group=True)
    offsets, ranks = _as_group(offsets), _as_group(ranks)
    modules = offsets.shape[1]
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
        modules=modules,
    )
    width = modules * max_rank
    h = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, k_splits * width), x.dtype if k_splits == 1 else F32),
        grid=(num_tokens, modules * pl.cdiv(max_rank, rank_block), k_splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="lora_unified_shrink",
    )(*_tables(adapter_ids, ranks, offsets, pages, layer), x, flat_pool(k), flat_pool(v))
    if k_splits == 1:
        return h
    h = h.reshape(num_tokens, k_splits, width)
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
    columns: tuple[int, ...] = (0,),
) -> jax.Array:
    """y[t] + h[t, :rank] @ B for the B of row t's slot, read as rank-rows from the KV pool.

    Args:
      y: [T, O] float, the base output (B's rank-rows are O wide; a group's: each module's width).
      h: [T, C] the shrink's result (columns at and past a row's rank are never read), or its
        partial sums [T, P, C] (`unified_shrink(partials=True)`, P a power of two), added here. A
        group's: [T, G * C] or [T, P, G * C], module m's in columns m * C onward.
      k, v, layer, pages, offsets, ranks, adapter_ids, align: as `unified_shrink` (offsets: B's;
        [S, G] for a group).
      block: most output columns a program takes (a chunk); rank_block: rank-rows per step.
      columns: a group's: where module m's output starts in y (static, ascending from 0; module m
        is columns[m + 1] - columns[m] wide, the last to y's end). One module: (0,).

    Returns:
      [T, O] in y.dtype, the delta accumulated in f32; base-model rows unchanged.
    """
    check_unified(y, k, v, pages, offsets, ranks, adapter_ids, group=True)
    checked_knobs(align, block, rank_block)
    offsets, ranks = _as_group(offsets), _as_group(ranks)
    modules = offsets.shape[1]
    if h.ndim not in (2, 3) or h.shape[0] != y.shape[0] or (h.ndim == 3 and not is_pow2(h.shape[1])):
        raise ValueError(f"h {h.shape} must be [T, C] or [T, P, C] (P a power of two) for y {y.shape}")
    if len(columns) != modules or h.shape[-1] % modules:
        raise ValueError(f"{modules} modules need {modules} columns (got {columns}) and h {h.shape} of G * C columns")
    num_tokens, out = y.shape
    widths = module_widths(columns, out)
    parts = 1 if h.ndim == 2 else h.shape[1]
    rank_cols = h.shape[-1] // modules
    h = h.reshape(num_tokens, parts * modules * rank_cols)
    chunk = chunk_size(functools.reduce(math.gcd, widths), segment_size(k), align, block)
    kernel = functools.partial(
        _expand_kernel,
        seg=segment_size(k),
        columns=tuple(int(c) for c in columns),
        widths=widths,
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


def _as_group(table: jax.Array) -> jax.Array:
    """[S] (one module) -> [S, 1]; [S, G] as given."""
    return table[:, None] if table.ndim == 1 else table


def _tables(adapter_ids, ranks, offsets, pages, layer) -> tuple[jax.Array, ...]:
    i32 = jnp.int32
    return (
        adapter_ids.astype(i32),
        ranks.astype(i32),
        offsets.astype(i32),
        pages.astype(i32),
        jnp.reshape(layer, (1,)).astype(i32),
    )
