"""Host step plan -> device arrays -> the jitted step (and sampler) -> next ids (still on device).

Every engine step is one call of one jitted step over a flat batch of `T` tokens, `T` one of the
engine's static token budgets (each compiled at warm-up), plus, in a step where a row samples with a
temperature, one call of the sampler after it. The step's inputs, unpacked:

    ragged_step(params, bank, kv*, tokens[T], src[T], positions[T], slot_ids[T], batch, sampling[S],
                last_ids[S]) -> (greedy next_ids[S], kv)

The engine sends them packed into one int32 array, one host->device copy per step that the runner
issues itself before the call (`packed_step`; layout in `jaxlora.engine.step_inputs`): as separate
jit arguments they would be a copy each, and a copy may wait behind the device work in flight.

S = max_batch rows; a running request keeps its row. The tokens of each row in this step (a decode
token, or a chunk of its prompt) are packed one row after another with no padding between them,
then padded to T; `batch` (`jaxlora.model.RaggedBatch`) says where each row's tokens start, how many
there are, how long its context is, and which KV pages hold it (block tables). The base matmuls see
the T tokens as one matrix; the LoRA term is per token (`slot_ids`); attention is the ragged paged
kernel. The token after each row's last token is chosen: `next_ids[s]` is row s's next output when
its chunk ends the tokens the request knows (a decode token or the end of its prompt), else unused.
The step picks each row's argmax; `packed_sample` then draws the rows with a temperature from the
step's logits. No conditional decides this inside the step: XLA:GPU reads a conditional's
predicate on the host, which would make every dispatch wait for the step before it.

A decode token's input may still be on the device: the engine dispatches step N+1 before it reads
step N's ids (one step behind, so the host's work overlaps the device's). `src[t] = s` takes token t
from `last_ids[s]`, row s's output of the previous step; `src[t] = -1` takes the host's `tokens[t]`.

A step none of whose tokens has an adapter (every slot 0) runs without the bank: the same math (slot
0 is all zero) without the LoRA launches. Both variants are compiled at warm-up, unless
`config.bank_free_steps` is off (then every step runs with the bank).

(* donated: the page pool is updated in place.) Padding tokens are harmless by construction: their
key/value writes go to a page past the pool (dropped), no row's range covers them, and their slot is
0. A row whose logits are not finite (an adapter that blows up) samples -1; the engine fails that
request alone. With `config.mesh.tensor > 1` the same step runs per shard under `shard_map`
(jaxlora.parallel): params, bank and page pool stay split over the mesh.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxlora.config import LoraBank, ModelConfig
from jaxlora.engine.compiles import start_counting, thread_backend_compiles
from jaxlora.engine.config import CPU_MAX_SEQ_LEN, CPU_POOL_POSITIONS, EngineConfig
from jaxlora.engine.kv_pages import PageTable, pages_for
from jaxlora.engine.request import Request
from jaxlora.engine.sampling import Logprobs, SamplingArrays, TokenHistory, greedy, sample, top_logprobs, update_history
from jaxlora.engine.scheduler import StepPlan
from jaxlora.engine.static_arg import Hashed
from jaxlora.engine.step_inputs import HostInputs, InputPacker, StepLayout
from jaxlora.kernels import GemmBackend, StepKernels, gemm_compiler_options
from jaxlora.lora.bank import Bank
from jaxlora.lora.unified_layout import max_adapter_pages
from jaxlora.model import PagedKVCache, RaggedBatch, init_paged_kv_cache
from jaxlora.model.kv_cache import kv_bytes_per_position
from jaxlora.model.params import LoadedModel
from jaxlora.model.sharded import init_sharded_paged_kv_cache
from jaxlora.parallel import check_mesh
from jaxlora.parallel.sharding import shard_params, shard_step, tensor_size

log = logging.getLogger(__name__)

# Traces of the step in this process: each is a compile. Module level, so engines with equal shapes
# share compiled steps (jit caches by function and static arguments).
_num_traces = 0
_traces_lock = threading.Lock()  # warm-up traces shapes in several threads at once

WarmupProgress = Callable[[str, int, int], None]  # (what is compiling, k, n)


def num_traces() -> int:
    return _num_traces


def _count_trace() -> None:
    global _num_traces
    with _traces_lock:
        _num_traces += 1


def _step(params, bank, kv, tokens, src, positions, slot_ids, batch, last_ids, *, graphdef, kernels, mesh):
    """The step's math over its unpacked fields (module doc; sampling is `packed_sample`'s); traced
    inside the jitted entries. -> (greedy next_ids [S], kv, logits [S, vocab] float32)."""
    tokens = _input_ids(tokens, src, last_ids)

    def step(params, bank, kv, tokens, positions, slot_ids, batch, *, tensor_axis):
        mod = nnx.merge(graphdef, params)
        hidden, kv = mod(
            tokens[:, None],
            positions[:, None],
            kv,
            bank=bank,
            slot_ids=None if bank is None else slot_ids,
            ragged=batch,
            kernels=kernels,
            tensor_axis=tensor_axis,
        )
        logits = mod.logits(hidden[batch.last_index, 0], tensor_axis=tensor_axis)  # [S, vocab]
        return greedy(logits), logits, kv

    step = shard_step(step, mesh, num_outputs_before_kv=2)
    ids, logits, kv = step(params, bank, kv, tokens, positions, slot_ids, batch)
    return ids, kv, logits


def _input_ids(tokens: jax.Array, src: jax.Array, last_ids: jax.Array) -> jax.Array:
    """The step's input ids [T]: the host's `tokens`, or where `src` >= 0 that row's previous output."""
    return jnp.where(src >= 0, last_ids[jnp.maximum(src, 0)], tokens)


