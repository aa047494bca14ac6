"""The engine on a weight-only quantized base: a mixed-adapter batch gives exactly the greedy tokens
of the same batch run on the dequantized weights as a dense float32 model. Both sides carry the
same quantization error, so any difference is the quantized kernel path (the int8/fp8 GEMM with
scaled output columns, and the LoRA delta added to its output)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.kernels import KernelConfig
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.model import quant
from jaxlora.model.params import build_model, quantized_model
from jaxlora.model.quant import dequantize_arrays
from tests.engine.conftest import engine_config, make_engine
from tests.factories import EOS, char_tokenizer, random_adapter, tiny_model
from tests.greedy import batched_greedy

NEW_TOKENS = 8
# (adapter, prompt): the base model and three adapters, prompts of different lengths, one adapter twice.
BATCH = (
    (None, [1, 40, 41, 42, 43]),
    ("a0", [1, 50, 60]),
    ("a1", [1, 70, 71, 72, 73, 74, 75, 76]),
    ("a2", [1, 33]),
    ("a0", [1, 90, 80, 70, 60, 50]),
)


def _reference(model, adapters) -> list[list[int]]:
    """Greedy ids of BATCH decoded together on `model`, each row on its own adapter's slot."""
    lora = engine_config().lora
    names = sorted({a for a, _ in BATCH if a})
    bank = init_bank(model.config, lora)
    for slot, name in enumerate(names, start=1):
        bank = set_slot(bank, slot, slot_arrays(adapters[name].weights, model.config, lora))
    slots = [0 if a is None else names.index(a) + 1 for a, _ in BATCH]
    return batched_greedy(model, [p for _, p in BATCH], slots, NEW_TOKENS, bank=bank)


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


# The engine's budgets are 8 and 16 tokens (tests.engine.conftest): with the kernel's limit at 8 the
# 8-token step programs run the Pallas 8-bit GEMM (interpreted) and the 16-token ones XLA's.
SPLIT = KernelConfig(quant_matmul="pallas", quant_kernel_max_tokens=8)


@pytest.mark.parametrize(
    ("quantization", "kernels"), [("int8", KernelConfig()), ("fp8", KernelConfig()), ("int8", SPLIT)]
)
def test_mixed_batch_on_quantized_base_equals_dequantized_weights(parts, quantization, kernels):
    model, tok, adapters = parts
    quantized = quantized_model(model, quantization)
    dequantized = build_model(model.config, dequantize_arrays(quantized.flat_params()), source="dequantized")
    expected = [_until_eos(ids) for ids in _reference(dequantized, adapters)]
    assert len({tuple(ids) for ids in expected}) == len(BATCH), "a swapped row must not go unnoticed"

    engine = make_engine((quantized, tok, adapters), kernels=kernels)
    budgets = engine.config.token_budgets
    if kernels is SPLIT:
        assert [engine.kernels.uses_quant_kernel(b) for b in budgets] == [True, False], budgets
    requests = [
        GenerationRequest(
            request_id=f"q{i}", prompt_ids=prompt, adapter=adapter, sampling=SamplingParams(max_tokens=NEW_TOKENS)
        )
        for i, (adapter, prompt) in enumerate(BATCH)
    ]
    with jax.no_tracing():
        got = [list(out.token_ids) for out in engine.generate(requests)]
    assert engine.compiles_after_warmup == 0
    assert got == expected


# The serving layout on the Mosaic GPU kernel: widths that are multiples of 64 (its tiles), bf16
# (its activation dtype). Interpreted (the CPU), with the 8-token step programs on the kernel and
# the 16-token ones on XLA's path, as `SPLIT` above does for the Triton kernel.
MGPU_SPLIT = KernelConfig(quant_matmul="mgpu", quant_kernel_max_tokens=8)
MGPU_SHAPES = dict(hidden_size=64, head_dim=16, intermediate_size=64)


def test_serving_layout_on_the_mosaic_kernel_gives_the_xla_paths_tokens(monkeypatch):
    """The engine on an int8 serving-layout model (K-major `qkernel_t`) gives the same greedy
    tokens with the Mosaic kernel as with XLA's dequantize-then-GEMM on the same weights, and the
    kernel really runs: the 8-token programs trace it at both widths the model has (o/down, and
    q|k|v and gate|up), and no other step size does."""
    dense = tiny_model(**MGPU_SHAPES)
    model = build_model(dense.config, dense.flat_params(), dtype=jnp.bfloat16, quantization="int8", fused=True)
    lora = engine_config().lora
    adapters = {
        name: random_adapter(name, model.config, modules=lora.target_modules, rng=i + 1)
        for i, name in enumerate(("a0", "a1", "a2"))
    }
    requests = [
        GenerationRequest(
            request_id=f"m{i}", prompt_ids=prompt, adapter=adapter, sampling=SamplingParams(max_tokens=NEW_TOKENS)
        )
        for i, (adapter, prompt) in enumerate(BATCH)
    ]
    xla = make_engine((model, char_tokenizer(), adapters), kernels=KernelConfig(quant_matmul="xla"))
    expected = [list(out.token_ids) for out in xla.generate(requests)]
    assert len({tuple(ids) for ids in expected}) == len(BATCH), "a swapped row must not go unnoticed"

    widths = []  # (rows, width) of every projection traced through the Mosaic kernel
    real = quant.quant_matmul_mgpu
    monkeypatch.setattr(
        quant, "quant_matmul_mgpu", lambda x, q, *a, **k: widths.append((x.shape[0], q.shape[1])) or real(x, q, *a, **k)
    )
    engine = make_engine((model, char_tokenizer(), adapters), kernels=MGPU_SPLIT)
    assert sorted(set(widths)) == [(8, 64), (8, 128)], widths  # o/down (64), q|k|v and gate|up (128)
    # No `jax.no_tracing()` here: the Pallas GPU interpreter runs kernels through io_callback, and a
    # jitted program with callbacks always takes jit's Python path, which no_tracing refuses even on a
    # cache hit. The compile count is what shows that nothing new was built.
    got = [list(out.token_ids) for out in engine.generate(requests)]
    assert engine.compiles_after_warmup == 0
    assert got == expected
