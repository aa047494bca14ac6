"""Adapter paging on one GPU: many registered adapters, few device slots, page-ins overlapped with decoding.

S-LoRA's S1 setting on a Llama-2-7B-shape model (random bf16 weights): rank-8 adapters on q, k, v, o
(~17 MB each), 2,000 registered, 64 device slots, requests drawn with S-LoRA's power law
(`numpy.random.power(alpha)`: alpha 1 is uniform, 0.1 very skewed). A second setting puts rank-16
adapters on all seven modules (~80 MB each), as many as the host budget holds.

What is measured, per setting and exponent, on the real serving path (jaxlora.engine.Engine with
the real Pager; Pallas LoRA kernels and decode attention on GPU):
  - tokens/s of the engine serving all requests (submitted at once, continuous batching, prefill
    included), against the same engine and requests with every adapter resident (64 adapters
    registered for 64 slots, paged in before the run; requests mapped onto them);
  - engine step time: every step's wall time is attributed to the step it reads back (the engine
    runs one step behind, so a call blocks on the previous step), split by whether that step issued
    page-ins; `step_ms_*` are decode-only steps (no prefill call in them);
  - page-in latency and GB/s: one at a time (the pager's blocking `time_transfers` mode: copy +
    write of one adapter, nothing else in flight), and a burst of up to 16 in one stage + commit
    (copies in flight together, then one write call) as the pager issues them under load;
    against raw host->device bandwidth from pinned_host (1 GiB copies, and one adapter's size) and
    from pageable numpy.

Registration: a few random weight sets are drawn once and every registered adapter is a copy of one
of them (each registration still validates, packs and pins its own host buffer), on a few threads.

    python -m benchmarks.engine.paging                # H200: both settings -> benchmarks/results/engine/paging/paging.{json,md,png}
    python -m benchmarks.engine.paging --tiny         # CPU smoke run at toy size
    python -m benchmarks.engine.paging --setting s1 --registered 2000 --exponents 1 0.1
    python -m benchmarks.engine.paging --setting full --host-gb 60 --budget-s 900
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, TINY, word_tokenizer
from benchmarks.paths import results_dir
from jaxlora.adapters import HostMemory, Pager
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, LoraBackend, LoraConfig, ModelConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.model.params import random_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    name: str
    rank: int
    modules: tuple[str, ...]
    registered: int | None  # None: as many as half the free host memory holds (at most max_registered)
    slots: int  # usable slots; the bank has slots + 1 (slot 0 is the base model)
    rows: int
    requests: int
    new_tokens: int
    prompt_len: int
    max_registered: int = 2000


def settings(tiny: bool) -> dict[str, Setting]:
    if tiny:
        return {
            "s1": Setting(
                name="s1",
                rank=4,
                modules=ATTENTION_MODULES,
                registered=40,
                slots=7,
                rows=4,
                requests=24,
                new_tokens=6,
                prompt_len=8,
            ),
            "full": Setting(
                name="full",
                rank=4,
                modules=TARGET_MODULES,
                registered=None,
                slots=7,
                rows=4,
                requests=24,
                new_tokens=6,
                prompt_len=8,
                max_registered=30,
            ),
        }
    return {
        "s1": Setting(
            name="s1",
            rank=8,
            modules=ATTENTION_MODULES,
            registered=2000,
            slots=64,
            rows=64,
            requests=1024,
            new_tokens=32,
            prompt_len=32,
        ),
        "full": Setting(
            name="full",
            rank=16,
            modules=TARGET_MODULES,
            registered=None,
            slots=64,
            rows=64,
            requests=1024,
            new_tokens=32,
            prompt_len=32,
        ),
    }


# -- raw host->device bandwidth ---------------------------------------------------------------------


def h2d_gbps(nbytes: int, pinned: bool, reps: int = 10) -> float:
    """Median GB/s of one device_put of `nbytes` from pinned_host (or pageable numpy) to the device."""
    dev = jax.devices()[0]
    host = np.ones((nbytes // 2,), np.dtype(jnp.bfloat16))
    if pinned:
        host = jax.device_put(host, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
        jax.block_until_ready(host)
    target = jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(host, target))
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


def has_pinned_host() -> bool:
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


# -- the workload -----------------------------------------------------------------------------------


def adapter_pool(model: ModelConfig, setting: Setting, num: int = 8) -> list[dict]:
    """A few random weight sets; registered adapters share them (each registration still copies)."""
    return weight_pool(model, setting.rank, setting.modules, num)


def weight_pool(model: ModelConfig, rank: int, modules: tuple[str, ...], num: int, seed: int = 0) -> list[dict]:
    """`num` random weight sets of one rank: module -> (A [L, in, rank], B [L, rank, out]), float32."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(num):
        weights = {}
        for m in modules:
            d_in, d_out = model.module_shape(m)
            weights[m] = (
                rng.standard_normal((model.num_layers, d_in, rank), np.float32) * 0.01,
                rng.standard_normal((model.num_layers, rank, d_out), np.float32) * 0.01,
            )
        pool.append(weights)
    return pool