class _ByCompilerOptions:
    """A step function jitted once per set of XLA compile options (compiler options are not a static
    argument of one jit). A call, `lower` or `trace` goes to the jit of its `kernels=` keyword's
    `compiler_options` for the step's token count, `count(argument tokens_arg)`."""

    def __init__(self, fun: Callable, tokens_arg: str, count: Callable[[object], int], **jit_kw) -> None:
        # Every option set made up front: warm-up compiles from several threads at once.
        choices = [
            gemm_compiler_options(g, concurrent=c)
            for g in GemmBackend
            if g is not GemmBackend.AUTO
            for c in (True, False)
        ]
        self._jits = {_key(o): jax.jit(fun, compiler_options=o or None, **jit_kw) for o in choices}
        # Where the argument sits when passed by position: found once, not per dispatch (a hot path).
        self._tokens_arg, self._tokens_at = tokens_arg, list(inspect.signature(fun).parameters).index(tokens_arg)
        self._count = count
        functools.update_wrapper(self, fun)

    def _jit(self, args: tuple, kwargs: dict):
        kernels = kwargs.get("kernels")
        if not isinstance(kernels, StepKernels):
            raise TypeError(f"{self.__name__} takes its StepKernels as the keyword argument kernels=, got {kernels!r}")
        value = kwargs[self._tokens_arg] if self._tokens_arg in kwargs else args[self._tokens_at]
        return self._jits[_key(kernels.compiler_options(self._count(value)))]

    def __call__(self, *args, **kwargs):
        return self._jit(args, kwargs)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jit(args, kwargs).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._jit(args, kwargs).trace(*args, **kwargs)


def _key(options: dict) -> tuple:
    return tuple(sorted(options.items()))


def by_compiler_options(
    tokens_arg: str, count: Callable[[object], int], **jit_kw
) -> Callable[[Callable], _ByCompilerOptions]:
    """Decorator: `_ByCompilerOptions`; `count(argument tokens_arg)` is the step's token count."""
    return lambda fun: _ByCompilerOptions(fun, tokens_arg, count, **jit_kw)


@by_compiler_options(
    "layout",
    lambda layout: layout.budget,
    static_argnames=("layout", "graphdef", "kernels", "mesh"),
    donate_argnames=("kv",),
)
def packed_step(params, bank, kv, packed, last_ids, *, layout: StepLayout, graphdef: Hashed, kernels, mesh=None):
    """The engine's step: its inputs as one int32 array `packed` [layout.size] (one host->device
    copy; `jaxlora.engine.step_inputs`), unpacked here at static offsets.
    -> (greedy next_ids [S], kv, logits [S, vocab] float32); `packed_sample` then samples the rows
    with a temperature, in steps that have any."""
    _count_trace()
    fields = layout.unpack(packed)
    for name in ("sampling", "prompt_len", "reset"):  # packed_sample's
        del fields[name]
    graphdef = Hashed.unwrap(graphdef, "packed_step")
    return _step(params, bank, kv, last_ids=last_ids, graphdef=graphdef, kernels=kernels, mesh=mesh, **fields)


