"""LoRA shrink + expand on the GPU: pallas vs XLA gather vs one-hot vs ragged_dot, against the bytes floor.

Times what a model step sees, not one dispatch: each case runs the op for `--layers` layers (each
with its own bank and inputs) inside one jitted function, calls it back to back (dispatch overlaps
the device work) and divides; input sets rotate so that the data touched between two uses of the
same set exceeds the 60 MB L2. HBM bandwidth is measured in the same run as a large device-to-device
copy (bytes read + written). Every case's floor counts the distinct adapter bytes, x read, h written
and read, and y read and written.

    python benchmarks/kernels.py check              # pallas vs xla on awkward shapes (GPU, compiled)
    python benchmarks/kernels.py tune               # sweep knobs for decode, print tuning rows
    python benchmarks/kernels.py bench --out DIR    # full table -> DIR/kernels.{json,md,png}
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pallas_kernels as pk  # noqa: E402
from pallas_kernels import lora_triton  # noqa: E402

L2_BYTES = 60e6
DTYPE = jnp.bfloat16


# -- measuring ------------------------------------------------------------------------------------


def hbm_gbps() -> float:
    x = jnp.ones((1 << 30,), jnp.bfloat16)  # 2 GiB
    copy = jax.jit(lambda v: v.copy())
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / np.median(times) / 1e9


REPEATS = 8


def time_per_layer(fn, sets, num_layers: int, reps: int = 3) -> float:
    """Median-of-3 microseconds per layer: each call runs REPEATS + 1 passes over all `sets`."""
    all_sets = [layers for layers, _ in sets]
    slots = sets[0][1]
    jax.block_until_ready(fn(all_sets, slots))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(all_sets, slots) for _ in range(reps)]
        jax.block_until_ready(outs)
        rounds.append((time.perf_counter() - t0) / (reps * (REPEATS + 1) * len(sets) * num_layers))
        del outs
    return float(np.median(rounds)) * 1e6


# -- cases --------------------------------------------------------------------------------------


def slot_pattern(rng, num_tokens: int, distinct: int, seg_len: int | None) -> np.ndarray:
    """Slots 1..distinct spread over the rows (or segments), shuffled."""
    units = num_tokens if seg_len is None else num_tokens // seg_len
    slots = 1 + rng.permutation(np.arange(units) % distinct)
    return slots.astype(np.int32) if seg_len is None else np.repeat(slots, seg_len).astype(np.int32)


def floor_bytes(op, num_tokens, hidden_in, hidden_out, rank, distinct) -> int:
    item = jnp.dtype(DTYPE).itemsize
    shrink = distinct * hidden_in * rank + num_tokens * hidden_in + num_tokens * rank
    expand = distinct * rank * hidden_out + num_tokens * rank + 2 * num_tokens * hidden_out
    return item * {"shrink": shrink, "expand": expand, "shrink+expand": shrink + expand}[op]


def make_fn(op: str, backend: str, seg_len: int | None, knobs: dict | None = None):
    knobs = knobs or {}

    def shrink(x, a, slots):
        if backend == "pallas" and knobs:
            if seg_len is None:
                return pk.bgmv_shrink(x, a, slots, **knobs.get("shrink", {}))
        return pk.lora_shrink(x, a, slots, backend=backend, seg_len=seg_len)

    def expand(y, h, b, slots):
        if backend == "pallas" and knobs:
            if seg_len is None:
                return pk.bgmv_expand(y, h, b, slots, **knobs.get("expand", {}))
        return pk.lora_expand(y, h, b, slots, backend=backend, seg_len=seg_len)

    def apply(layers, slots):
        outs = []
        for x, a, h, b, y in layers:
            if op == "shrink":
                outs.append(shrink(x, a, slots))
            elif op == "expand":
                outs.append(expand(y, h, b, slots))
            else:
                outs.append(expand(y, shrink(x, a, slots), b, slots))
        return outs

    def run(all_sets, slots):
        # REPEATS passes over every set inside one call, so host dispatch is amortized. Each pass
        # depends on the last through `slots` (+0 unless a NaN appears), so nothing is hoisted.
        def one_pass(_, carry):
            slots, _ = carry
            outs = [o for layers in all_sets for o in apply(layers, slots)]
            probe = outs[-1][0, 0]
            return slots + (probe != probe).astype(slots.dtype), outs

        init = (slots, [o for layers in all_sets for o in apply(layers, slots)])
        return jax.lax.fori_loop(0, REPEATS, one_pass, init)

    return jax.jit(run)


def make_sets(rng, num_tokens, hidden_in, hidden_out, rank, distinct, num_layers, seg_len):
    num_slots = distinct + 1
    touched = floor_bytes("shrink+expand", num_tokens, hidden_in, hidden_out, rank, distinct) * num_layers
    num_sets = int(min(16, max(1, math.ceil(3 * L2_BYTES / touched))))
    key = jax.random.key(int(rng.integers(1 << 30)))
    slots = jnp.asarray(slot_pattern(rng, num_tokens, distinct, seg_len))
    sets = []
    for s in range(num_sets):
        layers = []
        for layer in range(num_layers):
            k = jax.random.fold_in(key, s * 1000 + layer)
            ka, kb, kx, ky, kh = jax.random.split(k, 5)
            a = (jax.random.normal(ka, (num_slots, hidden_in, rank), DTYPE) * 0.02).at[0].set(0)
            b = (jax.random.normal(kb, (num_slots, rank, hidden_out), DTYPE) * 0.02).at[0].set(0)
            x = jax.random.normal(kx, (num_tokens, hidden_in), DTYPE)
            y = jax.random.normal(ky, (num_tokens, hidden_out), DTYPE)
            h = jax.random.normal(kh, (num_tokens, rank), DTYPE)
            layers.append((x, a, h, b, y))
        sets.append((layers, slots))
    return sets


def decode_cases():
    for tokens in (16, 64, 256, 512):
        for distinct in sorted({1, 16, max(1, tokens // 4), tokens}):
            if distinct <= tokens:
                yield dict(mode="decode", tokens=tokens, hidden_in=4096, hidden_out=4096, rank=16, distinct=distinct)
    for rank in (8, 64):
        for distinct in (16, 256):
            yield dict(mode="decode", tokens=256, hidden_in=4096, hidden_out=4096, rank=rank, distinct=distinct)
    for tokens in (64, 256):
        for distinct in (16, tokens):
            yield dict(mode="decode", tokens=tokens, hidden_in=4096, hidden_out=11008, rank=16, distinct=distinct)


def prefill_cases():
    for seg_len in (128, 512, 2048):
        tokens = 4096
        yield dict(mode="prefill", tokens=tokens, hidden_in=4096, hidden_out=4096, rank=16,
                   distinct=tokens // seg_len, seg_len=seg_len)


def run_case(rng, case, backends, ops, num_layers):
    seg_len = case.get("seg_len")
    sets = make_sets(rng, case["tokens"], case["hidden_in"], case["hidden_out"], case["rank"], case["distinct"],
                     num_layers, seg_len)
    rows = []
    for op, backend in itertools.product(ops, backends):
        if backend == "onehot" and case["tokens"] * (case["distinct"] + 1) > (1 << 17):
            continue  # one-hot does T*S work per row: hopeless at this size, skip to save device time
        fn = make_fn(op, backend, seg_len)
        us = time_per_layer(fn, sets, num_layers)
        floor_us = floor_bytes(op, case["tokens"], case["hidden_in"], case["hidden_out"], case["rank"],
                               case["distinct"]) / (HBM_GBPS * 1e3)
        row = dict(op=op, **{k: case[k] for k in ("mode", "tokens", "hidden_in", "hidden_out", "rank", "distinct")},
                   backend=backend, us=round(us, 2), floor_us=round(floor_us, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- modes ----------------------------------------------------------------------------------------


def check() -> None:
    """Compiled pallas vs xla on awkward shapes, NaN-poisoned unused slots; prints max relative error."""
    rng = np.random.default_rng(0)
    for dtype, (tokens, hidden, rank, out, seg_len) in itertools.product(
        (jnp.bfloat16, jnp.float32),
        [(37, 2049, 48, 300, None), (256, 4096, 16, 11008, None), (512, 576, 1, 1536, None),
         (64, 1536, 128, 576, None), (1024, 4096, 16, 4096, 128), (384, 2049, 8, 2049, 128)],
    ):
        num_slots = 40
        units = tokens if seg_len is None else tokens // seg_len
        used = rng.integers(0, 20, units).astype(np.int32)  # slots 20.. stay NaN, slot 0 rows included
        slots = jnp.asarray(used if seg_len is None else np.repeat(used, seg_len))
        a = jnp.asarray(rng.standard_normal((num_slots, hidden, rank)) / np.sqrt(hidden), dtype)
        b = jnp.asarray(rng.standard_normal((num_slots, rank, out)) / np.sqrt(rank), dtype)
        a = a.at[20:].set(jnp.nan).at[0].set(0)
        b = b.at[20:].set(jnp.nan).at[0].set(0)
        x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
        y = jnp.asarray(rng.standard_normal((tokens, out)), dtype)
        errs = []
        h_ref = pk.lora_shrink(x, a, slots, backend="xla", seg_len=seg_len)
        y_ref = pk.lora_expand(y, h_ref, b, slots, backend="xla", seg_len=seg_len)
        h = pk.lora_shrink(x, a, slots, backend="pallas", seg_len=seg_len)
        y_new = pk.lora_expand(y, h_ref, b, slots, backend="pallas", seg_len=seg_len)
        for got, want in ((h, h_ref), (y_new, y_ref)):
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            errs.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)) if np.isfinite(got).all() else float("nan"))
        base_rows = np.asarray(slots) == 0
        exact = bool(np.array_equal(np.asarray(y_new)[base_rows], np.asarray(y)[base_rows]))
        print(f"check {jnp.dtype(dtype).name:8s} T={tokens:5d} D={hidden:5d} R={rank:4d} O={out:5d} seg={seg_len}: "
              f"shrink rel err {errs[0]:.2e}  expand rel err {errs[1]:.2e}  slot-0 rows exact {exact}", flush=True)


def tune() -> None:
    """Sweep knobs on the decode headline shapes; prints the best row per (op, tokens)."""
    rng = np.random.default_rng(0)
    num_layers = 16
    for tokens, distinct in ((16, 16), (64, 64), (64, 16), (256, 256), (256, 16), (512, 512)):
        sets = make_sets(rng, tokens, 4096, 4096, 16, distinct, num_layers, None)
        for op, grid in (
            ("shrink", [dict(block_k=bk, split_k=sk, num_warps=w, num_stages=st, block_rows=16)
                        for bk in (128, 256, 512) for sk in (1, 2, 4, 8) for w in (4,) for st in (3,)]),
            ("expand", [dict(block_out=bo, out_split=os, num_warps=4, num_stages=3, block_rows=16)
                        for bo in (64, 128, 256) for os in (1, 2, 4, 8, 16)]),
        ):
            results = []
            for knobs in grid:
                fn = make_fn(op, "pallas", None, {op: knobs})
                results.append((time_per_layer(fn, sets, num_layers, reps=4), knobs))
            results.sort(key=lambda r: r[0])
            for us, knobs in results[:3]:
                print(f"tune {op} T={tokens} distinct={distinct}: {us:.2f} us {knobs}", flush=True)


def write_results(out: Path, rows: list[dict], command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__, hbm_GBps=round(HBM_GBPS, 1),
                   command=command, rows=rows)
    (out / "kernels.json").write_text(json.dumps(payload, indent=1))
    lines = ["| op | mode | T | in->out | rank | distinct | floor us | " + " | ".join(BACKENDS) + " | pallas/floor |",
             "|" + "---|" * (8 + len(BACKENDS))]
    key = lambda r: (r["op"], r["mode"], r["tokens"], r["hidden_in"], r["hidden_out"], r["rank"], r["distinct"])
    for k, group in itertools.groupby(sorted(rows, key=key), key=key):
        group = {r["backend"]: r for r in group}
        floor = next(iter(group.values()))["floor_us"]
        cells = [f"{group[b]['us']:.1f}" if b in group else "-" for b in BACKENDS]
        ratio = f"{group['pallas']['us'] / floor:.2f}" if "pallas" in group else "-"
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}->{k[4]} | {k[5]} | {k[6]} | {floor:.1f} | "
                     + " | ".join(cells) + f" | {ratio} |")
    (out / "kernels.md").write_text(f"# LoRA kernels on {payload['device']} (JAX {jax.__version__}, "
                                    f"HBM copy {HBM_GBPS:.0f} GB/s)\n\nMedian microseconds per layer.\n`{command}`\n\n"
                                    + "\n".join(lines) + "\n")
    plot(out / "kernels.png", rows)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["op"] == "shrink+expand"]
    labels = sorted({(r["mode"], r["tokens"], r["hidden_out"], r["rank"], r["distinct"]) for r in sel})
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.5), 5))
    width = 0.8 / (len(BACKENDS) + 1)
    for i, backend in enumerate(BACKENDS + ("floor",)):
        vals = []
        for lab in labels:
            match = [r for r in sel if (r["mode"], r["tokens"], r["hidden_out"], r["rank"], r["distinct"]) == lab]
            if backend == "floor":
                vals.append(match[0]["floor_us"] if match else np.nan)
            else:
                vals.append(next((r["us"] for r in match if r["backend"] == backend), np.nan))
        ax.bar(np.arange(len(labels)) + i * width, vals, width, label=backend)
    ax.set_xticks(np.arange(len(labels)) + 0.4)
    ax.set_xticklabels([f"{m[0][0]} T{m[1]} o{m[2]} r{m[3]} d{m[4]}" for m in labels], rotation=75, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("us per layer (shrink + expand)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


BACKENDS = ("pallas", "xla", "ragged", "onehot")
HBM_GBPS = float("nan")


def main() -> None:
    global HBM_GBPS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("check", "tune", "bench", "quick"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    if args.mode == "check":
        return check()
    if args.mode == "tune":
        return tune()
    HBM_GBPS = hbm_gbps()
    print(f"hbm copy {HBM_GBPS:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    if args.mode == "quick":
        for case in (dict(mode="decode", tokens=256, hidden_in=4096, hidden_out=4096, rank=16, distinct=256),
                     dict(mode="decode", tokens=256, hidden_in=4096, hidden_out=4096, rank=16, distinct=16)):
            rows += run_case(rng, case, ("pallas", "xla"), ("shrink", "expand", "shrink+expand"), args.layers)
        return
    headline = lambda c: c["mode"] == "decode" and c["tokens"] == 256 and c["rank"] == 16 and c["hidden_out"] == 4096
    for case in itertools.chain(decode_cases(), prefill_cases()):
        ops = ("shrink", "expand", "shrink+expand") if headline(case) else ("shrink+expand",)
        rows += run_case(rng, case, BACKENDS, ops, args.layers)
    write_results(args.out, rows, "python benchmarks/kernels.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
