"""PEFT LoRA folders: config semantics, scale folding, dtypes, round trip, and every rejection.

Adapter folders are written here with safetensors.numpy (no torch). That these folders and the
semantics match PEFT itself was checked against peft 0.21.2 (adapters built by PEFT load to the same
per-module deltas; adapters saved here load in PeftModel.from_pretrained to the same forward).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxlora.config import TARGET_MODULES, ModelConfig
from jaxlora.errors import AdapterError
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.peft_format import load_peft_adapter, module_key, save_peft_adapter, tensor_key

MODEL = ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4
)
NAME = "test-adapter"
# Folding reorders float32 products (scale applied to B, not to the product): allow rounding only.
F32_TOL = {"rtol": 1e-6, "atol": 1e-5}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def peft_pair(rng: np.random.Generator, module: str, r: int) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A [r, in], lora_B [out, r]) as PEFT stores them, random, no zeros, exact in bf16."""
    d_in, d_out = MODEL.module_shape(module)
    # Multiples of 1/8 in [1/8, 2] are exact in bf16/fp16/fp32, so every dtype loads the same numbers.
    draw = lambda *shape: (rng.integers(1, 17, shape) * rng.choice([-1, 1], shape) / 8).astype(np.float32)
    return draw(r, d_in), draw(d_out, r)


