"""The jitted whole-model call for tests, tools and training (the engine builds its own step)."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxlora.kernels import StepKernels
from jaxlora.model.kv_cache import KVCache
from jaxlora.parallel.sharding import shard_step


@functools.partial(jax.jit, static_argnames=("graphdef", "kernels", "mesh"), donate_argnames=("kv",))
def forward_logits(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    kv: KVCache,
    bank: dict | None = None,
    slot_ids: jax.Array | None = None,
    row_ids: jax.Array | None = None,
    *,
    kernels: StepKernels = StepKernels(),
    mesh: Mesh | None = None,
):
    """float32 logits [b, t, vocab] of every position, and the updated cache (donated).

    With a tensor-parallel `mesh`, the model runs per shard (`jaxlora.parallel.sharding.shard_step`):
    params, bank and kv must be placed as that module says (shard_params / shard_bank / shard_kv);
    the logits are whole on every device and the cache stays split by KV heads.
    """

    def step(params, bank, kv, tokens, positions, slot_ids, row_ids, *, tensor_axis):
        mod = nnx.merge(graphdef, params)
        hidden, kv = mod(
            tokens,
            positions,
            kv,
            bank=bank,
            slot_ids=slot_ids,
            row_ids=row_ids,
            kernels=kernels,
            tensor_axis=tensor_axis,
        )
        return mod.logits(hidden, tensor_axis=tensor_axis), kv

    return shard_step(step, mesh)(params, bank, kv, tokens, positions, slot_ids, row_ids)
