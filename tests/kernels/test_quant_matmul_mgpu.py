"""The Mosaic GPU weight-only 8-bit GEMM (`pallas_kernels.quant.mgpu`) on CPU.

References, sharing no index math with the kernel: a float64 numpy product
x @ (q[layer] * scale[layer][:, None]).T (every int8 and e4m3 value, and every bf16 / f16 x, is
exact in float64), and hand-computed values (one exact small product, `pick_splits`' cost model).

Runs: the Pallas GPU interpreter executes the single-warpgroup variant that keeps the widened
weight tile in shared memory (a_in_smem=True, compute_wgs=1): it has no register-operand wgmma and
cannot run the warp-specialized CTA. Those (compute_wgs=2, cluster=2, the register operand) are
checked by lowering for CUDA under an abstract H200, which runs Mosaic GPU's own lowering
(layouts, conversions, shared-memory budget) without a GPU.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jaxlora.model.quant import Quantization, quantize
from pallas_kernels.quant.mgpu import SMEM_BYTES, MgpuKnobs, pick_splits, quant_matmul_mgpu, smem_bytes
from tests.tolerances import assert_close

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)
LAYERS, LAYER = 3, 1  # a layer in the middle of the stack
# What the interpreter runs; tile_n=64 and tile_k=64 so that N = 192 and K = 320 (multiples of 64,
# not of 128) take several tiles of each, and one K run (the automatic choice would give each of the
# 5 steps a CTA of its own), so that 5 steps go through the 4 pipeline buffers and reuse the first.
INTERP = MgpuKnobs(tile_n=64, tile_k=64, splits=1, a_in_smem=True)
WIDTH, DEPTH = 192, 320


def _data(
    seed: int,
    quantization: Quantization,
    num_rows: int,
    depth: int,
    width: int,
    x_dtype: jnp.dtype = jnp.bfloat16,
    only: int | None = LAYER,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x [M, K], K-major q [L, N, K], scale [L, N]). With `only` set, only that layer is usable: the
    other layers' scales are NaN (and their e4m3 weights too), so a read from the wrong layer shows
    (int8 weights cannot be NaN, but the other layers hold different random weights)."""
    rng = np.random.default_rng(seed)
    # Channel magnitudes spread over four decades, so a scale applied to the wrong column shows.
    w = rng.standard_normal((LAYERS, depth, width)) * np.logspace(-2, 2, width)
    q, scale = quantize(jnp.asarray(w, jnp.float32), quantization)  # q [L, K, N]
    if only is not None:
        others = np.arange(LAYERS) != only
        scale = scale.at[others].set(jnp.nan)
        if quantization is Quantization.FP8:
            q = q.at[others].set(jnp.nan)
    x = jnp.asarray(rng.standard_normal((num_rows, depth)) + 0.5, x_dtype)  # shifted: no all-cancelling rows
    return x, jnp.swapaxes(q, 1, 2), scale