def pool_adapters(pool: list[dict], rank: int, modules: tuple[str, ...]) -> list[HostAdapter]:
    """The pool's weight sets as host adapters (named pool0, pool1, ...; registered under other names)."""
    return [HostAdapter(name=f"pool{i}", rank=rank, target_modules=modules, weights=w) for i, w in enumerate(pool)]


def register_all(pager: Pager, pool: list[dict], setting: Setting, num: int, threads: int | None = None) -> float:
    """Registers a0..a{num-1} (copies of the pool's weight sets) from a few threads; returns seconds."""
    return register_copies(pager, pool_adapters(pool, setting.rank, setting.modules), num, threads)


def register_copies(pager: Pager, adapters: list[HostAdapter], num: int, threads: int | None = None) -> float:
    """Registers a{i} as a copy of adapters[i % len(adapters)], i < num, from a few threads; returns seconds.

    `Pager.register` is thread-safe and its work (validate, pack, pin) is numpy and device copies
    that release the GIL, so threads overlap it.
    """

    def register(i: int) -> None:
        pager.register(f"a{i}", adapters[i % len(adapters)])  # registered under its own name

    threads = threads or min(8, os.cpu_count() or 1)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool_:
        list(pool_.map(register, range(num)))
    return time.perf_counter() - t0


def num_registered(setting: Setting, slot_bytes: int, host_bytes: int | None) -> int:
    """The setting's count, or as many as `host_bytes` (default: half the free memory) holds."""
    if host_bytes is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        host_bytes = int(0.5 * free)
    fit = int(host_bytes // slot_bytes)
    if setting.registered is not None:
        return min(setting.registered, fit)
    return min(setting.max_registered, fit)


def make_engine(model, setting: Setting, pager: Pager, backend: str) -> Engine:
    lora = pager.lora_config
    config = EngineConfig(
        max_batch=setting.rows,
        max_seq_len=setting.prompt_len + setting.new_tokens,
        token_budgets=tuple(sorted({setting.rows, 8 * setting.prompt_len})),
        max_new_tokens_limit=setting.new_tokens,
        max_queue=setting.requests + 1,
        lora=dataclasses.replace(lora, backend=backend),
        dtype=jnp.dtype(model.dtype).name,
        prefetch_adapters=setting.rows,
    )
    return Engine(model, word_tokenizer(model.config.vocab_size), config, pager)


def make_requests(setting: Setting, adapters: list[str], vocab: int, seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=rng.integers(0, vocab, setting.prompt_len).tolist(),
            adapter=name,
            sampling=SamplingParams(max_tokens=setting.new_tokens),
        )
        for i, name in enumerate(adapters)
    ]


@contextlib.contextmanager
def host_profile(engine: Engine):
    """Seconds the engine loop spends inside each call that matters for paging (and the one blocking
    read of sampled ids, which is the host waiting for the device): a host-bound loop shows little
    time in `device_get`."""
    totals: collections.Counter[str] = collections.Counter()
    targets = [
        (engine.pager, "stage"),
        (engine.pager, "commit"),
        (engine.pager, "prefetch"),
        (engine.runner, "step"),
        (jax, "device_get"),
    ]
    originals = [(obj, name, getattr(obj, name)) for obj, name in targets]
    for obj, name, fn in originals:

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - t0

        setattr(obj, name, timed)
    try:
        yield totals
    finally:
        for obj, name, fn in originals:
            if obj is jax:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # back to the class's method


