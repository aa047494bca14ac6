"""Mixed-adapter batches through the stacked bank: every row must equal its own adapter merged into
the base weights (computed independently, in numpy), on every backend."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.config import TARGET_MODULES, AttentionBackend, LoraBackend, LoraConfig
from jaxlora.kernels import StepKernels
from jaxlora.lora.bank import init_bank, reset_slot, set_slot, slot_arrays
from jaxlora.lora.merge import merged_params
from jaxlora.model import init_kv_cache
from jaxlora.model.forward import forward_logits
from jaxlora.model.params import build_model, random_model
from tests.factories import tiny_config
from tests.tolerances import assert_close

CFG = tiny_config(num_layers=3)
MAX_RANK = 8


def _adapter(seed: int, modules, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for m in modules:
        d_in, d_out = CFG.module_shape(m)
        out[m] = (
            rng.standard_normal((CFG.num_layers, d_in, rank), np.float32) * 0.3,
            rng.standard_normal((CFG.num_layers, rank, d_out), np.float32) * 0.3,
        )
    return out


ADAPTERS = {
    1: _adapter(1, ("q_proj", "k_proj", "v_proj", "o_proj"), 4),  # attention only
    2: _adapter(2, ("gate_proj", "up_proj", "down_proj"), 8),  # MLP only, max rank
    3: _adapter(3, TARGET_MODULES, 1),  # all-linear, rank 1
    4: _adapter(4, ("q_proj", "v_proj"), 6),  # a subset of a shared-shrink group
}


@pytest.fixture(scope="module")
def base():
    return random_model(CFG, seed=5)


@pytest.fixture(scope="module")
def bank():
    lora = LoraConfig(max_slots=6, max_rank=MAX_RANK)
    bank = init_bank(CFG, lora)
    for slot, weights in ADAPTERS.items():
        bank = set_slot(bank, slot, slot_arrays(weights, CFG, lora))
    return bank


def _logits(model, tokens, bank=None, slots=None, backend=LoraBackend.XLA):
    b, t = tokens.shape
    kv = init_kv_cache(CFG, b, 16)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    kernels = StepKernels.for_platform(backend)
    return np.asarray(
        forward_logits(
            model.graphdef,
            model.params,
            tokens,
            pos,
            kv,
            bank,
            None if slots is None else jnp.asarray(slots, jnp.int32),
            kernels=kernels,
        )[0]
    )


@pytest.fixture(scope="module")
def expected(base):
    """Logits of each slot's adapter merged into the weights, row by row (slot 0: base alone)."""
    tokens = _tokens()
    out = {0: _logits(base, tokens)}
    for slot, weights in ADAPTERS.items():
        merged = build_model(CFG, merged_params(base.flat_params(), weights, quantization=None))
        out[slot] = _logits(merged, tokens)
    return out


def _tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (6, 5)), jnp.int32)


@pytest.mark.parametrize("backend", list(LoraBackend))
def test_mixed_batch_equals_merged_rows(base, bank, expected, backend):
    slots = [3, 0, 1, 4, 2, 1]  # shuffled, with a base row and a repeated adapter
    got = _logits(base, _tokens(), bank, slots, backend)
    for row, slot in enumerate(slots):
        assert_close(got[row], expected[slot][row], "float32", err_msg=f"row {row} (slot {slot}, backend {backend})")


def test_decode_step_with_bank_matches_prefill(base, bank):
    tokens = _tokens()
    slots = jnp.asarray([1, 2, 3, 4, 0, 2], jnp.int32)
    full = _logits(base, tokens, bank, slots)
    kv = init_kv_cache(CFG, 6, 16)
    logits, kv = forward_logits(
        base.graphdef, base.params, tokens[:, :4], jnp.broadcast_to(jnp.arange(4), (6, 4)), kv, bank, slots
    )
    last, _ = forward_logits(base.graphdef, base.params, tokens[:, 4:], jnp.full((6, 1), 4), kv, bank, slots)
    assert_close(np.asarray(last)[:, 0], full[:, 4], "float32")


def test_reset_slot_and_zero_b_reproduce_base_exactly(base, bank, expected):
    lora = LoraConfig(max_slots=6, max_rank=MAX_RANK)
    zero_b = {m: (a, np.zeros_like(b)) for m, (a, b) in ADAPTERS[3].items()}
    bank2 = set_slot(jax_copy(bank), 5, slot_arrays(zero_b, CFG, lora))
    bank2 = reset_slot(bank2, 1)
    got = _logits(base, _tokens(), bank2, [1, 5, 0, 1, 5, 0])
    np.testing.assert_array_equal(got, expected[0])


def test_slot_arrays_rejects_rank_and_module_mismatch():
    lora = LoraConfig(max_slots=4, max_rank=4, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="rank 8 exceeds the bank's max_rank=4"):
        slot_arrays(_adapter(9, ("q_proj",), 8), CFG, lora)
    with pytest.raises(ValueError, match=r"adapter targets \['down_proj'\]"):
        slot_arrays(_adapter(9, ("down_proj",), 2), CFG, lora)
    with pytest.raises(ValueError, match="slot 0 is the reserved base-model slot"):
        set_slot(init_bank(CFG, lora), 0, slot_arrays(_adapter(9, ("q_proj",), 2), CFG, lora))


def jax_copy(tree):
    import jax

    # set_slot donates its input; the module-scoped bank must survive for other tests.
    return jax.tree_util.tree_map(jnp.copy, tree)


def test_attention_names_come_from_one_enum():
    from jaxlora.engine.config import EngineConfig
    from jaxlora.kernels import KernelConfig

    assert EngineConfig().kernels.attention is AttentionBackend.AUTO
    assert EngineConfig(kernels=KernelConfig(attention="xla")).kernels.attention is AttentionBackend.XLA
    assert EngineConfig.from_dict({"kernels": {"attention": "xla"}}).kernels.attention is AttentionBackend.XLA
    with pytest.raises(ValueError, match="attention='flash' must be one of"):
        KernelConfig(attention="flash")
    with pytest.raises(ValueError, match=r"unknown kernels config key\(s\) \['flash'\]"):
        EngineConfig.from_dict({"kernels": {"flash": True}})
    assert StepKernels.for_platform("xla", "gpu").attention is AttentionBackend.PALLAS
    assert StepKernels.for_platform("xla", "cpu", attention="auto").attention is AttentionBackend.XLA
    assert StepKernels(attention="pallas").attention is AttentionBackend.PALLAS
    with pytest.raises(ValueError, match="attention='auto' must be one of"):
        StepKernels(attention="auto")  # for_platform resolves auto
