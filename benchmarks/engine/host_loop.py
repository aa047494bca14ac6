"""Does the engine loop keep the device busy? Host time per step against device time per step.

The real `Engine` runs closed loop: `batch` requests in flight at all times (a finished request is
replaced by a new one before the next step), every row on its own adapter when `distinct` equals
the batch (row i on adapter i % distinct; 0: base model, bank present). Prompts are random ids of
`--prompt-len` tokens; each request generates a length drawn uniformly in [gen_len / 2, 3 gen_len /
2], so finishes are staggered: once the batch is full, a step decodes every row and, about every
gen_len / batch steps, prefills a new prompt alongside (token budgets batch and batch + prompt_len).
The model has random weights: the Llama-2-7B shape in bf16 on GPU (`--layers` keeps its first
layers only), a toy model with `--tiny` (CPU).

Per case, over `--steps` steps after `--warmup-steps`:
  host_ms_per_step   `Engine.stats()["host"]` per dispatched step (jaxlora.engine.host_timing):
                     schedule, inputs, dispatch, stream, and host_ms (all four: everything but the
                     wait for the previous step's ids);
  wait_ms_per_step   time the host blocked on the previous step's ids;
  wall_ms_per_step   the loop's wall time per step (host + wait + this driver's top-ups);
  device_step_ms     one decode step of this batch replayed back to back on the device, the same
                     packed inputs every call (no host work between calls): the device's time;
  dispatch_probe     host ms of one dispatch while two steps are queued on the device, for the step's
                     inputs as one packed int32 array (`packed_step`, what the engine sends) and as
                     the ~16 separate host arrays of the unpacked step (`ragged_step`): whether a
                     host->device copy of the inputs waits behind queued device work; and "idle",
                     the packed dispatch with nothing queued (the call's own host cost: when it is
                     as long as the queued one, the host is launching kernels, not waiting);
  profile            from a jax.profiler trace of `--profile-steps` loop steps: each step's device
                     time ("XLA Modules" line of the GPU plane) and the device idle gap between
                     consecutive steps, plus the host->device copies per step. Needs a GPU plane
                     in the trace: on CPU the entry says it is not available.
`--bank unified` runs the same loop on the unified bank (adapters at their rank in the KV pool's
pages, `jaxlora.adapters.UnifiedPager`, paged in by the loop's first requests); the padded bank's
adapters are drawn into their slots for good.
The loop must compile nothing after warm-up (`compiles_after_warmup` is recorded and checked).
`token_digest` hashes every token id the loop streamed (warm-up and measured steps): two runs of
the same case and seed that compute the same agree on it (e.g. under different XLA_FLAGS).

    python -m benchmarks.engine.host_loop --tiny --out /tmp/host_loop       # CPU, seconds
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python -m benchmarks.engine.host_loop \\
        --out benchmarks/results/engine/host_loop                                 # H200

Writes OUT/host_loop.json, rewritten after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import hashlib
import json
import math
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, TINY, adapter_name, random_bank, word_tokenizer
from benchmarks.engine.paging import pool_adapters, register_copies, weight_pool
from jaxlora.adapters import ResidentBank, UnifiedPager
from jaxlora.config import TARGET_MODULES, LoraBank, LoraConfig
from jaxlora.engine.compiles import backend_compiles, check_no_compiles
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.engine.host_timing import per_step
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.engine.runner import Runner, ragged_step
from jaxlora.engine.step_inputs import HostInputs
from jaxlora.kernels import CONCURRENT_MIN_TOKENS, KernelConfig
from jaxlora.lora.unified_layout import adapter_layout
from jaxlora.model.params import random_model

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    batch: int
    distinct: int

    @classmethod
    def parse(cls, text: str) -> Case:
        """ "BATCH:DISTINCT", e.g. "64:64"."""
        batch, distinct = (int(x) for x in text.split(":"))
        if batch < 1 or not 0 <= distinct <= batch:
            raise ValueError(f"case {text!r}: need batch >= 1 and 0 <= distinct <= batch")
        return cls(batch=batch, distinct=distinct)

    @property
    def label(self) -> str:
        return f"B={self.batch} d={self.distinct}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    tiny: bool
    cases: tuple[Case, ...]
    layers: int | None
    backend: str
    rank: int
    prompt_len: int
    gen_len: int
    steps: int
    warmup_steps: int
    replay_steps: int
    profile_steps: int
    probe_reps: int
    one_budget: bool = False
    seed: int = 0
    concurrent_min_tokens: int = CONCURRENT_MIN_TOKENS
    prefix_caching: bool = True
    bank: str = LoraBank.PADDED


# -- the closed loop ------------------------------------------------------------------------------


class ClosedLoop:
    """Keeps `batch` requests in flight on `engine`: every finished one is replaced at once."""

    def __init__(self, engine: Engine, case: Case, opts: Options) -> None:
        self.engine, self.case, self.opts = engine, case, opts
        self.rng = np.random.default_rng(opts.seed)
        self.submitted = 0
        self.in_flight = 0
        # Every streamed token id, in step order: runs that must compute the same (the same seed
        # under different XLA flags) compare digests.
        self.digest = hashlib.sha256()

    def fill(self) -> None:
        while self.in_flight < self.case.batch:
            self._submit()

    def _submit(self) -> None:
        o, i = self.opts, self.submitted
        vocab = self.engine.model.config.vocab_size
        gen = int(self.rng.integers(max(1, o.gen_len // 2), o.gen_len + o.gen_len // 2 + 1))
        self.engine.submit(
            GenerationRequest(
                request_id=f"q{i}",
                prompt_ids=self.rng.integers(0, vocab, o.prompt_len).tolist(),
                adapter=adapter_name(i % self.case.distinct) if self.case.distinct else None,
                sampling=SamplingParams(max_tokens=gen),
            ),
            stream=False,  # the loop reads the step's outputs, not the handles
        )
        self.submitted += 1
        self.in_flight += 1

    def run(self, steps: int) -> None:
        """`steps` engine steps that dispatch, topping the batch up after each."""
        until = self.engine.stats()["steps"] + steps
        while self.engine.stats()["steps"] < until:
            outputs = self.engine.step()
            for o in sorted(outputs, key=lambda o: o.request_id):
                self.digest.update(f"{o.request_id}:{o.token_ids};".encode())
            self.in_flight -= sum(o.finished for o in outputs)
            self.fill()


def measure_loop(loop: ClosedLoop, steps: int) -> dict:
    engine = loop.engine
    s0 = engine.stats()
    t0 = time.perf_counter()
    loop.run(steps)
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    n = s1["steps"] - s0["steps"]
    host = per_step(s0["host"], s1["host"])
    return {
        "steps": n,
        "host_ms_per_step": {k: host[k] for k in ("schedule_ms", "inputs_ms", "dispatch_ms", "stream_ms", "host_ms")},
        "wait_ms_per_step": host["wait_ms"],
        "wall_ms_per_step": round(wall / n * 1e3, 4),
        "decode_tokens_per_step": round((s1["decode_tokens"] - s0["decode_tokens"]) / n, 2),
        "prefill_tokens_per_step": round((s1["prefill_tokens"] - s0["prefill_tokens"]) / n, 2),
        "padded_tokens_per_step": round((s1["padded_tokens"] - s0["padded_tokens"]) / n, 2),
        "generated_tokens_per_s": round((s1["generated_tokens"] - s0["generated_tokens"]) / wall, 1),
    }


# -- the profile ----------------------------------------------------------------------------------


def device_intervals(trace_dir: str) -> dict | None:
    """From the xplane files under trace_dir: {"steps": [(start_ns, end_ns)] of each run of the
    engine's step on the first GPU ("XLA Modules" line), "h2d": [(start_ns, end_ns)] of host->device
    copies on its streams, "ops": the other stream events' spans, "names": their names, "lines": the
    GPU plane's line names}; None when the trace has no GPU plane (CPU)."""
    from jax.profiler import ProfileData

    for path in sorted(glob.glob(trace_dir + "/**/*.xplane.pb", recursive=True)):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU:0"):
                continue
            lines = list(plane.lines)
            steps, h2d, ops, names = [], [], [], []
            for line in lines:
                for ev in line.events:
                    span = (ev.start_ns, ev.start_ns + ev.duration_ns)
                    if line.name == "XLA Modules" and "packed_step" in ev.name:
                        steps.append(span)
                    elif "Stream" in line.name and ("MemcpyH2D" in ev.name or "MemcpyH2D" in line.name):
                        h2d.append(span)
                    elif "Stream" in line.name:
                        ops.append(span)
                        names.append((ev.name, ev.duration_ns))
            return {
                "steps": sorted(steps),
                "h2d": sorted(h2d),
                "ops": sorted(ops),
                "names": names,
                "lines": [ln.name for ln in lines],
            }
    return None


def gaps_summary(steps: list[tuple[float, float]], h2d: list[tuple[float, float]]) -> dict:
    """Device step time and the idle gap between consecutive steps (ms), and host->device copies per
    step, from (start_ns, end_ns) intervals sorted by start."""
    if len(steps) < 2:
        raise ValueError(f"need at least two steps in the trace, got {len(steps)}")
    durations = np.array([e - s for s, e in steps]) / 1e6
    gaps = np.array([max(0.0, s2 - e1) for (_, e1), (s2, _) in zip(steps, steps[1:])]) / 1e6
    window = (steps[-1][1] - steps[0][0]) / 1e6
    return {
        "steps": len(steps),
        "device_step_ms_mean": round(float(durations.mean()), 4),
        "gap_ms_mean": round(float(gaps.mean()), 4),
        "gap_ms_median": round(float(np.median(gaps)), 4),
        "gap_ms_max": round(float(gaps.max()), 4),
        "idle_share": round(float(gaps.sum() / window), 4),
        "h2d_copies_per_step": round(len(h2d) / len(steps), 2),
    }


def profile_loop(loop: ClosedLoop, steps: int) -> dict:
    trace_dir = tempfile.mkdtemp(prefix="host_loop_trace_")
    jax.profiler.start_trace(trace_dir)
    try:
        loop.run(steps)
        jax.block_until_ready(loop.engine.runner.last_ids)
    finally:
        jax.profiler.stop_trace()
    host_events = host_event_summary(trace_dir, steps)
    found = device_intervals(trace_dir)
    if found is None:
        return {"available": False, "reason": "the trace has no GPU plane (device time is only traced on GPU)"}
    kernels = {
        **kernel_summary(found["ops"], steps),
        "top_ops": top_ops(found["names"], steps),
        "host_events": host_events,
    }
    if len(found["steps"]) < 2:
        return {
            "available": False,
            "reason": f"fewer than two steps on the XLA Modules line; lines {found['lines'][:12]}",
            **kernels,
        }
    return {
        "available": True,
        **gaps_summary(found["steps"], found["h2d"]),
        **kernels,
        "gpu_lines": found["lines"][:12],
    }


def host_event_summary(trace_dir: str, steps: int, top: int = 25) -> list[tuple[str, float, float]]:
    """The host threads' traced events with the most time: (name, ms a step, calls a step). Where
    a dispatch's host time goes (launches, buffer handling, Python)."""
    from jax.profiler import ProfileData

    totals: dict[str, list[float]] = {}
    for path in sorted(glob.glob(trace_dir + "/**/*.xplane.pb", recursive=True)):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/host:"):
                continue
            for line in plane.lines:
                for ev in line.events:
                    name = ev.name.split("#")[0][:80]  # TraceMe names carry "#key=value#" args
                    entry = totals.setdefault(name, [0.0, 0.0])
                    entry[0] += ev.duration_ns / 1e6
                    entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, round(ms / steps, 4), round(n / steps, 1)) for name, (ms, n) in ranked]