def write_adapter(folder: Path, config: dict, tensors: dict[str, np.ndarray], dtype: str = "float32") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", **config}))
    save_file({k: v.astype(DTYPES[dtype]) for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def make_tensors(rng, modules, layers, ranks=None) -> dict[str, np.ndarray]:
    """PEFT tensors for every (layer, module); `ranks` maps (layer, module) or module to r (default 4)."""
    ranks = ranks or {}
    out = {}
    for layer in layers:
        for m in modules:
            a, b = peft_pair(rng, m, ranks.get((layer, m), ranks.get(m, 4)))
            out[tensor_key(layer, m, "A")] = a
            out[tensor_key(layer, m, "B")] = b
    return out


def load(folder: Path, max_rank: int = 8) -> HostAdapter:
    return load_peft_adapter(folder, name=NAME, model_config=MODEL, max_rank=max_rank)


def delta(adapter: HostAdapter, module: str, layer: int) -> np.ndarray:
    """The adapter's [in, out] weight delta for one layer (scale included)."""
    a, b = adapter.weights[module]
    return a[layer] @ b[layer]


def peft_delta(tensors, module: str, layer: int, scale: float) -> np.ndarray:
    """PEFT's delta in our [in, out] orientation: scale * (B @ A).T."""
    return scale * (tensors[tensor_key(layer, module, "B")] @ tensors[tensor_key(layer, module, "A")]).T


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ------------------------------------------------------------------------------------------------
# Folding math


def test_folding_hand_computed(tmp_path):
    # r=2, lora_alpha=4 -> scale = 4/2 = 2 (rsLoRA would give 4/sqrt(2)).
    # lora_A [2, 16]: row0 = e0, row1 = 2*e1.      lora_B [16, 2]: col0 = 3*e5, col1 = -1*e7.
    # x = e0 + e1:  x @ A.T = [1, 2];  [1, 2] @ B.T = 3*e5 - 2*e7;  times 2 -> 6*e5 - 4*e7.
    a = np.zeros((2, 16), np.float32)
    a[0, 0], a[1, 1] = 1, 2
    b = np.zeros((16, 2), np.float32)
    b[5, 0], b[7, 1] = 3, -1
    tensors = {tensor_key(i, "q_proj", "A"): a for i in range(2)} | {tensor_key(i, "q_proj", "B"): b for i in range(2)}
    adapter = load(write_adapter(tmp_path / "ad", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}, tensors))
    x = np.zeros(16, np.float32)
    x[0] = x[1] = 1
    want = np.zeros(16, np.float32)
    want[5], want[7] = 6, -4
    a_host, b_host = adapter.weights["q_proj"]
    np.testing.assert_array_equal(x @ a_host[1] @ b_host[1], want)
    assert a_host.shape == (2, 16, 2) and b_host.shape == (2, 2, 16)
    assert adapter.target_modules == ("q_proj",) and adapter.rank == 2


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes_load_to_the_same_float32_weights(tmp_path, rng, dtype):
    tensors = make_tensors(rng, ["q_proj", "down_proj"], range(2))
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    adapter = load(write_adapter(tmp_path / dtype, config, tensors, dtype=dtype))
    for m in ("q_proj", "down_proj"):
        a, b = adapter.weights[m]
        assert a.dtype == b.dtype == np.float32
        for layer in range(2):
            np.testing.assert_array_equal(a[layer], tensors[tensor_key(layer, m, "A")].T)
            np.testing.assert_array_equal(b[layer], 2.0 * tensors[tensor_key(layer, m, "B")].T)


def test_rslora_scale(tmp_path, rng):
    tensors = make_tensors(rng, ["v_proj"], range(2))
    config = {"r": 4, "lora_alpha": 6, "use_rslora": True, "target_modules": ["v_proj"]}
    adapter = load(write_adapter(tmp_path / "ad", config, tensors))
    for layer in range(2):  # 6 / sqrt(4) = 3, not 6 / 4
        np.testing.assert_allclose(
            delta(adapter, "v_proj", layer), peft_delta(tensors, "v_proj", layer, 3.0), **F32_TOL
        )


def test_rank_and_alpha_pattern(tmp_path, rng):
    ranks = {"k_proj": 2, (1, "q_proj"): 6}
    tensors = make_tensors(rng, ["q_proj", "k_proj", "up_proj"], range(2), ranks)
    config = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "up_proj"],
        # Per module, and per layer by full name; the first matching key wins, as in PEFT.
        "rank_pattern": {"k_proj": 2, "model.layers.1.self_attn.q_proj": 6},
        "alpha_pattern": {r"layers\.1\.mlp\.up_proj": 2, "up_proj": 16, "k_proj": 3},
    }
    adapter = load(write_adapter(tmp_path / "ad", config, tensors))
    assert adapter.module_rank("q_proj") == 6 and adapter.module_rank("k_proj") == 2 and adapter.rank == 6
    expect = {
        ("q_proj", 0): 8 / 4,
        ("q_proj", 1): 8 / 6,
        ("k_proj", 0): 3 / 2,
        ("k_proj", 1): 3 / 2,
        ("up_proj", 0): 16 / 4,
        ("up_proj", 1): 2 / 4,
    }
    for (m, layer), scale in expect.items():
        np.testing.assert_allclose(delta(adapter, m, layer), peft_delta(tensors, m, layer, scale), **F32_TOL)
    # Layer 0's q_proj is rank 4 inside a rank-6 module: the padding is exact zeros.
    a, b = adapter.weights["q_proj"]
    assert not a[0, :, 4:].any() and not b[0, 4:, :].any()


def test_regex_target_modules(tmp_path, rng):
    tensors = make_tensors(rng, ["v_proj"], range(2)) | make_tensors(rng, ["gate_proj"], [1])
    config = {"r": 4, "lora_alpha": 4, "target_modules": r".*\.(self_attn\.v_proj|1\.mlp\.gate_proj)"}
    adapter = load(write_adapter(tmp_path / "ad", config, tensors))
    assert adapter.target_modules == ("v_proj", "gate_proj")
    assert not adapter.weights["gate_proj"][0][0].any() and adapter.weights["gate_proj"][0][1].all()


def test_all_linear(tmp_path, rng):
    tensors = make_tensors(rng, TARGET_MODULES, range(2))
    adapter = load(write_adapter(tmp_path / "ad", {"r": 4, "lora_alpha": 4, "target_modules": "all-linear"}, tensors))
    assert adapter.target_modules == TARGET_MODULES
    for m in TARGET_MODULES:
        np.testing.assert_allclose(delta(adapter, m, 1), peft_delta(tensors, m, 1, 1.0), **F32_TOL)