def run_engine(engine: Engine, requests: list[GenerationRequest]) -> dict:
    """Serves `requests` (submitted at once) to the end; tokens/s and step times.

    The engine runs one step behind: call i dispatches step i and blocks on step i-1's ids, so
    call i's wall time is charged to step i-1, classified by whether step i-1 issued page-ins and
    whether it held a prefill call.
    """
    pager, stats = engine.pager, engine.stats
    before = stats()["generated_tokens"]
    for r in requests:
        engine.submit(r, stream=False)
    steps: list[tuple[bool, bool]] = []  # per dispatched step: (page-ins issued, prefill)
    seconds: list[float] = []  # wall time of the call that read each step back
    counts0 = stats()
    with host_profile(engine) as host:
        t_start = time.perf_counter()
        while engine.has_work():
            page_ins, prefills = pager.metrics.page_ins, stats()["prefill_tokens"]
            t0 = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - t0)
            steps.append((pager.metrics.page_ins > page_ins, stats()["prefill_tokens"] > prefills))
        total = time.perf_counter() - t_start
    counts = {k: stats()[k] - counts0[k] for k in ("steps", "prefill_tokens", "decode_tokens", "generated_tokens")}
    generated = stats()["generated_tokens"] - before
    expected = sum(r.sampling.max_tokens for r in requests)
    if generated != expected:
        raise RuntimeError(f"expected {expected} generated tokens, got {generated}")
    read_back = list(zip(steps[:-1], seconds[1:]))  # step i's time = call i+1's wall time

    def ms(paging: bool, prefill: bool = False) -> float | None:
        xs = [s for (p, pre), s in read_back if p == paging and pre == prefill]
        return round(float(np.mean(xs)) * 1e3, 3) if xs else None

    return {
        "tokens_per_s": generated / total,
        "seconds": total,
        "step_ms_paging": ms(True),
        "step_ms_no_paging": ms(False),
        "prefill_step_ms_paging": ms(True, True),
        "prefill_step_ms_no_paging": ms(False, True),
        "steps": len(steps),
        "steps_with_page_ins": sum(p for p, _ in steps),
        "decode_tokens_per_step": round(counts["decode_tokens"] / max(counts["steps"], 1), 2),
        "prefill_calls": sum(pre for _, pre in steps),
        "host_ms_per_step": {k: round(v / len(steps) * 1e3, 3) for k, v in sorted(host.items())},
    }


def timed_page_ins(pager: Pager, names: list[str]) -> tuple[float, float]:
    """p50 ms and GB/s of page-ins done one at a time (blocking), into slots not pinned."""
    pager.time_transfers = True
    start = len(pager.metrics.transfer_seconds)
    b0, s0 = pager.metrics.timed_bytes, pager.metrics.timed_seconds
    for name in names:
        pager.acquire(name)
        pager.commit()
        pager.release(name)
    pager.time_transfers = False
    samples = list(pager.metrics.transfer_seconds)[start:]
    if not samples:
        return float("nan"), float("nan")
    gbps = (pager.metrics.timed_bytes - b0) / (pager.metrics.timed_seconds - s0) / 1e9
    return float(np.median(samples)) * 1e3, gbps


def burst_page_ins(pager: Pager, names: list[str]) -> float:
    """GB/s of len(names) page-ins issued by ONE commit (all copies in flight at once, then the
    writes): their bytes over the wall time from the commit's start to the written bank being ready.
    `names` must be cold and no more than the slots."""
    if not names:
        return float("nan")
    jax.block_until_ready(pager.bank)
    for name in names:
        pager.acquire(name)
    t0 = time.perf_counter()
    pager.commit()
    jax.block_until_ready(pager.bank)
    seconds = time.perf_counter() - t0
    for name in names:
        assert pager.is_ready(name) is not None
        pager.release(name)
    return len(names) * pager.slot_nbytes / seconds / 1e9


