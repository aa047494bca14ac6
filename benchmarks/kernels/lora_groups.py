"""A 7B layer's four LoRA module groups on the GPU: one launch a group (`lora.fused`) against the
split shrink + expand launches (`group.decode_group`, per-row expand or tile expand) and XLA,
per slot pattern.

Each variant runs what a model layer runs: q|k|v into one fused output, o, gate|up into one fused
output, down, for `--layers` layers in a `fori_loop` (the layer index traced, the bank stacked over
layers as the engine holds it, every layer's output feeding the next layer's add), with the step's
`lora_plan` built once per call. Variants are tuning.py group rows, installed in this process
before each jit. Patterns are data: per token count T, `distinct` adapters spread over the rows,
and "chunk" patterns (a prompt chunk of one adapter beside decode rows), which is what the ragged
step runs through these kernels.

    python -m benchmarks.kernels.lora_groups --out DIR [--layers 8] [--tokens 64 16 256 512 1024]
        [--ranks 16 64] [--check-ranks 8 32] [--families split xla tiles fused] [--max-fused N]
        [--budget-s S]
    python -m benchmarks.kernels.lora_groups --smoke        # tiny shapes in interpret mode (CPU)

Writes DIR/group_kernels.json after every case: rows (variant, knobs, T, pattern, rank, us per
layer, floor us, max |diff| against xla), and `best` per rank and T (the candidate with the least
summed time over that T's patterns), the data behind tuning.py's GROUP_DECODE rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.common import hbm_gbps
from pallas_kernels.lora import tuning

DTYPE = jnp.bfloat16
SPLIT = dict(impl="split", block_rows=16, block_k=128, block_out=256, col_split=1, num_warps=4, num_stages=3)
# (block_k, block_out, col_split, num_warps, num_stages). The first sweep (block_k 64-256, col_split
# 1-4) lost to the split launches below 1,024 rows: a program's shrink is a serial loop over D, so
# deeper block_k and more column runs (more programs, the shrink recomputed from L2) come next.
CANDIDATES = [
    dict(impl="fused", block_rows=16, block_k=bk, block_out=bo, col_split=cs, num_warps=w, num_stages=st)
    for bk, bo, cs, w, st in (
        (256, 256, 1, 4, 3),
        (256, 256, 2, 4, 3),
        (512, 256, 2, 4, 3),
        (512, 256, 4, 8, 3),
        (512, 512, 2, 8, 3),
        (1024, 256, 2, 8, 2),
        (1024, 256, 4, 8, 2),
        (1024, 512, 8, 8, 2),
    )
]


# The split form with the tile expand (`decode_group(tiles=...)`): (block_out, num_warps). The shrink
# is the split form's; the expand reads each b column block once per 16-row work item. The first
# sweep (H100, results/archive/group_probe_s11/g) also ran block_out 64 / 4 warps and 512 / 8 warps: both
# lost to these two at every rank and T.
TILE_CANDIDATES = [
    dict(impl="split_tiles", block_rows=16, block_out=bo, num_warps=w, num_stages=1) for bo, w in ((128, 4), (256, 4))
]
FAMILIES = ("split", "xla", "tiles", "fused")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's group shapes: hidden, kv width (q|k|v), ffn; slots in the bank."""

    hidden: int = 4096
    kv: int = 4096
    ffn: int = 11008
    slots: int = 257
    interpret: bool = False


H200 = Shape()
SMOKE = Shape(hidden=64, kv=32, ffn=96, slots=9, interpret=True)


