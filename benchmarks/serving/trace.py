"""Open-loop serving benchmark: req/s at an SLO, TTFT and TPOT under S-LoRA's synthetic trace.

The trace (`make_trace`) is S-LoRA's `benchmarks/trace.py::generate_requests`, draw for draw: with
`numpy.random.RandomState(seed)` (the generator behind S-LoRA's `np.random.seed(seed)`) it draws, in
this order,
  - `int(rate * duration)` requests;
  - each request's adapter `int(power(alpha) * n)`: `numpy.random.power(alpha)` has density
    alpha * x**(alpha - 1) on [0, 1), so alpha = 1 is uniform over the n adapters and a smaller alpha
    concentrates requests on the low-numbered adapters (0.1: very skewed), as `benchmarks/engine/paging.py`;
  - input lengths, then output lengths, uniform integers in [8, 512) (`randint(8, 512)`);
  - inter-arrival times Gamma(shape = 1 / cv**2, scale = cv**2 / rate): mean 1 / rate, coefficient
    of variation cv (cv = 1 is a Poisson process); request i arrives at the sum of the first i + 1.
With the same seed (default 42, S-LoRA's) the trace is S-LoRA's. Prompts are random token ids; the
models have random weights and a word tokenizer without an end-of-sequence id, and requests carry
no stop ids or strings, so every request generates exactly its output length (checked).

What runs: the real `Engine` (background loop, `engine.start()`) with the real `Pager` over a
random-weight Llama-2-7B-shape model in bf16 (Pallas LoRA kernels on GPU). A driver thread submits
each request at its arrival time; the request's callback (on the engine thread) timestamps every
token. Settings (S-LoRA's S1 and S2, plus one with adapters on all seven modules):
  s1   rank 8 on q/k/v/o, 2,000 registered adapters, 256 device slots (paged);
  s2   ranks 64/32/16/8 on q/k/v/o (adapter i has rank (64, 32, 16, 8)[i % 4], as S-LoRA's S2 list),
       2,000 asked; the pager keeps each host copy at its rank class (8-64: 17-134 MB, 63 MB on
       average), so `--host-gb` caps n (the default 64 GB holds 1,016) and the rows record the n
       that ran;
  all  rank 16 on all seven modules, 64 adapters, all resident in the 64 slots;
  s70  a Llama-3-70B-shape base in FP8 on one GPU, 32 rank-16 adapters on q/k/v/o, all resident,
       rows with "bound_req_s" (benchmarks/serving/s70.py); runs alone (its own model).
Rows say which base weights served them: "weights": "bf16" | "fp8".

`--bank padded|paged|unified` (default padded): the device adapter bank (`lora.bank`). "paged" keeps
every adapter at its true rank in pages of one pool (`jaxlora.adapters.PagedPager`) with as many
page-table rows as the padded bank has slots and a pool of the padded bank's bytes, and reads them
through the paged kernels; "unified" keeps them at true rank in the KV pool's own pages
(`jaxlora.adapters.UnifiedPager`, S-LoRA's unified pool: no memory of their own, the KV pool takes
what a bank would); rows record "bank". Every row has the pool column (`benchmarks/serving/pool.py`): the
mean share of the adapter + KV device memory held by resident adapters (pool_adapter_share) and by
KV pages (pool_kv_share) over the run.

Per run (one offered rate) a row records:
  served_req_s / served_tok_s: completed requests / tokens generated, over the window from the first
    arrival to the last completion;
  ttft_ms_*: first token time - arrival time (the scheduled one: submission delays are the server's);
  tpot_ms_*: (last token time - first token time) / (tokens - 1), completed requests;
  e2e_ms_*: last token time - arrival time, completed requests;
  slo_attainment: share of ALL arrived requests whose first token came within 6 s (no first token, a
    rejected submission or one still waiting at the drain cap is a miss);
  unfinished: requests not finished `--max-drain-s` after the last arrival (then cancelled; the
    engine is idle again before the next run starts);
  loop_ms_per_step: the engine loop's ms per step by phase (`_loop_ms_per_step`): where a step's
    time went on the host, and how long the loop waited on the device;
  steps, prefill_tokens_per_step, decode_tokens_per_step, padding_share: from `engine.stats()`
    (`TokenCounter`): each step computes its padded token budget; padding_share is the share of
    those token slots that held no request's token. (The "bucketed" rows came from the engine
    that ran prefill calls of prefill_batch x bucket slots apart from a decode call of max_batch rows,
    counted by wrapping those calls, at the commit in their `engine_commit`.)
`--sweep K` adds up to K runs per setting that bisect for the highest rate at SLO attainment >= 0.9.

`--trace chat` (setting `chat`): multi-turn conversations instead (`benchmarks/serving/chat_trace.py`): 64
adapters, all resident, with Zipf popularity, each with its own 1,000-token system prompt; 4-8 turns
of 50-200 new user tokens and 50-300 generated, the whole history resent each turn after a think
time; Poisson conversation arrivals at `--rates` conversations/s. A row's requests are turns
(served_req_s: turns/s), and it adds the conversation counts and the prefix cache's hits.

`--prefix-cache on|off|both`: every run with the engine's prefix cache on, off, or once each (off
first), on one engine (`Engine.set_prefix_caching`, which empties the cache: every run starts cold).
Rows record "trace" ("s-lora" or "chat") and "prefix_cache" (true/false), and the prompt tokens the
cache served (prefix_cache_hit_share).

The engine is the preset configs/llama2-7b-h200.yaml (what `jaxlora serve --config` runs) with each
setting's adapter bank; `all` is the preset's own bank. One model for the whole invocation; per
setting one pager and one engine (compiled and warmed up once), serving its rates one after another: each run starts with an idle engine, and with the
adapters the previous run left resident (a paged setting's first run starts with no adapter on the
device; `all` pages its 64 in before the first).

    python -m benchmarks.serving.trace --tiny                                  # CPU smoke run
    python -m benchmarks.serving.trace --tiny --settings s2 --bank paged       # CPU smoke run, paged bank
    python -m benchmarks.serving.trace --settings s1 s2 all --rates 10 40 --bank paged --merge
    python -m benchmarks.serving.trace --settings all s1 --rates 4 10 40 --duration 30 --max-drain-s 30
    python -m benchmarks.serving.trace --settings s2 --rates 4 10 40 --sweep 3 --merge
    python -m benchmarks.serving.trace --render                                # md + png from the JSON
    python -m benchmarks.serving.trace --trace chat --rates 10 20 --prefix-cache both
    python -m benchmarks.serving.trace --smoke --trace chat --prefix-cache both  # CPU smoke run
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, TINY, slot_pattern, time_decode, word_tokenizer
from benchmarks.engine.paging import pool_adapters, register_copies, weight_pool
from benchmarks.paths import results_dir
from benchmarks.serving import s70
from benchmarks.serving.chat_trace import (
    CHAT,
    TINY_CHAT,
    ChatShape,
    ChatTrace,
    conversation_fields,
    drive_chat,
    make_chat_trace,
)
from benchmarks.serving.pool import PoolSampler
from jaxlora.adapters import PagedPager, Pager, UnifiedPager
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, LoraBackend, LoraBank, LoraConfig, ModelConfig
from jaxlora.engine.config import ENGINE_KIND, EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.engine.host_timing import PHASES
from jaxlora.engine.request import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from jaxlora.errors import JaxloraError
from jaxlora.model.params import LoadedModel, random_model
from pallas_kernels.lora import tuning

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "llama2-7b-h200.yaml"  # the engine of the full-size rows
OPEN_LOOP_QUEUE = 1 << 20
SLO_TTFT_S = 6.0  # S-LoRA's SLO: the first token within 6 s
# What --merge replaces rows by: a run of another arrival window is another row.
KEY_FIELDS = (
    "engine", "api", "start", "setting", "n", "rate", "duration_s", "cv", "alpha", "temperature", "trace",
    "prefix_cache", "bank",
)  # fmt: skip
# Rows written before a field existed: greedy, S-LoRA's trace, no prefix cache, in-process, padded bank.
KEY_DEFAULTS = {
    "temperature": 0.0, "trace": "s-lora", "prefix_cache": False, "api": "inprocess", "start": None, "bank": "padded",
}  # fmt: skip
APIS = ("inprocess", "http", "grpc")
RESULTS = "serving.json"


# -- the trace --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceRequest:
    arrival_s: float  # since the start of the run
    adapter: int  # index in [0, n)
    prompt_len: int
    output_len: int


def make_trace(
    *,
    n: int,
    alpha: float,
    rate: float,
    cv: float,
    duration_s: float,
    input_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (8, 512),
    seed: int = 42,
) -> list[TraceRequest]:
    """S-LoRA's `generate_requests` (see the module docstring): same draws, same order, same seed."""
    if n < 1 or rate <= 0 or cv <= 0 or alpha <= 0 or duration_s <= 0:
        raise ValueError(
            f"need n >= 1 and rate, cv, alpha, duration_s > 0; got {n=} {rate=} {cv=} {alpha=} {duration_s=}"
        )
    for name, (lo, hi) in (("input_range", input_range), ("output_range", output_range)):
        if not 1 <= lo < hi:
            raise ValueError(f"{name}=({lo}, {hi}) must satisfy 1 <= low < high")
    rng = np.random.RandomState(seed)
    total = int(rate * duration_s)
    adapters = (rng.power(alpha, total) * n).astype(int)
    inputs = rng.randint(input_range[0], input_range[1], total)
    outputs = rng.randint(output_range[0], output_range[1], total)
    arrivals = np.cumsum(rng.gamma(1.0 / (cv * cv), cv * cv / rate, total))
    return [
        TraceRequest(arrival_s=float(t), adapter=int(a), prompt_len=int(i), output_len=int(o))
        for t, a, i, o in zip(arrivals, adapters, inputs, outputs)
    ]


