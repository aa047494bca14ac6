"""Weight-only quantization (jaxlora.model.quant): per-channel round-trip bounds of each format, the
quantized layer against its dequantized weight, and what build_model accepts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.errors import ModelLoadError
from jaxlora.kernels import QUANT_KERNEL_MAX_TOKENS, QuantMatmul, StepKernels
from jaxlora.lora.merge import merged_params
from jaxlora.model import init_kv_cache
from jaxlora.model import quant as quant_module
from jaxlora.model.forward import forward_logits
from jaxlora.model.params import build_model, quantized_model, random_model
from jaxlora.model.quant import (
    Quantization,
    QuantLinear,
    dequantize,
    dequantize_arrays,
    from_kmajor_arrays,
    matmul,
    project,
    quantize,
    to_kmajor_arrays,
)
from pallas_kernels.quant.tuning import mgpu_knobs
from tests.factories import tiny_config
from tests.greedy import batched_greedy
from tests.tolerances import assert_close

IN, OUT = 576, 2049  # SmolLM2's hidden size, and an odd width


def _weights() -> np.ndarray:
    """[IN, OUT] float32 with per-channel magnitudes from 1e-4 to 1e2, an all-zero channel, a channel
    with one large outlier and one of tiny values (fp8's subnormal range after scaling)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((IN, OUT)).astype(np.float32) * np.logspace(-4, 2, OUT, dtype=np.float32)
    w[:, 7] = 0.0
    w[:, 8] = rng.standard_normal(IN) * 0.01
    w[3, 8] = 50.0
    w[:, 9] = rng.standard_normal(IN) * 1e-5
    w[0, 9] = 1.0  # the rest of channel 9 sits 1e5x below its amax: subnormal e4m3 (< 2^-6) after scaling
    return w


def _round_trip(quantization: Quantization):
    w = _weights()
    q, scale = quantize(jnp.asarray(w), quantization)
    assert q.dtype == quantization.storage_dtype and q.shape == (IN, OUT)
    assert scale.dtype == jnp.float32 and scale.shape == (OUT,)
    back = np.asarray(dequantize(q, scale))
    return w, np.asarray(q).astype(np.float32), np.asarray(scale), back


def test_int8_round_trip_within_half_a_step_per_channel():
    w, q, scale, back = _round_trip(Quantization.INT8)
    amax = np.abs(w).max(axis=0)
    live = amax > 0
    np.testing.assert_allclose(scale[live], amax[live] / 127, rtol=1e-6)
    assert scale[7] == 1.0 and not back[:, 7].any()  # a zero channel stays exactly zero
    assert (np.abs(q).max(axis=0)[live] == 127).all()  # the channel's amax maps onto the limit
    err = np.abs(w - back).max(axis=0)
    # Half a step, plus float32 rounding of w / scale and of q * scale.
    assert (err <= scale / 2 * (1 + 1e-5) + np.abs(w).max(axis=0) * 2e-7).all()
    assert (err[live] > 0).any()  # the weights really went through 8 bits


def test_fp8_round_trip_within_e4m3_bound_per_channel():
    w, q, scale, back = _round_trip(Quantization.FP8)
    amax = np.abs(w).max(axis=0)
    live = amax > 0
    np.testing.assert_allclose(scale[live], amax[live] / 448, rtol=1e-6)
    assert scale[7] == 1.0 and not back[:, 7].any()
    assert (np.abs(q).max(axis=0)[live] == 448).all()
    err = np.abs(w - back)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; below 2^-6 (scaled)
    # the subnormal step is 2^-9, so at most 2^-10 * scale. Plus float32 rounding.
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5) + np.abs(w) * 2e-7
    assert (err <= bound).all()
    assert (np.abs(w[:, 9] / scale[9]) < 2.0**-6).sum() > IN // 2  # channel 9 did test the subnormal bound
    assert err[:, live].max() > 0


def test_int8_hand_computed_case():
    # Column [2, -1, 0.3]: amax 2, scale 2/127; -1 / (2/127) = -63.5 rounds half to even -> -64,
    # 0.3 * 63.5 = 19.05 -> 19. Dequantized: -64 * 2/127 = -1.00787..., 19 * 2/127 = 0.29921...
    q, scale = quantize(jnp.asarray([[2.0], [-1.0], [0.3]]), Quantization.INT8)
    assert np.asarray(q)[:, 0].tolist() == [127, -64, 19]
    np.testing.assert_allclose(np.asarray(dequantize(q, scale))[:, 0], [2.0, -128 / 127, 38 / 127], rtol=1e-6)