SAMPLER_VARIANTS = (False, True)  # packed_sample's `extended`


@functools.partial(jax.jit, static_argnames=("layout", "eos_ids", "extended"), donate_argnames=("history",))
def packed_sample(
    logits,
    ids,
    packed,
    last_ids,
    history: TokenHistory,
    *,
    layout: StepLayout,
    eos_ids: tuple[int, ...] = (),
    extended: bool = False,
):
    """The rows of a step sampled from its logits [S, vocab] (`jaxlora.engine.sampling.sample`: EOS
    banned below min_tokens, penalties, temperature, top-k, top-p, min-p); rows whose logits are not
    finite keep `ids` [S]. -> (next_ids [S], history, Logprobs or None).

    Two variants, static, compiled at warm-up (`SAMPLER_VARIANTS`), so that only the steps with a
    row that has a penalty or asks for logprobs pay for them: `extended` adds the step's input ids
    (`last_ids` [S] resolves those on the device) to the rows' token history, applies the penalties,
    and returns the raw distribution's log-probabilities of every row (`top_logprobs`); without it
    the history passes through untouched. One variant for both, not one each: the sampler compiles
    once per token budget and variant, and two more variants per budget made the start-up's
    compiles of small programs the larger part of a CPU warm-up; next to the vocabulary sort every
    sampler step pays, the history update and the top-k are small.

    A program of its own, dispatched after the step only when a row of the step samples: inside the
    step, the choice would be an XLA conditional, whose predicate the GPU runtime reads on the host,
    so every dispatch would wait for the whole device step before it
    (benchmarks/DECISIONS.md#sampling-outside-step), and computing both branches always sorts the
    vocabulary per row."""
    _count_trace()
    f = layout.unpack(packed)
    if extended:
        history = update_history(history, *_history_inputs(f, last_ids, layout.rows))
    drawn = sample(logits, f["sampling"], eos_ids=eos_ids, history=history if extended else None)
    next_ids = jnp.where(ids >= 0, drawn, ids)
    return next_ids, history, top_logprobs(logits, next_ids) if extended else None


def _history_inputs(f: dict, last_ids: jax.Array, rows: int) -> tuple[jax.Array, ...]:
    """`update_history`'s token arguments from a step's unpacked fields: input ids [T], the row of
    each [T] (`rows` for padding), whether each is generated [T], and the rows to reset [S]."""
    batch = f["batch"]
    t = jnp.arange(f["tokens"].shape[0])
    in_row = (t[None, :] >= batch.q_start[:, None]) & (t[None, :] < (batch.q_start + batch.q_len)[:, None])  # [S, T]
    row = jnp.where(in_row.any(axis=0), jnp.argmax(in_row, axis=0), rows)
    is_output = f["positions"] >= f["prompt_len"][jnp.minimum(row, rows - 1)]
    return _input_ids(f["tokens"], f["src"], last_ids), row, is_output, f["reset"]


@by_compiler_options(
    "tokens",
    lambda tokens: tokens.shape[0],
    static_argnames=("graphdef", "kernels", "mesh"),
    donate_argnames=("kv",),
)
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
    graphdef: Hashed,
    kernels,
    mesh=None,
):
    """The same step over its fields as separate arrays (module doc): for tools that build a step's
    arrays themselves (benchmarks, HLO checks). The engine sends `packed_step`. -> (greedy next_ids
    [S], kv); `sampling` is unused (sampled rows are `packed_sample`'s)."""
    _count_trace()
    graphdef = Hashed.unwrap(graphdef, "ragged_step")
    ids, kv, _ = _step(
        params,
        bank,
        kv,
        tokens,
        src,
        positions,
        slot_ids,
        batch,
        last_ids,
        graphdef=graphdef,
        kernels=kernels,
        mesh=mesh,
    )
    return ids, kv


