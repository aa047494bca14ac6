"""A small batched greedy decoder over an adapter bank, for checking what an adapter learned.

Each row has its own prompt and its own bank slot (0 = base model), so one call is one mixed batch:
the same path serving takes, without the engine's scheduler. Prompts are right-padded for the
prefill; each row then decodes at its own positions, and the padding's stale cache entries lie
beyond every position a row attends to until its own tokens overwrite them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.config import LoraConfig
from jaxlora.lora.apply import LoraRuntime
from jaxlora.lora.bank import Bank, init_bank, set_slot, slot_arrays
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.model.kv_cache import init_kv_cache
from jaxlora.model.params import LoadedModel
from jaxlora.train.data import bucket_length


def build_bank(model: LoadedModel, adapters: Sequence[HostAdapter], *, max_rank: int | None = None) -> Bank:
    """A bank whose slot i + 1 holds adapters[i] (slot 0 is the base model)."""
    max_rank = max_rank or max((a.rank for a in adapters), default=1)
    targets = tuple(sorted({m for a in adapters for m in a.target_modules})) or ("q_proj",)
    lora = LoraConfig(max_slots=len(adapters) + 1, max_rank=max_rank, target_modules=targets)
    bank = init_bank(model.config, lora, model.dtype)
    for slot, adapter in enumerate(adapters, 1):
        bank = set_slot(bank, slot, slot_arrays(adapter.weights, model.config, lora))
    return bank


def greedy_generate(model: LoadedModel, bank: Bank | None, prompts: Sequence[Sequence[int]],
                    slot_ids: Sequence[int], *, max_new_tokens: int, eos_ids: Sequence[int] = (),
                    runtime: LoraRuntime = LoraRuntime()) -> list[list[int]]:
    """Greedy continuation of every prompt with its row's adapter; each list stops before the first EOS."""
    if len(prompts) != len(slot_ids) or not prompts:
        raise ValueError(f"need one slot id per prompt, got {len(prompts)} prompts and {len(slot_ids)} slot ids")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError("every prompt needs at least one token")
    width = bucket_length(int(lengths.max()), int(lengths.max()) + 127)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = p
    eos = np.asarray(list(eos_ids) or [-1], np.int32)
    out = _generate(model.params, bank, jnp.asarray(tokens), jnp.asarray(lengths),
                    jnp.asarray(np.asarray(slot_ids, np.int32)), jnp.asarray(eos), graphdef=model.graphdef,
                    max_new_tokens=max_new_tokens, runtime=runtime)
    results = []
    for row in np.asarray(out).tolist():
        stop = next((i for i, t in enumerate(row) if t in eos_ids or t < 0), len(row))
        results.append(row[:stop])
    return results


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "runtime"))
def _generate(params, bank, tokens, lengths, slot_ids, eos, *, graphdef, max_new_tokens: int,
              runtime: LoraRuntime):
    """tokens [b, t] right-padded, lengths [b], eos [k] -> ids [b, max_new_tokens], -1 after a row's EOS.

    Decoding stops early once every row has produced an EOS.
    """
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    kv = init_kv_cache(model.cfg, b, t + max_new_tokens, dtype=model.embed_tokens.embedding[...].dtype)
    kw = {"bank": bank, "slot_ids": slot_ids if bank is not None else None, "runtime": runtime}
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, kv = model(tokens, positions, kv, **kw)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(model.logits(last), axis=-1).astype(jnp.int32)

    def unfinished(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def decode(carry):
        step, token, pos, kv, done, out = carry
        out = out.at[:, step].set(jnp.where(done, -1, token))
        done = done | jnp.isin(token, eos)
        hidden, kv = model(token[:, None], pos[:, None], kv, **kw)
        nxt = jnp.argmax(model.logits(hidden[:, 0]), axis=-1).astype(jnp.int32)
        return step + 1, nxt, pos + 1, kv, done, out

    init = (jnp.int32(0), first, lengths, kv, jnp.zeros((b,), bool), jnp.full((b, max_new_tokens), -1, jnp.int32))
    return jax.lax.while_loop(unfinished, decode, init)[-1]