def top_ops(names: list[tuple[str, int]], steps: int, top: int = 20) -> list[tuple[str, float, float]]:
    """The GPU ops with the most time over the traced loop: (name, ms a step, launches a step). What
    a step spends its time on (a copy of the KV pool would lead the list)."""
    totals: dict[str, list[float]] = {}
    for name, ns in names:
        entry = totals.setdefault(name[:80], [0.0, 0.0])
        entry[0] += ns / 1e6
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, round(ms / steps, 4), round(n / steps, 2)) for name, (ms, n) in ranked]


def kernel_summary(ops: list[tuple[float, float]], steps: int) -> dict:
    """Kernels and copies on the GPU's streams over the traced loop: how many a step, and the time
    at least one ran (the device's real busy time, free of launch gaps). The profiler runs the
    step op by op (XLA leaves command buffers while tracing), so the count is the launch count."""
    if not ops:
        return {"kernels_per_step": 0}
    busy, end = 0.0, ops[0][0]
    for s, e in ops:  # sorted by start: the union of the intervals
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    window = ops[-1][1] - ops[0][0]
    return {
        "kernels_per_step": round(len(ops) / steps, 1),
        "busy_ms_per_step": round(busy / steps / 1e6, 4),
        "busy_share": round(busy / window, 4),
        "window_ms_per_step": round(window / steps / 1e6, 4),
    }