def groups_of(s: Shape) -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, input width, module output widths), in layer order."""
    return [("qkv", s.hidden, (s.hidden, s.kv, s.kv)), ("o", s.hidden, (s.hidden,)),
            ("gate_up", s.hidden, (s.ffn, s.ffn)), ("down", s.ffn, (s.hidden,))]  # fmt: skip


def patterns(tokens: int, rng: np.random.Generator, slots: int) -> dict[str, np.ndarray]:
    """Slot patterns at T rows: distinct adapters spread over rows, and prompt chunks beside decode rows."""
    out = {}
    # At most slots - 1 adapters: a slot id past the bank is not a valid input (the first H200 run of
    # T=2048 on a 257-slot bank asked for 512 and every family read past the bank, results/archive/probe_s11b).
    for distinct in sorted({1, min(max(1, tokens // 4), slots - 1), min(tokens, slots - 1)}):
        out[f"d{distinct}"] = (1 + rng.permutation(np.arange(tokens) % distinct)).astype(np.int32)
    if tokens >= 512:  # ragged steps: 400-token chunks of one adapter each, the rest decode rows on 64 adapters
        chunks = [np.full(400, 1 + c, np.int32) for c in range(tokens // 512)]
        decode = tokens - 400 * len(chunks)
        out["chunks"] = np.concatenate([*chunks, 1 + rng.integers(0, min(64, slots - 1), decode).astype(np.int32)])
    return out


def floor_bytes(s: Shape, tokens: int, slot_ids: np.ndarray, rank: int) -> int:
    """Distinct adapters' A and B, x read, y read and written: per layer, all four groups."""
    distinct = len(set(slot_ids.tolist()) - {0})
    item = jnp.dtype(DTYPE).itemsize
    total = 0
    for _, d_in, outs in groups_of(s):
        total += distinct * (d_in * rank * len(outs) + rank * sum(outs)) + tokens * (d_in + 2 * sum(outs))
    return total * item


def make_bank(s: Shape, rank: int, layers: int, key) -> list[tuple[jax.Array, tuple[jax.Array, ...]]]:
    bank = []
    for g, (_, d_in, outs) in enumerate(groups_of(s)):
        ka, *kb = jax.random.split(jax.random.fold_in(key, g), 1 + len(outs))
        a = (jax.random.normal(ka, (layers, s.slots, d_in, rank * len(outs)), DTYPE) * 0.02).at[:, 0].set(0)
        bs = tuple(
            (jax.random.normal(k, (layers, s.slots, rank, o), DTYPE) * 0.02).at[:, 0].set(0) for k, o in zip(kb, outs)
        )
        bank.append((a, bs))
    return bank


def make_step(s: Shape, backend: str, layers: int):
    """jit(xs, ys, bank, slots) -> ys after `layers` layers of the four groups (outputs chained)."""

    def step(xs, ys, bank, slots):
        plan = pk.lora_plan(slots, num_slots=s.slots, backend=backend)

        def layer(i, ys):
            new = []
            for (_, _, outs), x, y, (a, bs) in zip(groups_of(s), xs, ys, bank):
                cols = tuple(int(c) for c in np.cumsum((0,) + outs[:-1]))
                (y,) = pk.lora_group(
                    x, a, (y,), bs, None, backend=backend, interpret=s.interpret, plan=plan, layer=i, out_cols=cols
                )
                new.append(y)
            return tuple(new)

        return jax.lax.fori_loop(0, layers, layer, tuple(ys))

    return jax.jit(step)


def timed_us(fn, args, per: int, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(reps)]
        jax.block_until_ready(outs)
        rounds.append((time.perf_counter() - t0) / (reps * per))
        del outs
    return float(np.median(rounds)) * 1e6


def install(knobs: dict) -> None:
    """Makes `knobs` tuning.py's group row for every decode T and rank in this process."""
    tuning.GROUP_DECODE.clear()
    tuning.GROUP_DECODE[1 << 30] = {1 << 30: dict(knobs)}


