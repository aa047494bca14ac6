"""The sharded twin of jaxlora.model.forward.forward_logits (tests, tools)."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxlora.lora.apply import LoraRuntime
from jaxlora.model.kv_cache import KVCache
from jaxlora.parallel.sharding import shard_step


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "mesh"), donate_argnames=("kv",))
def sharded_forward_logits(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, positions: jax.Array,
                           kv: KVCache, bank: dict | None = None, slot_ids: jax.Array | None = None,
                           row_ids: jax.Array | None = None, *, mesh: Mesh | None,
                           runtime: LoraRuntime = LoraRuntime()):
    """float32 logits [b, t, vocab] (whole on every device) and the updated cache (split by KV heads).

    params, bank and kv must be placed as jaxlora.parallel.sharding says (shard_params / shard_bank /
    shard_kv); the cache is donated.
    """
    def step(params, bank, kv, tokens, positions, slot_ids, row_ids, *, tensor_axis):
        mod = nnx.merge(graphdef, params)
        hidden, kv = mod(tokens, positions, kv, bank=bank, slot_ids=slot_ids, row_ids=row_ids, runtime=runtime,
                         tensor_axis=tensor_axis)
        return mod.logits(hidden, tensor_axis=tensor_axis), kv

    return shard_step(step, mesh)(params, bank, kv, tokens, positions, slot_ids, row_ids)