# -- the device step alone, and the dispatch probe --------------------------------------------------


class DecodeCapture:
    """Wraps the engine runner's `pack` to keep a host copy of the last step that decodes every row
    (and nothing else): the inputs the replay and the probe send."""

    def __init__(self, runner, batch: int) -> None:
        self.inputs: HostInputs | None = None
        pack = runner.pack

        def capturing(plan, pages):
            inputs = pack(plan, pages)
            if plan.num_decode_tokens == batch == plan.num_tokens:  # decode tokens only
                self.inputs = dataclasses.replace(inputs, buffer=inputs.buffer.copy())
            return inputs

        runner.pack = capturing


def time_replay(runner, bank, inputs: HostInputs, steps: int) -> float:
    """Milliseconds per step of the engine's step on the same packed inputs, already on the device,
    `steps` calls back to back (ids and page pool fed through; the writes land where they did)."""
    packed = jax.device_put(inputs.buffer, runner.input_sharding, may_alias=False)
    bank = bank if inputs.has_adapter else None
    for _ in range(2):
        runner.dispatch_packed(bank, packed, inputs.layout)
    jax.block_until_ready(runner.last_ids)
    compiles = backend_compiles()
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = runner.dispatch_packed(bank, packed, inputs.layout)
    ids.block_until_ready()
    seconds = time.perf_counter() - t0
    check_no_compiles(compiles, "the replayed steps")
    return seconds / steps * 1e3


