"""The serving layout (q|k|v and gate|up fused, jaxlora.model.fused) computes what the separate
layout computes: the same canonical parameters, the same logits on every LoRA backend, dense or
quantized, and the same greedy tokens through the engine."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.config import TARGET_MODULES, LoraBackend, LoraConfig
from jaxlora.errors import ModelLoadError
from jaxlora.kernels import KernelConfig, StepKernels, gemm_compiler_options
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.model import init_kv_cache
from jaxlora.model.forward import forward_logits
from jaxlora.model.fused import fuse_arrays, split_arrays
from jaxlora.model.params import build_model, random_model
from tests.factories import random_adapter, tiny_config
from tests.tolerances import assert_close

CFG = tiny_config(num_layers=2, attention_bias=True)


def _bank(target_modules=TARGET_MODULES):
    lora = LoraConfig(max_slots=4, max_rank=4, target_modules=target_modules)
    bank = init_bank(CFG, lora)
    for slot, (seed, rank) in {1: (1, 4), 2: (2, 1), 3: (3, 3)}.items():
        weights = random_adapter(f"a{slot}", CFG, modules=target_modules, rank=rank, rng=seed, scale=0.3).weights
        bank = set_slot(bank, slot, slot_arrays(weights, CFG, lora))
    return bank


def _names(model) -> set[str]:
    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(model.params)}


def test_fused_model_holds_one_matrix_per_group_and_gives_canonical_params():
    separate = random_model(CFG, seed=4)
    fused = random_model(CFG, seed=4, fused=True)
    assert fused.fused and not separate.fused
    names = _names(fused)
    assert {
        "layers.self_attn.qkv_proj.kernel",
        "layers.self_attn.qkv_proj.bias",
        "layers.mlp.gate_up_proj.kernel",
    } <= names
    assert not any(f".{m}." in n for n in names for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    qkv = fused.params["layers"]["self_attn"]["qkv_proj"]["kernel"][...]
    assert qkv.shape == (CFG.num_layers, CFG.hidden_size, CFG.q_size + 2 * CFG.kv_size)
    a, b = separate.flat_params(), fused.flat_params()
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
    back = split_arrays(fuse_arrays(a), CFG)
    assert set(back) == set(a)
    for name in a:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(a[name]), err_msg=name)


def test_partial_group_and_fused_input_names_are_refused():
    arrays = random_model(CFG, seed=4).flat_params()
    del arrays["layers.self_attn.k_proj.kernel"]
    with pytest.raises(ModelLoadError, match=r"missing tensor.*k_proj.kernel"):
        build_model(CFG, arrays, fused=True)
    fused_names = fuse_arrays(random_model(CFG, seed=4).flat_params())
    with pytest.raises(ModelLoadError, match="canonical"):
        build_model(CFG, fused_names, fused=True)


def test_misshapen_pieces_are_refused_before_fusing():
    # CFG has grouped-query attention (q 32 wide, k and v 16): q and k swapped still add up to the
    # fused width, so each piece must be checked against its own module's shape.
    arrays = random_model(CFG, seed=4).flat_params()
    q, k = "layers.self_attn.q_proj.kernel", "layers.self_attn.k_proj.kernel"
    swapped = {**arrays, q: arrays[k], k: arrays[q]}
    with pytest.raises(ModelLoadError, match=r"src: tensor layers.self_attn.[qk]_proj.kernel has shape"):
        build_model(CFG, swapped, fused=True, source="src")
    up = "layers.mlp.up_proj.kernel"
    wide_input = {**arrays, up: np.concatenate([arrays[up], arrays[up][:, :1]], axis=1)}
    with pytest.raises(ModelLoadError, match="up_proj.kernel has shape"):
        build_model(CFG, wide_input, fused=True, source="src")


def test_cublas_gemms_follow_the_projection_layout():
    pick = lambda platform, fused: (
        StepKernels.for_platform(  # noqa: E731
            "xla", platform, fused_projections=fused
        ).gemm.value
    )
    assert pick("gpu", True) == "cublas"
    assert pick("gpu", False) == "xla"  # one matrix per module: cuBLAS measured slower
    assert pick("cpu", True) == "xla"


def _logits(model, bank, slots, backend, quant_matmul="xla"):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 5)), jnp.int32)
    kv = init_kv_cache(CFG, 4, 16)
    pos = jnp.broadcast_to(jnp.arange(5), (4, 5))
    kernels = StepKernels.for_platform(backend, quant_matmul=quant_matmul)
    slots = jnp.asarray(slots, jnp.int32)
    prefill, kv = forward_logits(
        model.graphdef, model.params, tokens[:, :4], pos[:, :4], kv, bank, slots, kernels=kernels
    )
    decode, _ = forward_logits(
        model.graphdef, model.params, tokens[:, 4:], pos[:, 4:], kv, bank, slots, kernels=kernels
    )
    return np.asarray(prefill), np.asarray(decode)


@pytest.mark.parametrize("backend", [LoraBackend.XLA, LoraBackend.PALLAS, LoraBackend.RAGGED])
@pytest.mark.parametrize("targets", [TARGET_MODULES, ("q_proj", "v_proj", "up_proj")])
def test_fused_logits_equal_separate_on_mixed_adapters(backend, targets):
    """Prefill (segments) and a decode step (one token per row: the Pallas fused-output kernel),
    rows on three adapters and the base, all modules or a subset of each group."""
    bank = _bank(targets)
    slots = [2, 0, 1, 3]
    want = _logits(random_model(CFG, seed=6), bank, slots, backend)
    got = _logits(random_model(CFG, seed=6, fused=True), bank, slots, backend)
    for g, w in zip(got, want):
        assert_close(g, w, "float32")


@pytest.mark.parametrize("quant_matmul", ["xla", "pallas"])
def test_fused_quantized_logits_equal_separate(quant_matmul):
    """int8 weights: per-column scales travel with their columns (quantized before fusing), and the
    serving layout stores the 8-bit matrices K-major (`qkernel_t` [L, out, in]) while its
    flat_params() gives back the separate model's canonical `qkernel` [L, in, out] exactly."""
    bank = _bank()
    slots = [1, 3, 0, 2]
    separate = random_model(CFG, seed=7, quantization="int8")
    want = _logits(separate, bank, slots, "pallas", quant_matmul)
    fused = random_model(CFG, seed=7, quantization="int8", fused=True)
    assert not any(n.endswith(".qkernel") for n in _names(fused))
    qkv_t = fused.params["layers"]["self_attn"]["qkv_proj"]["qkernel_t"][...]
    assert qkv_t.shape == (CFG.num_layers, CFG.q_size + 2 * CFG.kv_size, CFG.hidden_size)
    down_t = fused.params["layers"]["mlp"]["down_proj"]["qkernel_t"][...]
    assert down_t.shape == (CFG.num_layers, CFG.hidden_size, CFG.intermediate_size)
    a, b = separate.flat_params(), fused.flat_params()
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
    assert fused.params["layers"]["mlp"]["gate_up_proj"]["qscale"][...].shape == (
        CFG.num_layers,
        2 * CFG.intermediate_size,
    )
    got = _logits(fused, bank, slots, "pallas", quant_matmul)
    for g, w in zip(got, want):
        assert_close(g, w, "float32")


