"""Weight-only-quantized GEMM as a Pallas kernel for the Triton (GPU) backend.

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

Work decomposition: program (i, j, s) owns rows i*block_m .., columns j*block_n .. and the s-th of
split_k runs of whole block_k steps along K. With split_k > 1 each program writes its scaled float32
partial sum and one XLA reduction adds them (decode has one or two row tiles, so splitting K is what
fills the SMs). Rows, columns or depth that do not fill a block are masked loads; masks are emitted
only where a dimension is not a multiple of its block. Block sizes come from `quant_tuning.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import quant_tuning

_F32 = jnp.float32
MIN_DOT = 16  # Triton's smallest dot operand size along any axis.
WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pad_pow2(n: int) -> int:
    return max(MIN_DOT, 1 << max(0, n - 1).bit_length())


def _all(shape: tuple[int, ...], *masks: jax.Array | None) -> jax.Array | None:
    """AND of the masks that exist, broadcast to `shape`; None when every dimension fills its block."""
    present = [m for m in masks if m is not None]
    return jnp.broadcast_to(functools.reduce(jnp.logical_and, present), shape) if present else None


def _dot(x: jax.Array, q: jax.Array) -> jax.Array:
    """x [BM, BK] @ q [BK, BN] converted to x's dtype (exact for int8 and e4m3 in bf16), f32 result."""
    precision = lax.Precision.HIGHEST if x.dtype == _F32 else None
    return jnp.dot(x, q.astype(x.dtype), preferred_element_type=_F32, precision=precision)


# -- kernel body --------------------------------------------------------------------------------


def _kernel(
    layer_ref,
    x_ref,
    q_ref,
    scale_ref,
    y_ref,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    blocks_per_split: int,
    is_even_split: bool,
    num_rows: int,
    depth: int,
    width: int,
    is_split: bool,
):
    # layer_ref: [1] int32; x_ref: [M, K] float; q_ref: [L, K, N] int8 | float8_e4m3fn;
    # scale_ref: [L, N] float32; y_ref: [S, M, N] float32 partial sums if is_split, else [M, N].
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows = i * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok = (rows < num_rows)[:, None] if num_rows % block_m else None  # [BM, 1]
    col_in = cols < width if width % block_n else None  # [BN]
    col_ok = None if col_in is None else col_in[None, :]  # [1, BN]
    first = s * blocks_per_split
    num_k_blocks = pl.cdiv(depth, block_k)
    # The last split may hold fewer blocks; a static trip count keeps Triton's loop pipelining simple.
    count = blocks_per_split if is_even_split else jnp.minimum(blocks_per_split, num_k_blocks - first)

    def step(b, acc):  # acc: [BM, BN] f32
        ks = (first + b) * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = ks < depth if depth % block_k else None  # [BK]
        x_mask = _all((block_m, block_k), row_ok, None if k_ok is None else k_ok[None, :])
        q_mask = _all((block_k, block_n), None if k_ok is None else k_ok[:, None], col_ok)
        x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=x_mask, other=None if x_mask is None else 0)
        # Each weight is read by exactly one program: let it leave L2 before x does.
        q = pltriton.load(
            q_ref.at[layer, ks[:, None], cols[None, :]],
            mask=q_mask,
            # A float fill for e4m3: Triton converts an integer fill only to integer or wide float types.
            other=None if q_mask is None else (0 if jnp.issubdtype(q_ref.dtype, jnp.integer) else 0.0),
            eviction_policy="evict_first",
        )
        return acc + _dot(x, q)

    acc = lax.fori_loop(0, count, step, jnp.zeros((block_m, block_n), _F32))
    scale = pltriton.load(scale_ref.at[layer, cols], mask=col_in, other=None if col_in is None else 0)  # [BN]
    out_at = (s, rows[:, None], cols[None, :]) if is_split else (rows[:, None], cols[None, :])
    pltriton.store(
        y_ref.at[out_at], (acc * scale[None, :]).astype(y_ref.dtype), mask=_all((block_m, block_n), row_ok, col_ok)
    )


# -- wrapper ------------------------------------------------------------------------------------


def _split_k(num_k_blocks: int, base_programs: int, split_k: int | None, min_programs: int) -> tuple[int, int]:
    """(split_k, blocks_per_split): the given split, or the fewest splits that give the grid
    `min_programs` programs; then trimmed so that every split holds at least one block."""
    wanted = split_k if split_k is not None else pl.cdiv(min_programs, base_programs)
    wanted = max(1, min(wanted, num_k_blocks))
    blocks_per_split = pl.cdiv(num_k_blocks, wanted)
    return pl.cdiv(num_k_blocks, blocks_per_split), blocks_per_split


