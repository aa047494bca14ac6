"""LoRA shrink + expand on the GPU: pallas vs XLA gather vs one-hot vs ragged_dot, against the bytes floor.

Times what a model step sees, not one dispatch: each case runs the op for `--layers` layers (each
with its own bank and inputs) inside one jitted function, calls it back to back (dispatch overlaps
the device work) and divides; input sets rotate so that the data touched between two uses of the
same set exceeds the 60 MB L2. Like the model, each pass builds the step's `lora_plan` once and
every layer's ops reuse it (its cost is inside the per-layer figure, spread over the layers).
HBM bandwidth is measured in the same run as a large device-to-device copy (bytes read + written).
Every case's floor counts the distinct adapter bytes, x read, h written and read, and y read and
written.

    python -m benchmarks.kernels.lora check              # pallas vs xla on awkward shapes (GPU, compiled)
    python -m benchmarks.kernels.lora tune               # sweep decode knobs, print tuning.py rows
    python -m benchmarks.kernels.lora bench --out DIR    # full table -> DIR/kernels.{json,md,png}
    python -m benchmarks.kernels.lora model              # scan over layers, plan hoisted vs per op
    python -m benchmarks.kernels.lora all --out DIR      # check, tune (installed for the bench), bench, model
    python -m benchmarks.kernels.lora all --smoke        # the same on tiny shapes in interpret mode (CPU)

`--budget-s` bounds the run: lower-priority cases are skipped once it is spent, and the results
written so far stay (they are rewritten after every case).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.paths import results_dir
from pallas_kernels.lora import common, tuning
from pallas_kernels.lora.expand import decode_expand, grouped_expand
from pallas_kernels.lora.shrink import grouped_shrink

L2_BYTES = 60e6
DTYPE = jnp.bfloat16


@dataclasses.dataclass
class Scale:
    """Sizes of one run: the real H200 one, or a tiny interpret-mode smoke test on CPU."""

    interpret: bool = False
    wide: int = 4096
    ffn: int = 11008
    tokens: tuple[int, ...] = (16, 64, 256, 512)
    repeats: int = 8
    max_sets: int = 16
    copy_elems: int = 1 << 30
    deadline: float = float("inf")

    def left(self) -> float:
        return self.deadline - time.perf_counter()


SMOKE = Scale(interpret=True, wide=256, ffn=320, tokens=(16, 32), repeats=1, max_sets=1, copy_elems=1 << 16)
S = Scale()
HBM_GBPS = float("nan")
BACKENDS = ("pallas", "pallas-rows", "pallas-grouped", "xla", "ragged", "onehot")


# -- measuring ------------------------------------------------------------------------------------


def hbm_gbps() -> float:
    x = jnp.ones((S.copy_elems,), jnp.bfloat16)
    copy = jax.jit(lambda v: v.copy())
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / np.median(times) / 1e9


def time_per_layer(fn, sets, num_layers: int, reps: int = 3) -> float:
    """Median-of-3 microseconds per layer: each call runs `repeats` passes over all `sets`."""
    all_sets = [layers for layers, _ in sets]
    slots = sets[0][1]
    jax.block_until_ready(fn(all_sets, slots))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(all_sets, slots) for _ in range(reps)]
        jax.block_until_ready(outs)
        rounds.append((time.perf_counter() - t0) / (reps * S.repeats * len(sets) * num_layers))
        del outs
    return float(np.median(rounds)) * 1e6


def repeated(apply):
    """jit(all_sets, slots) running `apply` S.repeats times over every set, nothing hoistable."""

    def run(all_sets, slots):
        def one_pass(_, carry):
            slots, _ = carry
            outs = [o for layers in all_sets for o in apply(layers, slots)]
            probe = outs[-1].reshape(-1)[0]  # +0 unless a NaN appears: each pass depends on the last
            return slots + (probe != probe).astype(slots.dtype), outs

        shapes = jax.eval_shape(lambda s: [o for layers in all_sets for o in apply(layers, s)], slots)
        init = (slots, [jnp.zeros(o.shape, o.dtype) for o in shapes])
        return jax.lax.fori_loop(0, S.repeats, one_pass, init)

    return jax.jit(run)


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


def make_fn(op: str, backend: str, seg_len: int | None, num_slots: int, knobs: dict | None = None):
    """backend "pallas-rows" / "pallas-grouped" pick the decode expand: per row (the product's) or the
    grouped candidate (rows sorted by slot, `grouped_expand(mode="decode")`); knobs override tuning.py."""
    impl = backend.split("-")[1] if "-" in backend else None
    backend = backend.split("-")[0]
    knobs = dict(knobs or {})
    if impl:
        knobs.setdefault("expand", {})["impl"] = impl
    mode = "decode" if seg_len is None else "prefill"

    def plan_for(slots, num_tokens):
        if backend != "pallas" or not knobs:
            return pk.lora_plan(slots, num_slots=num_slots, seg_len=seg_len, backend=backend)
        shrink = {**tuning.lookup("shrink", mode, num_tokens), **knobs.get("shrink", {})}
        expand = {**tuning.lookup("expand", mode, num_tokens), **knobs.get("expand", {})}
        heights = (shrink["block_rows"],) + ((expand["block_rows"],) if expand.get("impl") == "grouped" else ())
        groups = common.make_row_groups(slots, num_slots=num_slots, seg_len=seg_len, block_rows=heights)
        return pk.LoraPlan(
            slot_ids=slots,
            groups=groups,
            sort_order=None,
            group_sizes=None,
            backend="pallas",
            seg_len=seg_len,
            num_slots=num_slots,
        )

    def shrink(x, a, plan):
        if backend == "pallas" and knobs:
            return grouped_shrink(x, a, plan.groups, mode=mode, interpret=S.interpret, **knobs.get("shrink", {}))
        return pk.lora_shrink(x, a, None, backend=backend, seg_len=seg_len, plan=plan, interpret=S.interpret)

    def expand(y, h, b, plan):
        if backend == "pallas" and knobs and seg_len is None:
            expand_knobs = dict(knobs.get("expand", {}))
            if expand_knobs.pop("impl", "rows") == "grouped":
                return grouped_expand(y, h, b, plan.groups, mode="decode", interpret=S.interpret, **expand_knobs)
            return decode_expand(y, h, b, plan.slot_ids, interpret=S.interpret, **expand_knobs)
        return pk.lora_expand(y, h, b, None, backend=backend, seg_len=seg_len, plan=plan, interpret=S.interpret)

    def apply(layers, slots):
        plan = plan_for(slots, slots.shape[0])  # once per pass, shared by every layer (as in the model)
        outs = []
        for x, a, h, b, y in layers:
            if op == "shrink":
                outs.append(shrink(x, a, plan))
            elif op == "expand":
                outs.append(expand(y, h, b, plan))
            else:
                outs.append(expand(y, shrink(x, a, plan), b, plan))
        return outs

    return repeated(apply)


def make_sets(rng, num_tokens, hidden_in, hidden_out, rank, distinct, num_layers, seg_len):
    num_slots = distinct + 1
    touched = floor_bytes("shrink+expand", num_tokens, hidden_in, hidden_out, rank, distinct) * num_layers
    num_sets = int(min(S.max_sets, max(1, math.ceil(3 * L2_BYTES / touched))))
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


def case(tokens, distinct, rank=16, hidden_out=None, mode="decode", seg_len=None):
    c = dict(mode=mode, tokens=tokens, hidden_in=S.wide, hidden_out=hidden_out or S.wide, rank=rank, distinct=distinct)
    return {**c, "seg_len": seg_len} if seg_len else c


def all_cases():
    """In priority order: the headline decode cases first (a spent budget drops the tail)."""
    t_head = S.tokens[-2]
    yield case(t_head, t_head), True
    yield case(t_head, 16), True
    yield case(t_head, 1), True
    yield case(t_head, max(1, t_head // 4)), True
    for tokens in S.tokens:
        for distinct in sorted({1, 16, max(1, tokens // 4), tokens}):
            if distinct <= tokens and tokens != t_head:
                yield case(tokens, distinct), False
    for rank in (8, 64):
        for distinct in (16, t_head):
            yield case(t_head, distinct, rank=rank), False
    for tokens in S.tokens[1:3]:
        for distinct in (16, tokens):
            yield case(tokens, distinct, hidden_out=S.ffn), False
    tokens = 16 * S.tokens[-1] // 2 if not S.interpret else 64
    for seg_len in (128, 512, 2048) if not S.interpret else (16, 32):
        yield case(tokens, tokens // seg_len, mode="prefill", seg_len=seg_len), False


def run_case(rng, c, backends, ops, num_layers):
    seg_len = c.get("seg_len")
    sets = make_sets(rng, c["tokens"], c["hidden_in"], c["hidden_out"], c["rank"], c["distinct"], num_layers, seg_len)
    rows = []
    for op, backend in itertools.product(ops, backends):
        if backend == "onehot" and c["tokens"] * (c["distinct"] + 1) > (1 << 17):
            continue  # one-hot does T*S work per row: hopeless at this size, skip to save device time
        if backend.startswith("pallas-") and (seg_len is not None or op == "shrink"):
            continue  # the expand impl choice exists for decode only
        if backend in ("ragged", "onehot") and (S.interpret or op != "shrink+expand"):
            continue  # the slow references only where the comparison is made (saves device time)
        try:
            us = time_per_layer(make_fn(op, backend, seg_len, c["distinct"] + 1), sets, num_layers)
        except Exception as e:  # keep the run going: one failing variant must not lose the table
            print(f"FAILED {op} {backend} {c}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        floor_us = floor_bytes(op, c["tokens"], c["hidden_in"], c["hidden_out"], c["rank"], c["distinct"]) / (
            HBM_GBPS * 1e3
        )
        row = dict(
            op=op,
            **{k: c[k] for k in ("mode", "tokens", "hidden_in", "hidden_out", "rank", "distinct")},
            backend=backend,
            us=round(us, 2),
            floor_us=round(floor_us, 2),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- modes ----------------------------------------------------------------------------------------


def check() -> bool:
    """Compiled pallas (both decode expand impls, with and without a plan) vs xla on awkward shapes."""
    rng = np.random.default_rng(0)
    shapes = [
        (37, 2049, 48, 300, None),
        (256, 4096, 16, 11008, None),
        (512, 576, 1, 1536, None),
        (64, 1536, 128, 576, None),
        (1024, 4096, 16, 4096, 128),
        (384, 2049, 8, 2049, 128),
    ]
    cases = [(jnp.bfloat16, s) for s in shapes] + [(jnp.float32, shapes[0]), (jnp.float32, shapes[3])]
    if S.interpret:
        cases = [(jnp.float32, (37, 200, 24, 70, None)), (jnp.bfloat16, (32, 96, 8, 64, 16))]
    all_ok = True
    for dtype, (tokens, hidden, rank, out, seg_len) in cases:
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
        kw = dict(seg_len=seg_len, interpret=S.interpret)
        h_ref = pk.lora_shrink(x, a, slots, backend="xla", seg_len=seg_len)
        y_ref = pk.lora_expand(y, h_ref, b, slots, backend="xla", seg_len=seg_len)
        plan = pk.lora_plan(slots, num_slots=num_slots, seg_len=seg_len, backend="pallas")
        got = {
            "shrink": pk.lora_shrink(x, a, slots, backend="pallas", **kw),
            "shrink+plan": pk.lora_shrink(x, a, None, backend="pallas", plan=plan, **kw),
            "expand": pk.lora_expand(y, h_ref, b, slots, backend="pallas", **kw),
            "expand+plan": pk.lora_expand(y, h_ref, b, None, backend="pallas", plan=plan, **kw),
        }
        if seg_len is None:
            groups = common.make_row_groups(slots, num_slots=b.shape[0], seg_len=None, block_rows=())
            got["expand:rows"] = pk.bgmv_expand(y, h_ref, b, slots, interpret=S.interpret)
            got["expand:grouped"] = grouped_expand(
                y, h_ref, b, groups, mode="decode", interpret=S.interpret, block_rows=16, block_out=128
            )
        base_rows = np.asarray(slots) == 0
        parts = []
        for name, value in got.items():
            want = h_ref if name.startswith("shrink") else y_ref
            v, w = np.asarray(value, np.float64), np.asarray(want, np.float64)
            err = float(np.linalg.norm(v - w) / np.linalg.norm(w)) if np.isfinite(v).all() else float("nan")
            exact = name.startswith("shrink") or np.array_equal(np.asarray(value)[base_rows], np.asarray(y)[base_rows])
            ok = err < (2e-2 if dtype == jnp.bfloat16 else 1e-3) and exact
            all_ok &= ok
            parts.append(f"{name} {err:.1e}{'' if ok else ' BAD'}")
        print(
            f"check {jnp.dtype(dtype).name:8s} T={tokens:5d} D={hidden:5d} R={rank:4d} O={out:5d} seg={seg_len}: "
            + ", ".join(parts),
            flush=True,
        )
    print("check", "PASSED" if all_ok else "FAILED", flush=True)
    return all_ok


def tune_grid():
    if S.interpret:
        return (
            [dict(block_k=128, split_k=sk, num_warps=4, num_stages=3, block_rows=16) for sk in (1, 2)],
            [
                dict(impl="rows", block_rows=2, block_out=64, num_warps=4, num_stages=1),
                dict(impl="grouped", block_rows=4, block_out=64, out_split=2, num_warps=4, num_stages=1),
            ],
        )
    shrink = [
        dict(block_k=bk, split_k=sk, num_warps=w, num_stages=3, block_rows=16)
        for bk, sk, w in ((256, 2, 4), (256, 4, 4), (256, 1, 4), (512, 4, 8), (256, 8, 4))
    ]
    expand = [
        dict(impl="rows", block_rows=br, block_out=bo, num_warps=w, num_stages=1)
        for br, bo, w in ((2, 256, 4), (4, 256, 4), (1, 512, 4), (8, 128, 4))
    ] + [
        dict(impl="grouped", block_rows=br, block_out=bo, out_split=os, num_warps=4, num_stages=st)
        for br, bo, os, st in ((16, 128, 8, 3), (4, 128, 8, 1))
    ]
    return shrink, expand


def tune(num_layers: int, deadline: float) -> dict:
    """Per token bucket: the knobs with the smallest summed time over distinct = 16 and T (a static rule).

    Token counts in priority order (the headline first); a bucket left untuned when the time is
    spent keeps tuning.py's row."""
    rng = np.random.default_rng(0)
    shrink_grid, expand_grid = tune_grid()
    best = {}
    order = [S.tokens[1], S.tokens[0], S.tokens[-2], S.tokens[-1]]  # 64 (the e2e headline batch) first
    for tokens in dict.fromkeys(order):
        pats = sorted({min(16, tokens), tokens})
        sets = {d: make_sets(rng, tokens, S.wide, S.wide, 16, d, num_layers, None) for d in pats}
        for op, grid in (("expand", expand_grid), ("shrink", shrink_grid)):
            if time.perf_counter() > deadline:
                print(f"tune: budget spent, skipping {op} T={tokens}", flush=True)
                continue
            scored = []
            for knobs in grid:
                try:
                    per = [
                        time_per_layer(make_fn(op, "pallas", None, d + 1, {op: knobs}), sets[d], num_layers, reps=2)
                        for d in pats
                    ]
                except Exception as e:
                    print(f"tune FAILED {op} T={tokens} {knobs}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                scored.append((sum(per), per, knobs))
                print(f"tune {op} T={tokens} distinct={pats}: {[round(p, 2) for p in per]} us {knobs}", flush=True)
            if scored:
                scored.sort(key=lambda r: r[0])
                best[(op, tokens)] = scored[0][2]
                print(f"BEST {op} T={tokens}: {scored[0][2]} ({[round(p, 2) for p in scored[0][1]]} us)", flush=True)
    return best


def install(best: dict) -> None:
    """Puts tuned knobs into tuning.py's tables for this process, and prints them as rows to paste."""
    for (op, tokens), knobs in best.items():
        knobs = dict(knobs)
        if knobs.pop("impl", "rows") == "grouped":  # a candidate the product has no decode form of
            print(f"CANDIDATE WON expand T={tokens}: the grouped decode expand {knobs}; not installed", flush=True)
            continue
        table = tuning.TABLES[(op, "decode")]
        bucket = min((b for b in table if b >= tokens), default=max(table))
        table[bucket] = knobs
    for op in ("shrink", "expand"):
        print(f"{op.upper()}_DECODE = {{", flush=True)
        for bucket, knobs in sorted(tuning.TABLES[(op, "decode")].items()):
            print(f"    {bucket}: dict({', '.join(f'{k}={v!r}' for k, v in knobs.items())}),", flush=True)
        print("}", flush=True)


def model_scan(num_layers: int) -> list[dict]:
    """apply_group-like per-layer calls (qkv: one stacked shrink, three expands) inside lax.scan over
    layers, with the plan built once before the scan vs inside every op."""
    rng = np.random.default_rng(1)
    rank, outs = 16, (S.wide, S.wide // 4, S.wide // 4)
    rows = []
    tokens = S.tokens[-2]
    for distinct, backend, hoist in itertools.product((16, tokens), ("pallas", "xla"), (True, False)):
        if S.left() < 15:
            print("model: budget spent", flush=True)
            break
        num_slots = distinct + 1
        key = jax.random.key(int(rng.integers(1 << 30)))
        ka, kb, kx = jax.random.split(key, 3)
        a = jax.random.normal(ka, (num_layers, num_slots, S.wide, 3 * rank), DTYPE) * 0.02
        bs = tuple(
            jax.random.normal(jax.random.fold_in(kb, i), (num_layers, num_slots, rank, o), DTYPE) * 0.02
            for i, o in enumerate(outs)
        )
        x = jax.random.normal(kx, (tokens, S.wide), DTYPE)
        slots = jnp.asarray(slot_pattern(rng, tokens, distinct, None))
        kw = dict(backend=backend, interpret=S.interpret)

        def step(x, slots, a=a, bs=bs, kw=kw, hoist=hoist, num_slots=num_slots):
            plan = pk.lora_plan(slots, num_slots=num_slots, backend=kw["backend"]) if hoist else None

            def layer(x, bank):
                a_l, bs_l = bank
                h = pk.lora_shrink(x, a_l, slots, plan=plan, **kw)
                ys = tuple(jnp.zeros((x.shape[0], o), x.dtype) + x[:, :o] for o in outs)  # stand-in base outputs
                ys = pk.lora_expand_multi(ys, h, bs_l, slots, plan=plan, **kw)
                return (ys[0] + ys[1].sum() * 0 + ys[2].sum() * 0).astype(x.dtype), None

            return jax.lax.scan(layer, x, (a, bs))[0]

        fn = jax.jit(lambda x, s: jax.lax.fori_loop(0, S.repeats, lambda _, c: step(c, s), x))
        try:
            jax.block_until_ready(fn(x, slots))
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, slots))
                times.append((time.perf_counter() - t0) / (S.repeats * num_layers) * 1e6)
        except Exception as e:
            print(f"model FAILED {backend} hoist={hoist}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        floor = sum(floor_bytes("shrink+expand", tokens, S.wide, o, rank, distinct) for o in outs) / (HBM_GBPS * 1e3)
        row = dict(
            op="qkv scan",
            mode="decode",
            tokens=tokens,
            distinct=distinct,
            backend=backend,
            plan="hoisted" if hoist else "per op",
            us=round(float(np.median(times)), 2),
            floor_us=round(floor, 2),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write_results(out: Path, rows: list[dict], model_rows: list[dict], tuned: dict, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(
        device=str(jax.devices()[0].device_kind),
        jax_version=jax.__version__,
        hbm_GBps=round(HBM_GBPS, 1),
        command=command,
        tuned={f"{op} T={t}": k for (op, t), k in tuned.items()},
        rows=rows,
        model_rows=model_rows,
    )
    (out / "kernels.json").write_text(json.dumps(payload, indent=1))
    lines = [
        "| op | mode | T | in->out | rank | distinct | floor us | "
        + " | ".join(BACKENDS)
        + " | pallas/floor | pallas/best other |",
        "|" + "---|" * (9 + len(BACKENDS)),
    ]
    key = lambda r: (r["op"], r["mode"], r["tokens"], r["hidden_in"], r["hidden_out"], r["rank"], r["distinct"])
    for k, group in itertools.groupby(sorted(rows, key=key), key=key):
        group = {r["backend"]: r for r in group}
        floor = next(iter(group.values()))["floor_us"]
        cells = [f"{group[b]['us']:.1f}" if b in group else "-" for b in BACKENDS]
        others = [group[b]["us"] for b in ("xla", "ragged", "onehot") if b in group]
        ratio = f"{group['pallas']['us'] / floor:.2f}" if "pallas" in group else "-"
        vs = f"{group['pallas']['us'] / min(others):.2f}" if "pallas" in group and others else "-"
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}->{k[4]} | {k[5]} | {k[6]} | {floor:.1f} | "
            + " | ".join(cells)
            + f" | {ratio} | {vs} |"
        )
    model_lines = [
        "| group | T | distinct | backend | plan | us per layer | floor us |",
        "|---|---|---|---|---|---|---|",
    ]
    model_lines += [
        f"| {r['op']} | {r['tokens']} | {r['distinct']} | {r['backend']} | {r['plan']} | {r['us']:.1f} | "
        f"{r['floor_us']:.1f} |"
        for r in model_rows
    ]
    tuned_lines = [f"- {op} T={t}: `{k}`" for (op, t), k in tuned.items()]
    (out / "kernels.md").write_text(
        f"# LoRA kernels on {payload['device']} (JAX {jax.__version__}, HBM copy {HBM_GBPS:.0f} GB/s)\n\n"
        f"Median microseconds per layer; the step's `lora_plan` is built once per pass and shared by the layers.\n"
        f"pallas = the backend as shipped (tuning.py's rule); pallas-rows / pallas-grouped: the per-row decode expand / the grouped candidate.\n"
        f"Command: `{command}`\n\n"
        + "\n".join(lines)
        + "\n\n## Model-level: qkv group in lax.scan over layers\n\n"
        + "\n".join(model_lines)
        + "\n\n## Tuned in this run (installed for the table above)\n\n"
        + "\n".join(tuned_lines)
        + "\n"
    )
    plot(out / "kernels.png", rows)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["op"] == "shrink+expand"]
    labels = sorted({(r["mode"], r["tokens"], r["hidden_out"], r["rank"], r["distinct"]) for r in sel})
    names = ("pallas", "xla", "ragged", "onehot", "floor")
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.5), 5))
    width = 0.8 / len(names)
    for i, backend in enumerate(names):
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