@pytest.mark.parametrize(
    "layers_cfg",
    [
        {"layers_to_transform": 1},
        {"layers_to_transform": [1]},
        {"layers_to_transform": [1], "layers_pattern": "layers"},
    ],
)
def test_layers_to_transform(tmp_path, rng, layers_cfg):
    tensors = make_tensors(rng, ["q_proj", "o_proj"], [1])
    config = {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"], **layers_cfg}
    adapter = load(write_adapter(tmp_path / "ad", config, tensors))
    for m in ("q_proj", "o_proj"):
        a, b = adapter.weights[m]
        assert not a[0].any() and not b[0].any()  # layer 0 untouched: all zero
        np.testing.assert_allclose(delta(adapter, m, 1), peft_delta(tensors, m, 1, 1.0), **F32_TOL)


def test_exclude_modules_and_full_name_targets(tmp_path, rng):
    # A full module name in target_modules ignores layers_to_transform (PEFT's exact-match branch).
    tensors = make_tensors(rng, ["q_proj"], [1]) | make_tensors(rng, ["v_proj"], [0])
    config = {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "model.layers.0.self_attn.v_proj", "k_proj"],
        "layers_to_transform": [1],
        "exclude_modules": ["k_proj"],
    }
    adapter = load(write_adapter(tmp_path / "ad", config, tensors))
    assert adapter.target_modules == ("q_proj", "v_proj")