def test_quant_linear_is_x_times_the_dequantized_weight_plus_bias():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 80)).astype(np.float32)
    bias = rng.standard_normal(80).astype(np.float32)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    for quantization in Quantization:
        layer = QuantLinear(48, 80, quantization=quantization, use_bias=True, dtype=jnp.float32)
        q, scale = quantize(jnp.asarray(w), quantization)
        layer.qkernel.set_value(q)
        layer.qscale.set_value(scale)
        layer.bias.set_value(jnp.asarray(bias))
        dense = x @ np.asarray(dequantize(q, scale))
        assert_close(layer(jnp.asarray(x)), dense + bias, "float32", str(quantization))
        assert_close(project(layer, jnp.asarray(x)), dense, "float32", str(quantization))  # no bias


def test_quantized_model_keeps_embeddings_norms_and_head_dense():
    model = random_model(tiny_config(tie_word_embeddings=False, attention_bias=True), seed=2)
    q = quantized_model(model, "fp8").flat_params()
    dense = model.flat_params()
    for name, value in dense.items():
        if name.endswith(".kernel") and name != "lm_head.kernel":
            prefix = name.removesuffix(".kernel")
            assert name not in q and q[f"{prefix}.qkernel"].dtype == jnp.float8_e4m3fn
            assert q[f"{prefix}.qscale"].shape == value.shape[:1] + value.shape[2:]  # [L, out]
        else:
            np.testing.assert_array_equal(np.asarray(q[name]), np.asarray(value), err_msg=name)
    with pytest.raises(ValueError, match="already quantized"):
        quantized_model(quantized_model(model, "int8"), "fp8")


def test_build_model_never_casts_quantized_weights_across_formats():
    model = quantized_model(random_model(tiny_config(), seed=2), "int8")
    arrays = model.flat_params()
    with pytest.raises(ModelLoadError, match=r"down_proj\.qkernel has dtype int8, expected float8_e4m3fn"):
        build_model(model.config, arrays, quantization="fp8")
    with pytest.raises(ValueError, match="must be one of"):
        build_model(model.config, arrays, quantization="int4")
    dense = build_model(model.config, dequantize_arrays(arrays))
    assert dense.quantization is None and "layers.mlp.up_proj.kernel" in dense.flat_params()


def test_merging_into_a_quantized_base_is_refused():
    model = quantized_model(random_model(tiny_config(), seed=2), "int8")
    with pytest.raises(ModelLoadError, match="cannot merge into int8 base weights"):
        merged_params(model.flat_params(), {}, quantization=model.quantization)


def _runs_quant_kernel(model, kernels: StepKernels) -> bool:
    """Whether the model's one-token step traces a pallas_kernels.quant.triton call."""
    kv = init_kv_cache(model.config, 1, 8)
    tokens, positions = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, kv: forward_logits(model.graphdef, p, tokens, positions, kv, kernels=kernels))
    return "quant_matmul" in str(jaxpr(model.params, kv))


