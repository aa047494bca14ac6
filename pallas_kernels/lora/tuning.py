"""Tuned block sizes for the Triton LoRA kernels, as data.

Each table maps a token-count bucket (the smallest bucket >= T wins, the last one covers the rest)
to the knobs of one kernel. `benchmarks/kernels/lora.py --tune` measures candidates on the GPU and prints
rows in this format; paste them here. Keys:

  block_rows: rows (tokens) per tile, power of two >= 16 (Triton dots need M >= 16).
  block_k:    shrink only, hidden-size chunk per loop step.
  split_k:    shrink only, programs sharing one tile's hidden size (more parallelism for small T).
  block_out:  expand only, output columns per loop step.
  out_split:  expand only, programs sharing one tile's output columns (each loops over its share).
  Decode expand runs per row (each row reads its own b columns; no grouping): its block_rows may
  go below 16, where the product is a multiply-and-sum, not a tensor-core dot.
  num_warps, num_stages: Triton compiler parameters.

The tuning rule: a bucket's knobs are those with the smallest summed time over the benchmark's
distinct-adapter counts at that row count (1, 16, T/4, T), since how many adapters a batch uses is
data, not shape. The benchmark also times a grouped decode expand (rows sorted by slot, b read once
per tile: `expand.grouped_expand(mode="decode")`); it lost in every bucket, so no row picks it.
"""

from __future__ import annotations

# Decode (BGMV), from `benchmarks/kernels/lora.py tune` (summed over 16 and T distinct adapters,
# rank 16, D = O = 4096): the timings are in benchmarks/DECISIONS.md#lora-expand-decode.
SHRINK_DECODE: dict[int, dict[str, int | str]] = {
    16: dict(block_rows=16, block_k=256, split_k=8, num_warps=4, num_stages=3),
    64: dict(block_rows=16, block_k=256, split_k=8, num_warps=4, num_stages=3),
    256: dict(block_rows=16, block_k=256, split_k=8, num_warps=4, num_stages=3),
    512: dict(block_rows=16, block_k=256, split_k=1, num_warps=4, num_stages=3),
}
EXPAND_DECODE: dict[int, dict[str, int | str]] = {
    16: dict(block_rows=1, block_out=512, num_warps=4, num_stages=1),
    64: dict(block_rows=1, block_out=512, num_warps=4, num_stages=1),
    256: dict(block_rows=1, block_out=512, num_warps=4, num_stages=1),
    512: dict(block_rows=1, block_out=512, num_warps=4, num_stages=1),
}