def test_default_adapter_infix_and_fan_in_fan_out(tmp_path, rng):
    tensors = make_tensors(rng, ["q_proj"], range(2))
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    config = {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"], "fan_in_fan_out": True, "some_future_key": 1}
    adapter = load(write_adapter(tmp_path / "ad", config, renamed))
    np.testing.assert_allclose(delta(adapter, "q_proj", 0), peft_delta(tensors, "q_proj", 0, 1.0), **F32_TOL)


def test_padded_and_nbytes(tmp_path, rng):
    tensors = make_tensors(rng, ["q_proj", "down_proj"], range(2), {"down_proj": 2})
    config = {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"], "rank_pattern": {"down_proj": 2}}
    adapter = load(write_adapter(tmp_path / "ad", config, tensors))
    assert adapter.nbytes == 4 * 2 * (16 * 4 + 4 * 16 + 24 * 2 + 2 * 16)
    padded = adapter.padded(8, ml_dtypes.bfloat16)
    a, b = padded["down_proj"]
    assert a.shape == (2, 24, 8) and b.shape == (2, 8, 16) and a.dtype == ml_dtypes.bfloat16
    assert not a[:, :, 2:].astype(np.float32).any() and not b[:, 2:, :].astype(np.float32).any()
    np.testing.assert_array_equal(a[:, :, :2].astype(np.float32), adapter.weights["down_proj"][0])
    with pytest.raises(ValueError, match="rank=4 must be <= max_rank=2"):
        adapter.padded(2)
    with pytest.raises(ValueError):  # frozen: the weights cannot be changed behind the bank's back
        adapter.weights["q_proj"][0][0, 0, 0] = 1.0


# ------------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_save_then_load(tmp_path, rng, dtype):
    weights = {}
    for m, r in (("q_proj", 4), ("o_proj", 2), ("up_proj", 4)):
        a, b = peft_pair(rng, m, r)
        weights[m] = (np.stack([a.T, -a.T]), np.stack([b.T, 0.5 * b.T]))  # [L, in, r], [L, r, out]
    folder = save_peft_adapter(
        tmp_path / "saved",
        weights=weights,
        rank=4,
        alpha=8.0,
        use_rslora=True,
        target_modules=["up_proj", "q_proj", "o_proj"],
        base_model_name_or_path="tiny",
        dtype=dtype,
    )
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["rank_pattern"] == {"o_proj": 2}
    adapter = load(folder)
    assert adapter.base_model_name_or_path == "tiny" and adapter.target_modules == ("q_proj", "o_proj", "up_proj")
    for m, (a, b) in weights.items():
        scale = 8.0 / math.sqrt(a.shape[-1])
        np.testing.assert_array_equal(adapter.weights[m][0], a)
        np.testing.assert_allclose(adapter.weights[m][1], b * np.float32(scale), **F32_TOL)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    rank=st.integers(1, 8),
    alpha=st.floats(0.5, 64),
    use_rslora=st.booleans(),
    modules=st.sets(st.sampled_from(TARGET_MODULES), min_size=1),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(tmp_path_factory, rank, alpha, use_rslora, modules, seed):
    rng = np.random.default_rng(seed)
    weights = {}
    for m in modules:
        d_in, d_out = MODEL.module_shape(m)
        weights[m] = (
            rng.normal(size=(2, d_in, rank)).astype(np.float32),
            rng.normal(size=(2, rank, d_out)).astype(np.float32),
        )
    folder = save_peft_adapter(
        tmp_path_factory.mktemp("rt"), weights=weights, rank=rank, alpha=alpha, use_rslora=use_rslora
    )
    adapter = load(folder)
    scale = alpha / (math.sqrt(rank) if use_rslora else rank)
    for m, (a, b) in weights.items():
        np.testing.assert_allclose(
            adapter.weights[m][0] @ adapter.weights[m][1], a @ b * scale, rtol=1e-5, atol=1e-5 * scale
        )


# ------------------------------------------------------------------------------------------------
# Rejections: each message names the adapter, the tensor where one is at fault, and the reason.

BASE_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
QA0, QB0 = tensor_key(0, "q_proj", "A"), tensor_key(0, "q_proj", "B")


def rejected(tmp_path, rng, *, config=None, edit=None, max_rank=8, dtype="float32") -> str:
    tensors = make_tensors(rng, ["q_proj", "down_proj"], range(2))
    if edit:
        edit(tensors)
    folder = write_adapter(tmp_path / "bad", {**BASE_CONFIG, **(config or {})}, tensors, dtype=dtype)
    with pytest.raises(AdapterError) as info:
        load(folder, max_rank=max_rank)
    message = str(info.value)
    assert NAME in message
    return message


def replace(key, value):
    return lambda t: t.__setitem__(key, value)


def test_rejects_rank_above_max_rank(tmp_path, rng):
    message = rejected(tmp_path, rng, max_rank=2)
    assert QA0 in message and "rank 4 exceeds max_rank=2" in message and "--max-lora-rank" in message


@pytest.mark.parametrize(
    "key, shape, reason",
    [
        (QA0, (4, 15), "does not fit the model (expected [r, 16] for q_proj)"),
        (QB0, (17, 4), "does not fit the model (expected [16, r] for q_proj)"),
        (QB0, (16, 3), "rank 3 does not match lora_A's rank 4"),
        (QA0, (4, 16, 1), "does not fit the model"),
    ],
)
def test_rejects_wrong_shapes(tmp_path, rng, key, shape, reason):
    message = rejected(tmp_path, rng, edit=replace(key, rng.normal(size=shape).astype(np.float32)))
    assert key in message and reason in message


def test_rejects_rank_that_disagrees_with_config(tmp_path, rng):
    message = rejected(tmp_path, rng, config={"rank_pattern": {"down_proj": 2}})
    assert tensor_key(0, "down_proj", "A") in message and "gives r=2" in message


def test_rejects_layer_beyond_the_model(tmp_path, rng):
    key = tensor_key(0, "q_proj", "A").replace("layers.0", "layers.2")
    message = rejected(tmp_path, rng, edit=replace(key, np.ones((4, 16), np.float32)))
    assert key in message and "layer index 2 is out of range: the model has 2 layers" in message


@pytest.mark.parametrize("missing, other", [(QA0, "lora_A"), (QB0, "lora_B")])
def test_rejects_missing_a_or_b(tmp_path, rng, missing, other):
    message = rejected(tmp_path, rng, edit=lambda t: t.pop(missing))
    assert missing in message and "missing" in message and other in message


def test_rejects_targeted_module_without_tensors(tmp_path, rng):
    message = rejected(tmp_path, rng, edit=lambda t: (t.pop(QA0), t.pop(QB0)))
    assert QA0 in message and "missing" in message and "targets model.layers.0.self_attn.q_proj" in message


def test_rejects_tensor_the_config_does_not_target(tmp_path, rng):
    message = rejected(tmp_path, rng, config={"target_modules": ["down_proj"]})
    assert "self_attn.q_proj.lora_A.weight" in message and "not targeted by adapter_config.json" in message


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rejects_non_finite_values(tmp_path, rng, bad, dtype):
    def poison(t):
        t[QB0][3, 1] = bad

    message = rejected(tmp_path, rng, edit=poison, dtype=dtype)
    assert QB0 in message and "NaN or Inf" in message


def test_rejects_finite_weights_above_the_magnitude_bound(tmp_path, rng):
    # The bound applies to B with its scale folded in: 100 passes at scale 1 and fails at scale 32.
    def big_b(t):
        t[QB0][3, 1] = 100.0

    assert load(write_adapter(tmp_path / "ok", {**BASE_CONFIG, "lora_alpha": 4}, _edited(rng, big_b)))
    message = rejected(tmp_path, rng, edit=big_b, config={"lora_alpha": 128})
    assert QB0 in message and "magnitude 3.2e+03" in message and "bound 1000" in message

    def huge_a(t):
        t[QA0][0, 0] = 1e30

    message = rejected(tmp_path, rng, edit=huge_a)
    assert QA0 in message and "magnitude 1e+30" in message


def _edited(rng, edit) -> dict[str, np.ndarray]:
    tensors = make_tensors(rng, ["q_proj", "down_proj"], range(2))
    edit(tensors)
    return tensors


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"use_dora": True}, "DoRA (use_dora: true) is not supported"),
        ({"lora_bias": True}, "lora_bias: true"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"bias": "lora_only"}, "bias 'lora_only' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"layer_replication": [[0, 2]]}, "layer_replication is not supported"),
        ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING' is not supported"),
        ({"use_qalora": True}, "QA-LoRA"),
        ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
        ({"init_lora_weights": "pissa_niter_4"}, "rewrites the base weights"),
        ({"target_modules": ["q_proj", "down_proj", "lm_head"]}, "selects 'lm_head', which is not a LoRA target"),
        ({"target_modules": ["q_proj", "down_proj", "embed_tokens"]}, "selects 'model.embed_tokens'"),
        ({"target_modules": ["q_proj", "down_proj", "input_layernorm"]}, "model.layers.0.input_layernorm"),
        ({"target_modules": ["c_attn"]}, "matches no module of the model (empty adapter)"),
        ({"target_modules": r"(unclosed"}, "not a valid regex"),
        ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, "cannot be used with a string target_modules"),
        ({"r": 0}, "r=0 must be a positive integer"),
        ({"lora_alpha": "8"}, "lora_alpha='8' must be a finite number"),
    ],
)
def test_rejects_config(tmp_path, rng, config, reason):
    message = rejected(tmp_path, rng, config=config)
    assert "adapter_config.json" in message and reason in message