def _reference(x: jax.Array, q: jax.Array, scale: jax.Array, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(x @ w.T, |x| @ |w|.T) in float64 for w = q[layer] * scale[layer][:, None], [N, K]: the product
    and the size of its terms, sum_k |x[m, k] * w[n, k]|, the scale of a dot's rounding error."""
    w = np.asarray(q[layer], np.float64) * np.asarray(scale[layer], np.float64)[:, None]
    xf = np.asarray(x, np.float64)
    return xf @ w.T, np.abs(xf) @ np.abs(w).T


def _assert_close(x: jax.Array, q: jax.Array, scale: jax.Array, got: jax.Array, err_msg: str = "", layer=LAYER):
    """got [M, N] in x's dtype against the float64 reference, twice: in units of sum_k |x * w| with
    the suite's bf16 row (as the Triton kernel's tests), and within the output's own rounding (half
    an ulp of x's dtype, 2^-8 relative for bf16, 2^-11 for f16) plus float32 accumulation over K, so
    that an f16 result rounded through bf16 fails."""
    assert got.shape == (x.shape[0], q.shape[1]) and got.dtype == x.dtype, (got.shape, got.dtype)
    want, unit = _reference(x, q, scale, layer)
    got64 = np.asarray(got, np.float64)
    assert_close(got64 / unit, want / unit, "bfloat16", err_msg)
    half_ulp = 2.0**-8 if got.dtype == jnp.bfloat16 else 2.0**-11
    accumulation = 2 * (x.shape[1] + 2) * 2.0**-24 * unit  # K f32 adds, the scale's multiply, the split sum
    bound = half_ulp * np.abs(want) + accumulation + 2.0**-24  # + f16's subnormal step
    excess = np.abs(got64 - want) - bound
    assert (excess <= 0).all(), f"{err_msg}: worst excess {excess.max():.3g} over the rounding bound"


def _splits_used(fn: Callable, *args, width: int, padded_rows: int) -> list[int]:
    """The K splits of the kernel's float32 partials [splits, N, padded M] in fn's jaxpr."""
    text = str(jax.make_jaxpr(fn)(*args))
    return sorted({int(s) for s in re.findall(rf"f32\[(\d+),{width},{padded_rows}\]", text)})


def test_hand_computed_case():
    # x[m, k] = m + 1, q[layer, n, k] = n % 5 - 2 along all K = 32, scale 0.5:
    # y[m, n] = 32 * (m + 1) * (n % 5 - 2) * 0.5 = 16 * (m + 1) * (n % 5 - 2), exact in bf16 (|y| <= 256).
    # The other layers hold 7s with NaN scales, so reading them shows.
    x = jnp.broadcast_to(jnp.arange(1, 9, dtype=jnp.bfloat16)[:, None], (8, 32))
    cols = np.arange(64) % 5 - 2
    q = np.full((LAYERS, 64, 32), 7, np.int8)
    q[LAYER] = cols[:, None]
    scale = np.full((LAYERS, 64), np.nan, np.float32)
    scale[LAYER] = 0.5
    got = quant_matmul_mgpu(
        x, jnp.asarray(q), jnp.asarray(scale), LAYER, MgpuKnobs(tile_n=64, tile_k=32, a_in_smem=True), interpret=True
    )
    want = 16 * np.arange(1, 9)[:, None] * cols[None, :]
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("quantization", list(Quantization))
@pytest.mark.parametrize(
    ("num_rows", "splits"),
    [
        (1, 1),  # padded to 8 rows inside
        # The automatic choice on 132 slots: 3 column tiles, 5 K steps (divisors 1, 5), W = 192 * 320,
        # P = 8 * 192 * 8: cost(1) = 132 W / 3 + P = 2715648 > cost(5) = 132 W / 15 + 5P = 602112.
        (8, None),
        (24, 1),
        # 25 groups of 8 rows; P = 8 * 192 * 200: cost(1) = 3010560 > cost(5) = 2076672.
        (200, None),
    ],
)
def test_matches_reference_on_awkward_shapes(quantization: Quantization, num_rows: int, splits: int | None):
    x, q, scale = _data(num_rows, quantization, num_rows, DEPTH, WIDTH)
    knobs = dataclasses.replace(INTERP, splits=splits)

    def fn(x, q, scale):
        return quant_matmul_mgpu(x, q, scale, LAYER, knobs, interpret=True)

    assert _splits_used(fn, x, q, scale, width=WIDTH, padded_rows=max(num_rows, 8)) == [splits or 5]
    _assert_close(x, q, scale, fn(x, q, scale), f"{quantization} M={num_rows}")


@pytest.mark.parametrize("quantization", list(Quantization))
def test_f16_activations_give_f16_output(quantization: Quantization):
    x, q, scale = _data(3, quantization, 24, DEPTH, WIDTH, jnp.float16)
    got = quant_matmul_mgpu(x, q, scale, LAYER, INTERP, interpret=True)
    _assert_close(x, q, scale, got, f"{quantization} f16")


# Knobs -> the K splits the call must run with (hand-computed where automatic). Data: M = 8 (no
# row padding to hide behind), N = 256, K = 256.
KNOB_CASES = {
    "tile_k=32": (MgpuKnobs(tile_n=64, tile_k=32, splits=1, a_in_smem=True), 1),  # 8 steps in one run
    "tile_k=64-splits=2": (MgpuKnobs(tile_n=64, tile_k=64, splits=2, a_in_smem=True), 2),  # 2 runs of 2 steps
    # tile_n = tile_k = 128: 2 column tiles, 2 runs of one step each.
    "tile_k=128-splits=2": (MgpuKnobs(tile_n=128, tile_k=128, splits=2, a_in_smem=True), 2),
    # Automatic: 4 column tiles, 4 K steps, 16 slots; weight bytes W = 65536, partial bytes P = 8 * 256 * 8
    # = 16384: cost(1) = 16 * W / 4 + P = 278528, cost(2) = 16 * W / 8 + 2P = 163840,
    # cost(4) = 16 * W / 16 + 4P = 131072, so 4.
    "auto-min_ctas=16": (MgpuKnobs(tile_n=64, tile_k=64, min_ctas=16, a_in_smem=True), 4),
    "out_via_smem": (MgpuKnobs(tile_n=64, tile_k=64, splits=2, a_in_smem=True, out_via_smem=True), 2),
    "stages=1": (MgpuKnobs(tile_n=64, tile_k=32, stages=1, splits=1, a_in_smem=True), 1),
    "stages>steps": (MgpuKnobs(tile_n=64, tile_k=64, stages=8, splits=1, a_in_smem=True), 1),  # 4 steps
}


@pytest.mark.parametrize("case", list(KNOB_CASES))
def test_knobs_give_the_same_result(case: str):
    knobs, splits = KNOB_CASES[case]
    x, q, scale = _data(5, Quantization.INT8, 8, 256, 256)

    def fn(x, q, scale):
        return quant_matmul_mgpu(x, q, scale, LAYER, knobs, interpret=True)

    assert _splits_used(fn, x, q, scale, width=256, padded_rows=8) == [splits]
    _assert_close(x, q, scale, fn(x, q, scale), case)


@pytest.mark.parametrize("quantization", list(Quantization))
def test_traced_layer_inside_a_scan_reads_each_layer(quantization: Quantization):
    # Every layer usable and different: layer i's output must match layer i's weights and scales.
    x, q, scale = _data(7, quantization, 5, 128, 128, only=None)

    def body(_, layer):
        return None, quant_matmul_mgpu(x, q, scale, layer, INTERP, interpret=True)

    _, ys = jax.lax.scan(body, None, jnp.arange(LAYERS, dtype=jnp.int32))
    for layer in range(LAYERS):
        _assert_close(x, q, scale, ys[layer], f"layer {layer}", layer=layer)


def test_jitted_call_with_a_traced_layer():
    x, q, scale = _data(8, Quantization.FP8, 24, 128, 192, jnp.float16)
    fn = jax.jit(lambda x, q, scale, layer: quant_matmul_mgpu(x, q, scale, layer, INTERP, interpret=True))
    _assert_close(x, q, scale, fn(x, q, scale, jnp.int32(LAYER)))
    # A concrete array index outside jit goes through the same path as the int.
    _assert_close(x, q, scale, quant_matmul_mgpu(x, q, scale, jnp.asarray(LAYER), INTERP, interpret=True))


# -- pick_splits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "min_ctas", "want"),
    [
        # 7B down_proj at 64 rows, tiles 64 x 64: K = 11008 in 172 steps, N = 4096 in 64 tiles.
        # cost(1) = 132/64 W + P, cost(2) = 132/128 W + 2P = 50692096, cost(4) = 264/256 W + 4P.
        ((172, 64, 45088768, 8 * 4096 * 64), 132, 2),
        # q|k|v-wide at 64 rows: K = 4096 in 64 steps, N = 12288 in 192 tiles. One split is 192 CTAs,
        # 2 waves on 132 SMs (cost 1.375 W + P = 75497472); 2 splits fill 3 waves (64487424); 4: 77070336.
        ((64, 192, 50331648, 8 * 12288 * 64), 132, 2),
        # 6 steps, 1 column tile, 4 slots, W = 1200, P = 10: cost(1) = 4810, cost(2) = 2420,
        # cost(3) = 1630, cost(6) = 2 waves, 8 * 1200 / 6 + 60 = 1660: not the most CTAs, 3.
        ((6, 1, 1200, 10), 4, 3),
        # The same with dear partials, P = 1000: 5800, 4400, 4600, 7600: 2.
        ((6, 1, 1200, 1000), 4, 2),
        # No partial cost and every split one full wave: a tie, the fewest splits win.
        ((4, 132, 1 << 20, 0), 132, 1),
        # One K step: nothing to split.
        ((1, 1, 1 << 20, 0), 132, 1),
    ],
)
def test_pick_splits_hand_computed_cases(args: tuple[int, int, int, int], min_ctas: int, want: int):
    num_k_steps, num_col_tiles, weight_bytes, split_bytes = args
    assert pick_splits(num_k_steps, num_col_tiles, MgpuKnobs(min_ctas=min_ctas), weight_bytes, split_bytes) == want


