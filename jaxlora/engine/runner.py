"""Host step plan -> device arrays -> the one jitted step -> sampled ids (still on device).

Every engine step is one call of one jitted function over a flat batch of `T` tokens, `T` one of
the engine's static token budgets (each compiled at warm-up):

    ragged_step(params, bank, kv*, tokens[T], src[T], positions[T], slot_ids[T], batch, sampling[S],
                last_ids[S]) -> (next_ids[S], kv)

S = max_batch rows; a running request keeps its row. The tokens of each row in this step (a decode
token, or a chunk of its prompt) are packed one row after another with no padding between them,
then padded to T; `batch` (`jaxlora.model.RaggedBatch`) says where each row's tokens start, how many
there are, how long its context is, and which KV pages hold it (block tables). The base matmuls see
the T tokens as one matrix; the LoRA term is per token (`slot_ids`); attention is the ragged paged
kernel. The token after each row's last token is sampled: `next_ids[s]` is row s's next output when
its chunk ends the tokens the request knows (a decode token or the end of its prompt), else unused.

A decode token's input may still be on the device: the engine dispatches step N+1 before it reads
step N's ids (one step behind, so the host's work overlaps the device's). `src[t] = s` takes token t
from `last_ids[s]`, row s's output of the previous step; `src[t] = -1` takes the host's `tokens[t]`.

A step none of whose tokens has an adapter (every slot 0) runs without the bank: the same math (slot
0 is all zero) without the LoRA launches. Both variants are compiled at warm-up.

(* donated: the page pool is updated in place.) Padding tokens are harmless by construction: their
key/value writes go to a page past the pool (dropped), no row's range covers them, and their slot is
0. A row whose logits are not finite (an adapter that blows up) samples -1; the engine fails that
request alone. With `config.mesh.tensor > 1` the same step runs per shard under `shard_map`
(jaxlora.parallel): params, bank and page pool stay split over the mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.engine.compiles import start_counting, thread_backend_compiles
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.kv_pages import PageTable, pages_for
from jaxlora.engine.request import Request
from jaxlora.engine.sampling import SamplingArrays, sample
from jaxlora.engine.scheduler import StepPlan
from jaxlora.lora.apply import LoraRuntime
from jaxlora.lora.bank import Bank
from jaxlora.model import PagedKVCache, RaggedBatch, init_paged_kv_cache
from jaxlora.model.kv_cache import kv_bytes_per_position
from jaxlora.model.params import LoadedModel
from jaxlora.model.sharded import init_sharded_paged_kv_cache
from jaxlora.parallel import check_mesh
from jaxlora.parallel.sharding import shard_params, shard_step, tensor_size

# Traces of the step in this process: each is a compile. Module level, so engines with equal shapes
# share compiled steps (jit caches by function and static arguments).
_num_traces = 0

WarmupProgress = Callable[[str, int, int], None]  # (what is compiling, k, n)


def num_traces() -> int:
    return _num_traces


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "mesh"), donate_argnames=("kv",))
def ragged_step(
    params,
    bank,
    kv,
    tokens,
    src,
    positions,
    slot_ids,
    batch: RaggedBatch,
    sampling,
    last_ids,
    *,
    graphdef,
    runtime,
    mesh=None,
):
    """One step over a flat token batch; see the module doc."""
    global _num_traces
    _num_traces += 1
    tokens = jnp.where(src >= 0, last_ids[jnp.maximum(src, 0)], tokens)

    def step(params, bank, kv, tokens, positions, slot_ids, batch, sampling, *, tensor_axis):
        mod = nnx.merge(graphdef, params)
        hidden, kv = mod(
            tokens[:, None],
            positions[:, None],
            kv,
            bank=bank,
            slot_ids=None if bank is None else slot_ids,
            ragged=batch,
            runtime=runtime,
            tensor_axis=tensor_axis,
        )
        logits = mod.logits(hidden[batch.last_index, 0], tensor_axis=tensor_axis)  # [S, vocab]
        finite = jnp.all(jnp.isfinite(logits), axis=-1)
        return jnp.where(finite, sample(logits, sampling), -1), kv

    return shard_step(step, mesh)(params, bank, kv, tokens, positions, slot_ids, batch, sampling)


class Runner:
    """Owns the page pool and calls the compiled step. Not thread-safe: the engine loop calls it."""

    def __init__(
        self, model: LoadedModel, config: EngineConfig, *, runtime: LoraRuntime, mesh: jax.sharding.Mesh | None = None
    ) -> None:
        check_mesh(config.mesh, mesh)  # the mesh is made once, by jaxlora.engine.build
        self.model = model
        self.config = config
        self.runtime = runtime
        self.mesh = mesh
        self.params = model.params if self.mesh is None else shard_params(model.params, model.config, self.mesh)
        self.pages_per_seq = pages_for(config.max_seq_len, config.page_size)
        self.num_pages = self._pool_pages()
        self.kv: PagedKVCache = self._new_pool()
        self._static = dict(graphdef=model.graphdef, runtime=runtime)
        if self.mesh is not None:  # one device: the same jit cache key as callers that never pass a mesh
            self._static["mesh"] = self.mesh
        # Each row's last sampled id, still on the device (see the module doc).
        self.last_ids: jax.Array | np.ndarray = np.zeros(config.max_batch, np.int32)
        # XLA compiles paid by this runner's step calls, a new placement of an argument included
        # (jit compiles those without retracing, so num_traces misses them).
        self.step_compiles = 0
        start_counting()

    @property
    def step_static(self) -> dict:
        """The static arguments this runner passes to `ragged_step`: a caller timing the step on its
        own inputs (benchmarks) passes them too, and runs the same compiled step."""
        return dict(self._static)

    def _pool_pages(self) -> int:
        """The configured page count, else what the device memory left after weights and adapter bank
        holds (GPU), else one max_seq_len sequence per row (CPU, where memory is the host's)."""
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if jax.default_backend() != "gpu":
            return cfg.max_batch * self.pages_per_seq
        stats = jax.local_devices()[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        per_page = kv_bytes_per_position(self.model.config, cfg.jnp_dtype) * cfg.page_size // tensor_size(self.mesh)
        return max(self.pages_per_seq, int(free * cfg.kv_memory_fraction) // per_page)

    def _new_pool(self) -> PagedKVCache:
        cfg, model = self.config, self.model
        if self.mesh is None:
            return init_paged_kv_cache(model.config, self.num_pages, cfg.page_size, model.dtype)
        return init_sharded_paged_kv_cache(model.config, self.num_pages, cfg.page_size, model.dtype, self.mesh)

    def step(self, bank: Bank | None, plan: StepPlan, pages: PageTable, *, lora: bool | None = None) -> jax.Array:
        """Dispatches the plan's step; returns next ids [S] by row, on the device.

        lora: run with the bank (True) or without (False); None: only if a token has an adapter.
        """
        arrays = self._inputs(plan, pages)
        bank = _bank_for(bank, arrays["slot_ids"], lora)
        compiles = thread_backend_compiles()  # jit compiles on the calling thread
        next_ids, self.kv = ragged_step(self.params, bank, self.kv, last_ids=self.last_ids, **arrays, **self._static)
        self.step_compiles += thread_backend_compiles() - compiles
        self.last_ids = next_ids
        return next_ids

    def _inputs(self, plan: StepPlan, pages: PageTable) -> dict:
        """The step's host arrays: per token [T] and per row [S] (see RaggedBatch)."""
        T, S, P = plan.budget, self.config.max_batch, self.config.page_size
        tokens, src = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        positions, slot_ids = np.zeros(T, np.int32), np.zeros(T, np.int32)
        write_page, write_offset = np.full(T, self.num_pages, np.int32), np.zeros(T, np.int32)
        q_start, q_len, kv_len = np.zeros(S, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32)
        block_tables = np.zeros((S, self.pages_per_seq), np.int32)
        sampled: list[Request | None] = [None] * S
        offset = 0
        for c in plan.chunks:
            span = slice(offset, offset + c.length)
            if c.from_device:
                src[offset] = c.row
            else:
                tokens[span] = c.request.tokens(c.start, c.start + c.length)
            seq_pages = np.asarray(pages.pages_of(c.row), np.int32)
            pos = np.arange(c.start, c.start + c.length, dtype=np.int32)
            positions[span], slot_ids[span] = pos, c.request.slot
            write_page[span], write_offset[span] = seq_pages[pos // P], pos % P
            q_start[c.row], q_len[c.row], kv_len[c.row] = offset, c.length, c.start + c.length
            block_tables[c.row, : len(seq_pages)] = seq_pages
            if c.samples:
                sampled[c.row] = c.request
            offset += c.length
        batch = RaggedBatch(
            q_start=q_start,
            q_len=q_len,
            kv_len=kv_len,
            block_tables=block_tables,
            write_page=write_page,
            write_offset=write_offset,
        )
        return dict(
            tokens=tokens,
            src=src,
            positions=positions,
            slot_ids=slot_ids,
            batch=batch,
            sampling=sampling_arrays(sampled, S),
        )

    def reset_pool(self) -> None:
        """A fresh page pool (after a failed step, whose donated pool may be gone)."""
        self.kv = self._new_pool()
        self.last_ids = np.zeros(self.config.max_batch, np.int32)

    def warmup(self, bank: Bank | None, pages: PageTable, progress: WarmupProgress | None = None) -> None:
        """Compiles the step at every token budget, with the bank and without, all tokens padding."""
        variants = (False,) if bank is None else (True, False)
        shapes = [(budget, lora) for budget in self.config.token_budgets for lora in variants]
        # Twice: the first call of a shape may see arguments the step never returns (a fresh pool),
        # and jit's fast dispatch path keys on that too; after round two every call hits it.
        for k, (budget, lora) in enumerate(shapes * 2):
            if progress is not None and k < len(shapes):
                progress(f"step of {budget} tokens{' with adapters' if lora else ''}", k + 1, len(shapes))
            empty = StepPlan(chunks=(), budget=budget, needs_commit=False)
            self.step(bank, empty, pages, lora=lora).block_until_ready()


def _bank_for(bank: Bank | None, slot_ids: np.ndarray, lora: bool | None) -> Bank | None:
    """The bank when the step needs it: asked for, or (lora None) some token has an adapter."""
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