@functools.partial(jax.jit, static_argnames=quant_tuning.KNOBS + ("split_k", "interpret"))
def _call(x, q, scale, layer, *, block_m, block_n, block_k, split_k, min_programs, num_warps, num_stages, interpret):
    # q: [L, K, N]; scale: [L, N]; layer: [1] int32. Jitted so that the identical calls of an
    # unrolled layer loop lower to one function (the layer is an operand, not a constant of it).
    num_rows, depth = x.shape
    width = q.shape[2]
    block_m = min(block_m, _pad_pow2(num_rows))
    block_n = min(block_n, _pad_pow2(width))
    block_k = min(block_k, _pad_pow2(depth))
    num_k_blocks = pl.cdiv(depth, block_k)
    grid_mn = (pl.cdiv(num_rows, block_m), pl.cdiv(width, block_n))
    split_k, blocks_per_split = _split_k(num_k_blocks, grid_mn[0] * grid_mn[1], split_k, min_programs)
    is_split = split_k > 1
    kernel = functools.partial(
        _kernel,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        is_even_split=num_k_blocks % blocks_per_split == 0,
        num_rows=num_rows,
        depth=depth,
        width=width,
        is_split=is_split,
    )
    out_shape = (split_k, num_rows, width) if is_split else (num_rows, width)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, _F32 if is_split else x.dtype),
        grid=(*grid_mn, split_k),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="quant_matmul",
    )(layer, x, q, scale)
    return y.sum(axis=0).astype(x.dtype) if is_split else y


def _check(x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | int | None) -> None:
    if x.ndim != 2 or q.ndim not in (2, 3) or q.shape[-2] != x.shape[1]:
        raise ValueError(f"quant_matmul needs x [M, K] and q [(L,) K, N]; got x {x.shape}, q {q.shape}")
    if scale.shape != q.shape[:-2] + q.shape[-1:]:
        raise ValueError(f"scale {scale.shape} must be [(L,) N] for q {q.shape}")
    if jnp.dtype(q.dtype) not in WEIGHT_DTYPES or jnp.dtype(scale.dtype) != jnp.dtype(_F32):
        raise ValueError(
            f"q {q.dtype} must be one of {[str(d) for d in WEIGHT_DTYPES]} and scale {scale.dtype} float32"
        )
    if jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(f"x {x.dtype} must be one of {[str(d) for d in X_DTYPES]}")
    if (q.ndim == 3) != (layer is not None):
        raise ValueError(f"a layer index goes with a stacked q [L, K, N] and only with one; got q {q.shape}, {layer=}")
    if layer is None:
        return
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar; got {layer!r}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < q.shape[0]:
        raise ValueError(f"layer={int(layer)} must be in [0, {q.shape[0]})")


def quant_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    min_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y = (x @ q[layer]) * scale[layer], with q converted to x's dtype tile by tile, f32 accumulation.

    Args:
      x: [M, K] bfloat16, float16 or float32 activations (any M >= 0).
      q: [L, K, N] int8 or float8_e4m3fn weights stacked over layers, or one layer [K, N].
      scale: [L, N] (or [N]) float32 per-output-column scales.
      layer: int32 scalar (may be traced) selecting the layer of a stacked q, read in place; None
        for an unstacked q. A traced index must lie in [0, L): Triton does not bound-check it.
      block_m, block_n, block_k: tile sizes, powers of two >= 16 (default: quant_tuning.py by M);
        clamped to the padded problem size.
      split_k: programs sharing one tile's K (default: the fewest that give `min_programs`).
      min_programs, num_warps, num_stages: tuning knobs (default: quant_tuning.py).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      [M, N] in x.dtype.
    """
    _check(x, q, scale, layer)
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        min_programs=min_programs,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    knobs = quant_tuning.lookup(x.shape[0]) | {k: v for k, v in given.items() if v is not None}
    for name in ("block_m", "block_n", "block_k"):
        if not _is_pow2(knobs[name]) or knobs[name] < MIN_DOT:
            raise ValueError(f"{name}={knobs[name]} must be a power of two >= {MIN_DOT} (Triton dot blocks)")
    if split_k is not None and split_k < 1:
        raise ValueError(f"{split_k=} must be >= 1")
    if x.shape[0] == 0:
        return jnp.zeros((0, q.shape[-1]), x.dtype)
    if q.ndim == 2:
        q, scale, layer = q[None], scale[None], 0
    layer = jnp.reshape(jnp.asarray(layer), (1,)).astype(jnp.int32)
    return _call(x, q, scale, layer, split_k=split_k, interpret=interpret, **knobs)
