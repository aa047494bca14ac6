"""The engine on a weight-only quantized base: a mixed-adapter batch gives exactly the greedy tokens
of the same batch run on the dequantized weights as a dense float32 model. Both sides carry the
same quantization error, so any difference is the quantized kernel path (the int8/fp8 GEMM with
scaled output columns, and the LoRA delta added to its output)."""

from __future__ import annotations

import jax
import pytest

from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.lora.apply import LoraRuntime
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.model.params import build_model, quantized_model
from jaxlora.model.quant import dequantize_arrays
from tests.engine.conftest import engine_config, make_engine
from tests.factories import EOS
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
SPLIT = LoraRuntime(quant_matmul="pallas", interpret=True, quant_kernel_max_tokens=8)


@pytest.mark.parametrize(("quantization", "runtime"), [("int8", None), ("fp8", None), ("int8", SPLIT)])
def test_mixed_batch_on_quantized_base_equals_dequantized_weights(parts, quantization, runtime):
    model, tok, adapters = parts
    quantized = quantized_model(model, quantization)
    dequantized = build_model(model.config, dequantize_arrays(quantized.flat_params()), source="dequantized")
    expected = [_until_eos(ids) for ids in _reference(dequantized, adapters)]
    assert len({tuple(ids) for ids in expected}) == len(BATCH), "a swapped row must not go unnoticed"

    engine = make_engine((quantized, tok, adapters), runtime=runtime)
    budgets = engine.config.token_budgets
    if runtime is not None:
        assert [runtime.uses_quant_kernel(b) for b in budgets] == [True, False], budgets
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
