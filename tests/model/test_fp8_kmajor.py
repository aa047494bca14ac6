"""FP8 weights stored K-major in the serving layout (`qkernel_t` [L, out, in]): the layout switch
(build_model's `kmajor`, default jaxlora.kernels.KMAJOR_SERVING), the products in that layout
against the [in, out] one and the dequantized reference, the canonical flat parameters and
checkpoints, and the engine's greedy tokens in both layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.kernels import BEST_KERNEL, KMAJOR_SERVING, KernelConfig, QuantKernel
from jaxlora.loading import load_model
from jaxlora.loading.orbax_ckpt import save_converted
from jaxlora.model import quant
from jaxlora.model.params import abstract_model, build_model, quantized_model, random_model
from jaxlora.model.quant import Quantization, dequantize, kmajor_serving, quantize, serving_kmajor
from jaxlora.model.w8a8 import matmul_w8a8
from pallas_kernels.quant.triton import quant_matmul
from tests.engine.conftest import engine_config, make_engine
from tests.factories import char_tokenizer, random_adapter, tiny_config, tiny_model, word_tokenizer

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# Awkward widths: nothing a multiple of a tile, q|k|v of 24 + 2 * 16 = 56 columns.
CFG = tiny_config(hidden_size=24, head_dim=6, num_heads=4, num_kv_heads=2, intermediate_size=40)


def _bits(a) -> np.ndarray:
    """Raw bytes, so that e4m3 arrays compare exactly."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _fp8_operands(rows: int, depth: int, width: int, seed: int):
    """x [rows, depth] float32 (random, no zero row), q [depth, width] e4m3, scale [width], and the
    float64 dequantized w, channels spread over four decades so that a misplaced scale shows."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((depth, width)) * np.logspace(-2, 2, width)
    q, scale = quantize(jnp.asarray(w, jnp.float32), Quantization.FP8)
    x = (rng.standard_normal((rows, depth)) + 0.25).astype(np.float32)
    return x, q, scale, np.asarray(dequantize(q, scale), np.float64)


# -- the table and the switch ----------------------------------------------------------------------


def test_kmajor_table_covers_every_format_and_keeps_the_mosaic_formats_kmajor():
    """Every storage format has a layout, and a format whose BEST kernel is the Mosaic one is stored
    K-major (that kernel reads nothing else: BEST would otherwise never reach it)."""
    assert set(KMAJOR_SERVING) == {q.storage_dtype for q in Quantization} == set(BEST_KERNEL)
    for dtype, kernel in BEST_KERNEL.items():
        if kernel is QuantKernel.MGPU:
            assert KMAJOR_SERVING[dtype], dtype


def test_the_default_layout_comes_from_the_table(monkeypatch):
    for quantization in Quantization:
        assert kmajor_serving(quantization) is KMAJOR_SERVING[quantization.storage_dtype]
        assert serving_kmajor(quantization, True) is KMAJOR_SERVING[quantization.storage_dtype]
        assert serving_kmajor(quantization, False) is False  # the separate layout never is
    assert not kmajor_serving(None)
    flipped = {d: not v for d, v in KMAJOR_SERVING.items()}
    monkeypatch.setattr(quant, "KMAJOR_SERVING", flipped)
    _, expected = abstract_model(CFG, jnp.float32, "fp8", fused=True)
    leaf = "qkernel_t" if flipped[FP8] else "qkernel"
    assert f"layers.self_attn.qkv_proj.{leaf}" in expected


def test_kmajor_true_needs_a_quantized_serving_layout():
    with pytest.raises(ValueError, match="kmajor=True stores quantized projections"):
        random_model(CFG, fused=True, kmajor=True)
    with pytest.raises(ValueError, match="kmajor=True stores quantized projections"):
        random_model(CFG, quantization="fp8", kmajor=True)
    with pytest.raises(ValueError, match="must be a bool or None"):
        random_model(CFG, quantization="fp8", fused=True, kmajor="yes")
    assert not random_model(CFG, quantization="fp8", fused=True, kmajor=False).kmajor


@pytest.mark.parametrize("quantization", list(Quantization))
def test_both_layouts_hold_the_same_canonical_weights(quantization):
    """kmajor=True stores every fused projection [L, out, in] as `qkernel_t`, kmajor=False [L, in, out]
    as `qkernel`; both give the separate model's canonical flat parameters bit for bit."""
    separate = random_model(CFG, seed=3, quantization=quantization)
    kmajor = random_model(CFG, seed=3, quantization=quantization, fused=True, kmajor=True)
    in_out = random_model(CFG, seed=3, quantization=quantization, fused=True, kmajor=False)
    assert kmajor.kmajor and not in_out.kmajor
    attn, mlp = kmajor.params["layers"]["self_attn"], kmajor.params["layers"]["mlp"]
    L, qkv = CFG.num_layers, CFG.q_size + 2 * CFG.kv_size
    assert attn["qkv_proj"]["qkernel_t"][...].shape == (L, qkv, CFG.hidden_size)
    assert attn["o_proj"]["qkernel_t"][...].shape == (L, CFG.hidden_size, CFG.q_size)
    assert mlp["gate_up_proj"]["qkernel_t"][...].shape == (L, 2 * CFG.intermediate_size, CFG.hidden_size)
    assert mlp["down_proj"]["qkernel_t"][...].shape == (L, CFG.hidden_size, CFG.intermediate_size)
    assert in_out.params["layers"]["mlp"]["down_proj"]["qkernel"][...].shape == (
        L,
        CFG.intermediate_size,
        CFG.hidden_size,
    )
    want = separate.flat_params()
    for model in (kmajor, in_out):
        got = model.flat_params()
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)


