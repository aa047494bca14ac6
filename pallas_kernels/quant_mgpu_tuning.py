"""Tuned knobs for the Mosaic GPU 8-bit GEMM (`quant_matmul_mgpu.py`), as data, and the rule that
fits a table row to a GEMM's shape (`mgpu_knobs`). The Triton kernel's table is `quant_tuning.py`.
"""

from __future__ import annotations

from pallas_kernels.quant_matmul_mgpu import MgpuKnobs

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