def run_variant(
    setting: Setting,
    engine: Engine,
    requests: list[GenerationRequest],
    base_run: dict,
    *,
    registered: int,
    alpha: float,
    distinct: int,
    reg_s: float,
    pageable: Pager,
) -> dict:
    """One paged run of `requests`, then page-in timings on the same pager; one result row."""
    pager = engine.pager
    before = pager.metrics.snapshot()
    paged = run_engine(engine, requests)
    after = pager.metrics.snapshot()
    if engine.compiles_after_warmup:
        raise RuntimeError(f"the engine compiled {engine.compiles_after_warmup} times after warm-up")
    cold = [
        f"a{i}" for i in range(registered - 1, max(registered - 1 - 32, -1), -1) if pager.is_ready(f"a{i}") is None
    ][:16]
    p50_ms, gbps = timed_page_ins(pager, cold) if cold else (float("nan"), float("nan"))
    burst = [f"a{i}" for i in range(registered) if pager.is_ready(f"a{i}") is None]
    burst = burst[: min(pager.max_page_ins_per_commit, setting.slots)]
    burst_gbps = burst_page_ins(pager, burst)
    pageable_ms, pageable_gbps = timed_page_ins(pageable, [f"a{i}" for i in range(setting.slots + 1)])
    row = {
        "setting": setting.name,
        "rank": setting.rank,
        "modules": list(setting.modules),
        "adapter_MB": round(pager.slot_nbytes / 1e6, 2),
        "registered": registered,
        "slots": setting.slots,
        "registration_s": round(reg_s, 2),
        "host_GB_registered": round(registered * pager.slot_nbytes / 1e9, 2),
        "rows": setting.rows,
        "requests": setting.requests,
        "prompt_len": setting.prompt_len,
        "new_tokens": setting.new_tokens,
        "popularity_exponent": alpha,
        "distinct_adapters": distinct,
        "tokens_per_s": round(paged["tokens_per_s"], 1),
        "all_resident_tokens_per_s": round(base_run["tokens_per_s"], 1),
        "throughput_vs_resident": round(paged["tokens_per_s"] / base_run["tokens_per_s"], 4),
        "page_ins": after["page_ins"] - before["page_ins"],
        "prefetches": after["prefetches"] - before["prefetches"],
        "hits": after["hits"] - before["hits"],
        "misses": after["misses"] - before["misses"],
        "page_in_GBps": round(burst_gbps, 2),
        "page_in_burst_n": len(burst),
        "page_in_ms_p50": round(p50_ms, 3),
        "page_in_serial_GBps": round(gbps, 2),
        "page_in_wait_ms_p50": round(after["page_in_ms_p50"], 3),
        "page_in_ms_p50_pageable": round(pageable_ms, 3),
        "page_in_GBps_pageable": round(pageable_gbps, 2),
        "step_ms_paging": paged["step_ms_paging"],
        "step_ms_no_paging": paged["step_ms_no_paging"],
        "step_ms_all_resident": base_run["step_ms_no_paging"],
        "steps": paged["steps"],
        "steps_with_page_ins": paged["steps_with_page_ins"],
        "compiles_after_warmup": engine.compiles_after_warmup,
    }
    row.update(
        resident_prefill_calls=base_run["prefill_calls"],
        prefill_calls=paged["prefill_calls"],
        resident_steps=base_run["steps"],
        decode_tokens_per_step=paged["decode_tokens_per_step"],
        resident_decode_tokens_per_step=base_run["decode_tokens_per_step"],
        prefill_step_ms_paging=paged["prefill_step_ms_paging"],
        prefill_step_ms_no_paging=paged["prefill_step_ms_no_paging"],
        resident_prefill_step_ms=base_run["prefill_step_ms_no_paging"],
        host_ms_per_step=paged["host_ms_per_step"],
        resident_host_ms_per_step=base_run["host_ms_per_step"],
    )
    return row


