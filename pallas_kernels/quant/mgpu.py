"""Weight-only 8-bit GEMM for Hopper as a Pallas Mosaic GPU kernel: TMA-pipelined int8 / e4m3 weight
tiles, converted in registers and fed to wgmma as its register operand.

Compute, for x [M, K] bf16 and one layer of K-major 8-bit weights q [L, N, K] (int8 or
float8_e4m3fn) with per-output-column float32 scales [L, N]:

    y[m, n] = (sum_k x[m, k] * float(q[layer, n, k])) * scale[layer, n]      (accumulated in f32)

the math of `pallas_kernels.quant.triton` with k_major=True and of `jaxlora.model.quant.matmul` on
q[layer].T (the tests' references), for the decode-sized steps (M <= 256) of a quantized base on an
H100 / H200.

Why another kernel: the Triton one (`triton.py`) streams its weights at 1.1-1.3 TB/s on the
H200 (4.1 TB/s copy), so an int8 decode step is slower than the bf16 one it halves the bytes of.
Here each CTA keeps `stages` weight tiles in flight through the TMA engine (no registers or
address arithmetic spent on loads), and the converted tile never goes back to shared memory.

Orientation (why K-major): Hopper's wgmma takes only its A operand from registers, and A is the
[64k, K] side. So the kernel computes the transposed product

    yT[n, m] = sum_k q[layer, n, k] * x[m, k]          A = q tile [tile_n, tile_k], in registers
                                                       B = x tile [M, tile_k]^T, in shared memory

with the 8-bit tile loaded from shared memory straight into the wgmma register layout and widened
to bf16 there (int8: Mosaic's byte-permute trick, no conversion instruction; e4m3: paired converts
to f16, then to bf16). q must be K-major (each output column's weights contiguous) for that load. x's tile
is fed transposed (wgmma reads 16-bit operands of either major-ness). The batch M is wgmma's N
dimension: a multiple of 8, at most 256 (the wrapper pads rows to 8).

Work decomposition: CTA (j, s) owns output columns j*tile_n .. and the s-th of `splits` equal runs
of K; it pipelines its run's tiles (`stages` in flight) and writes a float32 partial yT[s] of
[tile_n, M]. One XLA fusion adds the partials, transposes to [M, N], multiplies by the layer's
scales and rounds to x's dtype. (Decode has one row tile, so splitting K is what fills the SMs when
N / tile_n is below their count: o_proj and down_proj of a 7B layer have 32 column tiles of 128.)

The layer index is data (a [1] int32 operand read once per CTA), so an unrolled layer loop's calls
lower to one kernel and read layer i of the stack in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_F32 = jnp.float32
_INT8 = jnp.dtype(jnp.int8)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
WEIGHT_DTYPES = (_INT8, _FP8)
X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_ROWS = 256  # wgmma's N dimension
ROW_ALIGN = 8  # wgmma N is a multiple of 8
WGMMA_M = 64  # wgmma's M: the weight tile's rows come in multiples of it
_SWIZZLES = (128, 64, 32)
# Shared memory a CTA may take on an H100 / H200 (Mosaic's limit: 227 KB), less a little for the
# pipeline's barriers.
SMEM_BYTES = 232448 - 1024


@dataclasses.dataclass(frozen=True)
class MgpuKnobs:
    """The kernel's static knobs (see the module doc).

    tile_n: output columns per CTA, a multiple of 64 (one wgmma M block per 64).
    tile_k: weight depth per pipeline step; tile_k bytes of 8-bit weights must be a supported swizzle
      (32, 64 or 128), so tile_k is 32, 64 or 128.
    stages: pipeline steps in flight per CTA (TMA loads issued ahead of the MMA).
    splits: None picks the fewest equal K runs that give at least `min_ctas` CTAs.
    min_ctas: the CTA count to reach by splitting K (the H200 has 132 SMs).
    a_in_smem: store the widened tile to shared memory and give wgmma both operands from there,
      instead of the register operand (one more shared-memory round trip per tile; the Pallas GPU
      interpreter, which the CPU tests run, has no register-operand wgmma).
    out_via_smem: write the partial through a shared-memory tile and one TMA store, instead of
      straight from the accumulator's registers.
    compute_wgs: 1: one warpgroup issues the TMA loads and the MMAs (`plgpu.emit_pipeline`); 2: a
      warp-specialized CTA, a memory warpgroup keeping the loads in flight and two compute
      warpgroups each owning tile_n of the CTA's 2 * tile_n columns (they share each x tile, so x is
      re-read half as often per weight byte).
    cluster: CTAs of neighbouring column tiles (same K run) in one cluster, which loads each x
      tile once and multicasts it (compute_wgs=2 only).
    """

    tile_n: int = 128
    tile_k: int = 128
    stages: int = 4
    splits: int | None = None
    min_ctas: int = 132
    a_in_smem: bool = False
    out_via_smem: bool = False
    compute_wgs: int = 1
    cluster: int = 1

    def __post_init__(self) -> None:
        if self.tile_n <= 0 or self.tile_n % WGMMA_M:
            raise ValueError(f"tile_n={self.tile_n} must be a positive multiple of {WGMMA_M}")
        if self.tile_k not in _SWIZZLES:
            raise ValueError(f"tile_k={self.tile_k} must be one of {_SWIZZLES} (8-bit bytes of a swizzled row)")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits={self.splits} must be >= 1 or None")
        if self.min_ctas < 1:
            raise ValueError(f"min_ctas={self.min_ctas} must be >= 1")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")
        if self.cluster not in (1, 2) or (self.cluster > 1 and self.compute_wgs == 1):
            raise ValueError(f"cluster={self.cluster} must be 1, or 2 with compute_wgs=2")
        if self.compute_wgs > 1 and (self.a_in_smem or self.out_via_smem):
            raise ValueError("a_in_smem and out_via_smem are single-warpgroup variants (compute_wgs=1)")

    @property
    def cta_cols(self) -> int:
        """Output columns per CTA."""
        return self.tile_n * self.compute_wgs

    @property
    def cluster_cols(self) -> int:
        """Output columns per cluster: N must be a multiple of it."""
        return self.cta_cols * self.cluster


def _transforms(row_bytes: int, itemsize: int) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose rows hold `row_bytes` bytes (the TMA and wgmma
    both want (8, swizzle / itemsize) tiles under the widest swizzle the row fills)."""
    swizzle = next((s for s in _SWIZZLES if row_bytes % s == 0), None)
    if swizzle is None:
        raise ValueError(f"a tile row of {row_bytes} bytes fits no swizzle of {_SWIZZLES}")
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _widen(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """An 8-bit weight tile in registers -> `dtype` (exact: every int8 and e4m3 value is a bf16 and
    an f16 value). e4m3 -> bf16 goes through f16: Mosaic converts e4m3 pairs to f16 natively but
    to bf16 only with a newer ptxas than the H200 image's (it raises NotImplementedError there)."""
    if jnp.dtype(w.dtype) == _FP8 and jnp.dtype(dtype) != jnp.dtype(jnp.float16):
        w = w.astype(jnp.float16)
    return w.astype(dtype)


def pick_splits(num_k_steps: int, num_col_tiles: int, knobs: MgpuKnobs, weight_bytes: int, split_bytes: int) -> int:
    """The K runs per column tile: knobs.splits if given, else the divisor d of num_k_steps (each run
    holds the same whole number of tile_k steps) that minimises a bytes model of the call: the
    busiest SM's share of the weights, slots * ceil(C / slots) * weight_bytes / C for C = d *
    num_col_tiles CTAs on knobs.min_ctas slots (waves round up), plus the d float32 partials written
    and read back (split_bytes each). Why a model: the fewest splits that fill the slots can leave
    most of a second wave idle (192 CTAs on 132 SMs), and many splits move more partial bytes than
    weights (down_proj at 64 rows in 43 runs: 45 MB of partials for 45 MB of weights)."""
    divisors = [d for d in range(1, num_k_steps + 1) if num_k_steps % d == 0]
    if knobs.splits is not None:
        if num_k_steps % knobs.splits:
            raise ValueError(f"splits={knobs.splits} must divide the {num_k_steps} K steps of {knobs.tile_k}")
        return knobs.splits
    slots = knobs.min_ctas

    def cost(d: int) -> float:
        ctas = d * num_col_tiles
        return slots * -(-ctas // slots) * weight_bytes / ctas + d * split_bytes

    return min(divisors, key=cost)


def _partials(
    x: jax.Array, q: jax.Array, layer: jax.Array, knobs: MgpuKnobs, splits: int, interpret: bool
) -> jax.Array:
    """x [M, K] (M % 8 == 0), q [L, N, K] 8-bit, layer [1] int32 -> yT partials [splits, N, M] f32."""
    num_rows, depth = x.shape
    width = q.shape[1]
    tile_n, tile_k = knobs.tile_n, knobs.tile_k
    steps = depth // tile_k // splits  # pipeline steps per CTA
    run = steps * tile_k  # K elements per CTA
    w_transforms = _transforms(tile_k * q.dtype.itemsize, q.dtype.itemsize)
    x_transforms = _transforms(tile_k * x.dtype.itemsize, x.dtype.itemsize)

    def kernel(layer_gmem, x_gmem, q_gmem, out_gmem, a_smem, out_smem):
        # layer_gmem [1] int32; x_gmem [M, K]; q_gmem [L, N, K] 8-bit; out_gmem [splits, N, M] f32;
        # a_smem [tile_n, tile_k] in x's dtype (the widened tile, with a_in_smem only); out_smem
        # [tile_n, M] f32 (with out_via_smem only). Unused scratch is a token 8 x 8 tile.
        col_tile, split = lax.axis_index("n"), lax.axis_index("s")
        layer = layer_gmem[0]
        cols = pl.ds(col_tile * tile_n, tile_n)
        ks = pl.ds(split * run, run)

        def scope(acc_ref):  # acc_ref: [tile_n, M] f32 wgmma accumulator
            def step(_, w_smem, x_smem):  # w_smem [tile_n, tile_k] 8-bit; x_smem [M, tile_k]
                w = _widen(w_smem[...], x.dtype)  # in registers, in the wgmma A layout
                if knobs.a_in_smem:
                    a_smem[...] = w
                    plgpu.commit_smem()
                    w = a_smem
                plgpu.wgmma(acc_ref, w, x_smem.T)
                # The next step overwrites w's registers and this step's buffers: let the MMA finish.
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step,
                grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((tile_n, tile_k), lambda k: (0, k), transforms=w_transforms),
                    plgpu.BlockSpec((num_rows, tile_k), lambda k: (0, k), transforms=x_transforms),
                ],
                max_concurrent_steps=min(knobs.stages, steps),
            )(q_gmem.at[layer, cols, ks], x_gmem.at[:, ks])
            return acc_ref[...]

        # Straight from registers to HBM: the partial is 4 * M bytes per weight column against the
        # column's K weight bytes, and a staging tile would take shared memory from the pipeline.
        acc = pl.run_scoped(scope, plgpu.ACC((tile_n, num_rows), _F32))
        if knobs.out_via_smem:
            out_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, cols])
            plgpu.wait_smem_to_gmem(0)
        else:
            out_gmem.at[split, cols][...] = acc

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, width, num_rows), _F32),
        grid=(width // tile_n, splits),
        grid_names=("n", "s"),
        scratch_types=[
            plgpu.SMEM(
                (tile_n, tile_k) if knobs.a_in_smem else (8, 8),
                x.dtype,
                transforms=x_transforms if knobs.a_in_smem else (),
            ),
            plgpu.SMEM((tile_n, num_rows) if knobs.out_via_smem else (8, 8), _F32),
        ],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(layer, x, q)


def _partials_ws(x: jax.Array, q: jax.Array, layer: jax.Array, knobs: MgpuKnobs, splits: int) -> jax.Array:
    """The warp-specialized form of `_partials` (compute_wgs=2): same operands and result."""
    num_rows, depth = x.shape
    width = q.shape[1]
    tile_n, tile_k, cluster = knobs.tile_n, knobs.tile_k, knobs.cluster
    cta_cols = knobs.cta_cols
    steps = depth // tile_k // splits
    run = steps * tile_k
    w_transforms = _transforms(tile_k * q.dtype.itemsize, q.dtype.itemsize)
    x_transforms = _transforms(tile_k * x.dtype.itemsize, x.dtype.itemsize)

    def kernel(layer_gmem, x_gmem, q_gmem, out_gmem):
        # layer_gmem [1] int32; x_gmem [M, K]; q_gmem [L, N, K] 8-bit; out_gmem [splits, N, M] f32.
        wg, split = lax.axis_index("wg"), lax.axis_index("s")
        col_tile = lax.axis_index("n") * cluster + (lax.axis_index("cluster") if cluster > 1 else 0)
        layer = layer_gmem[0]
        ks = pl.ds(split * run, run)
        wg_rows = pl.ds(wg * tile_n, tile_n)  # this compute warpgroup's rows of the CTA's weight tile

        def compute_context(eval_pipeline):  # runs on the compute warpgroups only
            def scope(acc_ref):  # acc_ref: [tile_n, M] f32, this warpgroup's columns
                eval_pipeline(acc_ref)
                out_gmem.at[split, pl.ds(col_tile * cta_cols + wg * tile_n, tile_n)][...] = acc_ref[...]

            pl.run_scoped(scope, plgpu.ACC((tile_n, num_rows), _F32))

        def step(_, w_smem, x_smem, acc_ref):  # w_smem [cta_cols, tile_k] 8-bit; x_smem [M, tile_k]
            plgpu.wgmma(acc_ref, _widen(w_smem[wg_rows], x.dtype), x_smem.T)
            plgpu.wgmma_wait(0)  # the converted tile's registers and the stage's buffers are reused
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_cols, tile_k), lambda k: (0, k), transforms=w_transforms),
                plgpu.BlockSpec(
                    (num_rows, tile_k),
                    lambda k: (0, k),
                    transforms=x_transforms,
                    collective_axes=("cluster",) if cluster > 1 else (),
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=knobs.compute_wgs,
            max_concurrent_steps=min(knobs.stages, steps),
            compute_context=compute_context,
        )(q_gmem.at[layer, pl.ds(col_tile * cta_cols, cta_cols), ks], x_gmem.at[:, ks])

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, width, num_rows), _F32),
        grid=(width // knobs.cluster_cols, splits),
        grid_names=("n", "s"),
        cluster=(cluster,) if cluster > 1 else (),
        cluster_names=("cluster",) if cluster > 1 else (),
        num_threads=knobs.compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(layer, x, q)


@functools.partial(jax.jit, static_argnames=("knobs", "interpret"))
def _call(
    x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array, knobs: MgpuKnobs, interpret: bool
) -> jax.Array:
    num_rows = x.shape[0]
    padded = -(-num_rows // ROW_ALIGN) * ROW_ALIGN
    xp = jnp.pad(x, ((0, padded - num_rows), (0, 0))) if padded != num_rows else x
    num_k_steps = x.shape[1] // knobs.tile_k
    width, depth = q.shape[1], q.shape[2]
    split_bytes = 2 * 4 * width * padded  # one float32 partial [N, M], written and read back
    splits = pick_splits(num_k_steps, width // knobs.cta_cols, knobs, width * depth * q.dtype.itemsize, split_bytes)
    if knobs.compute_wgs > 1:
        parts = _partials_ws(xp, q, layer, knobs, splits)  # [splits, N, padded]
    else:
        parts = _partials(xp, q, layer, knobs, splits, interpret)
    y = parts.sum(axis=0).T[:num_rows] * lax.dynamic_index_in_dim(scale, layer[0], keepdims=False)[None, :]
    return y.astype(x.dtype)


def smem_bytes(knobs: MgpuKnobs, rows: int, w_itemsize: int = 1, x_itemsize: int = 2) -> int:
    """Shared memory of one CTA: `stages` buffers of the weight tile [cta_cols, tile_k] and the x tile
    [rows, tile_k], plus the single-warpgroup variants' widened tile and epilogue tile."""
    stage = knobs.cta_cols * knobs.tile_k * w_itemsize + rows * knobs.tile_k * x_itemsize
    extra = knobs.tile_n * knobs.tile_k * x_itemsize if knobs.a_in_smem else 0
    extra += knobs.tile_n * rows * 4 if knobs.out_via_smem else 0
    return knobs.stages * stage + extra


def check_shapes(x: jax.Array, q: jax.Array, scale: jax.Array, knobs: MgpuKnobs) -> None:
    """Raises ValueError unless the kernel takes these operands (module doc): x [M, K] bf16 / f16
    with M <= 256, q [L, N, K] int8 / e4m3 with N a multiple of knobs.cluster_cols and K of tile_k,
    scale [L, N] f32."""
    if x.ndim != 2 or q.ndim != 3 or q.shape[2] != x.shape[1]:
        raise ValueError(f"quant_matmul_mgpu needs x [M, K] and q [L, N, K]; got x {x.shape}, q {q.shape}")
    if jnp.dtype(q.dtype) not in WEIGHT_DTYPES or jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(
            f"q must be one of {[str(d) for d in WEIGHT_DTYPES]} and x one of {[str(d) for d in X_DTYPES]}; "
            f"got q {q.dtype}, x {x.dtype}"
        )
    if scale.shape != q.shape[:2] or jnp.dtype(scale.dtype) != jnp.dtype(_F32):
        raise ValueError(f"scale must be [L, N] float32 = {q.shape[:2]}; got {scale.shape} {scale.dtype}")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; the kernel takes 1 to {MAX_ROWS} (wgmma's N)")
    rows = -(-x.shape[0] // ROW_ALIGN) * ROW_ALIGN
    if knobs.cluster > 1 and rows % 16:
        raise ValueError(
            f"cluster={knobs.cluster} multicasts halves of the x tile: rows ({rows} padded) must be a multiple of 16"
        )
    smem = smem_bytes(knobs, rows, q.dtype.itemsize, x.dtype.itemsize)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"{knobs} at {rows} rows needs ~{smem} bytes of shared memory, over the {SMEM_BYTES} a CTA gets: "
            "lower stages, tile_k or tile_n"
        )
    if q.shape[1] % knobs.cluster_cols or x.shape[1] % knobs.tile_k:
        raise ValueError(
            f"N={q.shape[1]} must be a multiple of {knobs.cluster_cols} (tile_n * compute_wgs * cluster) and "
            f"K={x.shape[1]} of tile_k={knobs.tile_k}"
        )


def quant_matmul_mgpu(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    layer: jax.Array | int,
    knobs: MgpuKnobs = MgpuKnobs(),
    *,
    interpret: bool = False,
) -> jax.Array:
    """y = (x @ q[layer].T) * scale[layer] for K-major 8-bit q, f32 accumulation, in x's dtype.

    Args:
      x: [M, K] bfloat16 or float16, 1 <= M <= 256.
      q: [L, N, K] int8 or float8_e4m3fn, K-major (q[l, n] holds output column n's weights).
      scale: [L, N] float32.
      layer: int32 scalar (may be traced), in [0, L): the kernel does not bound-check it.
      knobs: MgpuKnobs (tile sizes, pipeline depth, K splits).
      interpret: run in the Pallas GPU interpreter (CPU); needs knobs.a_in_smem.

    Returns:
      [M, N] in x.dtype.
    """
    check_shapes(x, q, scale, knobs)
    if interpret and not knobs.a_in_smem:
        raise ValueError("the Pallas GPU interpreter has no register-operand wgmma: interpret needs a_in_smem=True")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar; got {layer!r}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < q.shape[0]:
        raise ValueError(f"layer={int(layer)} must be in [0, {q.shape[0]})")
    layer = jnp.reshape(jnp.asarray(layer), (1,)).astype(jnp.int32)
    return _call(x, q, scale, layer, knobs, interpret)
