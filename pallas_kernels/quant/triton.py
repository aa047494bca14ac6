"""Quantized GEMM as a Pallas kernel for the Triton (GPU) backend: weight-only, or W8A8.

Compute, for x [M, K] and one layer of a stack of quantized weights q [L, K, N] with per-column
float32 scales [L, N]:

    y[m, n] = (sum_k x[m, k] * float(q[layer, k, n])) * scale[layer, n]      (accumulated in f32)

q is int8 or float8_e4m3fn; y comes out in x's dtype. The math is `jaxlora.model.quant.matmul`'s.

Why a kernel: XLA does not fuse the int8/fp8 -> bf16 convert into its GEMM; it writes a bf16 copy
of every weight first and the GEMM reads that, 5 bytes moved per 1-byte weight (on the H200 the
7B-shape decode step at B=64 ran 1.46x slower with int8 or fp8 weights than with bf16). Here each
weight tile is converted in registers right after its load, so a memory-bound decode step reads
one byte per weight. The kernel reads layer `layer` of the stack in place (the index is data: a constant when
the model's layers are unrolled, the scan's counter otherwise); slicing a layer out before the call
would copy it.

Variants (static, chosen per call):

  convert="cast"   the weight tile is converted with a plain cast (int8 -> bf16: an I2F and an
                   F2F conversion per weight; conversions issue at a fraction of the FP32 rate).
  convert="magic"  int8 only: q + 128 is written into the low mantissa bits of float32 2^23 (one
                   integer add), the float 2^23 + 128 subtracted (exact), and bf16 taken as the
                   upper half of the bits (exact: |q| <= 128 has 8 significant bits); float16 does
                   the same with 2^10. Integer and FP32 ops only, no conversion instruction.
  w8a8=True        x is quantized per row by XLA before the call (`quantize_rows`: symmetric,
                   to q's format, int8 on a grid of amax / 127, e4m3 scaled to amax 448); the kernel
                   multiplies the 8-bit tiles as they are (int8 x int8 -> int32, e4m3 x e4m3 ->
                   f32), no weight conversion, and scales by row_scale[m] * scale[n]. Not the
                   model's numerics (activations lose precision); opt-in. On Hopper, Triton runs
                   an e4m3 dot on wgmma only if the dot allows >= 32 imprecise accumulations,
                   which Pallas's dot does not set: it runs on mma.sync with both operands
                   promoted to f16 (a packed e4m3 -> f16 convert), so fp8 W8A8 here avoids the
                   int -> float convert but not the convert altogether; int8 W8A8 is native.
  k_major=True     q is stored [L, N, K] (each column's weights contiguous, the layout cuBLASLt's
                   8-bit GEMMs read). Hopper's 8-bit wgmma reads only K-major operands from shared
                   memory; an [L, K, N] tile would go through registers to be transposed.
  swap_ab=True     each tile is computed as (w^T x^T)^T (see tuning.py).

Work decomposition: program (i, j, s) owns rows i*block_m .., columns j*block_n .. and the s-th of
split_k runs of whole block_k steps along K. With split_k > 1 each program writes its scaled float32
partial sum and one XLA reduction adds them (decode has one or two row tiles, so splitting K is what
fills the SMs). Rows, columns or depth that do not fill a block are masked loads; masks are emitted
only where a dimension is not a multiple of its block. Block sizes come from `tuning.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.quant import tuning as quant_tuning

_F32 = jnp.float32
_INT8 = jnp.dtype(jnp.int8)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
MIN_DOT = 16  # Triton's smallest dot operand size along any axis.
MIN_DOT_8BIT = 32  # 8-bit MMAs (mma.sync m16n8k32, wgmma k32) step K by 32.
WEIGHT_DTYPES = (_INT8, _FP8)
X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(_F32))
CONVERTS = ("cast", "magic")
# int8 W8A8 accumulates in int32: |sum_k xq * q| <= K * 127 * 128 (q may be -128) must stay below 2^31.
MAX_INT8_W8A8_DEPTH = (2**31 - 1) // (127 * 128)
# The magic numbers: float32 2^23 + 128 (bits 0x4B000080), float16 2^10 + 128 (bits 0x6480). The
# spacing of floats there is 1, so adding the sign-extended q to the bits adds q to the value.
_MAGIC_F32_BITS, _MAGIC_F32 = 0x4B000080, 8388736.0
_MAGIC_F16_BITS, _MAGIC_F16 = 0x6480, 1152.0


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The kernel's static parameters (blocks already clamped to the problem)."""

    block_m: int
    block_n: int
    block_k: int
    blocks_per_split: int
    is_even_split: bool
    num_rows: int
    depth: int
    width: int
    is_split: bool
    w8a8: bool
    convert: str
    k_major: bool
    swap_ab: bool


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pad_pow2(n: int, minimum: int = MIN_DOT) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _all(shape: tuple[int, ...], *masks: jax.Array | None) -> jax.Array | None:
    """AND of the masks that exist, broadcast to `shape`; None when every dimension fills its block."""
    present = [m for m in masks if m is not None]
    return jnp.broadcast_to(functools.reduce(jnp.logical_and, present), shape) if present else None