@pytest.mark.parametrize(("quantization", "unroll_layers"), [("int8", False), ("fp8", True)])
def test_kernel_path_gives_the_greedy_tokens_of_the_xla_path(quantization, unroll_layers):
    """The model with its quantized GEMMs in pallas_kernels.quant.triton (interpret mode; the stacked
    weights read in place by the scan's traced layer index, or a static one unrolled) against XLA."""
    model = quantized_model(random_model(tiny_config(head_dim=16, num_layers=3), seed=3), quantization)
    prompts = [[5, 6, 7, 8, 9], [11, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    xla = StepKernels(unroll_layers=unroll_layers)
    kernel = StepKernels(quant_matmul="pallas", interpret=True, unroll_layers=unroll_layers)
    assert _runs_quant_kernel(model, kernel) and not _runs_quant_kernel(model, xla)
    want = batched_greedy(model, prompts, [0, 0, 0], 6, kernels=xla)
    assert len({tuple(ids) for ids in want}) == len(prompts), "rows must differ for a swap to show"
    assert batched_greedy(model, prompts, [0, 0, 0], 6, kernels=kernel) == want


def test_quant_matmul_choice_is_resolved_per_platform():
    gpu = StepKernels.for_platform("xla", "gpu", compute_capability="9.0")  # an H100 / H200
    assert gpu.quant_matmul is QuantMatmul.BEST and gpu.quant_kernel_max_tokens == QUANT_KERNEL_MAX_TOKENS
    assert gpu.uses_quant_kernel(QUANT_KERNEL_MAX_TOKENS) and not gpu.uses_quant_kernel(QUANT_KERNEL_MAX_TOKENS + 1)
    assert gpu.quant_kernel == "best" and StepKernels(quant_matmul="pallas").quant_kernel == "triton"
    # Not a Hopper (an A100; Blackwell has no wgmma either; no GPU at all reads as unknown): Triton.
    for capability in ("8.0", "10.0"):
        other = StepKernels.for_platform("xla", "gpu", compute_capability=capability)
        assert other.quant_matmul is QuantMatmul.PALLAS and other.quant_kernel_max_tokens == QUANT_KERNEL_MAX_TOKENS
        for kernel in ("mgpu", "best"):
            with pytest.raises(ValueError, match="needs a Hopper GPU"):
                StepKernels.for_platform("xla", "gpu", compute_capability=capability, quant_matmul=kernel)
    if jax.default_backend() == "cpu":  # no GPU to read a capability from: not known to be a Hopper
        assert StepKernels.for_platform("xla", "gpu").quant_matmul is QuantMatmul.PALLAS
    mgpu = StepKernels.for_platform("xla", "gpu", compute_capability="9.0", quant_matmul="mgpu")
    assert mgpu.quant_kernel == "mgpu" and mgpu.quant_kernel_max_tokens == QUANT_KERNEL_MAX_TOKENS
    with pytest.raises(ValueError, match="reads the serving layout.s K-major weights"):
        StepKernels.for_platform("xla", "gpu", compute_capability="9.0", quant_matmul="mgpu", fused_projections=False)
    for kernel, limit in (("mgpu", None), ("best", 257)):
        with pytest.raises(ValueError, match="at most 256 rows"):
            StepKernels(quant_matmul=kernel, quant_kernel_max_tokens=limit)
    # The kernel was measured in the serving layout only; the separate one (tensor parallelism) keeps XLA.
    assert not StepKernels.for_platform("xla", "gpu", fused_projections=False).uses_quant_kernel(1)
    explicit = StepKernels.for_platform("xla", "gpu", quant_matmul="pallas")
    assert explicit.quant_matmul is QuantMatmul.PALLAS and explicit.uses_quant_kernel(1 << 20)
    assert not StepKernels.for_platform("xla", "gpu", quant_matmul="xla").uses_quant_kernel(1)
    cpu = StepKernels.for_platform("xla", "cpu")
    assert cpu.quant_matmul is QuantMatmul.XLA and not cpu.interpret
    assert StepKernels.for_platform("xla", "cpu", quant_matmul="pallas").interpret
    assert StepKernels.for_platform("xla", "cpu", quant_matmul="mgpu").interpret
    for kernel in ("pallas", "mgpu", "best"):
        with pytest.raises(ValueError, match=f"quant_matmul={kernel} is a GPU kernel"):
            StepKernels.for_platform("xla", "tpu", quant_matmul=kernel)
    with pytest.raises(ValueError, match="quant_matmul='auto' must be one of"):
        StepKernels(quant_matmul="auto")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="quant_kernel_max_tokens"):
            StepKernels(quant_matmul="pallas", quant_kernel_max_tokens=bad)
        with pytest.raises(ValueError, match="concurrent_min_tokens"):
            StepKernels(concurrent_min_tokens=bad)


def test_quant_kernel_runs_only_steps_within_its_token_limit():
    """With a token limit the kernel takes the small steps and XLA the large ones, and both give the
    XLA path's greedy tokens. The limit counts a step's tokens, rows x tokens a row: two rows
    decoding are a step of 2, a prompt of 4 a step of 4."""
    model = quantized_model(random_model(tiny_config(head_dim=16, num_layers=2), seed=5), "int8")
    limited = StepKernels(quant_matmul="pallas", interpret=True, quant_kernel_max_tokens=2)

    def traces_kernel(rows: int, tokens_per_row: int) -> bool:
        kv = init_kv_cache(model.config, rows, 8)
        tokens = jnp.zeros((rows, tokens_per_row), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(tokens_per_row, dtype=jnp.int32), (rows, tokens_per_row))
        step = lambda p, kv: forward_logits(model.graphdef, p, tokens, positions, kv, kernels=limited)  # noqa: E731
        return "quant_matmul" in str(jax.make_jaxpr(step)(model.params, kv))

    assert traces_kernel(2, 1) and traces_kernel(1, 1)
    assert not traces_kernel(1, 4) and not traces_kernel(2, 2)
    prompts = [[5, 6, 7, 8, 9], [11, 3]]
    want = batched_greedy(model, prompts, [0, 0], 4, kernels=StepKernels())
    assert batched_greedy(model, prompts, [0, 0], 4, kernels=limited) == want


def test_a_stacked_quant_linear_needs_its_layer():
    layer = QuantLinear(48, 80, quantization=Quantization.INT8, use_bias=False, dtype=jnp.float32)
    layer.qkernel.set_value(jnp.ones((2, 48, 80), jnp.int8))
    layer.qscale.set_value(jnp.ones((2, 80), jnp.float32))
    with pytest.raises(ValueError, match="needs the layer index"):
        layer(jnp.ones((3, 48)))


@pytest.mark.parametrize("unroll_layers", [False, True])
def test_kernel_path_reads_the_stacked_weights_in_place_on_cuda(unroll_layers):
    """Lowered for an H200: no quantized weight is sliced out of its stack (a slice feeding a kernel
    is a copy), whether the layer index is the scan's counter or a constant of the unrolled loop."""
    from jax.sharding import AbstractDevice, AbstractMesh

    h200 = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    )
    model = quantized_model(random_model(tiny_config(hidden_size=64, intermediate_size=96), seed=4), "int8")
    kernels = StepKernels(quant_matmul="pallas", unroll_layers=unroll_layers)
    kv = init_kv_cache(model.config, 2, 8)
    tokens, positions = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)

    def step(params, kv):
        return forward_logits(model.graphdef, params, tokens, positions, kv, kernels=kernels)

    with jax.sharding.use_abstract_mesh(h200):
        text = jax.jit(step).trace(model.params, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    stacked = [f"tensor<2x{a}x{b}xi8>" for a, b in ((64, 64), (64, 32), (64, 96), (96, 64))]
    slices = [line for line in text.splitlines() if "slice" in line and any(s in line for s in stacked)]
    assert not slices, slices[:3]
    assert sum(text.count(s) for s in stacked) > 0  # the stacked weights do reach the lowered step


def _kmajor_linear(quantization: Quantization, dtype=jnp.bfloat16, k_major: bool = True) -> QuantLinear:
    """A stacked QuantLinear [2 layers, 128 in, 192 out] with random weights, K-major or not."""
    layer = QuantLinear(128, 192, quantization=quantization, use_bias=False, dtype=dtype, k_major=k_major)
    w = jax.random.normal(jax.random.key(0), (2, 128, 192), jnp.float32)
    q, scale = quantize(w, quantization)
    (layer.qkernel_t if k_major else layer.qkernel).set_value(jnp.swapaxes(q, 1, 2) if k_major else q)
    layer.qscale.set_value(scale)
    return layer


@pytest.mark.parametrize(
    ("quantization", "kernel", "k_major", "dtype", "runs"),
    [
        ("int8", "best", True, jnp.bfloat16, "mgpu"),  # BEST_KERNEL: int8 on the Mosaic kernel
        ("fp8", "best", True, jnp.bfloat16, "mgpu"),  # and e4m3, since its GPU check
        ("int8", "best", False, jnp.bfloat16, "triton"),  # the separate layout is not K-major
        ("fp8", "best", False, jnp.bfloat16, "triton"),
        ("fp8", "triton", True, jnp.bfloat16, "triton"),  # opted out
        ("int8", "best", True, jnp.float32, "triton"),  # the Mosaic kernel takes bf16 / f16 only
        ("int8", "triton", True, jnp.bfloat16, "triton"),
    ],
)
def test_project_routes_each_format_to_its_kernel(monkeypatch, quantization, kernel, k_major, dtype, runs):
    """Which kernel a stacked projection runs, and that it gives XLA's product of the same layer."""
    layer = _kmajor_linear(Quantization(quantization), dtype, k_major)
    called = []
    for name in ("quant_matmul", "quant_matmul_mgpu"):
        real = getattr(quant_module, name)
        monkeypatch.setattr(quant_module, name, lambda *a, _r=real, _n=name, **k: called.append(_n) or _r(*a, **k))
    x = jax.random.normal(jax.random.key(1), (8, 128), dtype)
    got = project(layer, x, layer=jnp.int32(1), kernel=kernel, interpret=True)
    assert called == ["quant_matmul_mgpu" if runs == "mgpu" else "quant_matmul"]
    stack = (layer.qkernel_t if k_major else layer.qkernel)[...]
    want = matmul(x, stack[1], layer.qscale[...][1], k_major=k_major)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_the_mosaic_kernel_by_name_refuses_what_it_cannot_take():
    """Asked for by name, the Mosaic kernel raises instead of running another kernel: the separate
    layout's [in, out] weights, float32 activations, more than 256 rows."""
    with pytest.raises(ValueError, match="K-major weights"):
        project(
            _kmajor_linear(Quantization.INT8, k_major=False), jnp.ones((8, 128), jnp.bfloat16), layer=0, kernel="mgpu"
        )
    kmajor = _kmajor_linear(Quantization.INT8, jnp.float32)
    with pytest.raises(ValueError, match="cannot take x"):
        project(kmajor, jnp.ones((8, 128), jnp.float32), layer=0, kernel="mgpu", interpret=True)
    with pytest.raises(ValueError, match="cannot take x"):
        project(_kmajor_linear(Quantization.INT8), jnp.ones((257, 128), jnp.bfloat16), layer=0, kernel="mgpu")


def test_kmajor_arrays_round_trip_and_rename():
    arrays = {"layers.mlp.down_proj.qkernel": np.arange(24, dtype=np.int8).reshape(1, 4, 6), "x.kernel": np.ones(3)}
    kmajor = to_kmajor_arrays(arrays)
    assert set(kmajor) == {"layers.mlp.down_proj.qkernel_t", "x.kernel"}
    np.testing.assert_array_equal(
        kmajor["layers.mlp.down_proj.qkernel_t"], arrays["layers.mlp.down_proj.qkernel"].transpose(0, 2, 1)
    )
    back = from_kmajor_arrays(kmajor)
    assert set(back) == set(arrays)
    np.testing.assert_array_equal(back["layers.mlp.down_proj.qkernel"], arrays["layers.mlp.down_proj.qkernel"])


def test_mgpu_knobs_follow_the_table_and_narrow_to_the_shape():
    wide, narrow = mgpu_knobs(64, 22016, 4096), mgpu_knobs(64, 4096, 11008)
    assert (wide.tile_n, wide.tile_k, wide.stages, wide.compute_wgs) == (64, 128, 6, 2)
    assert (narrow.tile_n, narrow.tile_k, narrow.stages, narrow.compute_wgs) == (64, 64, 8, 1)
    # At 64 rows the table gives wide GEMMs two warpgroups and tile_k 128. K = 8256 is not a multiple
    # of 128 (64 is); 8256 columns are not whole 128-column CTAs, so the CTA narrows to one warpgroup.
    deep = mgpu_knobs(64, 8192, 8256)
    assert (deep.tile_k, deep.compute_wgs) == (64, 2)
    odd = mgpu_knobs(64, 8192 + 64, 4096)
    assert (odd.tile_k, odd.compute_wgs) == (128, 1)
    assert mgpu_knobs(257, 4096, 4096) is None and mgpu_knobs(0, 4096, 4096) is None
    assert mgpu_knobs(16, 4096 + 32, 4096) is None and mgpu_knobs(16, 4096, 4096 + 16) is None
    interpreted = mgpu_knobs(64, 22016, 4096, interpret=True)
    assert interpreted.a_in_smem and interpreted.compute_wgs == 1


@pytest.mark.parametrize("unroll_layers", [False, True])
def test_serving_layout_on_the_mosaic_kernel_reads_the_kmajor_stacks_in_place_on_cuda(unroll_layers):
    """Lowered for an H200: a bf16 int8 model in the serving layout runs its projections as Mosaic GPU
    kernels (no Triton one) on the K-major stacks [L, out, in], none of them sliced out first."""
    from jax.sharding import AbstractDevice, AbstractMesh

    h200 = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    )
    cfg = tiny_config(hidden_size=64, head_dim=16, intermediate_size=64)
    dense = random_model(cfg, seed=4, dtype=jnp.bfloat16, fused=True)
    model = quantized_model(dense, "int8")
    kernels = StepKernels(quant_matmul="best", unroll_layers=unroll_layers, quant_kernel_max_tokens=256)
    kv = init_kv_cache(model.config, 2, 8, dtype=jnp.bfloat16)
    tokens, positions = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)

    def step(params, kv):
        return forward_logits(model.graphdef, params, tokens, positions, kv, kernels=kernels)

    with jax.sharding.use_abstract_mesh(h200):
        text = jax.jit(step).trace(model.params, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text
    # [L=2, out, in]: q|k|v 128 x 64, o 64 x 64, gate|up 128 x 64, down 64 x 64.
    stacked = [f"tensor<2x{a}x{b}xi8>" for a, b in ((128, 64), (64, 64))]
    # Only slice ops count: the Mosaic custom call's serialized module may contain the bytes "slice".
    ops = [line for line in text.splitlines() if re.search(r"stablehlo\.(dynamic_)?slice", line)]
    slices = [line for line in ops if any(s in line for s in stacked)]
    assert not slices, slices[:3]
    assert sum(text.count(s) for s in stacked) > 0