@pytest.mark.parametrize(
    "key, reason",
    [
        ("base_model.model.lm_head.lora_A.weight", "no LoRA-capable module 'lm_head'"),
        ("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight", "no LoRA-capable module"),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "no LoRA-capable module"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", "LoRA on an embedding is not supported"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA is not supported"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "lora_bias"),
        ("base_model.model.lm_head.modules_to_save.default.weight", "modules_to_save"),
    ],
)
def test_rejects_unservable_tensors(tmp_path, rng, key, reason):
    message = rejected(tmp_path, rng, edit=replace(key, np.ones((4, 16), np.float32)))
    assert key in message and reason in message


@pytest.mark.parametrize("dtype, code", [(np.int32, "I32"), (np.int16, "I16"), (np.uint16, "U16")])
def test_rejects_integer_tensors(tmp_path, rng, dtype, code):
    # I32 is a dtype the mapped reader knows, I16 and U16 are not: the same message for all three.
    folder = write_adapter(tmp_path / "bad", BASE_CONFIG, make_tensors(rng, ["q_proj", "down_proj"], range(2)))
    save_file({QA0: np.ones((4, 16), dtype)}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=rf"{NAME}.*tensor {QA0}: dtype {code} is not a float type"):
        load(folder)


def test_refuses_pickle_weights(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(BASE_CONFIG))
    # Would run code if unpickled; the loader must never open it.
    (folder / "adapter_model.bin").write_bytes(b"cos\nsystem\n(S'exit 1'\ntR.")
    with pytest.raises(
        AdapterError, match=rf"{NAME}.*only pickle weights \(adapter_model.bin\); jaxlora never unpickles"
    ):
        load(folder)


