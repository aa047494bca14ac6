"""Tuned block sizes for the weight-only-quantized GEMM (`quant_matmul.py`), as data.

The table maps a row-count bucket (the smallest bucket >= M wins, the last one covers the rest) to
the kernel's knobs:

  block_m:      rows of x per tile, power of two >= 16 (Triton dots need M >= 16; fewer rows are
                masked).
  block_n:      output columns per tile, power of two >= 16.
  block_k:      input depth per loop step, power of two >= 16.
  min_programs: split K until the grid holds at least this many programs (132 SMs on the H200): a
                decode step has one or two row tiles, so columns alone leave SMs idle. Each split
                writes a float32 partial sum of [M, N] that one XLA reduction adds up, so a split
                costs 8 * M * N bytes against the K * N weight bytes it parallelises.
  num_warps, num_stages: Triton compiler parameters (stages pipeline the weight loads).

The rule: decode buckets (M <= 256) are bound by streaming the weights once, so they take wide
column tiles (x is re-read once per column tile, 2 * M / block_n of the weight bytes) and split K to
fill the SMs; prefill (M > 256) is compute-bound: square 128 tiles, no split.

`benchmarks/quant_gemm.py --tune` times candidate rows at one batch size on the GPU over the 7B
projections; paste the fastest here. The rows below are the starting point, not yet measured.
"""

from __future__ import annotations

QUANT_MATMUL: dict[int, dict[str, int]] = {
    16: dict(block_m=16, block_n=128, block_k=256, min_programs=132, num_warps=4, num_stages=4),
    64: dict(block_m=64, block_n=128, block_k=128, min_programs=132, num_warps=4, num_stages=4),
    256: dict(block_m=64, block_n=128, block_k=64, min_programs=132, num_warps=4, num_stages=4),
    1 << 30: dict(block_m=128, block_n=128, block_k=64, min_programs=1, num_warps=8, num_stages=3),
}

KNOBS = ("block_m", "block_n", "block_k", "min_programs", "num_warps", "num_stages")


def lookup(num_rows: int) -> dict[str, int]:
    """Knobs for a GEMM over `num_rows` rows of x."""
    for bucket in sorted(QUANT_MATMUL):
        if num_rows <= bucket:
            return dict(QUANT_MATMUL[bucket])
    return dict(QUANT_MATMUL[max(QUANT_MATMUL)])