def test_engine_greedy_tokens_equal_separate_layout_with_zero_compiles():
    """The engine's ragged paged step (decode rows and prompt chunks in one flat batch) on the
    fused model: the same greedy tokens as on the separate one, and nothing compiles after warm-up."""
    from tests.engine.conftest import ADAPTERS, make_engine
    from tests.engine.test_engine import traffic
    from tests.factories import char_tokenizer, tiny_model

    separate = tiny_model()
    fused = build_model(separate.config, separate.flat_params(), fused=True)
    tok = char_tokenizer()
    lora = LoraConfig(max_slots=4, max_rank=4)
    adapters = {
        n: random_adapter(n, separate.config, modules=lora.target_modules, rng=i + 1) for i, n in enumerate(ADAPTERS)
    }
    requests = traffic(8, seed=3)
    outputs = {}
    # The cuBLAS choice is the step programs' other jit (an XLA compile option, accepted on CPU too):
    # warm-up must compile it, and calls must reach it, with nothing compiled while serving.
    cublas = KernelConfig(gemm="cublas")
    # And with the smallest budget's program compiled without CONCURRENT scheduling, the others with it.
    split = dataclasses.replace(cublas, concurrent_min_tokens=16)
    variants = (
        ("separate", separate, KernelConfig()),
        ("fused", fused, KernelConfig()),
        ("cublas", fused, cublas),
        ("split", fused, split),
    )
    for name, model, kernels in variants:
        engine = make_engine((model, tok, adapters), kernels=kernels)
        outputs[name] = [r.token_ids for r in engine.generate(requests)]
        assert engine.compiles_after_warmup == 0, name
    options = [engine.kernels.compiler_options(b) for b in engine.config.token_budgets]  # budgets 8 and 16
    assert options == [
        gemm_compiler_options("cublas", concurrent=False),
        gemm_compiler_options("cublas", concurrent=True),
    ]
    assert options[0] != options[1]
    assert outputs["fused"] == outputs["separate"] == outputs["cublas"] == outputs["split"]
    assert any(r.adapter for r in requests) and any(not r.adapter for r in requests)
