"""The quantized GEMM kernel against plain references that share no index math with it: weight-only
against `jaxlora.model.quant.matmul` (XLA's dot over the converted weight), W8A8 against a numpy
product of the per-row quantized x; interpret mode on CPU, and lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jaxlora.model.quant import Quantization, matmul, quantize
from pallas_kernels.quant.triton import MAX_INT8_W8A8_DEPTH, int8_to_float, quant_matmul, quantize_rows
from tests.tolerances import assert_close

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)
LAYERS, LAYER = 3, 1  # a layer in the middle of the stack
# Blocks small enough that K = 200 and N = 72 take several blocks, none of them full at the edge.
SMALL = dict(block_m=16, block_n=32, block_k=64)


def _data(seed: int, quantization: Quantization, num_rows: int, depth: int, width: int, x_dtype=jnp.float32):
    """(x [M, K], q [L, K, N], scale [L, N]) with only layer LAYER usable: the other layers' scales are
    NaN (and their e4m3 weights too), so a read from the wrong layer shows."""
    rng = np.random.default_rng(seed)
    # Channel magnitudes spread over four decades, so a scale applied to the wrong column shows.
    w = rng.standard_normal((LAYERS, depth, width)) * np.logspace(-2, 2, width)
    q, scale = quantize(jnp.asarray(w, jnp.float32), quantization)
    others = np.arange(LAYERS) != LAYER
    scale = scale.at[others].set(jnp.nan)
    if quantization is Quantization.FP8:
        q = q.at[others].set(jnp.nan)
    x = jnp.asarray(rng.standard_normal((num_rows, depth)) + 0.5, x_dtype)  # shifted: no all-cancelling rows
    return x, q, scale


def _reference(x, q, scale, layer=LAYER):
    return matmul(x, q[layer], scale[layer])


def _assert_close(x, q, scale, got, kind: str, err_msg: str = "", layer=LAYER) -> None:
    """got against the reference, in units of sum_k |x[m, k] * w[k, n]|: a dot's rounding error
    scales with the magnitude of its terms, not of their (possibly cancelling) sum."""
    want = np.asarray(_reference(x, q, scale, layer), np.float32)
    w = np.asarray(q[layer], np.float64) * np.asarray(scale[layer], np.float64)
    unit = np.abs(np.asarray(x, np.float64)) @ np.abs(w)
    assert_close(np.asarray(got, np.float32) / unit, want / unit, kind, err_msg)


def test_reference_hand_computed_case():
    # y = [1*1 + 2*3, 1*(-2) + 2*4] * [0.5, 0.25] = [7 * 0.5, 6 * 0.25] = [3.5, 1.5]
    x = jnp.asarray([[1.0, 2.0]])
    q = jnp.asarray([[1, -2], [3, 4]], jnp.int8)
    scale = jnp.asarray([0.5, 0.25])
    np.testing.assert_array_equal(matmul(x, q, scale), [[3.5, 1.5]])
    np.testing.assert_array_equal(quant_matmul(x, q, scale, interpret=True), [[3.5, 1.5]])


@pytest.mark.parametrize("quantization", list(Quantization))
@pytest.mark.parametrize("num_rows", [1, 3, 17, 64, 130])
def test_matches_reference_on_awkward_shapes(quantization, num_rows):
    x, q, scale = _data(num_rows, quantization, num_rows, 200, 72)
    got = quant_matmul(x, q, scale, LAYER, interpret=True, **SMALL)
    assert got.shape == (num_rows, 72) and got.dtype == jnp.float32
    _assert_close(x, q, scale, got, "float32", f"{quantization} M={num_rows}")


@pytest.mark.parametrize("quantization", list(Quantization))
@pytest.mark.parametrize("num_rows", [3, 64])
def test_bf16_activations_give_bf16_output(quantization, num_rows):
    x, q, scale = _data(7, quantization, num_rows, 200, 72, jnp.bfloat16)
    got = quant_matmul(x, q, scale, LAYER, interpret=True, **SMALL)
    assert got.dtype == jnp.bfloat16
    _assert_close(x, q, scale, got, "bfloat16")


@pytest.mark.parametrize(
    "knobs",
    [
        dict(SMALL, split_k=1),
        dict(SMALL, split_k=3),  # 4 blocks of K over 3 splits: blocks_per_split 2, so 2 splits remain
        dict(block_m=16, block_n=16, block_k=16, split_k=5),  # 13 blocks of K, the last split shorter
        dict(SMALL, min_programs=40),  # 2 x 3 tiles want 7 splits; K has 4 blocks, so 4
        {},  # the tuning table's row for M = 17 (blocks clamped to the problem)
    ],
)
def test_split_k_and_block_choices_give_the_same_result(knobs):
    x, q, scale = _data(3, Quantization.INT8, 17, 200, 72)
    _assert_close(x, q, scale, quant_matmul(x, q, scale, LAYER, interpret=True, **knobs), "float32")


def test_traced_layer_inside_a_scan_reads_each_layer():
    rng = np.random.default_rng(4)
    q, scale = quantize(jnp.asarray(rng.standard_normal((LAYERS, 96, 48)), jnp.float32), Quantization.FP8)
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.bfloat16)

    def body(_, layer):
        return None, quant_matmul(x, q, scale, layer, interpret=True, **SMALL)

    _, ys = jax.lax.scan(body, None, jnp.arange(LAYERS, dtype=jnp.int32))
    for layer in range(LAYERS):
        _assert_close(x, q, scale, ys[layer], "bfloat16", layer=layer)


def test_one_unstacked_layer_and_no_rows():
    x, q, scale = _data(5, Quantization.INT8, 3, 200, 72)
    got = quant_matmul(x, q[LAYER], scale[LAYER], interpret=True, **SMALL)
    _assert_close(x, q, scale, got, "float32")
    assert quant_matmul(x[:0], q, scale, LAYER, interpret=True).shape == (0, 72)


def test_bad_inputs_are_refused():
    x, q, scale = _data(6, Quantization.INT8, 4, 64, 32)
    with pytest.raises(ValueError, match="power of two"):
        quant_matmul(x, q, scale, LAYER, block_k=48)
    with pytest.raises(ValueError, match="power of two >= 16"):
        quant_matmul(x, q, scale, LAYER, block_m=8)
    with pytest.raises(ValueError, match=r"layer=3 must be in \[0, 3\)"):
        quant_matmul(x, q, scale, 3)
    with pytest.raises(ValueError, match="layer index goes with a stacked q"):
        quant_matmul(x, q, scale)
    with pytest.raises(ValueError, match="layer index goes with a stacked q"):
        quant_matmul(x, q[0], scale[0], 0)
    with pytest.raises(ValueError, match="must be one of"):
        quant_matmul(x, q.astype(jnp.bfloat16), scale, LAYER)
    with pytest.raises(ValueError, match="scale"):
        quant_matmul(x, q, scale[:, :-1], LAYER)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        quant_matmul(x[:, :-1], q, scale, LAYER)
    with pytest.raises(ValueError, match="split_k"):
        quant_matmul(x, q, scale, LAYER, split_k=0)


# -- variants: the magic int8 convert, W8A8, K-major weights, swapped tiles ---------------------

# name -> (weight format, kernel flags). Each flag appears alone and in combination.
VARIANTS = {
    "magic": (Quantization.INT8, dict(convert="magic")),
    "magic-swap": (Quantization.INT8, dict(convert="magic", swap_ab=True)),
    "int8-kmajor": (Quantization.INT8, dict(k_major=True)),
    "fp8-kmajor": (Quantization.FP8, dict(k_major=True)),  # the serving layout's FP8 with kmajor=True
    "fp8-kmajor-swap": (Quantization.FP8, dict(k_major=True, swap_ab=True)),
    "fp8-swap": (Quantization.FP8, dict(swap_ab=True)),
    "w8a8-int8": (Quantization.INT8, dict(w8a8=True)),
    "w8a8-fp8": (Quantization.FP8, dict(w8a8=True)),
    "w8a8-int8-kmajor-swap": (Quantization.INT8, dict(w8a8=True, k_major=True, swap_ab=True)),
    "w8a8-fp8-kmajor": (Quantization.FP8, dict(w8a8=True, k_major=True)),
    "w8a8-fp8-swap": (Quantization.FP8, dict(w8a8=True, swap_ab=True)),
}
# Rows -> blocks: K split over the default 132 programs (4 splits of one block), an uneven split
# (7 blocks of 32 over 3 splits: 3, 3, 1), and no split.
ROW_KNOBS = {1: SMALL, 17: dict(SMALL, block_k=32, split_k=3), 130: dict(SMALL, split_k=1)}


def _w8a8_reference(x, q, scale, layer=LAYER) -> np.ndarray:
    """numpy W8A8: x quantized per row in float32 as specified (scale amax * float32(1 / 127), x / scale
    rounded half to even; or amax * float32(1 / 448), x / scale cast to e4m3), then the exact product
    in float64 (integers, or e4m3 values whose products and sums fit float64's mantissa), scaled per
    row and per column."""
    xf = np.asarray(x, np.float32)
    limit = np.float32(127 if q.dtype == jnp.int8 else 448)
    amax = np.abs(xf).max(axis=1)
    row_scale = np.where(amax > 0, amax * np.float32(1 / limit), np.float32(1)).astype(np.float32)
    scaled = np.clip(xf / row_scale[:, None], -limit, limit)
    xq = np.round(scaled) if q.dtype == jnp.int8 else scaled.astype(ml_dtypes.float8_e4m3fn)
    product = xq.astype(np.float64) @ np.asarray(q[layer], np.float64)
    return product * row_scale[:, None] * np.asarray(scale[layer], np.float64)


def _unit(x, q, scale, layer=LAYER) -> np.ndarray:
    """sum_k |x[m, k] * w[k, n]|: the scale of a dot's rounding error (see _assert_close)."""
    return np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(q[layer], np.float64) * np.asarray(scale[layer]))