# -- settings and the engine ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    name: str
    ranks: tuple[int, ...]  # adapter i has rank ranks[i % len(ranks)]
    modules: tuple[str, ...]
    n: int  # adapters asked for (the host budget may hold fewer)
    slots: int  # device slots for adapters; the bank has slots + 1 (slot 0 is the base model)
    trace: str = "s-lora"  # or "chat" (`benchmarks/chat_trace.py`)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)


def settings(tiny: bool) -> dict[str, Setting]:
    if tiny:
        return {
            "s1": Setting(name="s1", ranks=(4,), modules=ATTENTION_MODULES, n=24, slots=4),
            "s2": Setting(name="s2", ranks=(8, 4, 2, 1), modules=ATTENTION_MODULES, n=24, slots=4),
            "all": Setting(name="all", ranks=(4,), modules=TARGET_MODULES, n=4, slots=4),
            "chat": Setting(name="chat", ranks=(4,), modules=ATTENTION_MODULES, n=4, slots=4, trace="chat"),
            s70.NAME: Setting(name=s70.NAME, ranks=(4,), modules=ATTENTION_MODULES, n=4, slots=4),
        }
    return {
        # Slots: enough distinct adapters for the 256 rows under the power law (about 130 distinct of
        # 2,000 at alpha 1); s2's bank pads every slot to rank 64, so it keeps fewer to leave HBM for KV.
        "s1": Setting(name="s1", ranks=(8,), modules=ATTENTION_MODULES, n=2000, slots=256),
        "s2": Setting(name="s2", ranks=(64, 32, 16, 8), modules=ATTENTION_MODULES, n=2000, slots=160),
        "all": Setting(name="all", ranks=(16,), modules=TARGET_MODULES, n=64, slots=64),
        # Each adapter with its own system prompt, all 64 resident: the trace measures prefixes, not paging.
        "chat": Setting(name="chat", ranks=(8,), modules=ATTENTION_MODULES, n=64, slots=64, trace="chat"),
        s70.NAME: Setting(
            name=s70.NAME, ranks=(s70.RANK,), modules=ATTENTION_MODULES, n=s70.NUM_ADAPTERS, slots=s70.NUM_ADAPTERS
        ),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scale:
    """Model, request lengths and engine of one benchmark size. The engine's LoRA limits are each
    setting's (`make_engine`); the full size's `all` setting is the preset's own."""

    model: ModelConfig
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    engine: EngineConfig

    @property
    def dtype(self) -> str:
        return self.engine.dtype


def scale(tiny: bool, model: str) -> Scale:
    """--tiny: toy everything. Else the preset's engine (configs/llama2-7b-h200.yaml), on the 7B shape
    or (model "tiny", a CPU check of the full-size schedule) on the toy model in float32 with
    positions for the full lengths."""
    if tiny:
        engine = EngineConfig(
            max_batch=8,
            max_seq_len=64,
            token_budgets=(8, 32),
            page_size=8,
            max_new_tokens_limit=32,
            dtype="float32",
            bank_free_steps=False,
        )
        return Scale(model=TINY, input_range=(8, 24), output_range=(8, 24), engine=engine)
    engine = EngineConfig.from_yaml(PRESET)
    if model == "llama2-7b":
        return Scale(model=LLAMA2_7B, input_range=(8, 512), output_range=(8, 512), engine=engine)
    toy = dataclasses.replace(TINY, max_position_embeddings=1024)
    return Scale(
        model=toy, input_range=(8, 512), output_range=(8, 512), engine=dataclasses.replace(engine, dtype="float32")
    )


def engine_config(setting: Setting, size: Scale, lora: LoraConfig) -> EngineConfig:
    """The size's engine with the setting's adapter bank (`lora`, from its pager), checked against the
    trace's lengths. The queue is unbounded: an open-loop trace submits every arrival, and an overloaded
    run must show as queueing delay, not as refused requests."""
    engine = size.engine
    longest = size.input_range[1] - 1 + size.output_range[1] - 1
    if longest > engine.max_seq_len:
        raise ValueError(f"a request may need {longest} positions, more than max_seq_len={engine.max_seq_len}")
    if size.output_range[1] - 1 > engine.max_new_tokens_limit:
        raise ValueError(f"outputs up to {size.output_range[1] - 1} tokens, more than {engine.max_new_tokens_limit=}")
    if setting.slots + 1 != lora.max_slots:
        raise ValueError(f"setting {setting.name} has {setting.slots} slots, the pager {lora.max_slots - 1}")
    return dataclasses.replace(engine, max_queue=OPEN_LOOP_QUEUE, lora=lora)


def chat_scale(size: Scale, shape: ChatShape) -> Scale:
    """`size` with positions for the chat trace's longest conversation (up to the model's), and the
    length ranges that `engine_config` checks the engine's limits against."""
    engine = size.engine
    page = engine.page_size
    max_seq_len = min(-(-shape.max_positions // page) * page, size.model.max_position_embeddings)
    longest_output = shape.output_len[1]
    return dataclasses.replace(
        size,
        input_range=(1, max_seq_len - longest_output + 1),
        output_range=(shape.output_len[0], longest_output + 1),
        engine=dataclasses.replace(
            engine, max_seq_len=max_seq_len, max_new_tokens_limit=max(engine.max_new_tokens_limit, longest_output)
        ),
    )


def lora_config(setting: Setting, backend: str, bank: str = LoraBank.PADDED) -> LoraConfig:
    return LoraConfig(
        max_slots=setting.slots + 1,
        max_rank=setting.max_rank,
        target_modules=setting.modules,
        backend=backend,
        bank=bank,
    )


def make_engine(setting: Setting, model: LoadedModel, pager: Pager, size: Scale, backend: str) -> Engine:
    """The engine under test, built in this one place so that another engine kind swaps in here."""
    lora = dataclasses.replace(pager.lora_config, backend=backend)
    engine = Engine(model, word_tokenizer(model.config.vocab_size), engine_config(setting, size, lora), pager)
    if engine.tokenizer.eos_token_ids:
        raise ValueError("the benchmark tokenizer must have no end-of-sequence id: requests run to max_tokens")
    return engine


class TokenCounter:
    """Token slots of the engine's steps, from `engine.stats()`: every step computes its padded
    token budget and fills it with decode tokens and prompt chunks. Decode tokens take no padding
    (no per-row shape), so a step's padding is counted against its prefill share."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def snapshot(self) -> dict[str, int]:
        s = self.engine.stats()
        return dict(
            prefill_tokens=s["prefill_tokens"],
            prefill_slots=s["padded_tokens"] - s["decode_tokens"],
            decode_tokens=s["decode_tokens"],
            decode_slots=s["decode_tokens"],
        )


def token_counter(engine: Engine) -> TokenCounter:
    return TokenCounter(engine)


def make_pager(
    setting: Setting, model: LoadedModel, size: Scale, backend: str, host_bytes: int | None, bank: str = "padded"
) -> tuple[Pager, int, float]:
    """A pager with the setting's adapters registered as a0..a{n-1} (n capped by `host_bytes`);
    returns (pager, n, registration seconds). Adapters share a few random weight sets per rank.
    `bank`: "padded" (`Pager`), "paged" (`PagedPager`, the pool of the padded bank's bytes) or
    "unified" (`UnifiedPager`: the engine's KV pages; its adapters page in once the engine exists)."""
    lora = lora_config(setting, backend, bank)
    # Page-ins per commit: the pager's default 16, or fewer with fewer slots (each size up to it compiles).
    kw = dict(
        dtype=jnp.dtype(size.dtype), host_capacity_bytes=host_bytes, max_page_ins_per_commit=min(16, setting.slots)
    )
    if lora.bank is LoraBank.UNIFIED:
        pager = UnifiedPager(model.config, lora, page_size=size.engine.page_size, **kw)
    else:
        pager = (PagedPager if lora.bank is LoraBank.PAGED else Pager)(model.config, lora, **kw)
    n = num_fitting(pager, setting.ranks, setting.n, host_bytes)
    if n < 1:
        raise ValueError(f"--host-gb holds no {pager.host_nbytes(setting.ranks[0]) / 1e6:.0f} MB adapter")
    adapters = [pool_adapters([w], r, setting.modules)[0] for w, r in zip(*adapter_weights(setting, model.config))]
    seconds = register_copies(pager, adapters, n)
    if not isinstance(pager, UnifiedPager):
        page_in_all(pager, n, setting)
    return pager, n, seconds


def page_in_all(pager: Pager, n: int, setting: Setting) -> None:
    """All resident when they fit the slots: page a0..a{n-1} in before serving (a unified pager once
    its engine exists: its pages are the engine's)."""
    if n <= setting.slots:
        pager.prefetch([f"a{i}" for i in range(n)])
        while pager.snapshot()["pending"]:
            pager.commit()
        pager.prefetch([])


def adapter_weights(setting: Setting, model: ModelConfig) -> tuple[list[dict], tuple[int, ...]]:
    """The few random weight sets the setting's adapters copy, and their ranks: a{i} is a copy of set
    i % len(sets), of rank ranks[i % len(ranks)] (interleaved so that both hold)."""
    per_rank = 2 if len(setting.ranks) > 1 else 8
    pools = {r: weight_pool(model, r, setting.modules, per_rank, seed=r) for r in setting.ranks}
    sets = [pools[r][j] for j in range(per_rank) for r in setting.ranks]
    return sets, tuple(r for _ in range(per_rank) for r in setting.ranks)


def num_fitting(pager: Pager, ranks: Sequence[int], n: int, host_bytes: int | None) -> int:
    """How many of a0..a{n-1} (a{i} of rank ranks[i % len(ranks)], at its rank class's host bytes)
    fit in `host_bytes` (None: all n)."""
    if host_bytes is None:
        return n
    sizes = np.array([pager.host_nbytes(ranks[i % len(ranks)]) for i in range(n)])
    return int(np.searchsorted(np.cumsum(sizes), host_bytes, side="right"))


# -- one open-loop run ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Timeline:
    """What the callback saw of one request (perf_counter seconds)."""

    arrival: float
    prompt_len: int
    output_len: int
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finished: float | None = None
    reason: FinishReason | None = None
    rejected: str | None = None


class _Recorder:
    """Timestamps every streamed token; ignores callbacks after `close` (the drain cap)."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.token_times: list[float] = []  # every token, in arrival order
        self.remaining = n
        self.all_done = threading.Event()
        self.closed = False
        if n == 0:
            self.all_done.set()

    def callback(self, line: _Timeline) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            now = time.perf_counter()
            with self.lock:
                if self.closed:
                    return
                if out.token_ids:
                    if line.first is None:
                        line.first = now
                    line.last = now
                    line.tokens += len(out.token_ids)
                    self.token_times.extend([now] * len(out.token_ids))
                if out.finished:
                    line.finished, line.reason = now, out.finish_reason
                    self._done_one()

        return on_output

    def reject(self, line: _Timeline, error: str) -> None:
        with self.lock:
            line.rejected = error
            self._done_one()

    def _done_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.all_done.set()


# The engine loop's cumulative host time by phase (jaxlora.engine.host_timing), and the calls it covers.
HOST_PHASE_KEYS = tuple(f"{p}_ms" for p in PHASES) + ("calls",)


def _engine_counts(engine: Engine, tokens: TokenCounter) -> dict[str, int]:
    s = engine.stats()
    out = {k: s[k] for k in ("steps", "preemptions")}
    out.update({f"prefix_cache_{k}": s["prefix_cache"][k] for k in ("queries", "hits", "evictions")})
    out["compiles"] = s["compiles"]
    out.update({f"host_{k}": s["host"][k] for k in HOST_PHASE_KEYS})
    out.update(tokens.snapshot())
    out.update({f"pager_{k}": v for k, v in s.get("pager", {}).items()})
    return out


def _loop_ms_per_step(counts: Mapping[str, float]) -> dict[str, float] | None:
    """The engine loop's ms per dispatched step by phase over the run (schedule, inputs, dispatch,
    stream: host time; wait: blocked on the device for the step before), and its idle calls (no
    step dispatched) per step. None when no step ran or the counts predate the field."""
    steps = counts.get("steps", 0)
    if not steps or "host_wait_ms" not in counts:
        return None
    out = {p: round(counts[f"host_{p}_ms"] / steps, 3) for p in PHASES}
    out["idle_calls_per_step"] = round((counts["host_calls"] - steps) / steps, 3)
    return out


def run_trace(
    engine: Engine,
    tokens: TokenCounter,
    trace: Sequence[TraceRequest],
    *,
    vocab: int,
    max_drain_s: float,
    run_id: str,
    seed: int,
    temperature: float = 0.0,
) -> dict:
    """Submits `trace` open loop to the running engine, waits for the last completion or the drain
    cap, cancels what is left and waits until the engine is idle. Returns the run's measurements.
    temperature 0: greedy requests (S-LoRA's workload); above 0 every request samples (seeded), so
    every step also runs the sampler program."""
    rng = np.random.default_rng(seed)
    requests = [
        GenerationRequest(
            request_id=f"{run_id}-{i}",
            adapter=f"a{r.adapter}",
            prompt_ids=rng.integers(0, vocab, r.prompt_len).tolist(),
            sampling=SamplingParams(max_tokens=r.output_len, stop_token_ids=(), temperature=temperature, seed=i),
        )
        for i, r in enumerate(trace)
    ]
    recorder = _Recorder(len(trace))
    lag: list[float] = []
    before = _engine_counts(engine, tokens)
    t0 = time.perf_counter() + 0.05
    lines = [_Timeline(arrival=t0 + r.arrival_s, prompt_len=r.prompt_len, output_len=r.output_len) for r in trace]

    def drive() -> None:
        for req, line in zip(requests, lines):
            delay = line.arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            lag.append(time.perf_counter() - line.arrival)
            try:
                engine.submit(req, callback=recorder.callback(line))
            except JaxloraError as e:
                recorder.reject(line, f"{type(e).__name__}: {e}")

    driver = threading.Thread(target=drive, name="serving-driver", daemon=True)
    driver.start()
    driver.join()
    cap = (lines[-1].arrival if lines else t0) + max_drain_s
    recorder.all_done.wait(max(0.0, cap - time.perf_counter()))
    with recorder.lock:
        recorder.closed = True
        t_close = time.perf_counter()
    after = _engine_counts(engine, tokens)
    unfinished = [
        req.request_id for req, line in zip(requests, lines) if line.finished is None and line.rejected is None
    ]
    for rid in unfinished:
        engine.cancel(rid)
    _wait_idle(engine, timeout_s=120.0)
    counts = {k: after[k] - before[k] for k in after}
    return summarize(lines, recorder.token_times, counts, t_close=t_close, lag_s=lag)


def run_chat(
    engine: Engine, tokens: TokenCounter, trace: ChatTrace, shape: ChatShape, *, max_drain_s: float, run_id: str
) -> dict:
    """Runs the chat trace closed loop (`benchmarks.chat_trace.drive_chat`) on the running engine
    and waits until it is idle. Returns the run's measurements, a turn counting as a request."""
    before = _engine_counts(engine, tokens)
    run = drive_chat(engine, trace, max_drain_s=max_drain_s, run_id=run_id)
    after = _engine_counts(engine, tokens)
    _wait_idle(engine, timeout_s=120.0)
    counts = {k: after[k] - before[k] for k in after}
    row = summarize(run.turns, run.token_times, counts, t_close=run.t_close, lag_s=run.lag_s)
    return {**row, "served_turns_s": row["served_req_s"], **conversation_fields(trace, run, shape)}


def _wait_idle(engine: Engine, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while engine.has_work():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the engine still had work {timeout_s} s after the run's requests were cancelled")
        time.sleep(0.01)


def _mean(xs: Sequence[float]) -> float | None:
    return round(float(np.mean(xs)), 1) if len(xs) else None


def _ms(xs: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 2) if len(xs) else None


def summarize(
    lines: Sequence[_Timeline],
    token_times: Sequence[float],
    counts: Mapping[str, int],
    *,
    t_close: float,
    lag_s: Sequence[float],
) -> dict:
    """One run's row fields from the request timelines and the engine counter deltas."""
    completed = [x for x in lines if x.reason is FinishReason.LENGTH]
    wrong = [x for x in completed if x.tokens != x.output_len]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests finished with a token count other than their output length")
    stopped = [x for x in lines if x.reason is not None and x.reason is not FinishReason.LENGTH]
    rejected = [x for x in lines if x.rejected is not None]
    unfinished = [x for x in lines if x.reason is None and x.rejected is None]
    if len(completed) + len(stopped) + len(rejected) + len(unfinished) != len(lines):
        raise RuntimeError("a request is both finished and rejected")
    start = min((x.arrival for x in lines), default=t_close)
    end = max((x.finished for x in completed), default=t_close)
    window = max(end - start, 1e-9)
    span = max((x.arrival for x in lines), default=start) - start
    tokens_in_window = bisect.bisect_right(token_times, end) - bisect.bisect_left(token_times, start)
    ttft = [x.first - x.arrival for x in lines if x.first is not None]
    tpot = [(x.last - x.first) / (x.tokens - 1) for x in completed if x.tokens > 1]
    e2e = [x.last - x.arrival for x in completed]
    met = sum(1 for x in lines if x.first is not None and x.first - x.arrival <= SLO_TTFT_S)
    steps = counts["steps"]
    slots = counts["prefill_slots"] + counts["decode_slots"]
    filled = counts["prefill_tokens"] + counts["decode_tokens"]

    def share(free: int, total: int) -> float | None:
        return round(free / total, 4) if total else None

    row = {
        "requests": len(lines),
        "completed": len(completed),
        "unfinished": len(unfinished),
        "rejected": len(rejected),
        "stopped_other": len(stopped),
        "no_first_token": sum(1 for x in lines if x.first is None),
        "served_req_s": round(len(completed) / window, 3),
        "served_tok_s": round(tokens_in_window / window, 1),
        "window_s": round(window, 2),
        # What the trace's draw offered: requests over the first to the last arrival. Served req/s
        # cannot exceed it (a Poisson draw of N requests at rate R spans about N / R +- sqrt(N) / R).
        "arrival_span_s": round(span, 2),
        "realized_rate": round(len(lines) / span, 3) if span > 0 else None,
        "slo_attainment": round(met / len(lines), 4) if lines else None,
        "slo_ttft_s": SLO_TTFT_S,
        "steps": steps,
        "preemptions": counts["preemptions"],
        "prefill_tokens_per_step": round(counts["prefill_tokens"] / steps, 2) if steps else None,
        "decode_tokens_per_step": round(counts["decode_tokens"] / steps, 2) if steps else None,
        "padding_share": share(slots - filled, slots),
        "prefill_padding_share": share(counts["prefill_slots"] - counts["prefill_tokens"], counts["prefill_slots"]),
        "decode_padding_share": share(counts["decode_slots"] - counts["decode_tokens"], counts["decode_slots"]),
        "page_ins": counts.get("pager_page_ins"),
        "loop_ms_per_step": _loop_ms_per_step(counts),
        "prefix_cache_hit_share": share(counts.get("prefix_cache_hits", 0), counts.get("prefix_cache_queries", 0)),
        "prefix_cache_evictions": counts.get("prefix_cache_evictions"),
        "compiles_during_run": counts["compiles"],
        "submit_lag_ms_p99": _ms(lag_s, 99),
        "mean_prompt_len": _mean([x.prompt_len for x in lines]),
        "mean_output_len": _mean([x.output_len for x in lines]),
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_ms_p{q}"] = _ms(xs, q)
    return row


# -- the rate sweep ---------------------------------------------------------------------------------


def next_sweep_rate(
    slo_by_rate: Mapping[float, float], *, target: float = 0.9, resolution: float = 0.5
) -> float | None:
    """The next rate of a coarse bisection for the highest rate with SLO attainment >= target, or
    None when the bracket is narrower than `resolution` (req/s). No passing rate yet: half the
    lowest; no failing rate above the best pass: twice it."""
    if not slo_by_rate:
        return None
    passing = [r for r, s in slo_by_rate.items() if s >= target]
    lo = max(passing, default=None)
    hi = min((r for r, s in slo_by_rate.items() if s < target and (lo is None or r > lo)), default=None)
    if hi is None:
        return 2 * lo
    lo = 0.0 if lo is None else lo
    if hi - lo <= resolution:
        return None
    mid = round((lo + hi) / 2 / resolution) * resolution
    return mid if lo < mid < hi else None


# -- output -----------------------------------------------------------------------------------------


def key_field(row: Mapping, name: str):
    """A key field of a row, or its default for rows written before the field existed."""
    return row[name] if name in row else KEY_DEFAULTS[name]


def row_key(row: Mapping) -> tuple:
    return tuple(key_field(row, k) for k in KEY_FIELDS)


def merge_rows(old: Iterable[dict], new: Iterable[dict]) -> list[dict]:
    """`old` with each row of `new` replacing the row of the same key, or appended."""
    rows = {row_key(r): r for r in old}
    for r in new:
        rows[row_key(r)] = r
    return sorted(rows.values(), key=lambda r: (r["engine"], r["setting"], r["n"], r["cv"], r["alpha"], r["rate"]))


MD_COLUMNS = [
    "engine",
    "setting",
    "n",
    "temperature",
    "trace",
    "prefix_cache",
    "rate",
    "realized_rate",
    "duration_s",
    "requests",
    "served_req_s",
    "served_tok_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "decode_step_ms",
    "tpot_over_decode_step",
    "e2e_ms_p50",
    "slo_attainment",
    "unfinished",
    "steps",
    "prefill_tokens_per_step",
    "decode_tokens_per_step",
    "padding_share",
    "page_ins",
    "prefix_cache_hit_share",
    "bank",
    "pool_adapter_share",
    "pool_kv_share",
]


def slo_summary(rows: Sequence[dict], target: float = 0.9) -> list[dict]:
    """Per engine x setting x n x cv x alpha x duration x temperature x prefix cache: the highest
    measured rate at SLO >= target and the lowest measured rate above it that missed."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        group = (
            r["engine"],
            r["setting"],
            r["n"],
            r["cv"],
            r["alpha"],
            r["duration_s"],
            key_field(r, "temperature"),
            key_field(r, "prefix_cache"),
        )
        groups.setdefault(group, []).append(r)
    out = []
    for (engine, setting, n, cv, alpha, duration, temperature, prefix_cache), rs in groups.items():
        ok = [r["rate"] for r in rs if r["slo_attainment"] is not None and r["slo_attainment"] >= target]
        best = max(ok, default=None)
        miss = min(
            (
                r["rate"]
                for r in rs
                if r["slo_attainment"] is not None
                and r["slo_attainment"] < target
                and (best is None or r["rate"] > best)
            ),
            default=None,
        )
        out.append(
            dict(
                engine=engine,
                setting=setting,
                n=n,
                cv=cv,
                alpha=alpha,
                duration_s=duration,
                temperature=temperature,
                prefix_cache=prefix_cache,
                max_rate_at_slo=best,
                lowest_rate_missing=miss,
            )
        )
    return out


def write_markdown(payload: dict, out: Path) -> None:
    rows = payload["rows"]
    commands = list(dict.fromkeys(r["command"] for r in rows))
    lines = (
        [
            f"# Open-loop serving ({payload['device']}, jax {payload['jax_version']})",
            "",
            "S-LoRA's synthetic trace: Gamma arrivals (cv), power-law adapter popularity (alpha), input and "
            "output lengths uniform in [8, 512) (rows' `input_range`, `output_range`), EOS ignored. Served "
            "req/s and tok/s: completed requests and generated tokens over the first arrival to the last "
            "completion; realized_rate: the requests over the first to the last arrival of the trace's draw, "
            "the most that can be served. SLO attainment: share of all "
            f"arrived requests with a first token within {SLO_TTFT_S:g} s. unfinished: not done "
            "`max_drain_s` after the last arrival. padding_share: share of the token slots computed by "
            "prefill and decode calls that held no request's token. Times in ms. Rows of trace `chat`: "
            "multi-turn conversations (benchmarks/chat_trace.py), rate in conversations/s, a request is "
            "a turn; prefix_cache_hit_share: prompt tokens the prefix cache served.",
            "",
            "Commands:",
            "",
        ]
        + [f"- `{c}`" for c in commands]
        + ["", "| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    )
    cells = [{**KEY_DEFAULTS, **r} for r in rows]  # rows from before a key field existed show its default
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in MD_COLUMNS) + " |" for r in cells]
    lines += [
        "",
        "Highest measured rate at SLO attainment >= 0.9 (and the lowest measured rate above it that missed):",
        "",
        "| engine | setting | n | cv | alpha | duration_s | temperature | prefix_cache | max rate at SLO | lowest miss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['engine']} | {s['setting']} | {s['n']} | {s['cv']} | {s['alpha']} | {s['duration_s']} | {s['temperature']} | "
        f"{s['prefix_cache']} | {s['max_rate_at_slo']} | {s['lowest_rate_missing']} |"
        for s in slo_summary(rows)
    ]
    notes = sorted({r["note"] for r in rows if r.get("note")})
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    (out / "serving.md").write_text("\n".join(lines) + "\n")


def write_plot(payload: dict, out: Path) -> bool:
    """served req/s and TTFT p99 against offered rate, one line per engine x setting; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = payload["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))

    def label_of(r: dict) -> tuple:
        return r["engine"], r["setting"], r["n"], r["cv"], r["alpha"], key_field(r, "temperature")

    for label in dict.fromkeys(label_of(r) for r in rows):
        rs = sorted(
            (r for r in rows if label_of(r) == label),
            key=lambda r: r["rate"],
        )
        name = f"{label[0]} {label[1]} (n={label[2]}" + (f", T={label[5]:g})" if label[5] else ")")
        xs = [r["rate"] for r in rs]
        ax1.plot(xs, [r["served_req_s"] for r in rs], "o-", label=name)
        ax2.plot(xs, [(r["ttft_ms_p99"] or float("nan")) / 1e3 for r in rs], "o-", label=name)
    top = max((r["rate"] for r in rows), default=1)
    ax1.plot([0, top], [0, top], color="gray", ls=":", lw=1, label="served = offered")
    ax1.set(xlabel="offered rate (req/s)", ylabel="served req/s", title="throughput")
    ax2.axhline(SLO_TTFT_S, color="gray", ls="--", lw=1, label=f"SLO {SLO_TTFT_S:g} s")
    ax2.set(xlabel="offered rate (req/s)", ylabel="TTFT p99 (s)", title="time to first token, p99", yscale="log")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Open-loop serving, {payload['device']}")
    fig.tight_layout()
    fig.savefig(out / "serving.png", dpi=120)
    plt.close(fig)
    return True


def write_results(payload: dict, out: Path, *, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).write_text(json.dumps(payload, indent=1) + "\n")
    write_markdown(payload, out)
    if plot and payload["rows"] and not write_plot(payload, out):
        print("matplotlib is not installed: serving.png not written", flush=True)


def engine_commit() -> str:
    """The checkout's HEAD (+"-dirty" with uncommitted changes). Raises without git."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"cannot read the engine's commit ({e}); pass --engine-commit") from None
    return head + ("-dirty" if dirty else "")


# -- main -------------------------------------------------------------------------------------------


def decode_step_probe(engine: Engine, row: Mapping, slots: int, steps: int) -> dict:
    """The decode-only step at the run's batch size, timed on the run's own engine and bank: what
    TPOT is measured against (issue 15: TPOT p50 <= 1.3x this). Rows: the run's mean decode tokens
    per step, each on its own adapter (up to the slots), at the mean context of a decoding request
    (prompt + half the output), padded to the budget the engine's scheduler picks for them."""
    if not steps or not row.get("decode_tokens_per_step") or row.get("tpot_ms_p50") is None:
        return {}
    budgets = engine.config.token_budgets
    rows = min(max(1, round(row["decode_tokens_per_step"])), engine.config.max_batch, budgets[-1])
    budget = budgets[bisect.bisect_left(budgets, rows)]
    context = min(round(row["mean_prompt_len"] + row["mean_output_len"] / 2), engine.config.max_seq_len - 1)
    bank = engine.pager.bank if engine.pager is not None else None
    ms = time_decode(engine.runner, bank, slot_pattern(rows, min(rows, slots)), context, steps, budget=budget)
    return {
        "decode_step_rows": rows,
        "decode_step_budget": budget,
        "decode_step_context": context,
        "decode_step_ms": round(ms, 3),
        "tpot_over_decode_step": round(row["tpot_ms_p50"] / ms, 3),
    }


def rate_spec(text: str) -> tuple[float, float | None]:
    """RATE -> (rate, None); RATE@SECONDS -> (rate, seconds): the rate and its own arrival seconds."""
    rate, at, duration = text.partition("@")
    try:
        out = float(rate), float(duration) if at else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not RATE or RATE@SECONDS") from None
    if not all(math.isfinite(x) and x > 0 for x in out if x is not None):
        raise argparse.ArgumentTypeError(f"{text!r}: the rate and the seconds must be finite and > 0")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy model, sizes and lengths (CPU, seconds)")
    p.add_argument(
        "--api",
        nargs="+",
        choices=APIS,
        default=["inprocess"],
        help="inprocess: the Engine in this process; http: `jaxlora serve` in a subprocess driven by the openai "
        "AsyncOpenAI client, streaming; grpc: the same server through serving.client. With a server api, "
        "in-process runs in a child process first and this process keeps JAX off the GPU",
    )
    p.add_argument(
        "--starts",
        type=int,
        choices=(1, 2),
        default=None,
        help="server starts per setting, each serving every run (2: then a warm-cache start; default 1, --smoke 2)",
    )
    p.add_argument(
        "--server-code",
        type=Path,
        default=None,
        help="a source tree (an export of another commit) whose jaxlora the servers run; needs --server-commit",
    )
    p.add_argument("--server-commit", default=None, help="the commit --server-code was exported from (rows)")
    p.add_argument("--client-workers", type=int, default=4, help="client processes sending a server api's requests")
    p.add_argument("--server-timeout-s", type=float, default=900.0, help="longest wait for a server's /health")
    p.add_argument(
        "--inprocess-budget-s",
        type=float,
        default=None,
        help="with a server api: --budget-s of the in-process child (default: half of --budget-s)",
    )
    p.add_argument(
        "--work-dir", type=Path, default=None, help="model and adapter folders for a server api (default: a temp dir)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="--tiny with one short run per setting by default (1 s of arrivals at 4/s): a CPU check; with a "
        "server api, s1 by default and two server starts",
    )
    p.add_argument(
        "--trace",
        choices=("s-lora", "chat"),
        default="s-lora",
        help="the default --settings: S-LoRA's trace (all s1 s2) or the multi-turn chat trace (chat)",
    )
    p.add_argument(
        "--prefix-cache",
        choices=("on", "off", "both"),
        default="on",
        help="every run with the engine's prefix cache on, off, or both (a row each, off first, one engine)",
    )
    p.add_argument(
        "--think-s", type=float, default=None, help="chat: mean think time between turns (default 1; --tiny 0.05)"
    )
    p.add_argument(
        "--model",
        choices=("llama2-7b", "tiny"),
        default="llama2-7b",
        help="without --tiny: the model under the 7B limits (tiny: a CPU check of the full schedule)",
    )
    p.add_argument(
        "--settings",
        nargs="+",
        choices=("s1", "s2", "all", "chat", s70.NAME),
        default=None,
        help="default: all s1 s2 (--trace s-lora) or chat (--trace chat)",
    )
    p.add_argument(
        "--rates",
        type=rate_spec,
        nargs="*",
        default=[(4.0, None), (10.0, None), (40.0, None)],
        help="offered req/s; RATE@SECONDS gives that run its own seconds of arrivals (else --duration)",
    )
    p.add_argument(
        "--sweep",
        type=int,
        default=0,
        help="up to this many extra runs per setting bisecting for the highest rate at SLO attainment >= --slo-target",
    )
    p.add_argument(
        "--sweep-settings",
        nargs="+",
        choices=("s1", "s2", "all", "chat"),
        default=None,
        help="the settings that get --sweep (default: every one run)",
    )
    p.add_argument("--slo-target", type=float, default=0.9)
    p.add_argument("--sweep-resolution", type=float, default=0.5, help="req/s")
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature (0: greedy, S-LoRA's workload; above 0 each step also runs the sampler)",
    )
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--probe-steps",
        type=int,
        default=20,
        help="decode-only steps timed after a setting's runs, at each run's batch size (0: no probe)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="device adapter slots of every setting (default: the "
        "setting's, 64); with at most one distinct adapter per slot, this caps the batch's adapters",
    )
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 120; --tiny 2)")
    p.add_argument("--max-drain-s", type=float, default=None, help="after the last arrival (default 60; --tiny 20)")
    p.add_argument(
        "--host-gb", type=float, default=None, help="host budget for registered adapters, GB (default: the preset's)"
    )
    p.add_argument(
        "--budgets", type=int, nargs="+", default=None, help="the engine's token budgets (default 128-2048 by 2x)"
    )
    p.add_argument(
        "--backend",
        choices=[b.value for b in LoraBackend],
        default=None,
        help="LoRA backend (default: pallas on GPU, xla elsewhere)",
    )
    p.add_argument(
        "--bank",
        choices=[b.value for b in LoraBank],
        default=LoraBank.PADDED.value,
        help="the device adapter bank: every slot padded to the max rank, true-rank pages of its own pools, or "
        "true-rank runs in the KV pool's pages (unified)",
    )
    p.add_argument(
        "--lora-groups",
        choices=("tuned", "split"),
        default="tuned",
        help="pallas module groups: tuning.py's rule (tuned), or the split shrink + per-row expand launches "
        "everywhere (the engine before the one-launch kernel and the tile expand; an A/B in the same tree)",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="start no run (or setting) that could end after this many seconds"
    )
    p.add_argument(
        "--setup-s",
        type=float,
        default=None,
        help="expected seconds to set up a setting, for --budget-s (default 150; --tiny 30)",
    )
    p.add_argument("--merge", action="store_true", help=f"add to --out/{RESULTS} (rows of the same key replaced)")
    p.add_argument("--skip-measured", action="store_true", help="with --merge: skip rates the file has already")
    p.add_argument("--render", action="store_true", help=f"only rewrite serving.md/png from --out/{RESULTS}")
    p.add_argument("--engine-commit", default=None, help="recorded in the rows (default: git HEAD)")
    p.add_argument("--out", type=Path, default=results_dir(__file__))
    args = p.parse_args(argv)
    if args.smoke:
        args.tiny = True
        if args.rates == p.get_default("rates"):
            args.rates = [(4.0, None)]
        args.duration = 1.0 if args.duration is None else args.duration
        if set(args.api) != {"inprocess"}:
            args.settings = args.settings or ["s1"]
            args.starts = args.starts or 2
            args.client_workers, args.probe_steps = 2, 0
    args.starts = args.starts or 1
    if args.settings is None:
        args.settings = ["chat"] if args.trace == "chat" else ["all", "s1", "s2"]
    if args.duration is None:
        args.duration = 2.0 if args.tiny else 120.0
    if args.max_drain_s is None:
        args.max_drain_s = 20.0 if args.tiny else 60.0
    if args.setup_s is None:
        args.setup_s = 30.0 if args.tiny else 150.0
    if args.skip_measured and not args.merge:
        p.error("--skip-measured needs --merge")
    if (args.server_code is None) != (args.server_commit is None):
        p.error("--server-code and --server-commit go together")
    if args.server_code is not None and set(args.api) == {"inprocess"}:
        p.error("--server-code needs a server api (--api http or grpc)")
    if args.prefix_cache != "on" and set(args.api) - {"inprocess"}:
        p.error("--prefix-cache off|both is in-process only: the server runs the preset's engine (prefix cache on)")
    return args


class _Clock:
    def __init__(self, budget_s: float | None) -> None:
        self.start = time.perf_counter()
        self.deadline = self.start + budget_s if budget_s is not None else float("inf")

    def fits(self, seconds: float) -> bool:
        return time.perf_counter() + seconds <= self.deadline


def run_setting(
    setting: Setting,
    model: LoadedModel,
    size: Scale,
    args: argparse.Namespace,
    *,
    backend: str,
    clock: _Clock,
    previous: list[dict],
    base_row: dict,
    on_row: Callable[[dict], None],
    not_run: list[str],
) -> None:
    """One engine for the setting; runs --rates, then the sweep, each with the prefix cache per
    --prefix-cache; calls on_row after every run."""
    chat = TINY_CHAT if args.tiny else CHAT
    if args.think_s is not None:
        chat = dataclasses.replace(chat, think_s=args.think_s)
    if setting.trace == "chat":
        size = chat_scale(size, chat)
    caches = {"on": (True,), "off": (False,), "both": (False, True)}[args.prefix_cache]
    host = None if args.tiny else int(args.host_gb * 1e9) if args.host_gb else size.engine.host_capacity_bytes
    t0 = time.perf_counter()
    pager, n, reg_s = make_pager(setting, model, size, backend, host, args.bank)
    note = None
    if n < setting.n:
        note = (
            f"{setting.name}: {n} adapters registered, not {setting.n}: a {host / 1e9:g} GB host budget holds {n} "
            f"host copies at their rank classes ({pager.registered_bytes / n / 1e6:.0f} MB on average)"
        )
    mb = pager.registered_bytes / max(n, 1) / 1e6
    print(f"[{setting.name}] {n} adapters x {mb:.1f} MB on average registered in {reg_s:.1f} s", flush=True)
    engine = make_engine(setting, model, pager, size, backend)
    engine.warmup()
    if isinstance(pager, UnifiedPager):
        page_in_all(pager, n, setting)
    tokens = token_counter(engine)
    pool = PoolSampler(engine)
    print(f"[{setting.name}] set up in {time.perf_counter() - t0:.1f} s", flush=True)
    key = dict(
        engine=ENGINE_KIND,
        setting=setting.name,
        n=n,
        cv=args.cv,
        alpha=args.alpha,
        temperature=args.temperature,
        trace=setting.trace,
        bank=args.bank,
    )
    same = [  # the sweep bisects over the runs with the last --prefix-cache mode
        r
        for r in previous
        if all(key_field(r, k) == v for k, v in key.items())
        and key_field(r, "prefix_cache") == caches[-1]
        and r["duration_s"] == args.duration
    ]
    slo = {r["rate"]: r["slo_attainment"] for r in same}
    measured = set(slo) if args.skip_measured else set()
    measured_here: list[dict] = []
    engine.start()
    try:

        def run_once(rate: float, duration: float, cache: bool) -> dict:
            engine.set_prefix_caching(cache)
            run_id = f"{setting.name}-{rate:g}-{'cache' if cache else 'nocache'}"
            if setting.trace == "chat":
                trace = make_chat_trace(
                    chat,
                    rate=rate,
                    duration_s=duration,
                    vocab=model.config.vocab_size,
                    max_seq_len=size.engine.max_seq_len,
                    seed=args.seed,
                )
                return run_chat(engine, tokens, trace, chat, max_drain_s=args.max_drain_s, run_id=run_id)
            trace = make_trace(
                n=n,
                alpha=args.alpha,
                rate=rate,
                cv=args.cv,
                duration_s=duration,
                input_range=size.input_range,
                output_range=size.output_range,
                seed=args.seed,
            )
            return run_trace(
                engine,
                tokens,
                trace,
                vocab=model.config.vocab_size,
                max_drain_s=args.max_drain_s,
                run_id=run_id,
                seed=args.seed + 1,
                temperature=args.temperature,
            )

        def run(rate: float, sweep: bool, duration: float) -> None:
            for cache in caches:
                run_one(rate, sweep, duration, cache)

        def run_one(rate: float, sweep: bool, duration: float, cache: bool) -> None:
            if not clock.fits(duration + args.max_drain_s + 10.0):  # arrivals, drain cap, flush
                print(f"[{setting.name}] time budget spent: rate {rate} not run", flush=True)
                not_run.append(f"{setting.name}@{rate:g}{'' if cache else ' (no prefix cache)'}")
                return
            t_run = time.perf_counter()
            pool.start()
            result = {**run_once(rate, duration, cache), **pool.stop()}
            row = {
                **base_row,
                **key,
                "prefix_cache": cache,
                "rate": rate,
                "duration_s": duration,
                "max_drain_s": args.max_drain_s,
                "seed": args.seed,
                "input_range": list(size.input_range),
                "output_range": list(size.output_range),
                "ranks": list(setting.ranks),
                "modules": list(setting.modules),
                "n_asked": setting.n,
                "slots": setting.slots,
                "paged": n > setting.slots,
                "max_batch": size.engine.max_batch,
                "token_budgets": list(size.engine.token_budgets),
                "registration_s": round(reg_s, 1),
                "sweep": sweep,
                **result,
                "run_s": round(time.perf_counter() - t_run, 1),
                "note": note,
            }
            if duration == args.duration and cache == caches[-1]:  # the sweep bisects over runs of --duration
                slo[rate] = row["slo_attainment"]
            measured_here.append(row)
            print(
                json.dumps(
                    {
                        k: row[k]
                        for k in (
                            "setting",
                            "prefix_cache",
                            "rate",
                            "requests",
                            "completed",
                            "unfinished",
                            "served_req_s",
                            "served_tok_s",
                            "ttft_ms_p50",
                            "ttft_ms_p99",
                            "tpot_ms_p50",
                            "slo_attainment",
                            "padding_share",
                            "prefix_cache_hit_share",
                            "run_s",
                        )
                    }
                ),
                flush=True,
            )
            on_row(row)

        for rate, duration in args.rates:
            if rate in measured and duration in (None, args.duration):
                print(f"[{setting.name}] rate {rate:g} already in the results: skipped", flush=True)
                continue
            run(rate, sweep=False, duration=args.duration if duration is None else duration)
        sweeps = args.sweep if args.sweep_settings is None or setting.name in args.sweep_settings else 0
        for _ in range(sweeps):
            rate = next_sweep_rate(slo, target=args.slo_target, resolution=args.sweep_resolution)
            if rate is None or not clock.fits(args.duration + args.max_drain_s + 10.0):
                break
            run(rate, sweep=True, duration=args.duration)
    finally:
        engine.stop(drain=False)
    for row in measured_here:  # the engine's thread is gone: the probe may use its runner
        try:
            row.update(decode_step_probe(engine, row, setting.slots, args.probe_steps))
        except Exception as e:  # the rows measured stand; the failure is recorded, not hidden
            row["decode_step_error"] = f"{type(e).__name__}: {e}"
            engine.runner.reset_pool()  # a failed call may have consumed the donated pool
            print(f"[{setting.name}] decode-step probe failed: {row['decode_step_error']}", flush=True)
        on_row(row)


# -- through the server (--api http|grpc) -----------------------------------------------------------


def run_setting_api(
    setting: Setting,
    size: Scale,
    args: argparse.Namespace,
    *,
    backend: str,
    work: Path,
    model_folder: Path,
    base_row: dict,
    on_row: Callable[[dict], None],
    clock: _Clock,
) -> None:
    """The setting's runs through `jaxlora serve` (benchmarks/serving/server_api.py), started --starts times
    on one compilation cache: the first start compiles ("first"), a later one reads the cache
    ("second"). Every start serves every --rates run of every api in --api (http, grpc)."""
    from benchmarks.serving import server_api as serving_api

    host = None if args.tiny else int(args.host_gb * 1e9) if args.host_gb else size.engine.host_capacity_bytes
    lora = lora_config(setting, backend, args.bank)  # the preset's lora.bank: the server builds that pager
    n = setting.n if host is None else num_fitting_bytes(setting, size, lora, host)
    sets, ranks = adapter_weights(setting, size.model)
    folder = work / setting.name
    adapters = serving_api.write_adapter_folders(sets, ranks=ranks, n=n, out=folder / "adapters")
    engine = dataclasses.replace(engine_config(setting, size, lora), host_capacity_bytes=host)
    preset = serving_api.write_preset(engine, folder / "engine.yaml")
    # The setting's own compilation cache, emptied first: the first start compiles ("first"), the
    # second reads what it wrote ("second"). A cache left by an earlier run on this --work-dir (a
    # machine kept warm between calls) would make the first start a second one under the wrong
    # label, and its rows would then take the second start's key.
    cache = work / "compilation-cache" / setting.name
    if cache.exists():
        print(f"[{setting.name}] emptying {cache} (left by an earlier run): the first start compiles", flush=True)
        shutil.rmtree(cache)
    key = dict(
        engine=ENGINE_KIND, setting=setting.name, n=n, cv=args.cv, alpha=args.alpha, temperature=args.temperature
    )
    for k in range(args.starts):
        start = ("first", "second")[k]
        if not clock.fits(args.setup_s):
            print(f"[{setting.name}] time budget spent: no {start} server start", flush=True)
            break
        log = folder / f"serve-{k + 1}-{start}{'-' + args.server_code.name if args.server_code else ''}.log"
        server = serving_api.start_server(
            model_folder,
            preset,
            adapters,
            log=log,
            cache=cache,
            timeout_s=args.server_timeout_s,
            code=args.server_code,
        )
        startup = server.startup()
        print(f"[{setting.name}] server ready in {server.ready_s:.1f} s ({start} start): {startup}", flush=True)
        try:
            for api in [a for a in args.api if a != "inprocess"]:
                for rate, duration in args.rates:
                    duration = args.duration if duration is None else duration
                    if not clock.fits(duration + args.max_drain_s + 10.0):
                        print(f"[{setting.name}] time budget spent: {api} rate {rate:g} not run", flush=True)
                        continue
                    result = run_trace_api(server, api, setting, n, size, args, rate=rate, duration=duration)
                    row = {
                        **base_row,
                        # The server ran another tree's code: its commit, not this checkout's.
                        **({"engine_commit": args.server_commit} if args.server_code else {}),
                        **key,
                        "api": api,
                        "start": start,
                        "bank": args.bank,
                        "prefix_cache": engine.enable_prefix_caching,  # the preset's: the server runs it
                        "server_ready_s": round(server.ready_s, 2),
                        "startup": startup,
                        "rate": rate,
                        "duration_s": duration,
                        "max_drain_s": args.max_drain_s,
                        "seed": args.seed,
                        "input_range": list(size.input_range),
                        "output_range": list(size.output_range),
                        "ranks": list(setting.ranks),
                        "modules": list(setting.modules),
                        "n_asked": setting.n,
                        "slots": setting.slots,
                        "paged": n > setting.slots,
                        "max_batch": size.engine.max_batch,
                        "token_budgets": list(size.engine.token_budgets),
                        "client_workers": args.client_workers,
                        **result,
                    }
                    print(json.dumps({k: row[k] for k in _API_PRINTED}), flush=True)
                    on_row(row)
        finally:
            server.stop()


_API_PRINTED = (
    "setting", "api", "start", "rate", "requests", "completed", "unfinished", "served_req_s",
    "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "server_ready_s",
)  # fmt: skip
# Engine-side counters a client cannot see: None in the rows of --api http|grpc.
_ENGINE_FIELDS = (
    "steps", "preemptions", "prefill_tokens_per_step", "decode_tokens_per_step", "padding_share",
    "prefill_padding_share", "decode_padding_share", "page_ins", "compiles_during_run", "loop_ms_per_step",
)  # fmt: skip


def num_fitting_bytes(setting: Setting, size: Scale, lora: LoraConfig, host_bytes: int) -> int:
    """`num_fitting` without a pager: a{i}'s host copy is one slot at its rank class (jaxlora.adapters.registry)."""
    from jaxlora.adapters.registry import slot_nbytes

    sizes = np.array(
        [
            slot_nbytes(size.model, lora, jnp.dtype(size.dtype), rank=setting.ranks[i % len(setting.ranks)])
            for i in range(setting.n)
        ]
    )
    return int(np.searchsorted(np.cumsum(sizes), host_bytes, side="right"))


def run_trace_api(
    server, api: str, setting: Setting, n: int, size: Scale, args: argparse.Namespace, *, rate: float, duration: float
) -> dict:
    """One open-loop run of the trace through the server; the same requests `run_trace` submits."""
    from benchmarks.serving.clients import Job, run_workers

    trace = make_trace(
        n=n,
        alpha=args.alpha,
        rate=rate,
        cv=args.cv,
        duration_s=duration,
        input_range=size.input_range,
        output_range=size.output_range,
        seed=args.seed,
    )
    rng = np.random.default_rng(args.seed + 1)
    prompts = [tuple(rng.integers(0, size.model.vocab_size, r.prompt_len).tolist()) for r in trace]
    jobs = [
        Job(index=i, arrival_s=r.arrival_s, adapter=f"a{r.adapter}", prompt_ids=p, max_tokens=r.output_len)
        for i, (r, p) in enumerate(zip(trace, prompts))
    ]
    target = server.base_url if api == "http" else server.grpc_target
    t0, seen = run_workers(api, target, jobs, workers=args.client_workers, timeout_s=duration + args.max_drain_s)
    lines, token_times = [], []
    for job, r, s in zip(jobs, trace, seen):
        line = _Timeline(arrival=t0 + job.arrival_s, prompt_len=r.prompt_len, output_len=r.output_len)
        line.first, line.last, line.tokens = s.first, s.last, s.tokens
        if s.error is not None:
            line.rejected = s.error
        elif s.reason is not None:
            line.finished = s.finished
            line.reason = FinishReason.LENGTH if s.reason == "length" else FinishReason.STOP
        lines.append(line)
        token_times.extend(s.token_times)
    token_times.sort()
    t_close = time.perf_counter()
    counts = dict.fromkeys(("steps", "preemptions", "compiles", "prefill_tokens", "prefill_slots"), 0)
    counts.update(decode_tokens=0, decode_slots=0)
    lag = [s.sent - (t0 + j.arrival_s) for j, s in zip(jobs, seen) if s.sent is not None]
    row = summarize(lines, token_times, counts, t_close=t_close, lag_s=lag)
    row.update(dict.fromkeys(_ENGINE_FIELDS))
    errors = sorted({s.error for s in seen if s.error})
    row["errors"] = errors[:5]
    return row


def split_every_group() -> None:
    """Makes every pallas module group run as split shrink + per-row expand launches in this process."""
    for table in tuning.GROUP_TABLES.values():
        for rank_bucket, rows in table.items():
            table[rank_bucket] = {t: dict(knobs, impl="split") for t, knobs in rows.items()}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    path = args.out / RESULTS
    if args.render:
        write_results(json.loads(path.read_text()), args.out)
        print(f"rendered {args.out / 'serving.md'}", flush=True)
        return
    if set(args.api) != {"inprocess"}:
        main_servers(args, argv)
        return
    clock = _Clock(args.budget_s)
    commit = args.engine_commit or engine_commit()

    size = scale(args.tiny, args.model)
    if args.budgets:  # finer budgets: less padding, one more compile at set-up each
        size = dataclasses.replace(
            size, engine=dataclasses.replace(size.engine, token_budgets=tuple(sorted(set(args.budgets))))
        )
    is_s70 = s70.NAME in args.settings
    if is_s70 and len(args.settings) > 1:
        raise SystemExit(f"--settings {s70.NAME} runs alone: it serves its own 70B-shape FP8 model")
    if is_s70:
        size = dataclasses.replace(
            size, model=s70.model_config(args.tiny), engine=s70.engine_config(size.engine, args.tiny)
        )
    dev = jax.devices()[0]
    backend = args.backend or ("pallas" if dev.platform == "gpu" else "xla")
    if args.lora_groups == "split":
        split_every_group()
    print(
        f"device {dev.device_kind}, jax {jax.__version__}, engine {ENGINE_KIND} at {commit}, "
        f"model {size.model.name}, LoRA backend {backend}",
        flush=True,
    )
    previous = json.loads(path.read_text())["rows"] if args.merge and path.exists() else []
    if is_s70:
        model = s70.base_model(size.model, size.dtype)
    else:
        model = random_model(size.model, dtype=jnp.dtype(size.dtype), fused=True)  # the serving layout
    jax.block_until_ready(model.params)
    rates = s70.measure(args.tiny) if is_s70 else None
    command = "python -m benchmarks.serving.trace " + " ".join(argv)
    base_row = {
        "api": "inprocess",
        "start": None,
        "device": str(dev.device_kind),
        "engine_commit": commit,
        "model": size.model.name,
        "lora_backend": backend,
        "lora_groups": args.lora_groups,
        "command": command,
        "weights": model.quantization.value
        if model.quantization is not None
        else {"float32": "f32"}.get(size.dtype, "bf16"),
    }
    new_rows: list[dict] = []
    not_run: list[str] = []
    payload = {
        "device": str(dev.device_kind),
        "jax_version": jax.__version__,
        "engine_commit": commit,
        "rows": previous,
        "not_run": not_run,
    }

    def on_row(row: dict) -> None:  # results after every run: a cut run keeps what it measured
        if not any(r is row for r in new_rows):  # a row comes again with its decode-step probe
            new_rows.append(row)
        if rates is not None:
            row.update(s70.bound(row, size.model, rates))
        payload["rows"] = merge_rows(previous, new_rows)
        write_results(payload, args.out, plot=False)

    for name in args.settings:
        if not clock.fits(args.setup_s + args.duration + args.max_drain_s):
            print(f"time budget spent: setting {name} not run", flush=True)
            not_run.append(name)
            continue
        setting = settings(args.tiny)[name]
        if args.slots is not None:
            setting = dataclasses.replace(setting, slots=args.slots)
        run_setting(
            setting,
            model,
            size,
            args,
            backend=backend,
            clock=clock,
            previous=previous,
            base_row=base_row,
            on_row=on_row,
            not_run=not_run,
        )
        gc.collect()  # the setting's engine (KV cache), bank and pinned host copies go before the next
        live = sum(a.nbytes for a in jax.live_arrays())  # the next setting needs the KV cache's room
        print(f"live arrays after {name}: {live / 2**30:.2f} GiB", flush=True)
    payload["seconds"] = round(time.perf_counter() - clock.start, 1)
    write_results(payload, args.out)
    print(f"wrote {path} ({len(new_rows)} new rows)", flush=True)


def main_servers(args: argparse.Namespace, argv: list[str]) -> None:
    """--api with http or grpc: the in-process runs first in a child process (when asked for), then
    per setting a `jaxlora serve` subprocess; this process's JAX stays on the CPU, so the servers
    find the GPU's memory free."""
    import tempfile

    from benchmarks.serving import server_api as serving_api

    jax.config.update("jax_platforms", "cpu")
    clock = _Clock(args.budget_s)
    if "inprocess" in args.api:
        child = _argv_without_api(argv) + ["--api", "inprocess"] + ([] if args.merge else ["--merge"])
        budget = args.inprocess_budget_s or (args.budget_s / 2 if args.budget_s else None)
        child += [] if budget is None else ["--budget-s", f"{budget:.0f}"]  # the last --budget-s wins
        print(f"in-process runs: python -m benchmarks.serving.trace {' '.join(child)}", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.serving.trace", *child], check=True)
        args.merge = True
    commit = args.engine_commit or engine_commit()
    size = scale(args.tiny, args.model)
    if args.budgets:
        size = dataclasses.replace(
            size, engine=dataclasses.replace(size.engine, token_budgets=tuple(sorted(set(args.budgets))))
        )
    device = serving_api.gpu_name()
    backend = args.backend or ("pallas" if device else "xla")
    device = device or str(jax.devices()[0].device_kind)
    path = args.out / RESULTS
    previous = json.loads(path.read_text())["rows"] if args.merge and path.exists() else []
    base_row = {
        "device": device,
        "engine_commit": commit,
        "model": size.model.name,
        "lora_backend": backend,
        "lora_groups": args.lora_groups,
        "command": "python -m benchmarks.serving.trace " + " ".join(argv),
    }
    new_rows: list[dict] = []
    payload = {"device": device, "jax_version": jax.__version__, "engine_commit": commit, "rows": previous}

    def on_row(row: dict) -> None:
        new_rows.append(row)
        payload["rows"] = merge_rows(previous, new_rows)
        write_results(payload, args.out, plot=False)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxlora-serving-") as tmp:
        work = args.work_dir or Path(tmp)
        t0 = time.perf_counter()
        model_folder = serving_api.write_model_folder(
            size.model, size.dtype, word_tokenizer(size.model.vocab_size), work / "model"
        )
        print(f"model folder written in {time.perf_counter() - t0:.1f} s: {model_folder}", flush=True)
        for name in args.settings:
            setting = settings(args.tiny)[name]
            if args.slots is not None:
                setting = dataclasses.replace(setting, slots=args.slots)
            if not clock.fits(args.setup_s + args.duration + args.max_drain_s):
                print(f"time budget spent: setting {name} not run through the server", flush=True)
                continue
            run_setting_api(
                setting,
                size,
                args,
                backend=backend,
                work=work,
                model_folder=model_folder,
                base_row=base_row,
                on_row=on_row,
                clock=clock,
            )
    payload["seconds"] = round(time.perf_counter() - start, 1)
    write_results(payload, args.out)
    print(f"wrote {args.out / RESULTS} ({len(new_rows)} new rows)", flush=True)


def _argv_without_api(argv: list[str]) -> list[str]:
    out, skipping = [], False
    for a in argv:
        if a == "--api":
            skipping = True
            continue
        if skipping and a in APIS:
            continue
        skipping = False
        out.append(a)
    return out


if __name__ == "__main__":
    main()
