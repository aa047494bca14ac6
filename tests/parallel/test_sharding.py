"""Mesh config, layouts and divisibility checks, in this process on one CPU device (no fake devices
needed: specs are plain data, and a tensor size of 1 must leave everything as it was)."""

from __future__ import annotations

import argparse

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxlora.cli.engine_args import add_engine_args, engine_config
from jaxlora.config import LoraConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.lora.bank import init_bank
from jaxlora.model.params import abstract_model
from jaxlora.parallel import MeshConfig, make_mesh
from jaxlora.parallel.sharding import (
    bank_specs,
    check_divisible,
    param_spec,
    slot_specs,
)
from tests.factories import tiny_config

T = "tensor"
CFG = tiny_config(
    num_heads=8,
    num_kv_heads=4,
    head_dim=4,
    vocab_size=96,
    intermediate_size=64,
    tie_word_embeddings=False,
    attention_bias=True,
    o_proj_bias=True,
)


def test_mesh_config_validates():
    assert MeshConfig() == MeshConfig(tensor=1, data=1) and not MeshConfig().is_sharded
    with pytest.raises(ValueError, match="tensor=0"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="data parallelism is reserved"):
        MeshConfig(data=2)


def test_make_mesh_axes_and_too_few_devices():
    mesh = make_mesh(MeshConfig())
    assert mesh.axis_names == ("data", "tensor") and mesh.shape == {"data": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"needs 2 devices .* found 1"):
        make_mesh(MeshConfig(tensor=2), devices=jax.devices()[:1])


@pytest.mark.parametrize(("field", "value"), [("num_heads", 6), ("num_kv_heads", 2), ("intermediate_size", 66)])
def test_indivisible_model_is_refused(field, value):
    overrides = {"num_heads": 8, "num_kv_heads": 4, "intermediate_size": 64, field: value}
    if field == "num_heads":
        overrides["num_kv_heads"] = 6
    cfg = tiny_config(**overrides)
    with pytest.raises(ValueError, match=f"must divide {field}="):
        check_divisible(cfg, 4)


def test_vocab_and_hidden_both_indivisible_is_refused():
    cfg = tiny_config(num_heads=4, num_kv_heads=4, head_dim=8, hidden_size=30, intermediate_size=64, vocab_size=99)
    check_divisible(cfg, 1)  # one device: anything goes
    with pytest.raises(ValueError, match="vocab_size=99 or hidden_size=30"):
        check_divisible(cfg, 4)


def test_every_param_has_a_megatron_layout():
    _, params = abstract_model(CFG, "float32")
    specs = {name: param_spec(name, spec.shape, 4) for name, spec in params.items()}
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, None, T)  # [L, in, out] by output columns
    assert specs["layers.self_attn.k_proj.bias"] == P(None, T)
    assert specs["layers.mlp.up_proj.kernel"] == P(None, None, T)
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, T, None)  # by input rows
    assert specs["layers.mlp.down_proj.kernel"] == P(None, T, None)
    assert specs["layers.self_attn.o_proj.bias"] == P()  # added once, after the all-reduce
    assert specs["layers.input_layernorm.scale"] == P() and specs["norm.scale"] == P()
    assert specs["embed_tokens.embedding"] == P(T, None)  # [V, D] by vocabulary
    assert specs["lm_head.kernel"] == P(None, T)  # [D, V] by vocabulary
    # A vocabulary the mesh does not divide: split by hidden instead.
    assert param_spec("embed_tokens.embedding", (99, 32), 4) == P(None, T)
    assert param_spec("lm_head.kernel", (32, 99), 4) == P(T, None)
    with pytest.raises(ValueError, match="no tensor-parallel layout"):
        param_spec("layers.self_attn.rotary.inv_freq", (4,), 4)


def test_bank_layout_is_s_lora():
    bank = jax.eval_shape(lambda: init_bank(CFG, LoraConfig(max_slots=4, max_rank=4)))
    specs = bank_specs(bank)
    # Column-parallel groups: A whole (every shard shrinks), B split like the base output.
    assert specs["qkv"]["a"] == P() and specs["gate_up"]["a"] == P()
    assert all(s == P(None, None, None, T) for g in ("qkv", "gate_up") for s in specs[g]["b"].values())
    # Row-parallel groups: A split on the input side like the base, B whole.
    assert specs["o"]["a"] == P(None, None, T, None) and specs["o"]["b"]["o_proj"] == P()
    assert specs["down"]["a"] == P(None, None, T, None) and specs["down"]["b"]["down_proj"] == P()
    one_slot = slot_specs(bank)  # [L, in, R] / [L, R, out]: the slot axis dropped
    assert one_slot["o"]["a"] == P(None, T, None) and one_slot["qkv"]["b"]["q_proj"] == P(None, None, T)


def test_engine_config_mesh_from_yaml(tmp_path):
    assert EngineConfig().mesh == MeshConfig()
    path = tmp_path / "engine.yaml"
    path.write_text("engine:\n  max_batch: 4\n  mesh: {tensor: 2}\n")
    assert EngineConfig.from_yaml(path).mesh == MeshConfig(tensor=2)
    with pytest.raises(TypeError):
        EngineConfig.from_dict({"mesh": {"pipeline": 2}})


def test_tensor_parallel_flag():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).mesh.tensor == 1
    assert engine_config(p.parse_args(["--tensor-parallel", "2"])).mesh.tensor == 2
    with pytest.raises(ValueError, match="tensor=0"):
        engine_config(p.parse_args(["--tensor-parallel", "0"]))


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_projections_split_like_their_dense_kernels(quantization):
    _, params = abstract_model(CFG, "float32", quantization)
    specs = {name: param_spec(name, spec.shape, 4) for name, spec in params.items()}
    assert "layers.self_attn.q_proj.kernel" not in specs
    for module in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert specs[f"layers.{module}.qkernel"] == P(None, None, T)  # [L, in, out] by output columns
        assert specs[f"layers.{module}.qscale"] == P(None, T)  # [L, out] with its columns
    for module in ("self_attn.o_proj", "mlp.down_proj"):
        assert specs[f"layers.{module}.qkernel"] == P(None, T, None)  # by input rows
        assert specs[f"layers.{module}.qscale"] == P()  # whole: each shard scales its partial sum
