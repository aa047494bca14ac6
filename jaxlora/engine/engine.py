"""The step loop: plan a step, dispatch it, stream detokenized text, finish.

    engine = Engine(model, tokenizer, EngineConfig(), pager)
    engine.warmup()
    handle = engine.submit(GenerationRequest(request_id="a", prompt="Hi", adapter="math"))
    engine.run_until_idle()            # or engine.start() for a background loop
    handle.result().text

`submit` and `cancel` are thread-safe; everything else runs on the loop's thread (the caller of
`step`, or the thread `start` spawns). Callbacks run on the loop's thread and must be quick.

The order of one step (`Engine.step`; everything else refers here):
  1. take new submissions and cancellations; pin the adapters of the waiting requests that free
     rows could take (`Scheduler.pin_adapters`: this queues their page-ins);
  2. prefetch the adapters of the next waiting requests and start the host->device copies of every
     queued page-in (`pager.stage()`): a copy waits for the device work queued before it, so it is
     issued before this step's dispatch and runs under it;
  3. plan the step (`Scheduler.schedule`): decode tokens, prompt chunks, admissions, preemptions;
     a request whose adapter the staged copies bring may be admitted;
  4. pack the step's inputs on the host (`Runner.pack`) and dispatch the jitted step, and the
     sampler after it when a row samples (`Runner.dispatch`: one host->device copy, then the
     calls; none waits for the device); if
     the step reads a slot that the staged copies fill, the slot writes (`pager.commit()`) go
     first, else right after the dispatch (the writes donate the bank the step reads, so JAX
     orders them after it, and the copies ran under it);
  5. read the *previous* step's sampled ids and stream those tokens (the engine runs one step
     behind: step N+1 is on the device's queue before the host blocks on step N's ids).
A step with nothing to run still commits, so requests waiting for a page-in make progress. The
host time of each part is in `stats()["host"]` (`jaxlora.engine.host_timing`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from jaxlora.adapters.pager import AdapterInfo
from jaxlora.adapters.source import AdapterSource
from jaxlora.adapters.unified_pager import UnifiedPager
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.detokenizer import Detokenizer
from jaxlora.engine.host_timing import HostTimes
from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.request import (
    FinalOutput,
    FinishReason,
    GenerationRequest,
    Phase,
    Request,
    RequestOutput,
    TokenLogprob,
    default_max_tokens,
    token_output,
)
from jaxlora.engine.runner import Runner, WarmupProgress, num_traces, pool_positions
from jaxlora.engine.sampling import Logprobs
from jaxlora.engine.scheduler import Scheduler, StepPlan
from jaxlora.errors import CapacityError, EngineFailedError, JaxloraError, RequestError, UnknownAdapterError
from jaxlora.lora.bank import Bank
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.model.params import LoadedModel
from jaxlora.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]


class RequestHandle:
    """A submitted request: wait for the final result, or (submitted with `stream`) iterate it for
    the streamed outputs.

    A handle that does not stream holds no updates: the engine makes one per generated token, and a
    server that forwards them through a callback would otherwise keep every request's whole stream
    alive a second time until it finishes (memory, and garbage-collector time on the loop thread).
    """

    def __init__(self, request_id: str, *, stream: bool) -> None:
        self.request_id = request_id
        self._updates: queue.SimpleQueue[RequestOutput] | None = queue.SimpleQueue() if stream else None
        self._done = threading.Event()
        self._final: FinalOutput | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> FinalOutput:
        """Blocks until the request finishes. Raises TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._final

    def __iter__(self) -> Iterator[RequestOutput]:
        """Streamed updates until the final one (blocks while the request runs).

        Raises:
          RuntimeError: the request was submitted without `stream` (it has a callback, or asked for none).
        """
        if self._updates is None:
            raise RuntimeError(
                f"request {self.request_id} does not stream through its handle: submit it with stream=True "
                "(a request with a callback streams through the callback)"
            )
        while True:
            out = self._updates.get()
            yield out
            if out.finished:
                return

    def _publish(self, out: RequestOutput) -> None:
        if self._updates is not None:
            self._updates.put(out)

    def _complete(self, final: FinalOutput) -> None:
        self._final = final
        self._done.set()