def dispatch_probe(runner, bank, inputs: HostInputs, reps: int) -> dict:
    """Host ms of one dispatch with two steps queued on the device, for the packed inputs (one
    device_put, then `packed_step`: what the engine does) and for the same fields as separate host
    arrays (`ragged_step`, each array a jit argument and a copy of its own). Medians and maxima."""
    fields = jax.tree.map(np.asarray, inputs.layout.unpack(jnp.asarray(inputs.buffer)))
    for name in ("prompt_len", "reset"):  # the sampler's token history reads these, not the step
        del fields[name]
    step_bank = bank if inputs.has_adapter else None
    static = dict(runner._static)

    def fields_dispatch():
        ids, runner.kv = ragged_step(runner.params, step_bank, runner.kv, last_ids=runner.last_ids, **fields, **static)
        runner.last_ids = ids

    def packed_dispatch():
        runner.dispatch(bank, inputs)

    for fn in (fields_dispatch, fields_dispatch, packed_dispatch):  # compiles the unpacked step once
        fn()
    jax.block_until_ready(runner.last_ids)
    compiles = backend_compiles()
    times: dict[str, list[float]] = {"packed": [], "fields": [], "idle": []}
    for _ in range(reps):
        t0 = time.perf_counter()  # the device is idle here: the call's own host cost
        packed_dispatch()
        times["idle"].append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(runner.last_ids)
        for name, fn in (("fields", fields_dispatch), ("packed", packed_dispatch)):
            packed_dispatch()
            packed_dispatch()  # two steps queued ahead of the timed dispatch
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
            jax.block_until_ready(runner.last_ids)
    check_no_compiles(compiles, "the probed dispatches")
    return {
        f"{name}_ms_{stat}": round(float(f(v)), 4)
        for name, v in times.items()
        for stat, f in (("median", np.median), ("max", np.max))
    }


