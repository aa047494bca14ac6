"""Where every array of a tensor-parallel engine lives, and how a step runs per shard.

Base weights, Megatron-style (n = mesh "tensor" size; flat names as in jaxlora.model.params):

    q/k/v/gate/up  kernel [L, in, out]  split by output columns  P(None, None, "tensor")
                   bias   [L, out]      like their outputs       P(None, "tensor")
    o/down         kernel [L, in, out]  split by input rows      P(None, "tensor", None)
                   bias   [L, out]      whole (added once, after the all-reduce)
    quantized      qkernel [L, in, out] like kernel
    (any of them)  qscale  [L, out]     like bias: split with the output columns of q/k/v/gate/up;
                                        whole for o/down (each shard scales its partial sum)
    embed_tokens   [V, D]               by vocabulary; by hidden when n does not divide V
    lm_head        kernel [D, V]        by vocabulary; by hidden rows when n does not divide V
    norms          whole

KV cache [L, rows, T, KVH, Dh]: split by KV heads, so every shard attends with its own heads.

Adapter bank, S-LoRA style, so that the LoRA term adds no collective of its own:

    qkv, gate_up   a [L, S, in, G*R]   whole: the shrink x @ A[slot] is computed on every shard
                   b [L, S, R, out]    split by output columns, like the base kernel
    o, down        a [L, S, in, R]     split by input rows, like the base kernel: h is a partial sum
                   b [L, S, R, out]    whole: h @ B is a partial sum too and joins the base layer's
                                       own all-reduce (linear, so sum(h_i) @ B = sum(h_i @ B))

A step runs per shard under `shard_map` (`shard_step`), with the collectives written out in the
model (jaxlora.parallel.layers). GSPMD alone would all-reduce the o/down shrink output separately
from the base output; explicit per-shard code also runs the Pallas LoRA kernels unchanged on each
shard's slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlora.config import ModelConfig
from jaxlora.parallel.mesh import TENSOR_AXIS

T = TENSOR_AXIS
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_ROW_PARALLEL_GROUPS = ("o", "down")
_MATRICES = ("kernel", "qkernel")  # [L, in, out]; the other leaves of a projection are [L, out]
KV_SPEC = P(None, None, None, T, None)


def tensor_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[T]


def check_divisible(config: ModelConfig, tensor: int) -> None:
    """Raises ValueError unless `config` can be split over `tensor` devices."""
    if tensor == 1:
        return
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(config, field) % tensor:
            raise ValueError(f"tensor parallelism {tensor} must divide {field}={getattr(config, field)}")
    if config.vocab_size % tensor and config.hidden_size % tensor:
        raise ValueError(
            f"tensor parallelism {tensor} must divide vocab_size={config.vocab_size} or "
            f"hidden_size={config.hidden_size} (the embedding is split by one of them)"
        )


def param_spec(name: str, shape: tuple[int, ...], tensor: int) -> P:
    """PartitionSpec of one flat parameter name of the given shape (see the module docstring)."""
    parts = name.split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
    if name == "embed_tokens.embedding":  # [V, D]
        return P(T, None) if shape[0] % tensor == 0 else P(None, T)
    if name == "lm_head.kernel":  # [D, V]
        return P(None, T) if shape[1] % tensor == 0 else P(T, None)
    if module in _COLUMN_PARALLEL:
        return P(None, None, T) if leaf in _MATRICES else P(None, T)
    if module in _ROW_PARALLEL:
        return P(None, T, None) if leaf in _MATRICES else P()
    if leaf == "scale":
        return P()
    raise ValueError(f"no tensor-parallel layout for parameter {name!r}")


def _flat_name(path) -> str:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return ".".join(map(str, keys))


def param_specs(params: Any, tensor: int) -> Any:
    """A pytree like `params` (the nnx.State of LoadedModel.params) with a PartitionSpec per leaf."""
    return jax.tree_util.tree_map_with_path(lambda path, x: param_spec(_flat_name(path), x.shape, tensor), params)


def bank_specs(bank: dict | None) -> dict | None:
    """A pytree like the bank (jaxlora.lora.bank layout) with a PartitionSpec per leaf."""
    if bank is None:
        return None
    out = {}
    for group, entries in bank.items():
        row_parallel = group in _ROW_PARALLEL_GROUPS
        out[group] = {
            "a": P(None, None, T, None) if row_parallel else P(),
            "b": {m: P() if row_parallel else P(None, None, None, T) for m in entries["b"]},
        }
    return out


def slot_specs(bank: dict) -> dict:
    """Specs of one slot's entries (`bank.slot_arrays`, no slot axis) matching `bank_specs`."""

    def drop_slot_axis(spec: P) -> P:
        return P(*(tuple(spec)[:1] + tuple(spec)[2:])) if len(spec) > 1 else spec

    return jax.tree.map(drop_slot_axis, bank_specs(bank), is_leaf=lambda x: isinstance(x, P))


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """`params` placed on the mesh, each leaf split per `param_spec` (a new state; the input is kept)."""
    check_divisible(config, tensor_size(mesh))
    return jax.device_put(params, _named(mesh, param_specs(params, tensor_size(mesh))))


def shard_model(model, mesh: Mesh):
    """A LoadedModel whose params live on the mesh (same config and graph)."""
    return dataclasses.replace(model, params=shard_params(model.params, model.config, mesh))


def bank_shardings(bank: dict, mesh: Mesh) -> dict:
    return _named(mesh, bank_specs(bank))


def slot_shardings(bank: dict, mesh: Mesh) -> dict:
    """Where one slot's entries go before they are written into the sharded bank."""
    return _named(mesh, slot_specs(bank))


def shard_bank(bank: dict, mesh: Mesh) -> dict:
    """The adapter bank placed on the mesh, S-LoRA style (see the module docstring)."""
    return jax.device_put(bank, bank_shardings(bank, mesh))


def shard_kv(kv: Any, mesh: Mesh) -> Any:
    """A KV cache (jaxlora.model.kv_cache, dense or paged) placed on the mesh, split by KV heads."""
    return jax.device_put(kv, NamedSharding(mesh, KV_SPEC))


def shard_step(fn: Callable, mesh: Mesh | None, *, num_outputs_before_kv: int = 1) -> Callable:
    """Runs a model step `fn(params, bank, kv, *rest, tensor_axis=...) -> (*outs, kv)` per shard.

    Call the result inside jit. params, bank and kv enter as their shards (specs above; place them
    with shard_params / shard_bank / shard_kv, which also check divisibility); every other argument
    and every output but the cache is whole on each device (replicated). With mesh None, `fn` runs
    as is with tensor_axis=None.
    """
    if mesh is None or tensor_size(mesh) == 1:
        return lambda *args: fn(*args, tensor_axis=None)
    tensor = tensor_size(mesh)

    def run(params, bank, kv, *rest):
        kv_specs = jax.tree.map(lambda _: KV_SPEC, kv)  # either cache layout: KV heads are axis 3
        in_specs = (param_specs(params, tensor), bank_specs(bank), kv_specs, *(P() for _ in rest))
        out_specs = (*(P() for _ in range(num_outputs_before_kv)), kv_specs)
        # check_vma off: Pallas calls (interpreted or not) carry no varying-axis types.
        body = jax.shard_map(
            lambda *a: fn(*a, tensor_axis=T), mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return body(params, bank, kv, *rest)

    return run