@dataclasses.dataclass
class _Live:
    """Engine-side bookkeeping of one request besides its scheduling state."""

    request: Request
    handle: RequestHandle
    detokenizer: Detokenizer
    stop_ids: frozenset[int]


@dataclasses.dataclass
class _Counters:
    steps: int = 0
    decode_tokens: int = 0  # decode tokens computed (one per running request per step)
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    padded_tokens: int = 0  # token slots of the dispatched steps, padding included
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    errors: int = 0
    cancelled: int = 0
    adapters_used: set[str] = dataclasses.field(default_factory=set)


class Engine:
    """Continuous batching of mixed-adapter requests over one model and one adapter source.

    pager: where adapters get their device slots, any `jaxlora.adapters.AdapterSource` (the paging
      `Pager`, or the all-resident `ResidentBank`); None serves the base model only.
    mesh: the tensor-parallel mesh `config.mesh` describes (None: one device); the pager's bank must
      already be split over it. `jaxlora.engine.build_engine` makes it once and hands it to both.

    The kernels its steps run (`kernels`) are `config.kernels` resolved once, here, for this model
    and platform; the warm-up names them per token budget.
    """

    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Tokenizer,
        config: EngineConfig,
        pager: AdapterSource | None = None,
        *,
        mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        if pager is not None and pager.max_slots != config.lora.max_slots:
            raise ValueError(f"pager has {pager.max_slots} slots but config.lora.max_slots={config.lora.max_slots}")
        if pager is not None and pager.mesh != mesh:
            raise ValueError(f"the pager's bank is on mesh {pager.mesh}, the engine's is {mesh}: build both with one")
        config = config.with_context(
            model_max=model.config.max_position_embeddings, pool_positions=pool_positions(model.config, config, mesh)
        )
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.pager = pager
        self.kernels = config.step_kernels(fused_projections=model.fused)
        self.runner = Runner(model, config, kernels=self.kernels, mesh=mesh, eos_ids=tuple(tokenizer.eos_token_ids))
        self.pages = PageTable(self.runner.num_pages, config.page_size, self.runner.pages_per_seq)
        self.scheduler = Scheduler(
            max_batch=config.max_batch,
            token_budgets=config.token_budgets,
            pages=self.pages,
            max_adapters_per_batch=config.max_adapters_per_batch,
            max_wait_steps=config.max_wait_steps,
            slots=pager,
            reserve_pages=max(1, self.runner.num_pages // 100),
            prefix_caching=config.enable_prefix_caching,
        )
        # A unified bank's adapters live in this engine's KV pages: beyond the AdapterSource protocol,
        # it shares the runner's pool and the page table (and hears when the pool is lost).
        self._unified = pager if isinstance(pager, UnifiedPager) else None
        if self._unified is not None:
            self._unified.attach(self.runner, self.pages, reserve=self.scheduler.reserve_pages)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[_Live] = []
        self._cancels: list[str] = []
        self._prefix_caching_next: bool | None = None  # set_prefix_caching's, applied by the loop
        self._live: dict[str, _Live] = {}  # submitted and not finished, by request id
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._counters = _Counters()
        self._times = HostTimes()
        self._compiles_at_warmup: int | None = None
        # Wall seconds of the last `warmup`: "compile" (the pager's slot writes and every step shape)
        # and "run" (one call of each step program); empty before it.
        self.warmup_seconds: dict[str, float] = {}
        self._inflight: _Inflight | None = None  # the dispatched step whose ids are not read yet
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._failure: str | None = None  # why the background loop died, once it has
        self._failure_listeners: list[Callable[[str], None]] = []

    # Submission (thread-safe).
    def submit(
        self, request: GenerationRequest, callback: Callback | None = None, *, stream: bool | None = None
    ) -> RequestHandle:
        """Validates and queues a request. Raises RequestError, UnknownAdapterError or CapacityError;
        a rejected request never affects the others.

        Args:
          callback: called on the loop's thread with every update (`RequestOutput`).
          stream: also queue every update on the returned handle, for iterating it (default: only
            when no callback is given). Without it the handle gives `result()` alone.
        """
        prompt_ids = self._prompt_ids(request)
        request = self._with_max_tokens(request, len(prompt_ids))
        self._validate(request, prompt_ids)
        seed = request.sampling.seed if request.sampling.seed is not None else self._seeds.getrandbits(32)
        with self._lock:
            if self._failure is not None:
                raise EngineFailedError(f"the engine failed and takes no requests ({self._failure})")
            if self._stopping:
                raise CapacityError("the engine is stopping and accepts no new requests")
            if request.request_id in self._live:
                raise RequestError(f"request_id {request.request_id!r} is already in flight")
            if len(self._inbox) + self.scheduler.num_waiting >= self.config.max_queue:
                raise CapacityError(f"the admission queue is full ({self.config.max_queue} requests waiting)")
            req = Request(request, prompt_ids, seed=seed & 0xFFFFFFFF, arrival=next(self._arrivals), callback=callback)
            eos_ids = () if request.sampling.ignore_eos else self.tokenizer.eos_token_ids
            stop_ids = frozenset(eos_ids) | frozenset(request.sampling.stop_token_ids)
            handle = RequestHandle(request.request_id, stream=callback is None if stream is None else stream)
            live = _Live(req, handle, Detokenizer(self.tokenizer.hf, request.sampling.stop), stop_ids)
            self._live[request.request_id] = live
            self._inbox.append(live)
            self._wake.notify_all()
        return live.handle

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turns prefix caching on or off from the next step, with an empty cache either way (for A/B
        runs on one engine). Thread-safe: the loop applies it between steps."""
        with self._lock:
            self._prefix_caching_next = bool(enabled)
            self._wake.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Cancels a request at the next step (its row and adapter pin are freed). False if unknown."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancels.append(request_id)
            self._wake.notify_all()
        return True

    # The loop.
    def step(self) -> list[RequestOutput]:
        """One engine step, in the order the module doc lists. Returns the outputs it streamed.

        The cost of running one step behind: a request that stops on an EOS id or a stop string has
        one extra token computed and thrown away; `max_tokens` is known in advance and never
        overshoots.

        Raises EngineFailedError once the background loop has died (`failure`).
        """
        if self._failure is not None:
            raise EngineFailedError(f"the engine failed and runs no steps ({self._failure})")
        outputs: list[RequestOutput] = []
        times = self._times
        times.start()
        self._take_inbox(outputs)
        for req, err in self.scheduler.pin_adapters():
            self._finish(req, FinishReason.ERROR, outputs, error=str(err))
        self._stage_page_ins()
        plan = self.scheduler.schedule()
        times.lap("schedule")
        if plan is None:
            self._commit_page_ins()  # nothing to overlap: issue them now, so waiting requests progress
            times.lap("dispatch")
            self._read_inflight(outputs)
            return outputs
        if plan.needs_commit:
            self._commit_page_ins()
            times.lap("dispatch")
        inputs = self.runner.pack(plan, self.pages)
        times.lap("inputs")
        next_ids = self.runner.dispatch(self._bank(), inputs)
        if not plan.needs_commit:
            self._commit_page_ins()
        self.scheduler.dispatched(plan)
        self._count(plan)
        times.lap("dispatch")
        self._read_inflight(outputs)
        self._inflight = _Inflight(plan=plan, next_ids=next_ids, logprobs=self.runner.last_logprobs)
        return outputs

    def _count(self, plan: StepPlan) -> None:
        c = self._counters
        c.steps += 1
        self._times.steps += 1
        num_tokens, num_decode = plan.num_tokens, plan.num_decode_tokens
        c.decode_tokens += num_decode
        c.prefill_tokens += num_tokens - num_decode
        c.padded_tokens += plan.budget

    def _read_inflight(self, outputs: list[RequestOutput]) -> None:
        """Blocks on the previous step's sampled ids (the one host round trip) and streams them."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        next_ids, logprobs = jax.device_get((inflight.next_ids, inflight.logprobs))
        self._times.lap("wait")
        plan = inflight.plan
        decode = plan.decode
        entries = None
        if logprobs is not None:
            entries = [_token_logprob(logprobs, next_ids, r, q) for r, q in zip(decode.rows, decode.requests)]
        self._take_decode_tokens(decode.requests, next_ids[decode.rows].tolist(), outputs, entries)
        for chunk in plan.prompt_chunks:
            if chunk.samples:
                entry = None if logprobs is None else _token_logprob(logprobs, next_ids, chunk.row, chunk.request)
                self._take_token(chunk.request, int(next_ids[chunk.row]), outputs, entry)
        self._times.lap("stream")

    def _take_decode_tokens(
        self,
        requests: list[Request],
        tokens: list[int],
        outputs: list[RequestOutput],
        entries: list[TokenLogprob | None] | None = None,
    ) -> None:
        """`_take_token` for each decode row of a step, its common case inlined: a token that neither
        fails nor ends its request is read, detokenized and emitted here. This loop runs for every
        running row on every step, so it avoids per-token calls and keyword arguments. `entries`:
        each row's logprobs, in steps that computed them."""
        live_of, finished = self._live, Phase.FINISHED
        token_read = self.scheduler.token_read
        append = outputs.append
        read = 0
        for i, (req, token) in enumerate(zip(requests, tokens)):
            if req.phase is finished:  # stopped (or cancelled) after this step was dispatched
                continue
            live = live_of[req.request_id]
            entry = None if entries is None else entries[i]
            if token < 0 or token in live.stop_ids:
                self._take_token(req, token, outputs, entry)
                continue
            token_read(req, token)
            if entry is not None:
                req.logprobs.append(entry)
            read += 1
            text, hit_stop = live.detokenizer.add(token)
            num_output = len(req.output_ids)
            if hit_stop or num_output >= req.sampling.max_tokens:
                reason = FinishReason.STOP if hit_stop else FinishReason.LENGTH
                self._finish(req, reason, outputs, text=text, token=token, logprob=entry)
                continue
            out = token_output(req.request_id, text, token, len(req.prompt_ids), num_output, entry)
            append(out)
            live.handle._publish(out)
            if req.callback is not None:
                _call_back(req.callback, out)
        self._counters.generated_tokens += read

    def _take_token(
        self, req: Request, token: int, outputs: list[RequestOutput], logprob: TokenLogprob | None = None
    ) -> None:
        if req.is_finished:  # stopped (or cancelled) after this step was dispatched: a wasted token
            return
        if token < 0:
            adapter = f"adapter {req.adapter!r}" if req.adapter else "the base model"
            return self._finish(
                req,
                FinishReason.ERROR,
                outputs,
                error=f"the logits of request {req.request_id} are not finite ({adapter})",
            )
        self.scheduler.token_read(req, token)
        if logprob is not None:
            req.logprobs.append(logprob)
        self._append_token(req, token, outputs, logprob)

    def _bank(self) -> Bank | None:
        return None if self.pager is None else self.pager.bank

    def _stage_page_ins(self) -> None:
        """Before the dispatch: prefetch the waiting requests' adapters and start the copies of
        every queued page-in, so they run under the step about to be dispatched (Pager.stage)."""
        if self.pager is None:
            return
        if self.config.prefetch_adapters:
            self.pager.prefetch(self.scheduler.upcoming_adapters(self.config.prefetch_adapters))
        self.pager.stage()

    def _commit_page_ins(self) -> None:
        if self.pager is not None:
            self.pager.commit()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancels) or not self._is_idle()

    def _is_idle(self) -> bool:
        return self.scheduler.is_idle and self._inflight is None

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[FinalOutput]:
        """Runs requests to completion; returns their final outputs in order. Invalid requests get an
        error output instead of raising. Uses the background loop if started, else steps here."""
        results: list[FinalOutput | None] = [None] * len(requests)
        handles: dict[int, RequestHandle] = {}
        pending = list(enumerate(requests))
        pending.reverse()
        while pending or any(not h.done for h in handles.values()):
            while pending:
                i, r = pending[-1]
                try:
                    handles[i] = self.submit(r, stream=False)
                except CapacityError:
                    if self._stopping and not self.is_running:
                        raise  # stopped for good: waiting would never make room
                    break
                except JaxloraError as e:
                    results[i] = _error_output(r.request_id, str(e))
                pending.pop()
            if not self.is_running:
                self.step()
                continue
            unfinished = next((h for h in handles.values() if not h.done), None)
            if unfinished is not None:
                try:
                    unfinished.result(0.05)
                except TimeoutError:
                    pass
        for i, h in handles.items():
            results[i] = h.result()
        return results

    # Background loop (the gRPC server uses this).
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._failure is not None:
            raise EngineFailedError(f"the engine failed and cannot start again ({self._failure})")
        if self.is_running:
            return
        self._stopping = self._draining = False
        self._thread = threading.Thread(target=self._loop, name="jaxlora-engine", daemon=True)
        self._thread.start()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stops the background loop. drain=True finishes in-flight requests first (new submits are
        refused); drain=False cancels them. Requests still running after `timeout` are cancelled."""
        with self._lock:
            self._stopping = True
            self._draining = drain
            if not drain:
                self._cancels.extend(self._live)
            self._wake.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:
                self._draining = False
                self._cancels.extend(self._live)
                self._wake.notify_all()
            self._thread.join()
        self._thread = None

    @property
    def failure(self) -> str | None:
        """Why the background loop died (a failure it could not recover from), or None."""
        return self._failure

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(reason)` (on the loop's thread) if the background loop dies: the server
        turns unhealthy and its process exits, so that a supervisor restarts it."""
        self._failure_listeners.append(listener)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the loop is gone: nobody may wait on it, nothing may queue for it
            log.exception("engine loop died")
            self._die(f"{type(e).__name__}: {e}")

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._cancels or self._stopping) and self._is_idle():
                    self._wake.wait()
                if self._stopping and not self._inbox and not self._cancels and self._is_idle():
                    return
            try:
                self.step()
            except Exception as e:  # a device failure must not leave callers waiting forever
                log.exception("engine step failed")
                # Raises if the device cannot even give a fresh KV pool: then the loop dies (`_die`).
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def _die(self, reason: str) -> None:
        """Fails every request still live (running, waiting or still in the inbox) through `_finish`,
        which gives back rows, pages and adapter pins host side only (the device may be gone); new
        requests and steps are refused from here on; then tells the failure listeners."""
        with self._lock:
            self._failure = reason
            live, self._inbox = list(self._live.values()), []
        for entry in live:
            self._guarded(self._finish, entry.request, FinishReason.ERROR, [], error=f"the engine failed: {reason}")
        for listener in self._failure_listeners:
            self._guarded(listener, reason)

    @staticmethod
    def _guarded(fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        # Everything must run to its end on a dying loop: one failure must not strand the rest.
        try:
            fn(*args, **kw)
        except Exception:
            log.exception("while failing the engine's requests")

    # Warm-up and stats.
    def warmup(self, progress: WarmupProgress | None = None) -> None:
        """Compiles every static shape (the step at each token budget, with and without the bank).
        `progress(what, k, n)` is called as each of the n compiles finishes."""
        start = time.perf_counter()
        if self.pager is not None:
            self.pager.warmup()
            self.pager.commit()
        pager_seconds = time.perf_counter() - start
        self.runner.warmup(None if self.pager is None else self.pager.bank, self.pages, progress)
        self._compiles_at_warmup = self.runner.step_compiles
        runner = self.runner.warmup_seconds
        self.warmup_seconds = {"compile": pager_seconds + runner["compile"], "run": runner["run"]}

    @property
    def compiles_after_warmup(self) -> int | None:
        """XLA compiles of the engine's steps since warm-up (None before it): retraces and new
        argument placements alike."""
        return None if self._compiles_at_warmup is None else self.runner.step_compiles - self._compiles_at_warmup

    def stats(self) -> dict[str, Any]:
        """Counters since the engine started. "host": the loop's cumulative host time by phase, and the
        steps it covers (`jaxlora.engine.host_timing`; `per_step` turns two snapshots into ms/step)."""
        c = self._counters
        out = {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting + len(self._inbox),
            "steps": c.steps,
            "decode_tokens": c.decode_tokens,
            "prefill_tokens": c.prefill_tokens,
            "padded_tokens": c.padded_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "free_pages": self.pages.num_free,
            "num_pages": self.pages.num_pages,
            "prefix_cache": self._prefix_cache_stats(),
            "prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "finished": c.finished,
            "errors": c.errors,
            "cancelled": c.cancelled,
            "adapters_used": len(c.adapters_used),
            "compiles": num_traces(),
            "compiles_after_warmup": self.compiles_after_warmup,
            "host": self._times.as_dict(),
        }
        if self.pager is not None:
            # Counters only: copying the latency samples (up to 10,000) on every call cost about a
            # millisecond, and raced with the engine thread appending to them.
            out["pager"] = self.pager.metrics.counters()
        return out

    def _prefix_cache_stats(self) -> dict[str, Any]:
        """Prompt tokens looked up at admission (queries) and found cached (hits), their ratio (the
        cached share of admitted prompts), cached pages nobody holds, and pages evicted for memory."""
        s = self.scheduler
        queries, hits = s.num_prefix_queries, s.num_prefix_hits
        return {
            "enabled": s.prefix_caching,
            "queries": queries,
            "hits": hits,
            "cached_share": hits / queries if queries else 0.0,
            "cached_pages": self.pages.num_cached,
            "evictions": self.pages.num_evictions,
        }

    # Adapters (pass-through to the pager).
    def register_adapter(self, name: str, path_or_adapter: str | Path | HostAdapter) -> AdapterInfo:
        return self._require_pager().register(name, path_or_adapter)

    def unregister_adapter(self, name: str, *, wait: bool = True, timeout: float | None = None) -> None:
        self._require_pager().unregister(name, wait=wait, timeout=timeout)

    def list_adapters(self) -> list[AdapterInfo]:
        return [] if self.pager is None else self.pager.list()

    def _require_pager(self) -> AdapterSource:
        if self.pager is None:
            raise JaxloraError("this engine was built without an adapter pager")
        return self.pager

    # Internals.
    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        # Measured before templating and tokenizing: tokenizing a 4 MB prompt took seconds, only to
        # refuse it.
        limit = self.config.max_seq_len * self.tokenizer.max_token_bytes
        if isinstance(request.messages, (list, tuple)):
            overhead = self.tokenizer.chat_overhead
            if len(request.messages) * overhead.tokens_per_message > self.config.max_seq_len:
                raise RequestError(
                    f"request {request.request_id}: {len(request.messages)} messages cannot fit max_seq_len="
                    f"{self.config.max_seq_len} tokens: each takes at least {overhead.tokens_per_message}"
                )
        if self._prompt_bytes(request, limit) > limit:
            raise RequestError(
                f"request {request.request_id}: the prompt cannot fit max_seq_len="
                f"{self.config.max_seq_len} tokens: it is longer than {limit} bytes as rendered"
            )
        try:
            if request.prompt is not None:
                ids = self.tokenizer.encode(request.prompt)
            elif request.messages is not None:
                ids = self.tokenizer.encode_chat(request.messages)
            else:
                ids = [int(t) for t in request.prompt_ids]
        except (ValueError, TypeError) as e:
            raise RequestError(f"request {request.request_id}: {e}") from None
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {request.request_id}: prompt token ids {bad[:5]} outside [0, {vocab})")
        return ids

    def _with_max_tokens(self, request: GenerationRequest, num_prompt: int) -> GenerationRequest:
        """`request` with its max_tokens default filled in (SamplingParams)."""
        if request.sampling.max_tokens is not None:
            return request
        n = default_max_tokens(
            is_chat=request.messages is not None,
            num_prompt=num_prompt,
            max_seq_len=self.config.max_seq_len,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
        )
        if n < 1:
            raise RequestError(
                f"request {request.request_id}: the prompt of {num_prompt} tokens leaves no room to generate "
                f"within max_seq_len={self.config.max_seq_len}"
            )
        return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, max_tokens=n))

    def _prompt_bytes(self, request: GenerationRequest, limit: int) -> int:
        """UTF-8 bytes of a request's prompt as rendered, at least: the prompt, or every string of
        every message (role, content, name, ...) plus the template's markup per message; a number
        above `limit` once it is known to exceed it. RequestError for text that is not valid
        Unicode (a lone surrogate), which no tokenizer can take."""
        if request.prompt is not None:
            texts, markup = [request.prompt], 0
        elif isinstance(request.messages, (list, tuple)):
            texts = [v for m in request.messages if isinstance(m, dict) for v in m.values() if isinstance(v, str)]
            markup = len(request.messages) * self.tokenizer.chat_overhead.bytes_per_message
        else:
            return 0
        num_chars = sum(map(len, texts)) + markup
        if num_chars > limit:  # a character is at least one byte: too long without encoding it
            return num_chars
        try:
            return sum(len(t.encode()) for t in texts) + markup
        except UnicodeEncodeError as e:
            raise RequestError(f"request {request.request_id}: the prompt is not valid Unicode ({e.reason})") from None

    def _validate(self, request: GenerationRequest, prompt_ids: list[int]) -> None:
        rid, s = request.request_id, request.sampling
        if not prompt_ids:
            raise RequestError(f"request {rid}: the prompt is empty")
        s.check_limits(max_new_tokens_limit=self.config.max_new_tokens_limit, vocab_size=self.model.config.vocab_size)
        if len(prompt_ids) + s.max_tokens > self.config.max_seq_len:
            raise RequestError(
                f"request {rid}: prompt of {len(prompt_ids)} tokens + max_tokens={s.max_tokens} "
                f"exceeds max_seq_len={self.config.max_seq_len}"
            )
        if request.adapter:
            if self.pager is None or not self.pager.has(request.adapter):
                raise UnknownAdapterError(f"unknown adapter {request.adapter!r}")

    def _take_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            prefix_caching, self._prefix_caching_next = self._prefix_caching_next, None
        if prefix_caching is not None:
            self.scheduler.prefix_caching = prefix_caching
            self.pages.forget_cached()
        for live in inbox:
            self.scheduler.add(live.request)
        for rid in cancels:
            live = self._live.get(rid)
            if live is not None and not live.request.is_finished:
                self._finish(live.request, FinishReason.CANCELLED, outputs)

    def _append_token(
        self, req: Request, token: int, outputs: list[RequestOutput], logprob: TokenLogprob | None = None
    ) -> None:
        live = self._live[req.request_id]
        self._counters.generated_tokens += 1
        if token in live.stop_ids and req.num_output > req.sampling.min_tokens:
            return self._finish(req, FinishReason.STOP, outputs, token=token, logprob=logprob)
        text, hit_stop = live.detokenizer.add(token)
        if hit_stop:
            return self._finish(req, FinishReason.STOP, outputs, text=text, token=token, logprob=logprob)
        if req.num_output >= req.sampling.max_tokens:
            return self._finish(req, FinishReason.LENGTH, outputs, text=text, token=token, logprob=logprob)
        self._emit(
            live,
            RequestOutput(
                request_id=req.request_id,
                text=text,
                token_ids=(token,),
                prompt_tokens=req.num_prompt,
                completion_tokens=req.num_output,
                logprobs=None if logprob is None else (logprob,),
            ),
            outputs,
        )

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        outputs: list[RequestOutput],
        *,
        text: str = "",
        token: int | None = None,
        error: str | None = None,
        logprob: TokenLogprob | None = None,
    ) -> None:
        live = self._live.get(req.request_id)
        was_admitted = req.phase in (Phase.PREFILL, Phase.DECODE) or req.num_preemptions > 0
        self.scheduler.finish(req)
        req.finish_reason, req.error = reason, error
        c = self._counters
        c.finished += 1
        c.errors += reason is FinishReason.ERROR
        c.cancelled += reason is FinishReason.CANCELLED
        if was_admitted:
            c.prompt_tokens += req.num_prompt
            if req.adapter:
                c.adapters_used.add(req.adapter)
        if live is None:
            return
        text += live.detokenizer.flush()
        out = RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=() if token is None else (token,),
            finished=True,
            finish_reason=reason,
            prompt_tokens=req.num_prompt,
            completion_tokens=req.num_output,
            error=error,
            logprobs=None if logprob is None else (logprob,),
        )
        self._emit(live, out, outputs)
        with self._lock:
            del self._live[req.request_id]
        live.handle._complete(
            FinalOutput(
                request_id=req.request_id,
                text=live.detokenizer.text,
                token_ids=tuple(req.output_ids),
                finish_reason=reason,
                prompt_tokens=req.num_prompt,
                completion_tokens=req.num_output,
                error=error,
                logprobs=None if req.logprobs is None else tuple(req.logprobs),
            )
        )

    def _emit(self, live: _Live, out: RequestOutput, outputs: list[RequestOutput]) -> None:
        outputs.append(out)
        live.handle._publish(out)
        if live.request.callback is not None:
            _call_back(live.request.callback, out)

    def _fail_all(self, message: str) -> None:
        self._inflight = None  # its ids may never arrive; its requests fail below
        outputs: list[RequestOutput] = []
        for req in list(self.scheduler.running.values()):
            self._finish(req, FinishReason.ERROR, outputs, error=message)
        # Preempted requests were recomputed from the host's tokens, but their pending ids are lost.
        for req in [r for r in self.scheduler.waiting if r.num_pending]:
            self._finish(req, FinishReason.ERROR, outputs, error=message)
        self.runner.reset_pool()
        self.pages.forget_cached()  # the fresh pool holds none of the cached contents
        if self._unified is not None:
            self._unified.pool_lost()  # nor the adapters that lived in its pages


