"""Adapter paging on one GPU: many registered adapters, few device slots, page-ins overlapped with decoding.

S-LoRA's S1 setting on a Llama-2-7B-shape model (random bf16 weights): rank-8 adapters on q, k, v, o
(~17 MB each), 2,000 registered, 64 device slots, requests drawn with S-LoRA's power law
(`numpy.random.power(alpha)`: alpha 1 is uniform, 0.1 very skewed). A second setting puts rank-16
adapters on all seven modules (~80 MB each), as many as half the free host memory holds.

What is measured, per setting and exponent:
  - decode tokens/s of a continuous-batching loop driving the real Pager (acquire once per request,
    poll is_ready, prefetch the queue head, commit after dispatching each step so the copies overlap
    it), against the same loop with every adapter resident (registered = slots - 1);
  - per-step time on steps whose commit issued page-ins vs steps without;
  - page-in latency and GB/s with transfers timed one by one, against raw host->device bandwidth
    from pinned_host and from pageable numpy (`h2d_*_GBps`).
The step is a stand-in until the engine lands: a jitted layer scan over the base projections plus
each row's LoRA term gathered from the bank by slot id (no attention, no KV cache, one token per row).
It reads the base weights and the rows' adapters once per step like a decode step does.

A page-in is one host->device copy of the adapter's flat (1-D) host buffer plus one jitted in-place
slot write (jaxlora.adapters.pager). `page_in_GBps` is the adapter's bytes over the wall time from
dispatching that copy to the written bank being ready, page-ins issued one at a time with the pager's
blocking `time_transfers` mode (nothing else in flight); compare it with `h2d_pinned_GBps` (one 1 GiB
pinned copy) and `h2d_pinned_adapter_GBps` (one pinned copy of an adapter's size): a lone copy of
one adapter pays a fixed latency that one-at-a-time timing cannot hide. `page_in_burst_GBps` is up
to 16 page-ins issued by one commit (as the serving loop does when several adapters are due), bytes
over the wall time from the commit to the written bank.

Registration: a few random weight sets are drawn once and every registered adapter is a copy of one
of them (each registration still validates, packs and pins its own host buffer), on a few threads,
so 2,000 S1 adapters register in seconds.

    python benchmarks/paging.py                # H200: both settings -> benchmarks/results/paging.{json,md,png}
    python benchmarks/paging.py --tiny         # CPU smoke run at toy size
    python benchmarks/paging.py --setting s1 --registered 2000 --exponents 1 0.1
    python benchmarks/paging.py --setting full --host-gb 60 --budget-s 900
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxlora.adapters import HostMemory, Pager  # noqa: E402
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, LoraConfig, ModelConfig  # noqa: E402
from jaxlora.lora.bank import bank_groups  # noqa: E402
from jaxlora.lora.host_adapter import HostAdapter  # noqa: E402

DTYPE = jnp.bfloat16
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128, name="llama-2-7b-shape")
TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, name="tiny")


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
    max_registered: int = 2000


def settings(tiny: bool) -> dict[str, Setting]:
    if tiny:
        return {
            "s1": Setting(name="s1", rank=4, modules=ATTENTION_MODULES, registered=40, slots=7, rows=4,
                          requests=24, new_tokens=6),
            "full": Setting(name="full", rank=4, modules=TARGET_MODULES, registered=None, slots=7, rows=4,
                            requests=24, new_tokens=6, max_registered=30),
        }
    return {
        "s1": Setting(name="s1", rank=8, modules=ATTENTION_MODULES, registered=2000, slots=64, rows=64,
                      requests=1024, new_tokens=32),
        "full": Setting(name="full", rank=16, modules=TARGET_MODULES, registered=None, slots=64, rows=64,
                        requests=1024, new_tokens=32),
    }


# -- raw host->device bandwidth ---------------------------------------------------------------------


def h2d_gbps(nbytes: int, pinned: bool, reps: int = 10) -> float:
    """Median GB/s of one device_put of `nbytes` from pinned_host (or pageable numpy) to the device."""
    dev = jax.devices()[0]
    host = np.ones((nbytes // 2,), np.dtype(DTYPE))
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


# -- a stand-in decode step -------------------------------------------------------------------------


def random_base(model: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Stacked random base projections {module: [L, in, out]} in bf16 (built on device)."""
    out = {}
    for i, m in enumerate(TARGET_MODULES):
        shape = (model.num_layers, *model.module_shape(m))
        make = jax.jit(lambda k, shape=shape: (jax.random.normal(k, shape, DTYPE) * 0.02).astype(DTYPE))
        out[m] = make(jax.random.fold_in(key, i))
    return out