def _assert_variant_close(x, q, scale, got, flags, kind: str, err_msg: str = "", layer=LAYER) -> None:
    """Weight-only against the converted-weight reference, W8A8 against the numpy W8A8 product."""
    if not flags.get("w8a8"):
        _assert_close(x, q, scale, got, kind, err_msg, layer)
        return
    unit = _unit(x, q, scale, layer)
    want = _w8a8_reference(x, q, scale, layer)
    assert_close(np.asarray(got, np.float64) / unit, want / unit, kind, err_msg)


def _stored(q: jax.Array, flags: dict) -> jax.Array:
    """q [L, K, N] as the kernel takes it: [L, N, K] for k_major."""
    return jnp.swapaxes(q, -1, -2) if flags.get("k_major") else q


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_int8_to_float_is_exact_for_every_int8(dtype):
    q = np.arange(-128, 128).astype(np.int8)
    got = np.asarray(int8_to_float(jnp.asarray(q), dtype))
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float32), q.astype(np.float32))


@pytest.mark.parametrize("quantization", list(Quantization))
def test_quantize_rows_matches_numpy(quantization):
    x = (np.random.default_rng(8).standard_normal((5, 40)) * np.logspace(-3, 3, 5)[:, None]).astype(np.float32)
    x[2] = 0  # an all-zero row: scale 1, stays zero
    xq, row_scale = quantize_rows(jnp.asarray(x), quantization.storage_dtype)
    limit = quantization.max_value
    amax = np.abs(x).max(axis=1)
    want_scale = np.where(amax > 0, amax * np.float32(1 / limit), 1).astype(np.float32)
    scaled = np.clip(x / want_scale[:, None], -limit, limit)
    want = (
        np.round(scaled).astype(np.int8)
        if quantization is Quantization.INT8
        else scaled.astype(ml_dtypes.float8_e4m3fn)
    )
    np.testing.assert_array_equal(row_scale, want_scale)
    assert xq.dtype == quantization.storage_dtype
    np.testing.assert_array_equal(np.asarray(xq).astype(np.float32), want.astype(np.float32))
    assert np.abs(np.asarray(xq).astype(np.float32)).max() <= limit and not np.asarray(xq[2]).astype(bool).any()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_rows", list(ROW_KNOBS))