@dataclasses.dataclass(frozen=True)
class _Inflight:
    """A dispatched step whose sampled ids the host has not read: next_ids [S] on the device."""

    plan: StepPlan
    next_ids: jax.Array
    logprobs: Logprobs | None = None  # [S] rows' logprobs, on the device, when the step computed them


def _token_logprob(logprobs: Logprobs, next_ids, row: int, req: Request) -> TokenLogprob | None:
    """Row `row`'s entry of a step's logprobs and sampled ids [S] (host numpy), for a request that
    asks for them."""
    n = req.sampling.logprobs
    if n is None:
        return None
    top = tuple(zip(logprobs.top_ids[row, :n].tolist(), logprobs.top[row, :n].tolist()))
    return TokenLogprob(int(next_ids[row]), float(logprobs.chosen[row]), top)


def _call_back(callback: Callback, out: RequestOutput) -> None:
    try:
        callback(out)
    except Exception:  # a broken consumer must not stop the batch
        log.exception("callback of request %s raised", out.request_id)


def _error_output(request_id: str, error: str) -> FinalOutput:
    return FinalOutput(
        request_id=request_id,
        text="",
        token_ids=(),
        finish_reason=FinishReason.ERROR,
        prompt_tokens=0,
        completion_tokens=0,
        error=error,
    )
