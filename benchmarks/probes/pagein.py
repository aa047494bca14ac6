"""Where a page-in's time goes: host->device copies of adapter buffers, alone and under a decode step.

A research probe for the pager (issue 6). Every figure is a median over repeats, on one device:

  size curve      one pinned_host -> device copy of 16 MB ... 1 GB: GB/s against size
  burst           k adapter copies (16.8 MB each, S1) issued back to back, then k jitted slot writes:
                  wall time from the first dispatch to the written bank, as GB/s, for several k and
                  for three ways of issuing them (one device_put per adapter; one device_put of the
                  list; one jitted call that reads the pinned buffers itself and writes all k slots)
  overlap         a stand-in decode step (benchmarks/engine/paging.py's) dispatched, then k page-ins: when
                  the step's output is ready and when the written bank is, against the step alone
                  and the copies alone; host time spent issuing the page-ins

    python -m benchmarks.probes.pagein                                 # GPU
    python -m benchmarks.probes.pagein --tiny --out /tmp/probe         # CPU smoke run
    python -m benchmarks.probes.pagein --render benchmarks/results/probes/pagein/pagein_probe.json   # -> pagein_probe.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, TINY
from benchmarks.paths import results_dir
from jaxlora.adapters.registry import FlatLayout
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, LoraConfig, ModelConfig
from jaxlora.lora.bank import bank_groups, init_bank, write_many_flat, write_slot_flat, write_slots_flat

DTYPE = jnp.bfloat16


# -- a stand-in decode step: reads every base weight and each row's adapter once, like a decode step


def random_base(model: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Stacked random base projections {module: [L, in, out]} in bf16 (built on device)."""
    out = {}
    for i, m in enumerate(TARGET_MODULES):
        shape = (model.num_layers, *model.module_shape(m))
        make = jax.jit(lambda k, shape=shape: (jax.random.normal(k, shape, DTYPE) * 0.02).astype(DTYPE))
        out[m] = make(jax.random.fold_in(key, i))
    return out


def make_step(lora: LoraConfig):
    """step(base, bank, x [B, H], slots [B] int32) -> next x [B, H]: one token per row through every
    layer (a layer scan of the base projections plus each row's LoRA term gathered by slot id; no
    attention, no KV cache)."""
    group_modules = dict(bank_groups(lora))
    R = lora.max_rank

    def step(base, bank, x, slots):
        def add_lora(outs, group, x_in, layer_bank):
            if group not in group_modules:
                return outs
            h = jnp.einsum("bi,bir->br", x_in, layer_bank[group]["a"][slots])  # A[slot]: [B, in, G*R]
            for i, m in enumerate(group_modules[group]):
                b = layer_bank[group]["b"][m][slots]  # [B, R, out]
                outs[m] = outs[m] + jnp.einsum("br,bro->bo", h[:, i * R : (i + 1) * R], b)
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


def median_s(fn, reps: int) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def shardings(dev: jax.Device) -> tuple[jax.sharding.Sharding | None, jax.sharding.Sharding]:
    kinds = {m.kind for m in dev.addressable_memories()}
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host") if "pinned_host" in kinds else None
    return pinned, jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)