def test_variants_match_reference_on_awkward_shapes(variant, num_rows):
    quantization, flags = VARIANTS[variant]
    x, q, scale = _data(num_rows + 11, quantization, num_rows, 200, 72)
    got = quant_matmul(x, _stored(q, flags), scale, LAYER, interpret=True, **flags, **ROW_KNOBS[num_rows])
    assert got.shape == (num_rows, 72) and got.dtype == jnp.float32
    _assert_variant_close(x, q, scale, got, flags, "float32", f"{variant} M={num_rows}")


@pytest.mark.parametrize("variant", ["magic", "fp8-kmajor", "w8a8-int8-kmajor-swap", "w8a8-fp8"])
def test_variants_take_bf16_activations(variant):
    quantization, flags = VARIANTS[variant]
    x, q, scale = _data(9, quantization, 17, 200, 72, jnp.bfloat16)
    got = quant_matmul(x, _stored(q, flags), scale, LAYER, interpret=True, **flags, **SMALL)
    assert got.dtype == jnp.bfloat16
    _assert_variant_close(x, q, scale, got, flags, "bfloat16", variant)


@pytest.mark.parametrize("quantization", list(Quantization))
def test_w8a8_is_within_the_activation_rounding_of_the_dense_product(quantization):
    """W8A8 against x @ w in float64 (bf16 x, the dequantized w): each x[m, k] moves by at most half
    a step of its row's grid, int8 amax / 254, e4m3 |x| 2^-4 (or 2^-10 of the scale if subnormal);
    the bf16 output rounds once more (2^-9 relative)."""
    x, q, scale = _data(10, quantization, 17, 200, 72, jnp.bfloat16)
    got = np.asarray(quant_matmul(x, q, scale, LAYER, w8a8=True, interpret=True, **SMALL), np.float64)
    xf = np.abs(np.asarray(x, np.float64))
    w = np.asarray(q[LAYER], np.float64) * np.asarray(scale[LAYER], np.float64)
    want = np.asarray(x, np.float64) @ w
    amax = xf.max(axis=1, keepdims=True)
    step = amax / 254 if quantization is Quantization.INT8 else xf * 2.0**-4 + amax / 448 * 2.0**-10
    bound = (np.broadcast_to(step, xf.shape) @ np.abs(w)) * 1.001 + np.abs(want) * 2.0**-8
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    assert np.abs(got - want).max() > 0  # the activations were quantized, not passed through