# -- one case -------------------------------------------------------------------------------------


def budgets(case: Case, opts: Options) -> tuple[int, ...]:
    """Decode only, and decode with one prompt (or the latter alone: one compile fewer)."""
    both = case.batch + opts.prompt_len
    return (both,) if opts.one_budget else (case.batch, both)


def build_engine(model, tokenizer, case: Case, opts: Options) -> Engine:
    """The padded bank: every adapter drawn into its device slot for good (`ResidentBank`). The
    unified bank: the adapters registered with a `UnifiedPager` at their rank, paged into the KV
    pool (which gets their pages on top of the sequences') by the loop's first requests."""
    cfg = model.config
    max_seq_len = opts.prompt_len + opts.gen_len + opts.gen_len // 2 + 1
    pages_per_seq = -(-max_seq_len // PAGE_SIZE)
    num_adapters = max(1, case.distinct)  # d = 0 still has a bank: base rows run the bank-free step
    lora = LoraConfig(max_slots=num_adapters + 1, max_rank=opts.rank, backend=opts.backend, bank=opts.bank)
    num_pages = case.batch * pages_per_seq * 21 // 20 + 1  # every row at full length, + the reserve
    if lora.bank is LoraBank.UNIFIED:
        ranks = dict.fromkeys(TARGET_MODULES, opts.rank)
        num_pages += num_adapters * adapter_layout(ranks, cfg, lora, PAGE_SIZE).num_pages
    config = EngineConfig(
        max_batch=case.batch,
        max_seq_len=max_seq_len,
        token_budgets=budgets(case, opts),
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        max_new_tokens_limit=opts.gen_len + opts.gen_len // 2,
        max_queue=4 * case.batch,
        lora=lora,
        dtype=jnp.dtype(model.dtype).name,
        enable_prefix_caching=opts.prefix_caching,
        kernels=KernelConfig(concurrent_min_tokens=opts.concurrent_min_tokens),
    )
    if lora.bank is LoraBank.UNIFIED:
        pager = UnifiedPager(cfg, lora, page_size=PAGE_SIZE, dtype=model.dtype)
        pool = weight_pool(cfg, opts.rank, TARGET_MODULES, min(4, num_adapters), seed=opts.seed)
        register_copies(pager, pool_adapters(pool, opts.rank, TARGET_MODULES), num_adapters)
        return Engine(model, tokenizer, config, pager)
    bank = random_bank(cfg, lora, num_adapters, model.dtype, seed=opts.seed)
    source = ResidentBank(bank, [adapter_name(i) for i in range(num_adapters)])
    return Engine(model, tokenizer, config, source)


def run_case(model, tokenizer, case: Case, opts: Options) -> dict:
    t0 = time.perf_counter()
    engine = build_engine(model, tokenizer, case, opts)
    engine.warmup()
    setup_s = time.perf_counter() - t0
    capture = DecodeCapture(engine.runner, case.batch)
    loop = ClosedLoop(engine, case, opts)
    loop.fill()
    loop.run(opts.warmup_steps)
    result: dict = {
        "batch": case.batch,
        "distinct": case.distinct,
        "bank": opts.bank.value,
        "setup_s": round(setup_s, 2),
    }
    result.update(measure_loop(loop, opts.steps))
    if opts.profile_steps:
        result["profile"] = profile_loop(loop, opts.profile_steps)
    result["token_digest"] = loop.digest.hexdigest()[:16]
    result["compiles_after_warmup"] = engine.compiles_after_warmup
    if engine.compiles_after_warmup:
        raise RuntimeError(f"{case.label}: the loop compiled {engine.compiles_after_warmup} program(s) after warm-up")
    if capture.inputs is None:
        raise RuntimeError(f"{case.label}: no step decoded every row; raise --steps or --gen-len")
    # From here the page pool gets replayed writes: the requests still in flight are abandoned.
    bank = engine.pager.bank
    result["device_step_ms"] = round(time_replay(engine.runner, bank, capture.inputs, opts.replay_steps), 4)
    result["pool_copies"] = pool_copies(engine.runner, bank, capture.inputs)
    if opts.probe_reps:
        result["dispatch_probe"] = dispatch_probe(engine.runner, bank, capture.inputs, opts.probe_reps)
    return result


_COPY = re.compile(r"= \w+\[([\d,]*)\]\S* copy\(")


def pool_copies(runner: Runner, bank: object, inputs: HostInputs) -> dict:
    """Copies of the KV pool (whole, one layer, or the kernels' [L, N * E] view of it) in the
    compiled decode step, as this backend compiles it: a unified bank's adapter reads must be ordered
    around the in-place KV write, and a step that copies the pool instead pays for its bytes on every
    layer. `large`: every copy at least one pool layer large (gathers of attention's keys included),
    its first instructions whole, for the reader."""
    lora = inputs.has_adapter
    text = runner._lower(bank, jax.device_put(inputs.buffer), inputs.layout, lora).compile().as_text()
    shape = tuple(runner.kv.k.shape)
    flat = (shape[0], math.prod(shape[1:]))
    copies = []  # (instruction, dims)
    for line in text.splitlines():
        m = _COPY.search(line)
        if m:
            copies.append((line.strip()[:300], tuple(int(d) for d in m.group(1).split(",") if d)))
    pool = [line for line, d in copies if d in (shape, shape[1:], flat)]
    large = [line for line, d in copies if math.prod(d) >= math.prod(shape[1:])]
    return {"count": len(pool), "pool_shape": list(shape), "large": len(large), "first_large": large[:4]}


# -- driver ---------------------------------------------------------------------------------------


def model_config(opts: Options):
    cfg = TINY if opts.tiny else LLAMA2_7B
    if opts.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=opts.layers, name=f"{cfg.name}, {opts.layers} layers")
    return cfg