def test_quantized_model_keeps_the_asked_layout():
    dense = random_model(CFG, seed=4, fused=True)
    assert quantized_model(dense, "fp8", kmajor=True).kmajor
    assert quantized_model(dense, "fp8").kmajor is KMAJOR_SERVING[FP8]


def test_converted_checkpoint_is_canonical_and_loads_in_either_layout(tmp_path):
    """`jaxlora convert` saves flat_params(): a K-major model writes [in, out] `qkernel`s, and the
    checkpoint loads back into either serving layout with the same weights."""
    model = random_model(CFG, seed=5, quantization="fp8", fused=True, kmajor=True)
    save_converted(model, word_tokenizer(), tmp_path / "ckpt")
    separate, _ = load_model(tmp_path / "ckpt")
    assert not separate.fused and all(not n.endswith("qkernel_t") for n in separate.flat_params())
    for kmajor in (True, False):
        loaded, _ = load_model(tmp_path / "ckpt", fused=True, kmajor=kmajor)
        assert loaded.kmajor is kmajor
        got, want = loaded.flat_params(), model.flat_params()
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)


# -- the products ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "depth", "width"), [(1, 65, 33), (7, 129, 255), (130, 96, 17)])
def test_kmajor_w8a8_equals_the_in_out_one_and_the_dequantized_product(rows, depth, width):
    """The same 8-bit operands contracted on q's last axis instead of its first: the same numbers,
    within fp8 W8A8's bound of the float64 product (tests/model/test_w8a8.py's module doc)."""
    x, q, scale, w = _fp8_operands(rows, depth, width, seed=rows)
    in_out = np.asarray(matmul_w8a8(jnp.asarray(x), q, scale), np.float64)
    kmajor = np.asarray(matmul_w8a8(jnp.asarray(x), jnp.swapaxes(q, 0, 1), scale, k_major=True), np.float64)
    unit = np.abs(x.astype(np.float64)) @ np.abs(w)
    np.testing.assert_allclose(kmajor / unit, in_out / unit, rtol=0, atol=1e-6)
    xs = np.abs(x).max(axis=1, keepdims=True).astype(np.float64) / 448.0
    err = np.maximum(np.abs(x) * 2.0**-4, xs * 2.0**-10)
    bound = err @ np.abs(w) + 1e-5 * unit
    assert (np.abs(kmajor - x.astype(np.float64) @ w) <= bound).all()


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_triton_kernel_reads_kmajor_fp8_like_the_reference(x_dtype, rows):
    """The weight-only Triton kernel on a K-major e4m3 stack (interpreted) against XLA's product of
    the [in, out] layer (`quant.matmul`, no index math shared), on awkward widths."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3, 200, 72)) * np.logspace(-2, 2, 72)
    q, scale = quantize(jnp.asarray(w, jnp.float32), Quantization.FP8)
    x = jnp.asarray(rng.standard_normal((rows, 200)) + 0.5, x_dtype)
    got = quant_matmul(x, jnp.swapaxes(q, 1, 2), scale, 1, k_major=True, interpret=True, block_n=32, block_k=64)
    want = quant.matmul(x, q[1], scale[1])
    unit = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(dequantize(q[1], scale[1]), np.float64))
    tol = 1e-5 if x_dtype == jnp.float32 else 2e-2
    assert got.dtype == jnp.dtype(x_dtype)
    np.testing.assert_allclose(
        np.asarray(got, np.float64) / unit, np.asarray(want, np.float64) / unit, rtol=0, atol=tol
    )


# -- the engine ------------------------------------------------------------------------------------

NEW_TOKENS = 8
BATCH = ((None, [1, 40, 41, 42, 43]), ("a0", [1, 50, 60]), ("a1", [1, 70, 71, 72, 73, 74, 75, 76]), ("a2", [1, 33]))
# 8-token steps on the Triton kernel (interpreted), 16-token ones W8A8 through XLA: both paths.
KERNELS = KernelConfig(quant_matmul="pallas", quant_kernel_max_tokens=8, w8a8="fp8", w8a8_min_tokens=16)


def _generate(model, adapters) -> list[list[int]]:
    engine = make_engine((model, char_tokenizer(), adapters), kernels=KERNELS)
    assert [engine.kernels.uses_quant_kernel(b) for b in engine.config.token_budgets] == [True, False]
    assert engine.kernels.w8a8_at(16, FP8)
    requests = [
        GenerationRequest(request_id=f"k{i}", prompt_ids=p, adapter=a, sampling=SamplingParams(max_tokens=NEW_TOKENS))
        for i, (a, p) in enumerate(BATCH)
    ]
    got = [list(out.token_ids) for out in engine.generate(requests)]
    assert engine.compiles_after_warmup == 0
    return got


def test_engine_gives_the_same_greedy_tokens_in_both_fp8_layouts(monkeypatch):
    """The serving layout with FP8 K-major: the same greedy tokens as [in, out], and the K-major
    model really runs the K-major paths (the kernel's k_major, W8A8's last-axis contraction)."""
    dense = tiny_model()
    lora = engine_config().lora
    adapters = {
        n: random_adapter(n, dense.config, modules=lora.target_modules, rng=i + 1)
        for i, n in enumerate(("a0", "a1", "a2"))
    }
    layout = dict(quantization="fp8", fused=True, source="test")
    in_out = build_model(dense.config, dense.flat_params(), kmajor=False, **layout)
    expected = _generate(in_out, adapters)
    assert len({tuple(ids) for ids in expected}) == len(BATCH), "a swapped row must not go unnoticed"

    seen = []
    real_kernel, real_w8a8 = quant.quant_matmul, quant.matmul_w8a8
    monkeypatch.setattr(
        quant, "quant_matmul", lambda *a, **k: seen.append(("kernel", k["k_major"])) or real_kernel(*a, **k)
    )
    monkeypatch.setattr(quant, "matmul_w8a8", lambda *a, **k: seen.append(("w8a8", k["k_major"])) or real_w8a8(*a, **k))
    kmajor = build_model(dense.config, dense.flat_params(), kmajor=True, **layout)
    assert _generate(kmajor, adapters) == expected
    assert set(seen) == {("kernel", True), ("w8a8", True)}, set(seen)


def test_kmajor_fp8_w8a8_contracts_the_last_axis_of_both_operands():
    """What lets cuBLASLt's FP8 GEMM ("TN": both operands K-major) take the weight as stored: the
    lowered dot contracts axis 1 of x and axis 1 of the [out, in] weight (axis 0 for [in, out])."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((512,), jnp.float32)
    for k_major, shape, dims in ((True, (512, 256), "[1] x [1]"), (False, (256, 512), "[1] x [0]")):
        q = jax.ShapeDtypeStruct(shape, FP8)
        text = jax.jit(lambda x, q, s, k=k_major: matmul_w8a8(x, q, s, k_major=k)).lower(x, q, s).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line and "f8E4M3FN" in line]
        assert len(dots) == 1 and f"contracting_dims = {dims}" in dots[0], dots
        assert "transpose" not in text
