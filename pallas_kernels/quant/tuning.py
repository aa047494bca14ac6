"""Tuned block sizes for the quantized GEMMs, as data: the Triton kernel (`triton.py`), one table per
variant, and the Mosaic GPU kernel (`mgpu.py`, `MGPU` and `mgpu_knobs` at the end).

A table maps a row-count bucket (the smallest bucket >= M wins, the last one covers the rest) to
the kernel's knobs:

  block_m:      rows of x per tile, power of two >= 16 (Triton dots need M >= 16; fewer rows are
                masked).
  block_n:      output columns per tile, power of two >= 16.
  block_k:      input depth per loop step, power of two >= 16 (>= 32 for W8A8: 8-bit MMAs step K
                by 32).
  min_programs: split K until the grid holds at least this many programs (132 SMs on the H200): a
                decode step has one or two row tiles, so columns alone leave SMs idle. Each split
                writes a float32 partial sum of [M, N] that one XLA reduction adds up, so a split
                costs 8 * M * N bytes against the K * N weight bytes it parallelises.
  num_warps, num_stages: Triton compiler parameters (stages pipeline the weight loads).
  swap_ab:      compute each tile transposed, (w^T x^T)^T, so that the weight tile is the MMA's
                M side. Hopper's wgmma needs M to be a multiple of 64 (else Triton falls back to
                mma.sync) and takes only its A operand from registers: swapped, a decode tile of
                16 rows still gets wgmma, and a weight tile converted in registers feeds it
                without a trip through shared memory.

The rule: decode buckets (M <= 256) are bound by streaming the weights once, so they take wide
column tiles (x is re-read once per column tile, 2 * M / block_n of the weight bytes) and split K to
fill the SMs; prefill (M > 256) is compute-bound: square 128 tiles, no split.

`python -m benchmarks.kernels.quant_gemm --tune FORMAT ...` times candidate rows per batch on the GPU over
the 7B projections and records the fastest per (format, batch); paste those here. For weight-only
int8 the sweep ran with the bit-trick convert (benchmarks/results/archive/quant_probe_s10/): at 16 and 256
rows no candidate beat these rows by more than 2%; at 64 rows the best (min_programs 264, 5 stages)
took 1.52 ms against 1.64 at these knobs with the same convert and 1.57 with the plain cast, and was
not adopted (never run with the plain cast, which the model uses). FP8 was not swept. W8A8's best
candidates stored the weights K-major (not the default layout).
"""

from __future__ import annotations

from pallas_kernels.quant.mgpu import MgpuKnobs

# Weight-only: x in its float dtype, weights converted tile by tile.
QUANT_MATMUL: dict[int, dict[str, int | bool]] = {
    16: dict(block_m=16, block_n=128, block_k=256, min_programs=132, num_warps=4, num_stages=4, swap_ab=False),
    64: dict(block_m=64, block_n=128, block_k=128, min_programs=132, num_warps=4, num_stages=4, swap_ab=False),
    256: dict(block_m=64, block_n=128, block_k=64, min_programs=132, num_warps=4, num_stages=4, swap_ab=False),
    1 << 30: dict(block_m=128, block_n=128, block_k=64, min_programs=1, num_warps=8, num_stages=3, swap_ab=False),
}
# W8A8: x quantized per row to the weights' format, 8-bit MMAs. An 8-bit step of K moves half the
# bytes of a bf16 one, so the depth blocks are twice the weight-only ones.
W8A8: dict[int, dict[str, int | bool]] = {
    16: dict(block_m=16, block_n=128, block_k=256, min_programs=132, num_warps=4, num_stages=4, swap_ab=False),
    64: dict(block_m=64, block_n=128, block_k=256, min_programs=132, num_warps=4, num_stages=4, swap_ab=False),
    256: dict(block_m=64, block_n=128, block_k=128, min_programs=132, num_warps=4, num_stages=4, swap_ab=False),
    1 << 30: dict(block_m=128, block_n=128, block_k=128, min_programs=1, num_warps=8, num_stages=3, swap_ab=False),
}

KNOBS = ("block_m", "block_n", "block_k", "min_programs", "num_warps", "num_stages", "swap_ab")


def bucket(num_rows: int, table: dict[int, dict] = QUANT_MATMUL) -> int:
    """The table key that covers `num_rows` rows."""
    return next((b for b in sorted(table) if num_rows <= b), max(table))


def lookup(num_rows: int, w8a8: bool = False) -> dict[str, int | bool]:
    """Knobs for a GEMM over `num_rows` rows of x (weight-only, or W8A8)."""
    table = W8A8 if w8a8 else QUANT_MATMUL
    return dict(table[bucket(num_rows, table)])


# -- the Mosaic GPU kernel (`mgpu.py`): the rule that fits a table row to a GEMM's shape ----------

# Row bucket -> (knobs for widths below WIDE_COLUMNS, knobs for widths from it), as
# (tile_n, tile_k, stages, compute_wgs). From the H200 sweep of benchmarks/kernels/quant_mgpu.py over the
# 7B serving layout's GEMMs (benchmarks/results/archive/mgpu_probe/, 8 layers each, us per GEMM): the
# single-warpgroup CTA streams the narrow o_proj / down_proj (N = 4096, few column tiles) best, the
# warp-specialized one the wide q|k|v and gate|up at 64 rows and more (against run2's one-warpgroup
# rows: qkv at 128 rows 62.5 -> 41.4 us); at 16 rows one warpgroup wins everywhere. Above 256 rows the kernel does not run (wgmma's N); the engine takes XLA there.
MGPU: dict[int, tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    16: ((64, 128, 6, 1), (64, 128, 6, 1)),
    64: ((64, 64, 8, 1), (64, 128, 6, 2)),
    128: ((64, 64, 6, 1), (64, 128, 4, 2)),
    256: ((64, 64, 6, 1), (64, 64, 4, 2)),
}
WIDE_COLUMNS = 8192


def mgpu_knobs(num_rows: int, width: int, depth: int, *, interpret: bool = False) -> MgpuKnobs | None:
    """The Mosaic kernel's knobs for an [num_rows, depth] x [depth, width] product, or None where the
    kernel cannot take it (over 256 rows, or a width that is not a multiple of 64 or a depth of 32).
    A table row whose tiles do not divide the shape is narrowed (tile_k 128 -> 64 -> 32; the
    two-warpgroup CTA -> one warpgroup), which only lowers its shared memory. interpret: the variant
    the Pallas GPU interpreter runs (one warpgroup, the widened tile in shared memory)."""
    bucket = next((b for b in sorted(MGPU) if num_rows <= b), None)
    if bucket is None or num_rows < 1:
        return None
    tile_n, tile_k, stages, wgs = MGPU[bucket][width >= WIDE_COLUMNS]
    tile_k = next((k for k in (tile_k, 64, 32) if k <= tile_k and depth % k == 0), None)
    if interpret:
        wgs = 1
    if width % (tile_n * wgs):
        wgs = 1
    if tile_k is None or width % tile_n:
        return None
    return MgpuKnobs(tile_n=tile_n, tile_k=tile_k, stages=stages, compute_wgs=wgs, a_in_smem=interpret)