def size_curve(pinned, device, sizes: list[int], reps: int) -> list[dict]:
    rows = []
    for nbytes in sizes:
        host = np.ones(nbytes // 2, np.dtype(DTYPE))
        if pinned is not None:
            host = jax.block_until_ready(jax.device_put(host, pinned))
        s = median_s(lambda: jax.block_until_ready(jax.device_put(host, device)), reps)
        rows.append({"MB": round(nbytes / 1e6, 1), "ms": round(s * 1e3, 3), "GBps": round(nbytes / s / 1e9, 2)})
        print("size", rows[-1], flush=True)
    return rows


def make_in_jit_writer(k: int, pinned, device):
    """One jitted call: k pinned flat buffers -> device (inside the program) -> k slot writes."""

    def write_all(bank, slots, *flats):
        if pinned is not None:
            flats = tuple(jax.device_put(flat, jax.memory.Space.Device) for flat in flats)
        return write_many_flat(bank, slots, flats)

    in_sh = (None, None) + ((pinned,) * k if pinned is not None else (None,) * k)
    return jax.jit(write_all, donate_argnums=0, in_shardings=in_sh if pinned is not None else None)


def loop_variants(step, base, x, slot_ids, state, flats, device, ks, args) -> list[dict]:
    """An engine-like loop, one step behind: dispatch step i, issue k page-ins, block on step i-1.

    Variants of where the page-ins' copies and writes are issued:
      after:   copies then writes, both after step i's dispatch (the pager's commit today)
      split:   copies before step i's dispatch, writes after it (one write call per adapter)
      split1:  as split, with all k writes in one jitted call
      lagged:  copies after step i's dispatch, their writes after step i+1's dispatch
    Reports ms per step against the same loop with no page-ins.
    """
    steps = 12
    rows = []

    def loop(k: int, how: str) -> dict:
        y_prev, xx = None, x
        carried = []
        issue_ms = []
        jax.block_until_ready(state["bank"])
        t0 = time.perf_counter()
        for _ in range(steps):
            ta = time.perf_counter()
            pre = [jax.device_put(f, device) for f in flats[:k]] if how.startswith("split") and k else []
            y = step(base, state["bank"], xx, slot_ids)
            if how == "after" and k:
                copies = [jax.device_put(f, device) for f in flats[:k]]
                for j, c in enumerate(copies):
                    state["bank"] = write_slot_flat(state["bank"], 1 + j, c)
            elif how == "split" and k:
                for j, c in enumerate(pre):
                    state["bank"] = write_slot_flat(state["bank"], 1 + j, c)
            elif how == "split1" and k:
                state["bank"] = write_slots_flat(state["bank"], np.arange(1, k + 1), tuple(pre))
            elif how == "lagged" and k:
                for j, c in enumerate(carried):
                    state["bank"] = write_slot_flat(state["bank"], 1 + j, c)
                carried = [jax.device_put(f, device) for f in flats[:k]]
            issue_ms.append((time.perf_counter() - ta) * 1e3)
            if y_prev is not None:
                y_prev.block_until_ready()
            y_prev, xx = y, y
        jax.block_until_ready((y_prev, state["bank"], carried))
        total = time.perf_counter() - t0
        return {
            "k": k,
            "how": how,
            "ms_per_step": round(total / steps * 1e3, 3),
            "host_issue_ms_p50": round(float(np.median(issue_ms)), 3),
        }

    for k, how in [(0, "none")] + [(k, h) for k in ks if 2 <= k <= 16 for h in ("after", "split", "split1", "lagged")]:
        try:
            loop(k, how)  # warm-up
            rows.append(loop(k, how))
        except Exception as e:
            rows.append({"k": k, "how": how, "error": f"{type(e).__name__}: {e}"[:300]})
        print("loop", rows[-1], flush=True)
    return rows


def render(path: Path) -> None:
    """pagein_probe.md next to a probe's JSON: one table per section."""
    d = json.loads(path.read_text())

    def table(rows: list[dict]) -> list[str]:
        cols = list(dict.fromkeys(k for r in rows for k in r))
        return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
            "| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows
        ]

    lines = [
        f"# Page-in probe ({d['device']}, jax {d['jax_version']})",
        "",
        f"Command: `{d['command']}`",
        "",
        f"Adapter buffer: {d['adapter_bytes'] / 1e6:.1f} MB (S1: rank 8, q/k/v/o, Llama-2-7B shape, bf16).",
        "",
    ]
    sections = [
        ("size_curve", "One pinned_host -> device copy, by size"),
        ("copies_only", "k adapter copies issued back to back, no slot writes"),
        (
            "burst",
            "k page-ins (copy + slot write): one write call per adapter (put_each, put_list) or one "
            "jitted call reading the pinned buffers itself (in_jit)",
        ),
        (
            "overlap",
            "A stand-in decode step dispatched, then k page-ins: step output ready, everything ready, "
            "host time issuing the page-ins",
        ),
        (
            "loop",
            "Engine-like loop (one step behind), k page-ins a step: after = copies and writes after the "
            "dispatch; split = copies before, writes after (one call each); split1 = copies before, one "
            "write call; lagged = writes one step later",
        ),
    ]
    for key, title in sections:
        if d.get(key):
            lines += [f"## {title}", ""] + table(d[key]) + [""]
    path.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=results_dir(__file__))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--render", type=Path, default=None, help="write the .md of this probe JSON (no run)")
    args = p.parse_args()
    if args.render:
        render(args.render)
        return
    model = TINY if args.tiny else LLAMA2_7B
    rank = 4 if args.tiny else 8
    slots = 9 if args.tiny else 65
    ks = [1, 2, 4, 8] if args.tiny else [1, 2, 4, 8, 16, 32]
    dev = jax.devices()[0]
    pinned, device = shardings(dev)
    print("device", dev.device_kind, "jax", jax.__version__, "pinned_host", pinned is not None, flush=True)
    out: dict = {
        "device": str(dev.device_kind),
        "jax_version": jax.__version__,
        "pinned_host": pinned is not None,
        "command": "python " + " ".join(sys.argv),
    }
    sizes = [1 << 16, 1 << 20] if args.tiny else [16_777_216, 67_108_864, 268_435_456, 1 << 30]
    out["size_curve"] = size_curve(pinned, device, sizes, args.reps)

    lora = LoraConfig(max_slots=slots, max_rank=rank, target_modules=ATTENTION_MODULES)
    layout = FlatLayout.for_bank(model, lora, DTYPE)
    rng = np.random.default_rng(0)
    flats = []
    for _ in range(max(ks)):
        flat = (rng.standard_normal(layout.size, np.float32) * 0.01).astype(layout.dtype)
        flats.append(jax.block_until_ready(jax.device_put(flat, pinned)) if pinned is not None else flat)
    nbytes = layout.nbytes
    out["adapter_bytes"] = nbytes
    state = {"bank": jax.device_put(init_bank(model, lora, DTYPE), device)}

    def issue(k: int, how: str) -> None:
        if how == "put_each":
            copies = [jax.device_put(f, device) for f in flats[:k]]
        elif how == "put_list":
            copies = jax.device_put(flats[:k], device)
        if how in ("put_each", "put_list"):
            for i, c in enumerate(copies):
                state["bank"] = write_slot_flat(state["bank"], 1 + i, c)
        else:
            state["bank"] = writers[k](state["bank"], jnp.arange(1, k + 1, dtype=jnp.int32), *flats[:k])

    writers = {k: make_in_jit_writer(k, pinned, device) for k in ks}
    burst = []
    for how in ("put_each", "put_list", "in_jit"):
        for k in ks:
            try:
                s = median_s(lambda: (issue(k, how), jax.block_until_ready(state["bank"])), args.reps)
                row = {"how": how, "k": k, "ms": round(s * 1e3, 3), "GBps": round(k * nbytes / s / 1e9, 2)}
            except Exception as e:  # a way JAX refuses here is a result too
                row = {"how": how, "k": k, "error": f"{type(e).__name__}: {e}"[:300]}
            burst.append(row)
            print("burst", row, flush=True)
    out["burst"] = burst
    copies_only = []
    for k in ks:
        s = median_s(lambda: jax.block_until_ready([jax.device_put(f, device) for f in flats[:k]]), args.reps)
        copies_only.append({"k": k, "ms": round(s * 1e3, 3), "GBps": round(k * nbytes / s / 1e9, 2)})
        print("copies only", copies_only[-1], flush=True)
    out["copies_only"] = copies_only

    # Overlap with a step that reads the bank.
    base = random_base(model, jax.random.key(0))
    step = make_step(lora)
    B = 64 if not args.tiny else 4
    x = jnp.ones((B, model.hidden_size), DTYPE)
    slot_ids = jnp.asarray((1 + np.arange(B) % (slots - 1)).astype(np.int32))
    jax.block_until_ready(step(base, state["bank"], x, slot_ids))

    def run(k: int, how: str, writes: bool) -> dict:
        times = {"out": [], "all": [], "issue": []}
        for rep in range(args.reps + 1):
            jax.block_until_ready(state["bank"])
            t0 = time.perf_counter()
            y = step(base, state["bank"], x, slot_ids)
            t1 = time.perf_counter()
            copies = []
            if k and writes:
                issue(k, how)
            elif k:
                copies = [jax.device_put(f, device) for f in flats[:k]]
            t2 = time.perf_counter()
            y.block_until_ready()
            t3 = time.perf_counter()
            jax.block_until_ready((state["bank"], copies))
            t4 = time.perf_counter()
            if rep:
                times["out"].append(t3 - t0)
                times["all"].append(t4 - t0)
                times["issue"].append(t2 - t1)
        med = {key: round(float(np.median(v)) * 1e3, 3) for key, v in times.items()}
        return {
            "k": k,
            "how": how if writes else "copies_no_write",
            "step_out_ms": med["out"],
            "all_ready_ms": med["all"],
            "host_issue_ms": med["issue"],
        }

    overlap = [run(0, "none", False)]
    print("overlap", overlap[-1], flush=True)
    for k in [kk for kk in ks if kk >= 4]:
        for how, writes in (("copies_no_write", False), ("put_each", True), ("in_jit", True)):
            try:
                overlap.append(run(k, how, writes))
            except Exception as e:
                overlap.append({"k": k, "how": how, "error": f"{type(e).__name__}: {e}"[:300]})
            print("overlap", overlap[-1], flush=True)
    out["overlap"] = overlap
    out["loop"] = loop_variants(step, base, x, slot_ids, state, flats, device, ks, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pagein_probe.json").write_text(json.dumps(out, indent=1))
    render(args.out / "pagein_probe.json")
    print("wrote", args.out / "pagein_probe.json", flush=True)


if __name__ == "__main__":
    main()