def run(opts: Options, out: Path, command: str) -> dict:
    cfg = model_config(opts)
    dtype = jnp.float32 if opts.tiny else jnp.bfloat16
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}, model {cfg.name}", flush=True)
    model = random_model(cfg, dtype=dtype, seed=opts.seed, fused=True)  # the serving layout
    jax.block_until_ready(model.params)
    payload = {
        "device": str(dev.device_kind),
        "jax_version": jax.__version__,
        "model": cfg.name,
        "num_layers": cfg.num_layers,
        "command": command,
        "options": {k: v for k, v in dataclasses.asdict(opts).items() if k != "cases"},
        "cases": [],
        "failed": [],
    }
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(cfg.vocab_size)
    for case in opts.cases:
        print(f"[{case.label}]", flush=True)
        try:
            row = run_case(model, tokenizer, case, opts)
        except Exception as e:  # one broken case must not lose the others
            payload["failed"].append({"case": case.label, "reason": f"{type(e).__name__}: {e}"[:500]})
            print(f"  FAILED {type(e).__name__}: {e}", flush=True)
        else:
            payload["cases"].append(row)
            print("  " + json.dumps(row), flush=True)
        (out / "host_loop.json").write_text(json.dumps(payload, indent=1) + "\n")
        gc.collect()
    return payload


