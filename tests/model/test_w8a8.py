"""W8A8 (jaxlora.model.w8a8): the 8-bit GEMM against a float64 numpy product, and where the step runs it.

The reference multiplies the float64 activations by the float64 dequantized weights: the only
error left is the activations' rounding to 8 bits (per token) and float32 accumulation, which the
bound below states per output element:

    |y[t, o] - ref[t, o]| <= sum_i err(x[t, i]) * |w[i, o]| + 1e-5 * sum_i |x[t, i] * w[i, o]|
    err(v) = max(|v| * 2^-4, xs[t] * 2^-10)   e4m3: relative half-ulp, half the subnormal step
           = xs[t] / 2                        int8: half a step
    xs[t]  = max_i |x[t, i]| / 448 (e4m3) or / 127 (int8)

One scale for the whole step would push the small rows below e4m3's smallest subnormal (their
error then is their whole value, far past the bound): the rows span 1e-3 to 1e3 for that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.kernels import W8A8_AUTO, KernelConfig, StepKernels
from jaxlora.model import init_kv_cache
from jaxlora.model.forward import forward_logits
from jaxlora.model.params import quantized_model, random_model
from jaxlora.model.quant import Quantization, dequantize, quantize
from jaxlora.model.w8a8 import matmul_w8a8, quantize_rows
from tests.factories import tiny_config

FP8, INT8 = "float8_e4m3fn", "int8"
MAX_VALUE = {Quantization.FP8: 448.0, Quantization.INT8: 127.0}


def _operands(rows: int, depth: int, width: int, quantization: Quantization, seed: int = 0):
    """x [rows, depth] float32, rows scaled from 1e-3 to 1e3 (one row zero when there are several),
    and the quantized weights (q, scale) with their float64 dequantized w [depth, width]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)) * np.logspace(-3, 3, rows)[:, None]
    if rows > 2:
        x[rows // 2] = 0.0
    q, scale = quantize(jnp.asarray(rng.standard_normal((depth, width)), jnp.float32), quantization)
    w = np.asarray(dequantize(q, scale), np.float64)
    return x.astype(np.float32), q, scale, w


def _bound(x: np.ndarray, w: np.ndarray, quantization: Quantization) -> np.ndarray:
    """The module doc's per-element bound, [rows, width] float64."""
    x = x.astype(np.float64)
    xs = np.abs(x).max(axis=1, keepdims=True) / MAX_VALUE[quantization]
    if quantization is Quantization.FP8:
        err = np.maximum(np.abs(x) * 2.0**-4, xs * 2.0**-10)
    else:
        err = np.broadcast_to(xs / 2, x.shape)
    return err @ np.abs(w) + 1e-5 * (np.abs(x) @ np.abs(w))


@pytest.mark.parametrize("quantization", list(Quantization))
@pytest.mark.parametrize(("rows", "depth", "width"), [(1, 65, 33), (7, 129, 255), (200, 96, 17)])
def test_w8a8_matches_the_float64_product_within_the_rounding_bound(quantization, rows, depth, width):
    x, q, scale, w = _operands(rows, depth, width, quantization)
    y = np.asarray(matmul_w8a8(jnp.asarray(x), q, scale), np.float64)
    assert y.shape == (rows, width) and np.isfinite(y).all()
    err = np.abs(y - x.astype(np.float64) @ w)
    bound = _bound(x, w, quantization)
    assert (err <= bound).all(), (
        f"worst excess {np.max(err - bound)} at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    )


@pytest.mark.parametrize("quantization", list(Quantization))
def test_small_rows_keep_their_own_scale(quantization):
    """A row 1e6 below another in the same step is still multiplied to the bound's relative error."""
    x, q, scale, w = _operands(2, 64, 8, quantization, seed=1)
    y = np.asarray(matmul_w8a8(jnp.asarray(x), q, scale), np.float64)
    small = x[0].astype(np.float64) @ w
    assert np.abs(y[0]).max() > 0
    assert (np.abs(y[0] - small) <= _bound(x[:1], w, quantization)[0]).all()


@pytest.mark.parametrize("quantization", list(Quantization))
def test_zero_rows_give_zeros_not_nan(quantization):
    _, q, scale, _ = _operands(1, 40, 9, quantization)
    y = np.asarray(matmul_w8a8(jnp.zeros((3, 40), jnp.bfloat16), q, scale))
    assert y.dtype == jnp.bfloat16 and (y == 0).all()
    xq, xs = quantize_rows(jnp.zeros((2, 40)), quantization.storage_dtype)
    assert (np.asarray(xs) == 1.0).all() and (np.asarray(xq, np.float32) == 0).all()


def test_int8_hand_computed_case():
    # x = [127, -63.5]: amax 127, so xs = 1 and xq = [127, -64] (-63.5 rounds half to even).
    # q = [[1], [2]], scale 0.5: 127 * 1 + (-64) * 2 = -1, times xs 1 and scale 0.5 -> -0.5.
    x = jnp.asarray([[127.0, -63.5]], jnp.float32)
    y = matmul_w8a8(x, jnp.asarray([[1], [2]], jnp.int8), jnp.asarray([0.5], jnp.float32))
    assert float(y[0, 0]) == -0.5


@pytest.mark.parametrize("quantization", list(Quantization))
def test_k_major_weights_give_the_same_product(quantization):
    x, q, scale, _ = _operands(5, 48, 24, quantization)
    y = matmul_w8a8(jnp.asarray(x), q, scale)
    y_t = matmul_w8a8(jnp.asarray(x), jnp.swapaxes(q, 0, 1), scale, k_major=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_t))


def test_bad_operands_are_refused():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        matmul_w8a8(x, jnp.ones((8, 4), jnp.bfloat16), jnp.ones((4,)))
    with pytest.raises(ValueError, match="contracted width"):
        matmul_w8a8(x, jnp.ones((9, 4), jnp.int8), jnp.ones((4,)))


def test_w8a8_choice_is_a_table_per_format_and_step_size():
    hopper = StepKernels.for_platform("xla", "gpu", compute_capability="9.0")
    fp8_from = W8A8_AUTO["hopper"][jnp.dtype(jnp.float8_e4m3fn)]
    assert hopper.w8a8_at(fp8_from, jnp.float8_e4m3fn) and not hopper.w8a8_at(fp8_from - 1, jnp.float8_e4m3fn)
    assert not hopper.uses_quant_kernel(fp8_from)  # W8A8 takes steps the weight-only kernel leaves to XLA
    int8_from = W8A8_AUTO["hopper"][jnp.dtype(jnp.int8)]
    assert hopper.w8a8_at(int8_from, jnp.int8) and not hopper.w8a8_at(int8_from - 1, jnp.int8)
    assert "w8a8=float8_e4m3fn" in hopper.describe(fp8_from)
    assert StepKernels.for_platform("xla", "gpu", compute_capability="8.0").w8a8_min_tokens == ()
    assert StepKernels.for_platform("xla", "cpu").w8a8_min_tokens == ()
    assert (
        StepKernels.for_platform("xla", "gpu", compute_capability="9.0", fused_projections=False).w8a8_min_tokens == ()
    )
    both = KernelConfig(w8a8=True, quant_matmul="xla").resolve("xla", "cpu")
    assert both.w8a8_min_tokens == ((FP8, 1), (INT8, 1)) and both.w8a8_at(1, jnp.int8)
    assert KernelConfig(w8a8="int8", w8a8_min_tokens=64).resolve("xla", "cpu").w8a8_min_tokens == ((INT8, 64),)
    assert KernelConfig(w8a8=False).resolve("xla", "gpu", compute_capability="9.0").w8a8_min_tokens == ()
    for bad in ("yes", "bf16"):
        with pytest.raises(ValueError, match="w8a8="):
            KernelConfig(w8a8=bad)
    for table in ((("bfloat16", 1),), ((FP8, 0),), 5):
        with pytest.raises(ValueError, match="w8a8_min_tokens"):
            StepKernels(w8a8_min_tokens=table)


@pytest.mark.parametrize("quantization", list(Quantization))
def test_the_model_step_runs_w8a8_from_its_table_size(quantization):
    """A step of 4 tokens multiplies 8-bit activations, a step of 2 does not (table: from 3)."""
    model = quantized_model(random_model(tiny_config(head_dim=16, num_layers=2), seed=4), quantization)
    kernels = StepKernels(w8a8_min_tokens=((quantization.storage_dtype.name, 3),))
    dtype = {Quantization.FP8: "f8_e4m3fn", Quantization.INT8: "i8"}[quantization]

    def quantizes_activations(rows: int) -> bool:
        kv = init_kv_cache(model.config, rows, 8)
        tokens, positions = jnp.zeros((rows, 1), jnp.int32), jnp.zeros((rows, 1), jnp.int32)
        step = lambda p, kv: forward_logits(model.graphdef, p, tokens, positions, kv, kernels=kernels)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(step)(model.params, kv))
        # Only activations are converted to 8 bits in a step (weights are stored so).
        return any(f":{dtype}[{rows}," in line and "convert_element_type" in line for line in jaxpr.splitlines())

    assert quantizes_activations(4) and not quantizes_activations(2)