def run_tokens(s, tokens, rank, variants, args, hbm, rows, rng, key) -> None:
    bank = make_bank(s, rank, args.layers, key)
    kx = jax.random.fold_in(key, 99)
    xs = tuple(
        jax.random.normal(jax.random.fold_in(kx, g), (tokens, d), DTYPE) for g, (_, d, _) in enumerate(groups_of(s))
    )
    ys = tuple(
        jax.random.normal(jax.random.fold_in(kx, 10 + g), (tokens, sum(o)), DTYPE)
        for g, (_, _, o) in enumerate(groups_of(s))
    )
    pats = patterns(tokens, rng, s.slots)
    xla = make_step(s, "xla", args.layers)
    want = {p: xla(xs, ys, bank, jnp.asarray(sl)) for p, sl in pats.items()}
    for name, knobs in variants:
        if time.perf_counter() > args.deadline:
            print(f"budget spent: skipping {name} T={tokens} rank={rank}", flush=True)
            return
        install(knobs if knobs else SPLIT)
        fn = xla if name == "xla" else make_step(s, "pallas", args.layers)
        for p, sl in pats.items():
            try:
                slots = jnp.asarray(sl)
                got = fn(xs, ys, bank, slots)
                diff = max(
                    float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in zip(got, want[p])
                )
                us = timed_us(fn, (xs, ys, bank, slots), args.layers, args.reps)
            except Exception as e:  # one failing variant must not lose the table
                print(f"FAILED {name} T={tokens} {p} rank={rank}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                break
            floor = floor_bytes(s, tokens, sl, rank) / (hbm * 1e3)
            row = dict(variant=name, knobs=knobs, tokens=tokens, pattern=p, rank=rank, us=round(us, 2),
                       floor_us=round(floor, 2), x_floor=round(us / floor, 2), max_abs_diff_vs_xla=diff)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def best_rows(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Per rank and T: the pallas variant with the least summed time over that T's patterns."""
    best: dict[str, dict[str, dict]] = {}
    for rank, tokens in sorted({(r["rank"], r["tokens"]) for r in rows}):
        at = [r for r in rows if r["tokens"] == tokens and r["rank"] == rank and r["variant"] != "xla"]
        npat = len({r["pattern"] for r in at})
        sums: dict[str, list[float]] = {}
        for r in at:
            sums.setdefault(r["variant"], []).append(r["us"])
        full = {v: sum(u) for v, u in sums.items() if len(u) == npat}
        if full:
            v = min(full, key=full.get)
            knobs = next(r["knobs"] for r in at if r["variant"] == v) or SPLIT
            best.setdefault(str(rank), {})[str(tokens)] = dict(
                variant=v,
                summed_us=round(full[v], 2),
                knobs=knobs,
                split_summed_us=round(full.get("split", float("nan")), 2),
            )
    return best


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 16, 256, 512, 1024])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64], help="ranks that run every candidate")
    p.add_argument(
        "--check-ranks",
        type=int,
        nargs="*",
        default=[8, 32],
        help="ranks that run the split form, xla and the first rank's best",
    )
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="variant families to run")
    p.add_argument("--max-fused", type=int, default=len(CANDIDATES), help="run only the first N fused candidates")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=float("inf"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.deadline = time.perf_counter() + args.budget_s
    s = SMOKE if args.smoke else H200
    if args.smoke:
        args.layers, args.reps = min(args.layers, 2), 1
    hbm = 1.0 if args.smoke else hbm_gbps()
    variants = [("split", None), ("xla", None)]
    variants += [(f"tiles{i}", c) for i, c in enumerate(TILE_CANDIDATES)]
    variants += [(f"fused{i}", c) for i, c in enumerate(CANDIDATES[: args.max_fused])]
    variants = [(n, c) for n, c in variants if n.rstrip("0123456789") in args.families]
    if args.smoke:
        variants = [v for v in variants if v[0] in ("split", "xla", "tiles0", "fused0")]
    rows: list[dict] = []
    rng, key = np.random.default_rng(0), jax.random.key(0)
    for rank in args.ranks + args.check_ranks:
        for tokens in args.tokens:
            chosen = variants
            if rank not in args.ranks:  # the split form against the first rank's best row at this T
                best = best_rows(rows).get(str(args.ranks[0]), {}).get(str(tokens))
                chosen = [("split", None), ("xla", None)]
                if best and best["variant"] not in ("split", "xla"):
                    chosen.append((best["variant"], best["knobs"]))
            run_tokens(s, tokens, rank, chosen, args, hbm, rows, rng, key)
            write(args, rows, hbm)
    for rank, per_t in best_rows(rows).items():
        for tokens, b in per_t.items():
            print(f"BEST rank={rank} T={tokens}: {b}", flush=True)


def write(args, rows: list[dict], hbm: float) -> None:
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    doc = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__, layers=args.layers,
               hbm_gbps=round(hbm, 1), command=" ".join(sys.argv), rows=rows, best=best_rows(rows))  # fmt: skip
    (args.out / "group_kernels.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