def parse_args(argv: list[str] | None) -> tuple[Options, Path]:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="toy model on the CPU (seconds)")
    p.add_argument("--out", type=Path, required=True, help="folder for host_loop.json")
    p.add_argument("--cases", nargs="+", default=None, help="BATCH:DISTINCT, default 64:64 256:256 (tiny: 8:4)")
    p.add_argument("--layers", type=int, default=None, help="keep the model's first N layers (compile/memory)")
    p.add_argument("--backend", default=None, help="LoRA backend (default pallas on GPU, xla with --tiny)")
    p.add_argument("--rank", type=int, default=None, help="adapter rank (default 16; 4 with --tiny)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32 (tiny: 8)")
    p.add_argument("--gen-len", type=int, default=None, help="mean generated tokens, default 256 (tiny: 16)")
    p.add_argument("--steps", type=int, default=None, help="measured loop steps, default 200 (tiny: 30)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default 60 (tiny: 10)")
    p.add_argument("--replay-steps", type=int, default=None, help="default 30 (tiny: 5)")
    p.add_argument("--profile-steps", type=int, default=None, help="traced loop steps, 0: no trace (default 30; 4)")
    p.add_argument("--probe-reps", type=int, default=None, help="dispatch probe pairs, 0: skip (default 20; 3)")
    p.add_argument(
        "--one-budget", action="store_true", help="compile one token budget, batch + prompt_len (CPU smoke runs)"
    )
    p.add_argument(
        "--concurrent-min-tokens",
        type=int,
        default=CONCURRENT_MIN_TOKENS,
        help="step programs of fewer tokens compile without CONCURRENT command-buffer scheduling (kernels.concurrent_min_tokens)",
    )
    p.add_argument(
        "--bank",
        choices=[LoraBank.PADDED.value, LoraBank.UNIFIED.value],
        default=LoraBank.PADDED.value,
        help="the device adapter bank (lora.bank): padded slots, or true-rank pages in the KV pool",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="run the engine without prefix caching (the prompts are random: it only costs host time)",
    )
    a = p.parse_args(argv)

    def pick(value, gpu, tiny):
        return value if value is not None else (tiny if a.tiny else gpu)

    opts = Options(
        tiny=a.tiny,
        cases=tuple(Case.parse(c) for c in (a.cases or (["8:4"] if a.tiny else ["64:64", "256:256"]))),
        layers=a.layers,
        backend=pick(a.backend, "pallas", "xla"),
        rank=pick(a.rank, 16, 4),
        prompt_len=pick(a.prompt_len, 32, 8),
        gen_len=pick(a.gen_len, 256, 16),
        steps=pick(a.steps, 200, 30),
        warmup_steps=pick(a.warmup_steps, 60, 10),
        replay_steps=pick(a.replay_steps, 30, 5),
        profile_steps=pick(a.profile_steps, 30, 4),
        probe_reps=pick(a.probe_reps, 20, 3),
        one_budget=a.one_budget,
        concurrent_min_tokens=a.concurrent_min_tokens,
        prefix_caching=not a.no_prefix_cache,
        bank=LoraBank(a.bank),
    )
    if opts.concurrent_min_tokens < 1:
        p.error(f"--concurrent-min-tokens {opts.concurrent_min_tokens} must be >= 1")
    if min(opts.steps, opts.replay_steps) < 1 or min(opts.warmup_steps, opts.profile_steps, opts.probe_reps) < 0:
        p.error("--steps and --replay-steps must be >= 1; --warmup-steps, --profile-steps, --probe-reps >= 0")
    return opts, a.out


def main(argv: list[str] | None = None) -> int:
    opts, out = parse_args(argv)
    command = shlex.join(["python", "benchmarks/engine/host_loop.py", *(sys.argv[1:] if argv is None else argv)])
    payload = run(opts, out, command)
    return 1 if payload["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
