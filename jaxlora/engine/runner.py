"""Host batch -> device arrays -> jitted prefill / decode step -> sampled ids (still on device).

Two jitted functions, each compiled once per static shape at warm-up:

    prefill(params, bank, kv*, tokens[P, bucket], positions[P, bucket], row_ids[P], slot_ids[P],
            last_idx[P], sampling[P]) -> (next_ids[P], kv)       one per bucket, P = prefill_batch
    decode(params, bank, kv*, tokens[B], positions[B], slot_ids[B], sampling[B], feed) -> (next_ids[B], kv)

A step none of whose rows has an adapter (every slot 0) runs without the bank: the same math (slot 0
is all zero) without the LoRA launches, which cost a decode step about as much as 64 adapters' bytes
(benchmarks/NOTES.md). Both variants are compiled at warm-up.

A decode row's input token may still be on the device: the engine dispatches step N+1 before it
reads step N's ids (one step behind, so the host's work overlaps the device's). `feed` = (src [B],
last_decode_ids [B], last_prefill_ids [P]) says where each row's token comes from: src = -1 is the
host's `tokens[b]`, src in [0, B) is the previous decode's id of that row, src = B + i is row i of
the previous prefill's ids. The runner keeps those last outputs itself.

(* donated: the cache is updated in place.) With `config.mesh.tensor > 1` the same steps run per shard
under `shard_map` (jaxlora.parallel): params, bank and cache stay split over the mesh. Padding rows are harmless by construction: a prefill
padding row has row id B (out of range, its cache writes are dropped); an idle decode row sits at
position max_seq_len (its write is dropped too) and its sampled id is ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.engine.config import EngineConfig
from jaxlora.engine.request import Request
from jaxlora.engine.sampling import SamplingArrays, sample
from jaxlora.engine.scheduler import PrefillPlan
from jaxlora.lora.apply import LoraRuntime
from jaxlora.lora.bank import Bank
from jaxlora.model import KVCache, init_kv_cache
from jaxlora.model.params import LoadedModel
from jaxlora.parallel import make_mesh
from jaxlora.parallel.sharding import init_sharded_kv_cache, shard_params, shard_step


# Traces of either step in this process: each is a compile. Module level, so engines with equal
# shapes share compiled steps (jit caches by function and static arguments).
_num_traces = 0


def num_traces() -> int:
    return _num_traces


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "mesh"), donate_argnames=("kv",))
def prefill_step(params, bank, kv, tokens, positions, row_ids, slot_ids, last_idx, sampling, *, graphdef, runtime,
                 mesh=None):
    """Prefill chunks of P rows; samples each row's token after position last_idx. See module doc."""
    global _num_traces
    _num_traces += 1

    def step(params, bank, kv, tokens, positions, row_ids, slot_ids, last_idx, sampling, *, tensor_axis):
        mod = nnx.merge(graphdef, params)
        hidden, kv = mod(tokens, positions, kv, bank=bank, slot_ids=None if bank is None else slot_ids,
                         row_ids=row_ids, runtime=runtime, tensor_axis=tensor_axis)
        last = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]  # [P, D]
        return sample(mod.logits(last, tensor_axis=tensor_axis), sampling), kv

    return shard_step(step, mesh)(params, bank, kv, tokens, positions, row_ids, slot_ids, last_idx, sampling)


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "mesh"), donate_argnames=("kv",))
def decode_step(params, bank, kv, tokens, positions, slot_ids, sampling, feed=None, *, graphdef, runtime, mesh=None):
    """One token for each of the B rows (batch row i is cache row i); `feed` as in the module doc."""
    global _num_traces
    _num_traces += 1
    if feed is not None:
        src, last_decode, last_prefill = feed
        on_device = jnp.concatenate([last_decode, last_prefill])[jnp.maximum(src, 0)]
        tokens = jnp.where(src >= 0, on_device, tokens)

    def step(params, bank, kv, tokens, positions, slot_ids, sampling, *, tensor_axis):
        mod = nnx.merge(graphdef, params)
        hidden, kv = mod(tokens[:, None], positions[:, None], kv, bank=bank,
                         slot_ids=None if bank is None else slot_ids, runtime=runtime, tensor_axis=tensor_axis)
        return sample(mod.logits(hidden[:, 0], tensor_axis=tensor_axis), sampling), kv

    return shard_step(step, mesh)(params, bank, kv, tokens, positions, slot_ids, sampling)