def main() -> None:
    global HBM_GBPS, S
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=("check", "tune", "bench", "model", "all"))
    parser.add_argument("--out", type=Path, default=results_dir(__file__))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--tune-share", type=float, default=0.35, help="fraction of the budget for tuning")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    args = parser.parse_args()
    start = time.perf_counter()
    S = dataclasses.replace(SMOKE if args.smoke else Scale(), deadline=start + args.budget_s)
    num_layers = 2 if args.smoke else args.layers
    command = "python -m benchmarks.kernels.lora " + " ".join(sys.argv[1:])
    stamp = lambda what: print(f"== {what} at {time.perf_counter() - start:.0f}s", flush=True)
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    HBM_GBPS = hbm_gbps()
    print(f"hbm copy {HBM_GBPS:.0f} GB/s", flush=True)
    if args.mode in ("check", "all"):
        stamp("check")
        try:
            check()
        except Exception:
            traceback.print_exc()
    tuned = {}
    if args.mode in ("tune", "all"):
        stamp("tune")
        tuned = tune(max(2, num_layers // 2), start + args.tune_share * args.budget_s)
        install(tuned)
    rows, model_rows = [], []
    rng = np.random.default_rng(0)
    if args.mode in ("bench", "all"):
        stamp("bench")
        for c, headline in all_cases():
            if S.left() < (25 if not headline else 10):
                print(f"bench: budget spent, skipping {c}", flush=True)
                continue
            ops = ("shrink", "expand", "shrink+expand") if headline else ("shrink+expand",)
            backends = BACKENDS if headline else ("pallas", "xla", "ragged", "onehot")
            rows += run_case(rng, c, backends, ops, num_layers)
            write_results(args.out, rows, model_rows, tuned, command)
            if headline and c["distinct"] == 16 and not model_rows:  # model-level right after the headline
                stamp("model")
                model_rows = model_scan(num_layers)
                write_results(args.out, rows, model_rows, tuned, command)
    elif args.mode == "model":
        model_rows = model_scan(num_layers)
        write_results(args.out, rows, model_rows, tuned, command)
    stamp("done")


if __name__ == "__main__":
    main()