@pytest.mark.parametrize("variant", ["magic-swap", "int8-kmajor", "fp8-kmajor", "w8a8-int8", "w8a8-fp8-kmajor"])
def test_variants_in_a_scan_read_each_layer(variant):
    quantization, flags = VARIANTS[variant]
    rng = np.random.default_rng(12)
    q, scale = quantize(jnp.asarray(rng.standard_normal((LAYERS, 96, 48)), jnp.float32), quantization)
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)

    def body(_, layer):
        return None, quant_matmul(x, _stored(q, flags), scale, layer, interpret=True, **flags, **SMALL)

    _, ys = jax.lax.scan(body, None, jnp.arange(LAYERS, dtype=jnp.int32))
    for layer in range(LAYERS):
        _assert_variant_close(x, q, scale, ys[layer], flags, "float32", f"layer {layer}", layer)


def test_bad_variant_inputs_are_refused():
    x, q, scale = _data(6, Quantization.INT8, 4, 64, 32)
    q8, s8 = quantize(jnp.ones((64, 32), jnp.float32), Quantization.FP8)
    with pytest.raises(ValueError, match="convert='fast' must be one of"):
        quant_matmul(x, q, scale, LAYER, convert="fast")
    with pytest.raises(ValueError, match="convert='magic' converts int8 weights"):
        quant_matmul(x, q8, s8, convert="magic")
    with pytest.raises(ValueError, match="convert='magic' converts int8 weights"):
        quant_matmul(x, q, scale, LAYER, convert="magic", w8a8=True)
    with pytest.raises(ValueError, match="block_k=16 must be a power of two >= 32"):
        quant_matmul(x, q, scale, LAYER, w8a8=True, block_k=16)
    with pytest.raises(ValueError, match=r"q \[\(L,\) N, K\]"):
        quant_matmul(x, q, scale, LAYER, k_major=True)  # [L, K, N] given as K-major: K=32 != 64
    with pytest.raises(ValueError, match="swap_ab='yes' must be a bool"):
        quant_matmul(x, q, scale, LAYER, swap_ab="yes")
    depth = MAX_INT8_W8A8_DEPTH + 1
    deep = quantize(jnp.ones((depth, 16), jnp.float32), Quantization.INT8)
    with pytest.raises(ValueError, match="accumulates in int32"):
        quant_matmul(jnp.ones((1, depth), jnp.bfloat16), *deep, w8a8=True)


