"""The weight-only-quantized GEMM kernel against `jaxlora.model.quant.matmul` (XLA's dot over the
converted weight; no index math shared): interpret mode on CPU, and lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jaxlora.model.quant import Quantization, matmul, quantize
from pallas_kernels.quant_matmul import quant_matmul
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


def test_unrolled_layers_read_the_stack_in_place():
    """Static layer indices, as in the model's unrolled decode: no layer is sliced out of the stack
    (a slice before a custom call is a copy), and the calls share their lowering (the first may
    differ: its x is the step's argument)."""
    sd = jax.ShapeDtypeStruct
    x, q, scale = sd((64, 576), jnp.bfloat16), sd((4, 576, 1536), jnp.int8), sd((4, 1536), jnp.float32)

    def layers(x, q, scale):
        for layer in range(4):
            x = quant_matmul(x, q, scale, jnp.int32(layer))[:, :576]
        return x

    text = _lower_for_cuda(layers, x, q, scale)
    assert text.count("call @_call") == 4 and text.count("__gpu$xla.gpu.triton") <= 2
    weight_slices = [line for line in text.splitlines() if "slice" in line and "4x576x1536" in line]
    assert not weight_slices, weight_slices