class Runner:
    """Owns the page pool and calls the compiled step. Not thread-safe: the engine loop calls it."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        *,
        kernels: StepKernels,
        mesh: jax.sharding.Mesh | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        check_mesh(config.mesh, mesh)  # the mesh is made once, by jaxlora.engine.build
        if mesh is not None and model.fused:
            raise ValueError(
                "a tensor-parallel engine needs the separate projection layout: load the model with fused=False "
                "(a column split of the fused q|k|v matrix would cut across q, k and v)"
            )
        self.model = model
        self.config = config
        self.kernels = kernels
        self.mesh = mesh
        self.eos_ids = tuple(sorted(eos_ids))  # banned by the sampler below a row's min_tokens
        self.params = model.params if self.mesh is None else shard_params(model.params, model.config, self.mesh)
        self.pages_per_seq = pages_for(config.max_seq_len, config.page_size)
        # The step's small inputs go whole to every device of the mesh (None: the default device).
        self.input_sharding = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        # Each row's last sampled id, still on the device (see the module doc). Before the pool: a
        # fresh pool is placed like them.
        self.last_ids: jax.Array = self._initial_ids()
        # Every row's token history for the penalties (`TokenHistory`: rows x vocab, on the device:
        # 5 bytes a row and token, 195 MB at 256 rows of a 152k vocabulary). Before the pool is
        # sized, so that the free memory it takes a share of is what is left after it.
        self.history: TokenHistory = self._new_history()
        self.num_pages = self._pool_pages()
        # The last dispatched step's logprobs (on the device), when it asked for them.
        self.last_logprobs: Logprobs | None = None
        self.kv: PagedKVCache = self._new_pool()
        self._static = dict(graphdef=Hashed(model.graphdef), kernels=kernels)
        if self.mesh is not None:  # one device: the same jit cache key as callers that never pass a mesh
            self._static["mesh"] = self.mesh
        self.packer = InputPacker(
            rows=config.max_batch,
            pages_per_seq=self.pages_per_seq,
            page_size=config.page_size,
            num_pages=self.num_pages,
            budgets=config.token_budgets,
        )
        self._sent: list[jax.Array | None] = [None] * InputPacker.NUM_BUFFERS  # each buffer's last copy
        # XLA compiles paid by this runner's step calls, a new placement of an argument included
        # (jit compiles those without retracing, so num_traces misses them).
        self.step_compiles = 0
        # Wall seconds of the last `warmup`: "compile" (every shape, in parallel) and "run" (one call
        # of each); empty before it.
        self.warmup_seconds: dict[str, float] = {}
        start_counting()

    @property
    def step_static(self) -> dict:
        """The static arguments this runner passes to `ragged_step`: a caller timing the step on its
        own inputs (benchmarks) passes them too, and runs the same compiled step."""
        return dict(self._static)

    def _pool_pages(self) -> int:
        """The configured page count, else what the device memory left after weights and adapter bank
        holds (GPU), else one max_seq_len sequence per row within CPU_POOL_POSITIONS (CPU, where
        memory is the host's), plus a unified bank's adapters."""
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if jax.default_backend() != "gpu":
            kv = max(self.pages_per_seq, min(cfg.max_batch * self.pages_per_seq, CPU_POOL_POSITIONS // cfg.page_size))
            return kv + self._unified_adapter_pages()
        return max(self.pages_per_seq, pool_positions(self.model.config, cfg, self.mesh) // cfg.page_size)

    def _unified_adapter_pages(self) -> int:
        """On CPU, where the pool is sized for the sequences alone: room for a unified bank's
        max_slots - 1 largest adapters on top (on GPU the pool takes the memory a bank would)."""
        lora = self.config.lora
        if lora.bank is not LoraBank.UNIFIED:
            return 0
        return (lora.max_slots - 1) * max_adapter_pages(self.model.config, lora, self.config.page_size)

    def _new_pool(self) -> PagedKVCache:
        cfg, model = self.config, self.model
        if self.mesh is None:
            return _fresh_pool(model.config, self.num_pages, cfg.page_size, jnp.dtype(model.dtype), self.last_ids)
        return init_sharded_paged_kv_cache(model.config, self.num_pages, cfg.page_size, model.dtype, self.mesh)

    def step(
        self,
        bank: Bank | None,
        plan: StepPlan,
        pages: PageTable,
        *,
        lora: bool | None = None,
        sample: bool | None = None,
    ) -> jax.Array:
        """Packs and dispatches the plan's step; returns next ids [S] by row, on the device.

        lora: run with the bank (True) or without (False); None: only if a token has an adapter (always
          without `config.bank_free_steps`).
        sample: run `packed_sample` after the step (True) or not; None: only if a row of the step
          needs it (`HostInputs.samples`).
        """
        return self.dispatch(bank, self.pack(plan, pages), lora=lora, sample=sample)

    def pack(self, plan: StepPlan, pages: PageTable) -> HostInputs:
        """The plan's inputs in one of the packer's host buffers, after that buffer's previous copy
        to the device is done (in the engine's loop it is: see `InputPacker`)."""
        sent = self._sent[self.packer.next_buffer]
        if sent is not None:
            sent.block_until_ready()
        return self.packer.pack(plan, pages)

    def dispatch(
        self, bank: Bank | None, inputs: HostInputs, *, lora: bool | None = None, sample: bool | None = None
    ) -> jax.Array:
        """Sends the packed inputs (one host->device copy, issued here so that the call finds them
        placed) and dispatches the step; returns next ids [S] on the device, without waiting."""
        # may_alias=False: on CPU a device_put may alias the numpy buffer, which the next pack rewrites.
        packed = jax.device_put(inputs.buffer, self.input_sharding, may_alias=False)
        self._sent[inputs.index] = packed
        bank = self._bank_for(bank, inputs.has_adapter, lora)
        return self.dispatch_packed(
            bank,
            packed,
            inputs.layout,
            sample=inputs.samples if sample is None else sample,
            extended=inputs.extended,
        )

    def dispatch_packed(
        self,
        bank: Bank | None,
        packed: jax.Array,
        layout: StepLayout,
        *,
        sample: bool = False,
        extended: bool = False,
    ) -> jax.Array:
        """Dispatches the step on inputs already on the device (packed [layout.size] int32), and
        `packed_sample` after it when `sample` (its `extended` variant: penalties, and logprobs,
        which land in `last_logprobs`)."""
        compiles = thread_backend_compiles()  # jit compiles on the calling thread
        next_ids, self.kv, logits = packed_step(
            self.params, bank, self.kv, packed, self.last_ids, layout=layout, **self._static
        )
        self.last_logprobs = None
        if sample:
            next_ids, self.last_logprobs = self._sample(logits, next_ids, packed, layout, extended)
        self.step_compiles += thread_backend_compiles() - compiles
        self.last_ids = next_ids
        return next_ids

    def _sample(
        self, logits: jax.Array, ids: jax.Array, packed: jax.Array, layout: StepLayout, extended: bool
    ) -> tuple[jax.Array, Logprobs | None]:
        ids, self.history, lp = packed_sample(
            logits,
            ids,
            packed,
            self.last_ids,
            self.history,
            layout=layout,
            eos_ids=self.eos_ids,
            extended=extended,
        )
        return ids, lp

    def reset_pool(self) -> None:
        """A fresh page pool (after a failed step, whose donated pool may be gone)."""
        self.kv = None  # the old pool goes before the new one takes its memory
        self.kv = self._new_pool()
        self.last_ids = self._initial_ids()
        self.history = self._new_history()
        self.packer.reset()
        self._sent = [None] * InputPacker.NUM_BUFFERS  # copies of the failed steps are not waited for

    def _initial_ids(self) -> jax.Array:
        """Every row's "previous output" before any step: zeros, placed as the step returns them
        (a jit's output on one device, or replicated over the mesh; see `_fresh_pool`)."""
        placement = self.input_sharding if self.mesh is not None else _home_device(self.params)
        return jax.device_put(np.zeros(self.config.max_batch, np.int32), placement)

    def _new_history(self) -> TokenHistory:
        """Empty token histories, placed like the ids (see `_initial_ids`)."""
        placement = self.input_sharding if self.mesh is not None else _home_device(self.params)
        rows, vocab = self.config.max_batch, self.model.config.vocab_size
        return TokenHistory(
            seen=jax.device_put(np.zeros((rows, vocab), bool), placement),
            counts=jax.device_put(np.zeros((rows, vocab), np.int32), placement),
        )

    def warmup(self, bank: Bank | None, pages: PageTable, progress: WarmupProgress | None = None) -> None:
        """Compiles the step at every token budget, with the bank and without, all tokens padding.

        The programs are traced and lowered one after another, in a fixed order, on this thread, and
        each compiles on a pool thread as soon as it is lowered: XLA compiles release the GIL and each
        is mostly single-threaded, so n compiles take about the longest one on a machine with n
        cores. Lowering in a fixed order keeps the programs' cache keys the same from one start to
        the next: a Pallas kernel traced once is reused by every program that calls it, carrying the
        source locations of the first caller into its serialized kernel, so lowering in threads made
        the key depend on which thread won (benchmarks/DECISIONS.md#deterministic-lowering). The
        compiled programs land in jit's compile cache; the calls below then only execute them.
        `progress(what, k, n)` is called as each of the n compiles finishes; `what` names the shape and
        the kernels it runs (`StepKernels.describe`).
        """
        variants = (False,) if bank is None else (True, False) if self.config.bank_free_steps else (True,)
        for budget in self.config.token_budgets:
            log.info("step of %d tokens runs %s", budget, self.kernels.describe(budget))
        shapes = [(budget, lora) for budget in self.config.token_budgets for lora in variants]
        # Inputs placed as `dispatch` places them (the placement is part of the compiled program).
        packed = {
            T: jax.device_put(np.zeros(layout.size, np.int32), self.input_sharding)
            for T, layout in self.packer.layouts.items()
        }
        layouts = self.packer.layouts
        start = time.perf_counter()
        finished = itertools.count(1)
        lock = threading.Lock()

        def report(job: concurrent.futures.Future, budget: int, lora: bool) -> None:
            # On the compiling thread, as each compile ends (lowering of the others may go on).
            if progress is None or job.exception() is not None:
                return
            what = f"step of {budget} tokens{' with adapters' if lora else ''} [{self.kernels.describe(budget)}]"
            with lock:
                progress(what, next(finished), len(shapes))

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(shapes), os.cpu_count() or 1)) as pool:
            jobs = []
            for budget, lora in shapes:
                job = pool.submit(self._lower(bank, packed[budget], layouts[budget], lora).compile)
                job.add_done_callback(functools.partial(report, budget=budget, lora=lora))
                jobs.append(job)
            jobs += [
                pool.submit(self._lower_sampler(packed[budget], layouts[budget], extended).compile)
                for budget in self.config.token_budgets
                for extended in SAMPLER_VARIANTS
            ]
            for job in jobs:
                job.result()
        compiled = time.perf_counter()
        # One call of each compiled program (it compiles nothing: the fresh pool and ids are placed
        # as the step returns them, see `_fresh_pool`), so that every shape's entry in jit's fast
        # dispatch path exists before the first request. Each budget runs `packed_sample` too, in
        # each of its variants, twice (the second call reads the history as a sampler returns it).
        # A step costs as much as a real one of its budget, so each runs once: on a CPU these calls
        # are a large part of the start-up.
        warmed: set[int] = set()
        for budget, lora in shapes:
            self._warm_step(bank, pages, budget, lora, samplers=budget not in warmed)
            warmed.add(budget)
        self.warmup_seconds = {"compile": compiled - start, "run": time.perf_counter() - compiled}

    def _warm_step(self, bank: Bank | None, pages: PageTable, budget: int, lora: bool, *, samplers: bool) -> None:
        """Runs an all-padding step of `budget` as `dispatch` does, then (`samplers`) every
        `packed_sample` variant twice on its logits."""
        inputs = self.pack(_empty_plan(budget), pages)
        packed = jax.device_put(inputs.buffer, self.input_sharding, may_alias=False)
        self._sent[inputs.index] = packed
        bank = self._bank_for(bank, False, lora)
        ids, self.kv, logits = packed_step(
            self.params, bank, self.kv, packed, self.last_ids, layout=inputs.layout, **self._static
        )
        for _ in range(2 if samplers else 0):
            for extended in SAMPLER_VARIANTS:
                sampled, _ = self._sample(logits, ids, packed, inputs.layout, extended)
            ids = sampled
        self.last_ids = ids
        ids.block_until_ready()

    def _lower_sampler(self, packed: jax.Array, layout: StepLayout, extended: bool) -> jax.stages.Lowered:
        """`packed_sample` of `layout` lowered (not compiled), as `_sample` calls it, on logits placed
        like the ids (as the step returns both)."""
        rows, vocab = self.config.max_batch, self.model.config.vocab_size
        logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=self.last_ids.sharding)
        return packed_sample.lower(
            logits,
            self.last_ids,
            packed,
            self.last_ids,
            self.history,
            layout=layout,
            eos_ids=self.eos_ids,
            extended=extended,
        )

    def _lower(self, bank: Bank | None, packed: jax.Array, layout: StepLayout, lora: bool) -> jax.stages.Lowered:
        """The step of `layout` lowered (not compiled), with the bank or without."""
        bank = self._bank_for(bank, False, lora)
        # Called exactly as `dispatch_packed` calls it (positional vs keyword is part of jit's cache key).
        return packed_step.lower(self.params, bank, self.kv, packed, self.last_ids, layout=layout, **self._static)

    def _bank_for(self, bank: Bank | None, has_adapter: bool, lora: bool | None) -> Bank | None:
        """The bank when the step needs it: asked for (lora), else when some token has an adapter, or
        always unless `config.bank_free_steps`."""
        if bank is None:
            return None
        if lora is None:
            lora = has_adapter or not self.config.bank_free_steps
        return bank if lora else None