# Prefill (SGMV: contiguous segments of tokens sharing a slot).
SHRINK_PREFILL: dict[int, dict[str, int | str]] = {
    1024: dict(block_rows=32, block_k=128, split_k=1, num_warps=4, num_stages=3),
    1 << 30: dict(block_rows=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
}
EXPAND_PREFILL: dict[int, dict[str, int | str]] = {
    1024: dict(block_rows=32, block_out=128, out_split=8, num_warps=4, num_stages=3),
    1 << 30: dict(block_rows=64, block_out=128, out_split=8, num_warps=4, num_stages=3),
}

# A module group's whole LoRA term (`api.lora_group` on "pallas"): impl "fused" runs it as one launch
# (`fused`: each work item's shrink computed in the program that expands it), "split" as the
# shrink and expand launches above (decode: `group.decode_group`, two launches a group, the
# expand per row), "split_tiles" as the same shrink and a tile expand (`decode_group(tiles=...)`:
# program (16-row work item, column block), each b column block read once per item, a tensor-core
# dot). Keys besides impl: `fused`'s knobs for "fused" (block_rows: work-item height, >= 16 for
# the tensor-core dots; block_k: shrink depth per loop step; block_out: output columns per step;
# col_split: runs of each module's column blocks, one program each, each recomputing its item's
# shrink), the tile expand's for "split_tiles" (block_out, num_warps, num_stages; its items are the
# shrink's).
#
# Keyed by the bank's rank, then T (smallest bucket >= each wins), from
# `benchmarks/kernels/lora_groups.py` (the four groups of a 7B layer; summed over 1, T/4 and T
# distinct adapters, and 400-token prompt chunks at T >= 512); the timings are in
# benchmarks/DECISIONS.md#lora-group-kernel. The rule: ranks up to 32 split up to 256 rows and
# take the tile expand above (the per-row expand re-reads b for every row, the tile one once per
# 16 rows, so it wins wherever items hold several rows; at T distinct adapters an item holds one
# row and 15 of 16 tile rows are padding); rank 64 splits up to 128 rows and fuses above.
# The fused launch is latency-bound below ~1,000 rows (its shrink is a serial loop over D in few
# programs). Ranks above 64 are unmeasured and stay split (the fused kernel's B tile grows with
# the rank).
_SPLIT = dict(impl="split", block_rows=16, block_k=128, block_out=256, col_split=1, num_warps=4, num_stages=3)
_TILES = dict(impl="split_tiles", block_rows=16, block_out=256, num_warps=4, num_stages=1)
_FUSED = dict(impl="fused", block_rows=16, block_k=256, block_out=256, col_split=1, num_warps=4, num_stages=3)
GROUP_DECODE: dict[int, dict[int, dict[str, int | str]]] = {
    32: {256: _SPLIT, 1 << 30: _TILES},
    64: {128: _SPLIT, 1 << 30: _FUSED},
    1 << 30: {1 << 30: _SPLIT},
}
GROUP_PREFILL: dict[int, dict[int, dict[str, int | str]]] = {
    1 << 30: {1 << 30: dict(_SPLIT, block_rows=32)},
}
GROUP_TABLES = {"decode": GROUP_DECODE, "prefill": GROUP_PREFILL}


def _bucket(table: dict, key: int):
    for bucket in sorted(table):
        if key <= bucket:
            return table[bucket]
    return table[max(table)]


def lookup_group(mode: str, num_tokens: int, rank: int) -> dict[str, int | str]:
    """Knobs (and impl) of a module group's LoRA term in `mode` at `num_tokens` rows, bank rank `rank`."""
    return dict(_bucket(_bucket(GROUP_TABLES[mode], rank), num_tokens))


def group_tile_heights(mode: str, num_tokens: int) -> tuple[int, ...]:
    """The work-item heights the fused group launch may use at this T, over every rank bucket."""
    return tuple(
        sorted(
            {
                int(r["block_rows"])
                for r in (_bucket(t, num_tokens) for t in GROUP_TABLES[mode].values())
                if r["impl"] == "fused"
            }
        )  # fmt: skip
    )


# The unified bank's per-row shrink (`unified.unified_shrink`, decode steps), by T bucket: k_splits
# programs share a rank block's input width and each loop step loads `unroll` chunks. A decode
# program is bound by the latency of its serial page-lookup-then-load chain (one chunk a step over
# the whole width), as the padded decode shrink's split_k above is. From
# `benchmarks/kernels/paged_lora.py` (s1 and s2 decode, 64 and 256 rows, 4096 wide, rank block 16:
# the knobs with the smallest summed shrink + expand time of the two mixes at that row count); the
# timings are in benchmarks/DECISIONS.md#unified-shrink-splits. A width whose chunks k_splits does not
# divide gives each split ceil(chunks / k_splits) in turn, the last one with any the rest (7B's
# down_proj: 86 chunks of 128 over 8, seven of 11 and one of 9). Above 64 rows k_splits 8, unroll 2
# ties with k_splits 4, unroll 1 (DECISIONS.md).
UNIFIED_SHRINK: dict[int, dict[str, int]] = {
    64: dict(k_splits=4, unroll=4, num_stages=1, rank_block=16),
    1 << 30: dict(k_splits=8, unroll=2, num_stages=1, rank_block=16),
}
# The per-row unified expand (`unified.unified_expand`), by T bucket: output columns a program takes
# (block), rank-rows a loop step (rank_block: h's layout does not depend on it), warps.
UNIFIED_EXPAND: dict[int, dict[str, int]] = {
    1 << 30: dict(block=128, rank_block=16, num_warps=4),
}


# The unified bank's tiled kernels (`unified_tiled`, steps of at least
# jaxlora.lora.apply.UNIFIED_TILED_MIN_TOKENS rows), by T bucket: rows a tile (block_rows, >= 16 for
# the tensor-core dots). A work item reads its adapter's factors once for its tile, so a prefill
# chunk of n rows reads them n / block_rows times; a decode row alone on its adapter fills one row of
# its tile whatever the height. `benchmarks/kernels/paged_lora.py` sweeps 16, 32 and 64.
UNIFIED_TILED: dict[int, dict[str, int]] = {
    1 << 30: dict(block_rows=16),
}


def unified_tiled_knobs(num_tokens: int) -> dict[str, int]:
    """The tiled unified kernels' knobs at `num_tokens` rows."""
    return dict(_bucket(UNIFIED_TILED, num_tokens))


def unified_shrink_knobs(num_tokens: int) -> dict[str, int]:
    """The per-row unified shrink's knobs at `num_tokens` rows."""
    return dict(_bucket(UNIFIED_SHRINK, num_tokens))


def unified_expand_knobs(num_tokens: int) -> dict[str, int]:
    """The per-row unified expand's knobs at `num_tokens` rows."""
    return dict(_bucket(UNIFIED_EXPAND, num_tokens))


TABLES: dict[tuple[str, str], dict[int, dict[str, int | str]]] = {
    ("shrink", "decode"): SHRINK_DECODE,
    ("expand", "decode"): EXPAND_DECODE,
    ("shrink", "prefill"): SHRINK_PREFILL,
    ("expand", "prefill"): EXPAND_PREFILL,
}


def lookup(op: str, mode: str, num_tokens: int) -> dict[str, int | str]:
    """Knobs for `op` ("shrink" | "expand") in `mode` ("decode" | "prefill") at `num_tokens` rows."""
    return dict(_bucket(TABLES[(op, mode)], num_tokens))