def test_pick_splits_explicit_splits():
    # An explicit choice wins over the model (which picks 3 here, above), but must divide the steps.
    assert pick_splits(6, 1, MgpuKnobs(splits=6), 1200, 10) == 6
    assert pick_splits(6, 1, MgpuKnobs(splits=1), 1200, 10) == 1
    with pytest.raises(ValueError, match="splits=4 must divide the 6 K steps of 128"):
        pick_splits(6, 1, MgpuKnobs(splits=4), 1200, 10)
    # The call refuses it too: K = 256 in 4 steps of 64.
    x, q, scale = _data(9, Quantization.INT8, 8, 256, 64)
    with pytest.raises(ValueError, match="splits=3 must divide the 4 K steps of 64"):
        quant_matmul_mgpu(x, q, scale, LAYER, dataclasses.replace(INTERP, splits=3), interpret=True)


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tile_n=96), "tile_n=96 must be a positive multiple of 64"),
        (dict(tile_n=0), "tile_n=0 must be a positive multiple of 64"),
        (dict(tile_k=256), r"tile_k=256 must be one of \(128, 64, 32\)"),
        (dict(tile_k=16), "tile_k=16 must be one of"),
        (dict(stages=0), "stages=0 must be >= 1"),
        (dict(splits=0), "splits=0 must be >= 1 or None"),
        (dict(min_ctas=0), "min_ctas=0 must be >= 1"),
        (dict(compute_wgs=3), "compute_wgs=3 must be 1 or 2"),
        (dict(cluster=2), "cluster=2 must be 1, or 2 with compute_wgs=2"),
        (dict(cluster=4, compute_wgs=2), "cluster=4 must be 1, or 2 with compute_wgs=2"),
        (dict(a_in_smem=True, compute_wgs=2), "a_in_smem and out_via_smem are single-warpgroup variants"),
        (dict(out_via_smem=True, compute_wgs=2), "a_in_smem and out_via_smem are single-warpgroup variants"),
    ],
)
def test_bad_knobs_are_refused(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        MgpuKnobs(**kwargs)


def test_knob_columns():
    assert MgpuKnobs().cta_cols == 128 and MgpuKnobs().cluster_cols == 128
    assert MgpuKnobs(tile_n=64, compute_wgs=2).cta_cols == 128
    knobs = MgpuKnobs(tile_n=64, compute_wgs=2, cluster=2)
    assert knobs.cta_cols == 128 and knobs.cluster_cols == 256
    with pytest.raises(dataclasses.FrozenInstanceError):  # a jit static argument: must not change
        knobs.stages = 2  # type: ignore[misc]


def _bad_inputs() -> dict[str, tuple[tuple, MgpuKnobs, bool, str]]:
    """name -> ((x, q, scale, layer), knobs, interpret, the error's pattern)."""
    x, q, scale = _data(6, Quantization.INT8, 4, 128, 128)
    ok = INTERP
    return {
        "x rank": ((x[None], q, scale, LAYER), ok, True, r"needs x \[M, K\] and q \[L, N, K\]"),
        "q rank": ((x, q[LAYER], scale, LAYER), ok, True, r"needs x \[M, K\] and q \[L, N, K\]"),
        "K mismatch": ((x[:, :64], q, scale, LAYER), ok, True, r"got x \(4, 64\), q \(3, 128, 128\)"),
        "q float32": ((x, q.astype(jnp.float32), scale, LAYER), ok, True, "got q float32, x bfloat16"),
        "x float32": ((x.astype(jnp.float32), q, scale, LAYER), ok, True, "got q int8, x float32"),
        "scale shape": ((x, q, scale[:, :-1], LAYER), ok, True, r"scale must be \[L, N\] float32"),
        "scale dtype": ((x, q, scale.astype(jnp.bfloat16), LAYER), ok, True, r"got \(3, 128\) bfloat16"),
        "no rows": ((x[:0], q, scale, LAYER), ok, True, "x has 0 rows; the kernel takes 1 to 256"),
        "257 rows": ((jnp.ones((257, 128), x.dtype), q, scale, LAYER), ok, True, "x has 257 rows"),
        # N = 128 is no multiple of the 256 columns of two warpgroups of 128.
        "N vs cluster_cols": ((x, q, scale, LAYER), MgpuKnobs(compute_wgs=2), False, "N=128 must be a multiple of 256"),
        "K vs tile_k": ((x[:, :96], q[:, :, :96], scale, LAYER), ok, True, "K=96 of tile_k=64"),
        "layer 3": ((x, q, scale, 3), ok, True, r"layer=3 must be in \[0, 3\)"),
        "layer -1": ((x, q, scale, -1), ok, True, r"layer=-1 must be in \[0, 3\)"),
        "interpret, registers": ((x, q, scale, LAYER), MgpuKnobs(tile_n=64, tile_k=64), True, "needs a_in_smem=True"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_inputs_are_refused(name: str):
    args, knobs, interpret, match = _bad_inputs()[name]
    with pytest.raises(ValueError, match=match):
        quant_matmul_mgpu(*args, knobs, interpret=interpret)


# -- lowering for CUDA ------------------------------------------------------------------------------


def _lower_for_cuda(fn: Callable, *args) -> str:
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _lowered_splits(text: str, width: int, padded_rows: int) -> list[int]:
    """The splits of each Mosaic GPU call's partials [splits, N, padded M] f32 (its result type)."""
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    return [int(s) for line in calls for s in re.findall(rf"-> tensor<(\d+)x{width}x{padded_rows}xf32>", line)]


LOWER_KNOBS = {
    "one-wg": MgpuKnobs(),
    "one-wg-out_via_smem": MgpuKnobs(out_via_smem=True),
    "two-wg": MgpuKnobs(compute_wgs=2),
    "two-wg-cluster": MgpuKnobs(tile_n=64, compute_wgs=2, cluster=2),  # 256 columns: 11008 = 43 * 256
}
# int8 with bf16 and f16 steps; e4m3 with f16 (e4m3 -> bf16, widened through f16, is the next test's case).
LOWER_DTYPES = [(jnp.int8, jnp.bfloat16), (jnp.int8, jnp.float16), (jnp.float8_e4m3fn, jnp.float16)]


@pytest.mark.parametrize("knobs_name", list(LOWER_KNOBS))
@pytest.mark.parametrize(("storage", "x_dtype"), LOWER_DTYPES)
@pytest.mark.parametrize("shape", [(64, 4096, 12288), (16, 11008, 4096), (1, 4096, 4096)])  # (M, K, N)
def test_lowers_for_cuda(knobs_name: str, storage: jnp.dtype, x_dtype: jnp.dtype, shape: tuple[int, int, int]):
    knobs = LOWER_KNOBS[knobs_name]
    num_rows, depth, width = shape
    sd = jax.ShapeDtypeStruct
    args = (sd((num_rows, depth), x_dtype), sd((4, width, depth), storage), sd((4, width), jnp.float32))
    call = lambda x, q, s, layer: quant_matmul_mgpu(x, q, s, layer, knobs)  # noqa: E731
    if knobs.cluster > 1 and max(num_rows, 8) % 16:
        # Multicast halves the x tile in 8-row tiles: one row (padded to 8) cannot be split.
        with pytest.raises(ValueError, match="must be a multiple of 16"):
            _lower_for_cuda(call, *args, sd((), jnp.int32))
        return
    text = _lower_for_cuda(call, *args, sd((), jnp.int32))
    rows = max(num_rows, 8)  # M = 1 is padded to 8 rows
    [splits] = _lowered_splits(text, width, rows)  # one kernel, with the wrapper's split
    steps, tiles = depth // knobs.tile_k, width // knobs.cta_cols
    assert splits == pick_splits(steps, tiles, knobs, width * depth, 8 * width * rows), splits


@pytest.mark.parametrize(("stages", "compute_wgs"), [(6, 1), (4, 2)])
def test_lowers_for_cuda_with_256_rows(stages: int, compute_wgs: int):
    # The most rows, with the tuning table's tiles for them (tile_k = 64: the default knobs' 4 stages of
    # x [256, 128] bf16 alone take 256 KiB, over the 227 KiB of shared memory).
    knobs = MgpuKnobs(tile_n=64, tile_k=64, stages=stages, compute_wgs=compute_wgs)
    sd = jax.ShapeDtypeStruct
    args = (sd((256, 4096), jnp.bfloat16), sd((4, 12288, 4096), jnp.int8), sd((4, 12288), jnp.float32))
    text = _lower_for_cuda(lambda x, q, s, layer: quant_matmul_mgpu(x, q, s, layer, knobs), *args, sd((), jnp.int32))
    assert len(_lowered_splits(text, 12288, 256)) == 1


@pytest.mark.parametrize(("depth", "width"), [(11008, 4096), (4096, 12288)])
def test_lowered_splits_follow_the_cost_model(depth: int, width: int):
    # The hand-computed pick_splits cases above as calls (64 rows, tiles 64 x 64): 2 splits each, so
    # the call passes the weight's and the partials' bytes the model expects.
    knobs = MgpuKnobs(tile_n=64, tile_k=64)
    sd = jax.ShapeDtypeStruct
    args = (sd((64, depth), jnp.bfloat16), sd((4, width, depth), jnp.int8), sd((4, width), jnp.float32))
    text = _lower_for_cuda(lambda x, q, s, layer: quant_matmul_mgpu(x, q, s, layer, knobs), *args, sd((), jnp.int32))
    assert _lowered_splits(text, width, 64) == [2]


def test_fp8_with_bf16_steps_lowers_for_cuda():
    """e4m3 weights for a bf16 model: Mosaic GPU converts e4m3 -> bf16 only with ptxas ISA >= 9.2 (not
    the H200 image's, nor the one it assumes here without a CUDA plugin), so the kernel widens e4m3
    through f16; a direct convert would raise NotImplementedError here."""
    sd = jax.ShapeDtypeStruct
    args = (sd((16, 4096), jnp.bfloat16), sd((4, 4096, 4096), jnp.float8_e4m3fn), sd((4, 4096), jnp.float32))
    text = _lower_for_cuda(lambda x, q, s, layer: quant_matmul_mgpu(x, q, s, layer), *args, sd((), jnp.int32))
    assert len(_lowered_splits(text, 4096, 16)) == 1


def _unrolled_layers_text(knobs: MgpuKnobs, slice_first: bool) -> tuple[str, str]:
    """The CUDA lowering of 4 layers unrolled with static layer indices, as the model's decode runs
    them, and the stack's shape as the text spells it. slice_first: hand the kernel q[layer] as a
    stack of one instead (the control: a copy the check must see)."""
    sd = jax.ShapeDtypeStruct
    q_shape = (4, 1024, 512)
    x, q, scale = sd((64, 512), jnp.bfloat16), sd(q_shape, jnp.int8), sd((4, 1024), jnp.float32)

    def layers(x, q, scale):
        for layer in range(4):
            if slice_first:
                y = quant_matmul_mgpu(x, q[layer][None], scale[layer][None], 0, knobs)
            else:
                y = quant_matmul_mgpu(x, q, scale, jnp.int32(layer), knobs)
            x = y[:, :512]
        return x

    return _lower_for_cuda(layers, x, q, scale), "x".join(map(str, q_shape))


def _weight_slices(text: str, stack: str) -> list[str]:
    """The XLA slices of the stack (the custom call's own line is left out: its serialized Mosaic
    module may spell anything)."""
    return [
        line
        for line in text.splitlines()
        if re.search(r"stablehlo\.(dynamic_)?slice", line) and stack in line and "custom_call" not in line
    ]


@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_unrolled_layers_read_the_stack_in_place(compute_wgs: int):
    """Static layer indices: no layer is sliced out of the stack (a slice before a custom call is a
    copy of the layer's weights), and the calls share their kernel (the layer is data; the first may
    differ, as in the Triton kernel's test: its x is the step's argument)."""
    knobs = MgpuKnobs(compute_wgs=compute_wgs)
    text, stack = _unrolled_layers_text(knobs, slice_first=False)
    assert text.count("call @_call") == 4
    assert text.count("custom_call @mosaic_gpu") <= 2
    assert not _weight_slices(text, stack), _weight_slices(text, stack)
    # ...and each kernel takes the whole stack as its operand.
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert calls and all(f"tensor<{stack}xi8>" in line.rsplit(" : (", 1)[1] for line in calls)
    # The control: slicing the layer out first is seen.
    sliced, _ = _unrolled_layers_text(knobs, slice_first=True)
    assert _weight_slices(sliced, stack)


def test_knobs_over_the_shared_memory_budget_are_refused():
    """Default tiles at 256 rows: 4 stages of x [256, 128] bf16 alone are 256 KiB, over a CTA's 227.
    A clear ValueError, not Mosaic's compile failure on the GPU; the tuning table's row fits."""
    x = jnp.ones((256, 256), jnp.bfloat16)
    q, scale = jnp.ones((1, 256, 256), jnp.int8), jnp.ones((1, 256), jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        quant_matmul_mgpu(x, q, scale, 0, MgpuKnobs())
    fits = MgpuKnobs(tile_n=64, tile_k=64, stages=6)
    assert smem_bytes(fits, 256) <= SMEM_BYTES < smem_bytes(MgpuKnobs(), 256)


def test_a_layer_that_is_not_an_integer_scalar_is_refused():
    x, q, scale = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.int8), jnp.ones((2, 64), jnp.float32)
    for bad in (1.5, jnp.array([0, 1], jnp.int32), jnp.float32(1)):
        with pytest.raises(ValueError, match="integer scalar"):
            quant_matmul_mgpu(x, q, scale, bad, INTERP, interpret=True)