# The step returns its pool and ids committed to their device (its inputs are), and jit keys its
# compiled programs on whether an argument is committed. A fresh pool from `jnp.zeros` is not, so
# warm-up's compiles against it did not serve the calls on a returned pool, which compiled every
# step program again (benchmarks/DECISIONS.md#committed-pool). The first ids are put on the model's
# device (committed), and the fresh pool comes out of a jit given them: a jit's outputs are
# committed when an input is, and the pool, most of the device's memory, is made in place, not
# copied.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _fresh_pool(model: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, placed_like: jax.Array):
    # A zero read from placed_like: an input the outputs do not depend on would be dropped, and then
    # not place them. XLA fuses the add into the fill.
    zero = (placed_like[0] * 0).astype(dtype)
    return jax.tree.map(lambda x: x + zero, init_paged_kv_cache(model, num_pages, page_size, dtype))


BLOCK_SHARE = 0.95  # of the largest free block the pool may take: the allocator rounds and aligns


def pool_positions(model: ModelConfig, config: EngineConfig, mesh: jax.sharding.Mesh | None = None) -> int:
    """KV positions the page pool can hold: `config.num_pages`, else on GPU the share
    `kv_memory_fraction` of the device memory free now (call it with weights and bank placed), else
    (CPU) CPU_MAX_SEQ_LEN, the bound of the default context there."""
    if config.num_pages is not None:
        return config.num_pages * config.page_size
    if jax.default_backend() != "gpu":
        return CPU_MAX_SEQ_LEN
    stats = jax.local_devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    # The pool's buffers need contiguous memory: a load that freed temporaries between live buffers
    # leaves the free bytes in pieces, and a pool sized from their sum failed to allocate at
    # warm-up (benchmarks/DECISIONS.md#load-on-device). Size it to fit the largest piece instead.
    block = stats.get("largest_free_block_bytes", free)
    if block < free * config.kv_memory_fraction:
        log.warning(
            "device memory is fragmented: %.2f GiB free, the largest free block %.2f GiB; the KV pool is "
            "sized to that block",
            free / 2**30,
            block / 2**30,
        )
    usable = min(free * config.kv_memory_fraction, block * BLOCK_SHARE)
    per_page = kv_bytes_per_position(model, config.jnp_dtype) * config.page_size // tensor_size(mesh)
    return int(usable) // per_page * config.page_size


def _home_device(params) -> jax.Device:
    """The one device holding every parameter (no mesh)."""
    devices = set().union(*(leaf.devices() for leaf in jax.tree.leaves(params)))
    if len(devices) != 1:
        raise ValueError(f"without a mesh the model's parameters must be on one device, not {len(devices)}")
    return devices.pop()


def _empty_plan(budget: int) -> StepPlan:
    return StepPlan(chunks=(), budget=budget, needs_commit=False)


def sampling_arrays(requests: Sequence[Request | None], rows: int) -> SamplingArrays:
    """Row i gets requests[i]'s parameters; missing rows are greedy padding."""
    s = SamplingArrays.zeros(rows)
    for i, r in enumerate(requests):
        if r is None:
            continue
        p = r.sampling
        s.temperature[i], s.top_k[i], s.top_p[i] = p.temperature, p.top_k, p.top_p
        s.seed[i], s.counter[i] = r.seed, r.num_dispatched  # index of the token this step samples
        s.min_p[i], s.min_tokens[i] = p.min_p, p.min_tokens
        s.repetition_penalty[i], s.presence_penalty[i] = p.repetition_penalty, p.presence_penalty
        s.frequency_penalty[i] = p.frequency_penalty
    return s