class Runner:
    """Owns the KV cache and calls the compiled steps. Not thread-safe: the engine loop calls it."""

    def __init__(self, model: LoadedModel, config: EngineConfig, *, runtime: LoraRuntime) -> None:
        self.model = model
        self.config = config
        self.runtime = runtime
        # One device: no mesh, the steps run unsharded exactly as before.
        self.mesh = make_mesh(config.mesh) if config.mesh.is_sharded else None
        self.params = model.params if self.mesh is None else shard_params(model.params, model.config, self.mesh)
        self.kv: KVCache = self._new_cache()
        self._static = dict(graphdef=model.graphdef, runtime=runtime)
        if self.mesh is not None:  # one device: the same jit cache key as callers that never pass a mesh
            self._static["mesh"] = self.mesh
        # The last sampled ids of each step function, still on the device (see the module doc).
        self.last_decode_ids: jax.Array | np.ndarray = np.zeros(config.max_batch, np.int32)
        self.last_prefill_ids: jax.Array | np.ndarray = np.zeros(config.prefill_batch, np.int32)

    def _new_cache(self) -> KVCache:
        cfg, model = self.config, self.model
        if self.mesh is None:
            return init_kv_cache(model.config, cfg.max_batch, cfg.max_seq_len, model.dtype)
        return init_sharded_kv_cache(model.config, cfg.max_batch, cfg.max_seq_len, model.dtype, self.mesh)

    # Host side.
    def prefill(self, bank: Bank | None, plan: PrefillPlan, *, lora: bool | None = None) -> jax.Array:
        """Runs one chunk per planned row; returns next ids [P] (meaningful for last chunks only).

        lora: run with the bank (True) or without (False); None: only if a row has an adapter.
        """
        P, T, B = self.config.prefill_batch, plan.bucket, self.config.max_batch
        tokens = np.zeros((P, T), np.int32)
        positions = np.tile(np.arange(T, dtype=np.int32), (P, 1))
        row_ids = np.full(P, B, np.int32)
        slot_ids = np.zeros(P, np.int32)
        last_idx = np.zeros(P, np.int32)
        for i, c in enumerate(plan.chunks):
            r = c.request
            tokens[i, :c.length] = r.prompt_ids[c.start:c.start + c.length]
            positions[i] += c.start
            row_ids[i], slot_ids[i], last_idx[i] = r.row, r.slot, c.length - 1
        sampling = sampling_arrays([c.request for c in plan.chunks], P)
        bank = _bank_for(bank, slot_ids, lora)
        next_ids, self.kv = prefill_step(self.params, bank, self.kv, tokens, positions, row_ids,
                                          slot_ids, last_idx, sampling, **self._static)
        self.last_prefill_ids = next_ids
        return next_ids

    def decode(self, bank: Bank | None, requests: Sequence[Request], *, lora: bool | None = None) -> jax.Array:
        """One token for every decoding request; returns next ids [B] indexed by row.

        A request whose last token is still on the device (`r.pending_src >= 0`, an index into the
        last decode's and prefill's ids as in the module doc) is fed from there; call `decode`
        before `prefill` in a step, so that `last_prefill_ids` are still the previous step's.
        `lora` as in `prefill`.
        """
        B = self.config.max_batch
        tokens = np.zeros(B, np.int32)
        src = np.full(B, -1, np.int32)
        positions = np.full(B, self.config.max_seq_len, np.int32)
        slot_ids = np.zeros(B, np.int32)
        by_row: list[Request | None] = [None] * B
        for r in requests:
            if r.num_pending:
                src[r.row] = r.pending_src
            else:
                tokens[r.row] = r.last_token
            positions[r.row], slot_ids[r.row] = r.next_position, r.slot
            by_row[r.row] = r
        sampling = sampling_arrays(by_row, B)
        feed = (src, self.last_decode_ids, self.last_prefill_ids)
        bank = _bank_for(bank, slot_ids, lora)
        next_ids, self.kv = decode_step(self.params, bank, self.kv, tokens, positions, slot_ids, sampling, feed,
                                        **self._static)
        self.last_decode_ids = next_ids
        return next_ids

    def reset_cache(self) -> None:
        """A fresh cache (after a failed step, whose donated cache may be gone)."""
        self.kv = self._new_cache()

    def warmup(self, bank: Bank | None) -> None:
        """Compiles every shape: each prefill bucket and the decode step, all rows padding."""
        # Twice: the first call of a shape may see arguments the steps never return (a fresh cache),
        # and jit's fast dispatch path keys on that too; after round two every call hits it.
        variants = (False,) if bank is None else (True, False)  # with the bank, and the adapter-free step
        for _ in range(2):
            for lora in variants:
                for bucket in self.config.prefill_buckets:
                    self.prefill(bank, PrefillPlan(bucket=bucket, chunks=()), lora=lora).block_until_ready()
                self.decode(bank, [], lora=lora).block_until_ready()


def _bank_for(bank: Bank | None, slot_ids: np.ndarray, lora: bool | None) -> Bank | None:
    """The bank when the step needs it: asked for, or (lora None) some row has an adapter."""
    if bank is None:
        return None
    if lora is None:
        lora = bool(np.any(slot_ids))
    return bank if lora else None


def sampling_arrays(requests: Sequence[Request | None], rows: int) -> SamplingArrays:
    """Row i gets requests[i]'s parameters; missing rows are greedy padding."""
    s = SamplingArrays.zeros(rows)
    for i, r in enumerate(requests):
        if r is None:
            continue
        p = r.sampling
        s.temperature[i], s.top_k[i], s.top_p[i] = p.temperature, p.top_k, p.top_p
        s.seed[i], s.counter[i] = r.seed, r.num_dispatched  # index of the token this step samples
    return s