def make_step(lora: LoraConfig):
    """step(base, bank, x [B, H], slots [B] int32) -> next x [B, H]: one token per row through every layer."""
    group_modules = dict(bank_groups(lora))
    R = lora.max_rank

    def step(base, bank, x, slots):
        def add_lora(outs, group, x_in, layer_bank):
            if group not in group_modules:
                return outs
            h = jnp.einsum("bi,bir->br", x_in, layer_bank[group]["a"][slots])  # A[slot]: [B, in, G*R]
            for i, m in enumerate(group_modules[group]):
                b = layer_bank[group]["b"][m][slots]  # [B, R, out]
                outs[m] = outs[m] + jnp.einsum("br,bro->bo", h[:, i * R:(i + 1) * R], b)
            return outs

        def layer(x, inputs):
            w, layer_bank = inputs
            outs = add_lora({m: x @ w[m] for m in ("q_proj", "k_proj", "v_proj")}, "qkv", x, layer_bank)
            attn = outs["q_proj"] + 0 * (outs["k_proj"].sum() + outs["v_proj"].sum())  # stands in for attention
            outs = add_lora({"o_proj": attn @ w["o_proj"]}, "o", attn, layer_bank)
            x = x + outs["o_proj"]
            outs = add_lora({m: x @ w[m] for m in ("gate_proj", "up_proj")}, "gate_up", x, layer_bank)
            act = jax.nn.silu(outs["gate_proj"]) * outs["up_proj"]
            outs = add_lora({"down_proj": act @ w["down_proj"]}, "down", act, layer_bank)
            return (x + outs["down_proj"]).astype(x.dtype), None

        out, _ = jax.lax.scan(layer, x, (base, bank))
        return out

    return jax.jit(step)


# -- the workload -----------------------------------------------------------------------------------


def adapter_pool(model: ModelConfig, setting: Setting, num: int = 8) -> list[dict]:
    """A few random weight sets; registered adapters share them (each registration still copies)."""
    rng = np.random.default_rng(0)
    pool = []
    for _ in range(num):
        weights = {}
        for m in setting.modules:
            d_in, d_out = model.module_shape(m)
            weights[m] = (rng.standard_normal((model.num_layers, d_in, setting.rank), np.float32) * 0.01,
                          rng.standard_normal((model.num_layers, setting.rank, d_out), np.float32) * 0.01)
        pool.append(weights)
    return pool


def register_all(pager: Pager, pool: list[dict], setting: Setting, num: int, threads: int | None = None) -> float:
    """Registers a0..a{num-1} (copies of the pool's weight sets) from a few threads; returns seconds.

    `Pager.register` is thread-safe and its work (validate, pack, pin) is numpy and device copies
    that release the GIL, so threads overlap it.
    """
    adapters = [HostAdapter(name=f"pool{i}", rank=setting.rank, target_modules=setting.modules,
                            weights=pool[i]) for i in range(len(pool))]

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


def run_loop(pager: Pager, step, base, model: ModelConfig, setting: Setting, requests: list[str]) -> dict:
    """Continuous batching over `requests` (adapter names); returns tokens/s and step times."""
    B = setting.rows
    x = jnp.ones((B, model.hidden_size), DTYPE)
    queue = deque(requests)
    rows: list[list | None] = [None] * B  # [adapter, tokens left]
    tokens, steps_paging, steps_quiet = 0, [], []
    t_start = time.perf_counter()
    while queue or any(rows):
        for i in range(B):  # admit FIFO while the head's adapter can get a slot
            if rows[i] is None and queue and pager.can_place(queue[0]):
                name = queue.popleft()
                pager.acquire(name)
                rows[i] = [name, setting.new_tokens]
        pager.prefetch(list(queue)[:B])
        ready = [r is not None and pager.is_ready(r[0]) is not None for r in rows]
        slots = np.array([pager.is_ready(r[0]) if ok else 0 for r, ok in zip(rows, ready)], np.int32)
        t0 = time.perf_counter()
        page_ins = pager.metrics.page_ins
        out = step(base, pager.bank, x, slots)  # dispatch step N ...
        pager.commit()  # ... then issue page-ins, which overlap it
        out.block_until_ready()  # the engine syncs on sampled tokens every step
        (steps_paging if pager.metrics.page_ins > page_ins else steps_quiet).append(time.perf_counter() - t0)
        for i, ok in enumerate(ready):
            if ok:
                tokens += 1
                rows[i][1] -= 1
                if rows[i][1] == 0:
                    pager.release(rows[i][0])
                    rows[i] = None
    seconds = time.perf_counter() - t_start
    ms = lambda xs: round(float(np.mean(xs)) * 1e3, 3) if xs else None  # noqa: E731
    return {"tokens_per_s": tokens / seconds, "step_ms_paging": ms(steps_paging),
            "step_ms_no_paging": ms(steps_quiet), "steps": len(steps_paging) + len(steps_quiet)}


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