def run_setting(
    setting: Setting,
    model,
    exponents: list[float],
    host_memory: str,
    backend: str,
    *,
    host_bytes: int | None = None,
    deadline: float = float("inf"),
    caps: tuple[int, ...] = (16,),
    prefetch: tuple[int, ...] | None = None,
    on_row=lambda row: None,
) -> list[dict]:
    """Rows for each exponent and pager variant (page-ins per commit x prefetch depth; the first
    variant is the default); stops before an exponent once time.perf_counter() passes `deadline`.
    Variants run one after the other on the same pager, each starting with what the last left
    resident."""
    prefetch = prefetch or (setting.rows,)
    cfg = model.config
    lora = LoraConfig(
        max_slots=setting.slots + 1, max_rank=setting.rank, target_modules=setting.modules, backend=backend
    )
    pool = adapter_pool(cfg, setting)
    rows = []
    pager = Pager(
        cfg,
        lora,
        dtype=model.dtype,
        host_memory=host_memory,
        host_capacity_bytes=host_bytes,
        max_page_ins_per_commit=max(caps),
    )  # compiles the writes of every smaller power of two too
    registered = num_registered(setting, pager.slot_nbytes, host_bytes)
    if registered < setting.slots + 1:
        print(
            f"[{setting.name}] skipped: the host budget holds {registered} adapters of "
            f"{pager.slot_nbytes / 2**20:.1f} MiB, not more than the {setting.slots} slots",
            flush=True,
        )
        return []
    reg_s = register_all(pager, pool, setting, registered)
    print(
        f"[{setting.name}] registered {registered} x {pager.slot_nbytes / 2**20:.1f} MiB in {reg_s:.1f} s", flush=True
    )
    resident = Pager(cfg, lora, dtype=model.dtype, host_memory=host_memory)
    register_all(resident, pool, setting, setting.slots)
    resident.prefetch([f"a{i}" for i in range(setting.slots)])
    while resident.snapshot()["pending"]:
        resident.commit()
    t0 = time.perf_counter()
    engine = make_engine(model, setting, pager, backend)
    engine.warmup()
    resident_engine = make_engine(model, setting, resident, backend)
    resident_engine.warmup()
    print(f"[{setting.name}] engines warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    # Page-ins from ordinary numpy, for the pinned-vs-pageable comparison. One adapter more than
    # slots, cycled in order: under LRU every acquire misses.
    pageable = Pager(cfg, lora, dtype=model.dtype, host_memory=HostMemory.PAGEABLE)
    register_all(pageable, pool, setting, setting.slots + 1)
    rng = np.random.default_rng(1)
    for j, alpha in enumerate(exponents):
        if time.perf_counter() > deadline:
            print(f"[{setting.name}] time budget spent: skipping exponent {alpha} and after", flush=True)
            break
        idx = (rng.power(alpha, setting.requests) * registered).astype(int)
        requests = make_requests(setting, [f"a{i}" for i in idx], cfg.vocab_size, seed=j)
        resident_requests = make_requests(setting, [f"a{i % setting.slots}" for i in idx], cfg.vocab_size, seed=j)
        base_run = run_engine(resident_engine, resident_requests)
        for cap, depth in [(c, d) for c in caps for d in prefetch]:
            pager.max_page_ins_per_commit = cap
            # A benchmark-only swap: the engine reads prefetch_adapters every step; nothing compiled depends on it.
            engine.config = dataclasses.replace(engine.config, prefetch_adapters=depth)
            row = run_variant(
                setting,
                engine,
                requests,
                base_run,
                registered=registered,
                alpha=alpha,
                distinct=int(len(set(idx))),
                reg_s=reg_s,
                pageable=pageable,
            )
            row.update(max_page_ins_per_commit=cap, prefetch_adapters=depth)
            print(json.dumps(row), flush=True)
            rows.append(row)
            on_row(row)
        pager.max_page_ins_per_commit = caps[0]
    del engine, resident_engine
    return rows


# -- output -----------------------------------------------------------------------------------------


def write_results(payload: dict, out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "paging.json").write_text(json.dumps(payload, indent=1))
    cols = [
        "setting",
        "adapter_MB",
        "registered",
        "slots",
        "popularity_exponent",
        "distinct_adapters",
        "tokens_per_s",
        "all_resident_tokens_per_s",
        "throughput_vs_resident",
        "page_ins",
        "prefill_calls",
        "resident_prefill_calls",
        "page_in_ms_p50",
        "page_in_serial_GBps",
        "page_in_GBps",
        "step_ms_paging",
        "step_ms_no_paging",
        "step_ms_all_resident",
        "prefill_step_ms_paging",
        "prefill_step_ms_no_paging",
        "resident_prefill_step_ms",
    ]
    pinned = payload["h2d_pinned_GBps"]
    commands = payload.get("commands", [payload["command"]])
    lines = (
        [f"# Adapter paging ({payload['device']}, jax {payload['jax_version']})", "", "Command(s):", ""]
        + [f"- `{c}`" for c in commands]
        + [
            "",
            f"Host->device: pinned {pinned} GB/s, pageable {payload['h2d_pageable_GBps']} GB/s "
            f"({payload['h2d_bytes'] / 1e6:.0f} MB copies); pinned at one adapter's size: "
            f"{payload.get('h2d_pinned_adapter_GBps')}. Serving: {payload['step']}.",
            "",
            "`page_in_GBps`: a burst of `page_in_burst_n` page-ins issued by one stage + commit (the way the "
            "pager issues them under load); `page_in_serial_GBps` and `page_in_ms_p50`: one at a time, "
            "blocking. `step_ms_*`: decode-only engine steps that issued page-ins / did not / the all-resident "
            "run; `prefill_step_ms_*`: the same for steps with a prefill call (requests are admitted in the "
            "step that pages their adapter in, so page-ins mostly come with a prefill; null: no such step).",
            "",
            "| " + " | ".join(cols) + " |",
            "|" + "---|" * len(cols),
        ]
    )
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in payload["rows"]]
    lines += [
        "",
        "Targets: throughput >= 90% of all-resident at 2,000 adapters; page-ins >= 70% of pinned "
        "host->device bandwidth (of the same run).",
        "",
    ]
    for r in payload["rows"]:
        row_pinned = r.get("h2d_pinned_GBps", pinned)
        share = f"{r['page_in_GBps'] / row_pinned:.0%}" if row_pinned else "n/a"
        lines.append(
            f"- {r['setting']}, {r['registered']} adapters, exponent {r['popularity_exponent']}: "
            f"{r['throughput_vs_resident']:.1%} of all-resident; page-ins at {share} of pinned bandwidth"
        )
    if payload.get("variant_rows"):
        vcols = [
            "setting",
            "popularity_exponent",
            "max_page_ins_per_commit",
            "prefetch_adapters",
            "throughput_vs_resident",
            "prefill_calls",
            "page_in_GBps",
        ]
        lines += ["", "Pager variants (same runs):", "", "| " + " | ".join(vcols) + " |", "|" + "---|" * len(vcols)]
        lines += ["| " + " | ".join(str(r.get(c)) for c in vcols) + " |" for r in payload["variant_rows"]]
    (out / "paging.md").write_text("\n".join(lines) + "\n")
    if not plot or not payload["rows"]:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["setting"] for r in payload["rows"]):
        rs = [r for r in payload["rows"] if r["setting"] == name]
        xs = [r["popularity_exponent"] for r in rs]
        ax.plot(
            xs,
            [r["tokens_per_s"] / r["all_resident_tokens_per_s"] for r in rs],
            "o-",
            label=f"{name}: {rs[0]['registered']} adapters, {rs[0]['slots']} slots",
        )
    ax.axhline(0.9, color="gray", ls="--", lw=1, label="target 90%")
    ax.set_xlabel("power-law exponent (1 = uniform)")
    ax.set_ylabel("tokens/s vs all resident")
    ax.set_title(f"Adapter paging, {payload['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "paging.png", dpi=120)


def merge(paths: list[Path], out: Path) -> dict:
    """One payload from several runs' paging.json: each setting's rows from the first file that has
    it, default-variant rows (the first --caps/--prefetch of that run) as `rows`, the others as
    `variant_rows`; every row keeps the command that made it."""
    payloads = [json.loads(p.read_text()) for p in paths]
    merged = {k: v for k, v in payloads[0].items() if k not in ("rows", "command")}
    merged.update(
        rows=[],
        variant_rows=[],
        commands=[p["command"] for p in payloads],
        command="python -m benchmarks.engine.paging --merge " + " ".join(str(p) for p in paths),
    )
    seen: set[str] = set()
    for payload in payloads:
        settings_here = {r["setting"] for r in payload["rows"]} - seen
        for r in payload["rows"]:
            if r["setting"] not in settings_here:
                continue
            first = next(x for x in payload["rows"] if x["setting"] == r["setting"])
            default = all(r.get(k) == first.get(k) for k in ("max_page_ins_per_commit", "prefetch_adapters"))
            row = {**r, "command": payload["command"], "h2d_pinned_GBps": payload["h2d_pinned_GBps"]}
            (merged["rows"] if default else merged["variant_rows"]).append(row)
        seen |= settings_here
    write_results(merged, out)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes (runs on CPU in seconds)")
    parser.add_argument(
        "--replay",
        action="store_true",
        help="the settings' full workloads (rows, slots, adapters, requests) on the toy model: the "
        "engine's schedule (steps, prefill calls, page-ins) is the H200 run's, without a GPU; "
        "its timings mean nothing",
    )
    parser.add_argument("--setting", action="append", choices=("s1", "full"), help="default: both")
    parser.add_argument("--exponents", type=float, nargs="+", default=[1.0, 0.5, 0.1])
    parser.add_argument("--host-memory", choices=[m.value for m in HostMemory], default="auto")
    parser.add_argument("--out", type=Path, default=results_dir(__file__))
    parser.add_argument(
        "--registered",
        type=int,
        default=None,
        help="registered adapters per setting (default: the setting's own, 2000 for s1)",
    )
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default: the setting's)")
    parser.add_argument(
        "--host-gb",
        type=float,
        default=None,
        help="host budget for registered adapters, GB; caps --registered, and the 'full' setting "
        "registers as many as fit (default: half the free memory)",
    )
    parser.add_argument(
        "--backend",
        choices=[b.value for b in LoraBackend],
        default=None,
        help="LoRA backend (default: pallas on GPU, xla elsewhere)",
    )
    parser.add_argument(
        "--caps",
        type=int,
        nargs="+",
        default=[16],
        help="pager variants: page-ins per commit (the first is the default row)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        nargs="+",
        default=None,
        help="pager variants: prefetch depth in waiting requests (default: the setting's rows)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting new settings/exponents after this many seconds; results so far are written",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="merge these runs' paging.json into --out (no run); see merge()",
    )
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s is not None else float("inf")
    host_bytes = int(args.host_gb * 1e9) if args.host_gb is not None else None
    small = args.tiny or args.replay
    cfg = TINY if small else LLAMA2_7B
    dev = jax.devices()[0]
    print("device", dev.device_kind, "jax", jax.__version__, flush=True)
    h2d_bytes = (1 << 20) if small else (1 << 30)
    pinned = round(h2d_gbps(h2d_bytes, pinned=True), 2) if has_pinned_host() else None
    pageable = round(h2d_gbps(h2d_bytes, pinned=False), 2)
    adapter_bytes = 16_777_216 if not small else 1 << 16  # one S1 adapter (rank 8, q/k/v/o, bf16)
    pinned_small = round(h2d_gbps(adapter_bytes, pinned=True, reps=30), 2) if has_pinned_host() else None
    print(
        f"h2d GB/s: pinned {pinned}, pageable {pageable}, pinned at {adapter_bytes / 1e6:.1f} MB {pinned_small}",
        flush=True,
    )
    backend = args.backend or ("pallas" if dev.platform == "gpu" else "xla")
    model = random_model(cfg, dtype=jnp.float32 if small else jnp.bfloat16, fused=True)  # the serving layout
    jax.block_until_ready(model.params)
    rows: list[dict] = []
    payload = {
        "device": str(dev.device_kind),
        "jax_version": jax.__version__,
        "h2d_pinned_GBps": pinned,
        "h2d_pageable_GBps": pageable,
        "h2d_bytes": h2d_bytes,
        "h2d_pinned_adapter_GBps": pinned_small,
        "h2d_adapter_bytes": adapter_bytes,
        "model": cfg.name,
        "host_gb": args.host_gb,
        "budget_s": args.budget_s,
        "lora_backend": backend,
        "step": f"jaxlora Engine + Pager, {cfg.name}, random {jnp.dtype(model.dtype).name} weights, "
        f"LoRA backend {backend}",
        "command": "python " + " ".join(sys.argv),
        "rows": rows,
    }
    not_run = []
    for name in args.setting or ["s1", "full"]:
        if time.perf_counter() > deadline:
            print(f"time budget spent: skipping setting {name}", flush=True)
            not_run.append(name)
            continue
        setting = settings(args.tiny)[name]
        if args.replay:
            setting = dataclasses.replace(setting, rank=4)
        if args.registered is not None:
            setting = dataclasses.replace(setting, registered=max(args.registered, setting.slots + 1))
        if args.requests is not None:
            setting = dataclasses.replace(setting, requests=args.requests)
        # Results are rewritten after every row, so a run cut short still leaves what it measured.
        run_setting(
            setting,
            model,
            args.exponents,
            args.host_memory,
            backend,
            host_bytes=host_bytes,
            caps=tuple(args.caps),
            prefetch=tuple(args.prefetch) if args.prefetch else None,
            deadline=deadline,
            on_row=lambda row: (rows.append(row), write_results(payload, args.out, plot=False)),
        )
        gc.collect()  # the setting's pinned host copies and device banks go before the next one's
    payload["not_run"] = not_run
    payload["seconds"] = round(time.perf_counter() - t_start, 1)
    write_results(payload, args.out)
    print(f"wrote {args.out / 'paging.json'}", flush=True)


if __name__ == "__main__":
    main()