# -- lowering for CUDA ---------------------------------------------------------------------------


def _lower_for_cuda(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("storage", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "shape", [(1, 4096, 4096), (64, 4096, 11008), (64, 11008, 4096), (2048, 4096, 4096), (17, 200, 72)]
)
def test_lowers_for_cuda(storage, x_dtype, shape):
    num_rows, depth, width = shape
    sd = jax.ShapeDtypeStruct
    args = (sd((num_rows, depth), x_dtype), sd((4, depth, width), storage), sd((4, width), jnp.float32))
    text = _lower_for_cuda(lambda x, q, s, layer: quant_matmul(x, q, s, layer), *args, sd((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(16, 4096, 4096), (64, 4096, 11008), (256, 11008, 4096), (17, 200, 72)])
def test_variants_lower_for_cuda(variant, shape):
    quantization, flags = VARIANTS[variant]
    num_rows, depth, width = shape
    sd = jax.ShapeDtypeStruct
    q_shape = (4, width, depth) if flags.get("k_major") else (4, depth, width)
    args = (sd((num_rows, depth), jnp.bfloat16), sd(q_shape, quantization.storage_dtype), sd((4, width), jnp.float32))
    text = _lower_for_cuda(lambda x, q, s, layer: quant_matmul(x, q, s, layer, **flags), *args, sd((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("flags", [{}, dict(w8a8=True, k_major=True, swap_ab=True)])
def test_unrolled_layers_read_the_stack_in_place(flags):
    """Static layer indices, as in the model's unrolled decode: no layer is sliced out of the stack
    (a slice before a custom call is a copy), and the calls share their lowering (the first may
    differ: its x is the step's argument)."""
    sd = jax.ShapeDtypeStruct
    q_shape = (4, 1536, 576) if flags.get("k_major") else (4, 576, 1536)
    x, q, scale = sd((64, 576), jnp.bfloat16), sd(q_shape, jnp.int8), sd((4, 1536), jnp.float32)

    def layers(x, q, scale):
        for layer in range(4):
            x = quant_matmul(x, q, scale, jnp.int32(layer), **flags)[:, :576]
        return x

    text = _lower_for_cuda(layers, x, q, scale)
    assert text.count("call @_call") == 4 and text.count("__gpu$xla.gpu.triton") <= 2
    stack = "x".join(map(str, q_shape))
    weight_slices = [line for line in text.splitlines() if "slice" in line and stack in line]
    assert not weight_slices, weight_slices