def _zero(dtype: jnp.dtype) -> int | float:
    # A float fill for e4m3: Triton converts an integer fill only to integer or wide float types.
    return 0 if jnp.issubdtype(dtype, jnp.integer) else 0.0


def quantize_rows(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """x [M, K] float -> (xq [M, K] in `dtype`, row_scale [M] float32), xq * row_scale ~= x.

    Symmetric per row: int8 takes scale amax * float32(1 / 127) and rounds x / scale to nearest (ties
    to even); e4m3 takes amax * float32(1 / 448) and rounds on the cast. An all-zero row gets scale 1
    and stays zero. (A product by the reciprocal, not amax / limit: XLA may rewrite a division by a
    constant into that product, so the division would not round the same way on every backend.)"""
    limit = 127.0 if jnp.dtype(dtype) == _INT8 else 448.0
    xf = x.astype(_F32)
    amax = jnp.max(jnp.abs(xf), axis=1)
    row_scale = jnp.where(amax > 0, amax * _F32(1 / limit), _F32(1))
    scaled = xf / row_scale[:, None]
    if jnp.dtype(dtype) == _INT8:
        scaled = jnp.round(scaled)
    # Division can land a hair past the limit; e4m3fn has no infinity (out of range turns NaN).
    return jnp.clip(scaled, -limit, limit).astype(dtype), row_scale


def int8_to_float(q: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """int8 q (any shape) -> exactly the same values in `dtype` (float32, bfloat16 or float16), by
    bit arithmetic instead of a conversion instruction (see the module doc, convert="magic")."""
    if jnp.dtype(dtype) == jnp.float16:
        bits = q.astype(jnp.int16) + jnp.int16(_MAGIC_F16_BITS)  # 2^10 + 128 + q, q + 128 in [0, 255]
        return lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(_MAGIC_F16)
    bits = q.astype(jnp.int32) + jnp.int32(_MAGIC_F32_BITS)  # 2^23 + 128 + q
    f = lax.bitcast_convert_type(bits, _F32) - _F32(_MAGIC_F32)
    if jnp.dtype(dtype) == _F32:
        return f
    # q has at most 8 significant bits, so the low 16 bits of its float32 are zero: truncating to
    # the upper half is bf16 exactly. A logical shift and a truncation, no F2F conversion.
    upper = lax.shift_right_logical(lax.bitcast_convert_type(f, jnp.uint32), jnp.uint32(16))
    return lax.bitcast_convert_type(upper.astype(jnp.uint16), jnp.bfloat16)


def _to_float(w: jax.Array, dtype: jnp.dtype, convert: str) -> jax.Array:
    """A weight tile in x's dtype (exact: int8 and e4m3 values are bf16 / f16 / f32 values)."""
    return int8_to_float(w, dtype) if convert == "magic" else w.astype(dtype)


def _tile_dot(x: jax.Array, w: jax.Array, plan: _Plan) -> jax.Array:
    """x [BM, BK] times the weight tile w ([BK, BN], or [BN, BK] if k_major): the [BM, BN] product,
    or its transpose [BN, BM] if swap_ab. int32 for int8 operands, else float32."""
    w_k = 1 if plan.k_major else 0  # w's contracting axis
    acc = jnp.int32 if x.dtype == _INT8 else _F32
    precision = lax.Precision.HIGHEST if x.dtype == _F32 else None
    if plan.swap_ab:
        dims = (((w_k,), (1,)), ((), ()))
        return lax.dot_general(w, x, dims, precision=precision, preferred_element_type=acc)
    dims = (((1,), (w_k,)), ((), ()))
    return lax.dot_general(x, w, dims, precision=precision, preferred_element_type=acc)


# -- kernel body --------------------------------------------------------------------------------


def _kernel(layer_ref, x_ref, q_ref, scale_ref, *refs, plan: _Plan):
    # layer_ref: [1] int32; x_ref: [M, K] float, or int8 | e4m3 with W8A8; q_ref: [L, K, N] (or
    # [L, N, K] if k_major) int8 | float8_e4m3fn; scale_ref: [L, N] float32; refs: row_scale_ref
    # [M] float32 (W8A8 only), then y_ref: [S, M, N] float32 partial sums if is_split, else [M, N].
    *row_scale_ref, y_ref = refs
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    row_in = rows < plan.num_rows if plan.num_rows % bm else None  # [BM]
    col_in = cols < plan.width if plan.width % bn else None  # [BN]
    first = s * plan.blocks_per_split
    num_k_blocks = pl.cdiv(plan.depth, bk)
    # The last split may hold fewer blocks; a static trip count keeps Triton's loop pipelining simple.
    count = plan.blocks_per_split if plan.is_even_split else jnp.minimum(plan.blocks_per_split, num_k_blocks - first)
    col_ok = None if col_in is None else (col_in[:, None] if plan.k_major else col_in[None, :])
    w_shape = (bn, bk) if plan.k_major else (bk, bn)

    def w_at(ks):  # the weight tile's indices in q: [BN, BK] if k_major, else [BK, BN]
        return (layer, cols[:, None], ks[None, :]) if plan.k_major else (layer, ks[:, None], cols[None, :])

    def step(b, acc):  # acc: [BM, BN], or [BN, BM] if swap_ab; int32 or float32
        ks = (first + b) * bk + jnp.arange(bk, dtype=jnp.int32)
        k_in = ks < plan.depth if plan.depth % bk else None  # [BK]
        k_ok = None if k_in is None else (k_in[None, :] if plan.k_major else k_in[:, None])
        x_mask = _all((bm, bk), None if row_in is None else row_in[:, None], None if k_in is None else k_in[None, :])
        w_mask = _all(w_shape, k_ok, col_ok)
        x_other = None if x_mask is None else _zero(x_ref.dtype)
        x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=x_mask, other=x_other)
        # Each weight is read by exactly one program: let it leave L2 before x does.
        w = pltriton.load(
            q_ref.at[w_at(ks)],
            mask=w_mask,
            other=None if w_mask is None else _zero(q_ref.dtype),
            eviction_policy="evict_first",
        )
        return acc + _tile_dot(x, w if plan.w8a8 else _to_float(w, x.dtype, plan.convert), plan)

    acc_shape = (bn, bm) if plan.swap_ab else (bm, bn)
    acc_dtype = jnp.int32 if x_ref.dtype == _INT8 else _F32
    acc = lax.fori_loop(0, count, step, jnp.zeros(acc_shape, acc_dtype)).astype(_F32)
    acc = acc.T if plan.swap_ab else acc  # [BM, BN]
    scale = pltriton.load(scale_ref.at[layer, cols], mask=col_in, other=None if col_in is None else 0)  # [BN]
    out = acc * scale[None, :]
    for rs_ref in row_scale_ref:  # W8A8: the rows' activation scales
        out = out * pltriton.load(rs_ref.at[rows], mask=row_in, other=None if row_in is None else 0)[:, None]
    out_at = (s, rows[:, None], cols[None, :]) if plan.is_split else (rows[:, None], cols[None, :])
    mask = _all((bm, bn), None if row_in is None else row_in[:, None], None if col_in is None else col_in[None, :])
    pltriton.store(y_ref.at[out_at], out.astype(y_ref.dtype), mask=mask)


# -- wrapper ------------------------------------------------------------------------------------


def _split_k(num_k_blocks: int, base_programs: int, split_k: int | None, min_programs: int) -> tuple[int, int]:
    """(split_k, blocks_per_split): the given split, or the fewest splits that give the grid
    `min_programs` programs; then trimmed so that every split holds at least one block."""
    wanted = split_k if split_k is not None else pl.cdiv(min_programs, base_programs)
    wanted = max(1, min(wanted, num_k_blocks))
    blocks_per_split = pl.cdiv(num_k_blocks, wanted)
    return pl.cdiv(num_k_blocks, blocks_per_split), blocks_per_split


_VARIANT = ("w8a8", "convert", "k_major")


@functools.partial(jax.jit, static_argnames=quant_tuning.KNOBS + _VARIANT + ("split_k", "interpret"))
def _call(
    x,
    q,
    scale,
    layer,
    *,
    block_m,
    block_n,
    block_k,
    split_k,
    min_programs,
    num_warps,
    num_stages,
    swap_ab,
    w8a8,
    convert,
    k_major,
    interpret,
):
    # q: [L, K, N] or [L, N, K]; scale: [L, N]; layer: [1] int32. Jitted so that the identical calls
    # of an unrolled layer loop lower to one function (the layer is an operand, not a constant of it).
    num_rows, depth = x.shape
    width = q.shape[1] if k_major else q.shape[2]
    min_k = MIN_DOT_8BIT if w8a8 else MIN_DOT
    block_m = min(block_m, _pad_pow2(num_rows))
    block_n = min(block_n, _pad_pow2(width))
    block_k = min(block_k, _pad_pow2(depth, min_k))
    num_k_blocks = pl.cdiv(depth, block_k)
    grid_mn = (pl.cdiv(num_rows, block_m), pl.cdiv(width, block_n))
    split_k, blocks_per_split = _split_k(num_k_blocks, grid_mn[0] * grid_mn[1], split_k, min_programs)
    plan = _Plan(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        is_even_split=num_k_blocks % blocks_per_split == 0,
        num_rows=num_rows,
        depth=depth,
        width=width,
        is_split=split_k > 1,
        w8a8=w8a8,
        convert=convert,
        k_major=k_major,
        swap_ab=swap_ab,
    )
    # W8A8: one small XLA fusion quantizes x per row; the kernel then reads 1-byte activations too.
    if w8a8:
        xq, row_scale = quantize_rows(x, q.dtype)
        operands = (xq, q, scale, row_scale)
    else:
        operands = (x, q, scale)
    out_shape = (split_k, num_rows, width) if plan.is_split else (num_rows, width)
    y = pl.pallas_call(
        functools.partial(_kernel, plan=plan),
        out_shape=jax.ShapeDtypeStruct(out_shape, _F32 if plan.is_split else x.dtype),
        grid=(*grid_mn, split_k),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="quant_matmul",
    )(layer, *operands)
    return y.sum(axis=0).astype(x.dtype) if plan.is_split else y


def _check(x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | int | None, k_major: bool) -> None:
    depth_axis, layout = (-1, "[(L,) N, K]") if k_major else (-2, "[(L,) K, N]")
    if x.ndim != 2 or q.ndim not in (2, 3) or q.shape[depth_axis] != x.shape[1]:
        raise ValueError(f"quant_matmul needs x [M, K] and q {layout} ({k_major=}); got x {x.shape}, q {q.shape}")
    width = q.shape[-2] if k_major else q.shape[-1]
    if scale.shape != q.shape[:-2] + (width,):
        raise ValueError(f"scale {scale.shape} must be [(L,) N] for q {q.shape} {layout}")
    if jnp.dtype(q.dtype) not in WEIGHT_DTYPES or jnp.dtype(scale.dtype) != jnp.dtype(_F32):
        raise ValueError(
            f"q {q.dtype} must be one of {[str(d) for d in WEIGHT_DTYPES]} and scale {scale.dtype} float32"
        )
    if jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(f"x {x.dtype} must be one of {[str(d) for d in X_DTYPES]}")
    if (q.ndim == 3) != (layer is not None):
        raise ValueError(f"a layer index goes with a stacked q [L, ...] and only with one; got q {q.shape}, {layer=}")
    if layer is None:
        return
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar; got {layer!r}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < q.shape[0]:
        raise ValueError(f"layer={int(layer)} must be in [0, {q.shape[0]})")


def _check_variant(q: jax.Array, depth: int, *, w8a8: bool, convert: str, k_major: bool, swap_ab: bool) -> None:
    for name, flag in (("w8a8", w8a8), ("k_major", k_major), ("swap_ab", swap_ab)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r} must be a bool")
    if convert not in CONVERTS:
        raise ValueError(f"convert={convert!r} must be one of {CONVERTS}")
    if convert == "magic" and (w8a8 or jnp.dtype(q.dtype) != _INT8):
        raise ValueError(f"convert='magic' converts int8 weights for the weight-only product; got q {q.dtype}, {w8a8=}")
    if w8a8 and jnp.dtype(q.dtype) == _INT8 and depth > MAX_INT8_W8A8_DEPTH:
        raise ValueError(f"int8 W8A8 accumulates in int32: K={depth} must be <= {MAX_INT8_W8A8_DEPTH}")


def _knobs(num_rows: int, w8a8: bool, given: dict[str, int | bool | None]) -> dict[str, int | bool]:
    """The tuning table's row for `num_rows`, overridden by the knobs given; block sizes checked."""
    knobs = quant_tuning.lookup(num_rows, w8a8) | {k: v for k, v in given.items() if v is not None}
    for name in ("block_m", "block_n", "block_k"):
        least = MIN_DOT_8BIT if w8a8 and name == "block_k" else MIN_DOT
        if not _is_pow2(knobs[name]) or knobs[name] < least:
            raise ValueError(f"{name}={knobs[name]} must be a power of two >= {least} (Triton dot blocks)")
    return knobs


def quant_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    w8a8: bool = False,
    convert: str = "cast",
    k_major: bool = False,
    swap_ab: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    min_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y = (x @ q[layer]) * scale[layer], with q converted to x's dtype tile by tile, f32 accumulation
    (or, with w8a8, x quantized per row and the 8-bit tiles multiplied as they are).

    Args:
      x: [M, K] bfloat16, float16 or float32 activations (any M >= 0).
      q: [L, K, N] int8 or float8_e4m3fn weights stacked over layers, or one layer [K, N]; with
        k_major, [L, N, K] (or [N, K]).
      scale: [L, N] (or [N]) float32 per-output-column scales.
      layer: int32 scalar (may be traced) selecting the layer of a stacked q, read in place; None
        for an unstacked q. A traced index must lie in [0, L): Triton does not bound-check it.
      w8a8: quantize x per row to q's format (`quantize_rows`) and run 8-bit MMAs (module doc).
      convert: how a weight-only tile becomes x's dtype, "cast" or "magic" (int8 only; module doc).
      k_major: q is stored [(L,) N, K].
      swap_ab: compute tiles transposed (tuning.py); default: the tuning table's.
      block_m, block_n, block_k: tile sizes, powers of two >= 16 (block_k >= 32 with w8a8; default:
        tuning.py by M); clamped to the padded problem size.
      split_k: programs sharing one tile's K (default: the fewest that give `min_programs`).
      min_programs, num_warps, num_stages: tuning knobs (default: tuning.py).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [M, N] in x.dtype.
    """
    _check(x, q, scale, layer, k_major)
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        min_programs=min_programs,
        num_warps=num_warps,
        num_stages=num_stages,
        swap_ab=swap_ab,
    )
    knobs = _knobs(x.shape[0], w8a8, given)
    _check_variant(q, x.shape[1], w8a8=w8a8, convert=convert, k_major=k_major, swap_ab=knobs["swap_ab"])
    if split_k is not None and split_k < 1:
        raise ValueError(f"{split_k=} must be >= 1")
    width = q.shape[-2] if k_major else q.shape[-1]
    if x.shape[0] == 0:
        return jnp.zeros((0, width), x.dtype)
    if q.ndim == 2:
        q, scale, layer = q[None], scale[None], 0
    layer = jnp.reshape(jnp.asarray(layer), (1,)).astype(jnp.int32)
    variant = dict(w8a8=w8a8, convert=convert, k_major=k_major)
    return _call(x, q, scale, layer, split_k=split_k, interpret=interpret, **variant, **knobs)