def run_setting(setting: Setting, model: ModelConfig, exponents: list[float], base, host_memory: str, *,
                host_bytes: int | None = None, deadline: float = float("inf"),
                on_row=lambda row: None) -> list[dict]:
    """Rows for each exponent; stops before an exponent once time.perf_counter() passes `deadline`."""
    lora = LoraConfig(max_slots=setting.slots + 1, max_rank=setting.rank, target_modules=setting.modules)
    step = make_step(lora)
    pool = adapter_pool(model, setting)
    rows = []
    pager = Pager(model, lora, dtype=DTYPE, host_memory=host_memory, host_capacity_bytes=host_bytes)
    registered = num_registered(setting, pager.slot_nbytes, host_bytes)
    if registered < setting.slots + 1:
        print(f"[{setting.name}] skipped: the host budget holds {registered} adapters of "
              f"{pager.slot_nbytes / 2**20:.1f} MiB, not more than the {setting.slots} slots", flush=True)
        return []
    reg_s = register_all(pager, pool, setting, registered)
    print(f"[{setting.name}] registered {registered} x {pager.slot_nbytes / 2**20:.1f} MiB in {reg_s:.1f} s",
          flush=True)
    resident = Pager(model, lora, dtype=DTYPE, host_memory=host_memory)
    register_all(resident, pool, setting, setting.slots)
    for name in (f"a{i}" for i in range(setting.slots)):
        resident.prefetch([name])
    resident.commit()
    # Page-ins from ordinary numpy, for the pinned-vs-pageable comparison. One adapter more than
    # slots, cycled in order: under LRU every acquire misses.
    pageable = Pager(model, lora, dtype=DTYPE, host_memory=HostMemory.PAGEABLE)
    register_all(pageable, pool, setting, setting.slots + 1)
    rng = np.random.default_rng(1)
    for alpha in exponents:
        if time.perf_counter() > deadline:
            print(f"[{setting.name}] time budget spent: skipping exponent {alpha} and after", flush=True)
            break
        idx = (rng.power(alpha, setting.requests) * registered).astype(int)
        # Warm-up (compiles the step), then the measured runs.
        run_loop(resident, step, base, model, dataclasses.replace(setting, requests=setting.rows, new_tokens=2),
                 [f"a{i % setting.slots}" for i in range(setting.rows)])
        base_run = run_loop(resident, step, base, model, setting, [f"a{i % setting.slots}" for i in idx])
        before = pager.metrics.snapshot()
        paged = run_loop(pager, step, base, model, setting, [f"a{i}" for i in idx])
        after = pager.metrics.snapshot()
        cold = [f"a{i}" for i in range(registered - 1, max(registered - 1 - 32, -1), -1)
                if pager.is_ready(f"a{i}") is None][:16]
        p50_ms, gbps = timed_page_ins(pager, cold) if cold else (float("nan"), float("nan"))
        burst = [f"a{i}" for i in range(registered) if pager.is_ready(f"a{i}") is None][:min(16, setting.slots)]
        burst_gbps = burst_page_ins(pager, burst)
        pageable_ms, pageable_gbps = timed_page_ins(pageable, [f"a{i}" for i in range(setting.slots + 1)])
        row = {
            "setting": setting.name, "rank": setting.rank, "modules": list(setting.modules),
            "adapter_MB": round(pager.slot_nbytes / 1e6, 2), "registered": registered, "slots": setting.slots,
            "registration_s": round(reg_s, 2), "host_GB_registered": round(registered * pager.slot_nbytes / 1e9, 2),
            "rows": setting.rows, "requests": setting.requests, "new_tokens": setting.new_tokens,
            "popularity_exponent": alpha, "distinct_adapters": int(len(set(idx))),
            "tokens_per_s": round(paged["tokens_per_s"], 1),
            "all_resident_tokens_per_s": round(base_run["tokens_per_s"], 1),
            "page_ins": after["page_ins"] - before["page_ins"],
            "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
            "page_in_ms_p50": round(p50_ms, 3), "page_in_GBps": round(gbps, 2),
            "page_in_burst_GBps": round(burst_gbps, 2), "page_in_burst_n": len(burst),
            "page_in_wait_ms_p50": round(after["page_in_ms_p50"], 3),
            "page_in_ms_p50_pageable": round(pageable_ms, 3), "page_in_GBps_pageable": round(pageable_gbps, 2),
            "step_ms_paging": paged["step_ms_paging"], "step_ms_no_paging": paged["step_ms_no_paging"],
            "step_ms_all_resident": base_run["step_ms_no_paging"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        on_row(row)
    return rows


# -- output -----------------------------------------------------------------------------------------


def write_results(payload: dict, out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "paging.json").write_text(json.dumps(payload, indent=1))
    cols = ["setting", "registered", "slots", "popularity_exponent", "tokens_per_s", "all_resident_tokens_per_s",
            "page_ins", "page_in_ms_p50", "page_in_GBps", "page_in_burst_GBps", "step_ms_paging", "step_ms_no_paging"]
    lines = [f"# Adapter paging ({payload['device']}, jax {payload['jax_version']})", "",
             f"Command: `{payload['command']}`", "",
             f"Host->device: pinned {payload['h2d_pinned_GBps']} GB/s, pageable {payload['h2d_pageable_GBps']} GB/s "
             f"({payload['h2d_bytes'] / 1e6:.0f} MB copies); pinned at one adapter's size: "
             f"{payload.get('h2d_pinned_adapter_GBps')}. Step: {payload['step']}.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in payload["rows"]]
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
        ax.plot(xs, [r["tokens_per_s"] / r["all_resident_tokens_per_s"] for r in rs], "o-",
                label=f"{name}: {rs[0]['registered']} adapters, {rs[0]['slots']} slots")
    ax.axhline(0.9, color="gray", ls="--", lw=1, label="target 90%")
    ax.set_xlabel("power-law exponent (1 = uniform)")
    ax.set_ylabel("tokens/s vs all resident")
    ax.set_title(f"Adapter paging, {payload['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "paging.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (runs on CPU in seconds)")
    parser.add_argument("--setting", action="append", choices=("s1", "full"), help="default: both")
    parser.add_argument("--exponents", type=float, nargs="+", default=[1.0, 0.5, 0.1])
    parser.add_argument("--host-memory", choices=[m.value for m in HostMemory], default="auto")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--registered", type=int, default=None,
                        help="registered adapters per setting (default: the setting's own, 2000 for s1)")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default: the setting's)")
    parser.add_argument("--host-gb", type=float, default=None,
                        help="host budget for registered adapters, GB; caps --registered, and the 'full' setting "
                             "registers as many as fit (default: half the free memory)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new settings/exponents after this many seconds; results so far are written")
    args = parser.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s is not None else float("inf")
    host_bytes = int(args.host_gb * 1e9) if args.host_gb is not None else None
    model = TINY if args.tiny else LLAMA2_7B
    dev = jax.devices()[0]
    print("device", dev.device_kind, "jax", jax.__version__, flush=True)
    h2d_bytes = (1 << 20) if args.tiny else (1 << 30)
    pinned = round(h2d_gbps(h2d_bytes, pinned=True), 2) if has_pinned_host() else None
    pageable = round(h2d_gbps(h2d_bytes, pinned=False), 2)
    adapter_bytes = 16_777_216 if not args.tiny else 1 << 16  # one S1 adapter (rank 8, q/k/v/o, bf16)
    pinned_small = round(h2d_gbps(adapter_bytes, pinned=True, reps=30), 2) if has_pinned_host() else None
    print(f"h2d GB/s: pinned {pinned}, pageable {pageable}, pinned at {adapter_bytes / 1e6:.1f} MB {pinned_small}",
          flush=True)
    base = random_base(model, jax.random.key(0))
    rows: list[dict] = []
    payload = {"device": str(dev.device_kind), "jax_version": jax.__version__, "h2d_pinned_GBps": pinned,
               "h2d_pageable_GBps": pageable, "h2d_bytes": h2d_bytes, "h2d_pinned_adapter_GBps": pinned_small,
               "h2d_adapter_bytes": adapter_bytes, "model": model.name, "host_gb": args.host_gb,
               "budget_s": args.budget_s,
               "step": "stand-in (layer scan: base projections + XLA-gather LoRA, no attention/KV)",
               "command": "python " + " ".join(sys.argv), "rows": rows}
    not_run = []
    for name in args.setting or ["s1", "full"]:
        if time.perf_counter() > deadline:
            print(f"time budget spent: skipping setting {name}", flush=True)
            not_run.append(name)
            continue
        setting = settings(args.tiny)[name]
        if args.registered is not None:
            setting = dataclasses.replace(setting, registered=max(args.registered, setting.slots + 1))
        if args.requests is not None:
            setting = dataclasses.replace(setting, requests=args.requests)
        # Results are rewritten after every row, so a run cut short still leaves what it measured.
        run_setting(setting, model, args.exponents, base, args.host_memory, host_bytes=host_bytes,
                    deadline=deadline, on_row=lambda row: (rows.append(row), write_results(payload, args.out, plot=False)))
    payload["not_run"] = not_run
    payload["seconds"] = round(time.perf_counter() - t_start, 1)
    write_results(payload, args.out)
    print(f"wrote {args.out / 'paging.json'}", flush=True)


if __name__ == "__main__":
    main()