@pytest.mark.parametrize(
    "setup, reason",
    [
        (lambda f: None, "not a directory"),
        (lambda f: f.mkdir(), "no adapter_config.json"),
        (lambda f: (f.mkdir(), (f / "adapter_config.json").write_text("{r: 4,")), "is not valid JSON"),
        (lambda f: (f.mkdir(), (f / "adapter_config.json").write_text("[4]")), "must hold a JSON object"),
        (lambda f: (f.mkdir(), (f / "adapter_config.json").write_text("{}")), "no adapter_model.safetensors"),
        (
            lambda f: (
                f.mkdir(),
                (f / "adapter_config.json").write_text("{}"),
                (f / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
            ),
            "cannot read adapter_model.safetensors",
        ),
        (
            lambda f: (
                f.mkdir(),
                (f / "adapter_config.json").write_text("{}"),
                save_file({}, str(f / "adapter_model.safetensors")),
            ),
            "holds no tensors (empty adapter)",
        ),
    ],
)
def test_rejects_broken_folders(tmp_path, setup, reason):
    folder = tmp_path / "ad"
    setup(folder)
    with pytest.raises(AdapterError) as info:
        load(folder)
    assert NAME in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x" * 129, "sp ace", "ünï", None])
def test_rejects_bad_names(tmp_path, rng, name):
    folder = write_adapter(tmp_path / "ok", BASE_CONFIG, make_tensors(rng, ["q_proj", "down_proj"], range(2)))
    with pytest.raises(AdapterError, match="adapter name .* is invalid"):
        load_peft_adapter(folder, name=name, model_config=MODEL, max_rank=8)


def test_accepts_edge_names(tmp_path, rng):
    folder = write_adapter(tmp_path / "ok", BASE_CONFIG, make_tensors(rng, ["q_proj", "down_proj"], range(2)))
    for name in ("a", "x" * 128, "my.adapter_v2-final", "..."):
        assert load_peft_adapter(folder, name=name, model_config=MODEL, max_rank=8).name == name


def test_module_and_tensor_names_match_peft():
    assert module_key(3, "gate_proj") == "model.layers.3.mlp.gate_proj"
    assert tensor_key(0, "o_proj", "B") == "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"


def test_save_refuses_inconsistent_arguments(tmp_path, rng):
    a, b = peft_pair(rng, "q_proj", 4)
    weights = {"q_proj": (a.T[None], b.T[None])}
    with pytest.raises(ValueError, match="must equal the modules in weights"):
        save_peft_adapter(tmp_path / "x", weights=weights, rank=4, alpha=8, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="must be \\[L, in, r\\] and \\[L, r, out\\]"):
        save_peft_adapter(tmp_path / "x", weights={"q_proj": (a.T[None], b[None])}, rank=4, alpha=8)
    with pytest.raises(ValueError, match="dtype='int8'"):
        save_peft_adapter(tmp_path / "x", weights=weights, rank=4, alpha=8, dtype="int8")
