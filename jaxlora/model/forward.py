"""Jitted whole-model calls for tests, tools and training (the engine builds its own steps)."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxlora.lora.apply import LoraRuntime
from jaxlora.model.kv_cache import KVCache


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime"))
def forward_logits(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, positions: jax.Array,
                   kv: KVCache, bank: dict | None = None, slot_ids: jax.Array | None = None,
                   row_ids: jax.Array | None = None, *, runtime: LoraRuntime = LoraRuntime()):
    """float32 logits [b, t, vocab] of every position, and the updated cache."""
    mod = nnx.merge(graphdef, params)
    hidden, kv = mod(tokens, positions, kv, bank=bank, slot_ids=slot_ids, row_ids=row_ids, runtime=runtime)
    return mod.logits(hidden), kv
