"""Paged true-rank LoRA kernels against the padded bank, on the serving benchmark's rank mixes.

One shrink + expand (4096 -> 4096, bf16): decode steps with every row on its own adapter, and a
mixed 2,048-token step (seven prefill chunks of one adapter each, then 64 decode rows). `padded`: the
shipped Pallas kernels over a bank padded to the mix's max rank (the step's row plan built outside
the timing, as the engine shares it across layers); `paged`: `pallas_kernels.lora.paged` reading each
adapter's true-rank pages through its page table; `unified`: `pallas_kernels.lora.unified`, one
program per row, reading each adapter out of a 7B-layer KV pool's pages (16 positions, 32 KV heads
of 128: S-LoRA's unified pool); `tiled`: `pallas_kernels.lora.unified_tiled`, the same pool read once
per tile of rows sharing an adapter, on the tensor cores. All run on the same factors (the padded bank holds them zero-padded), and their
results are compared before timing. Bytes: the device bytes the adapters of the case take in each
layout (unified: this one module's pages alone; the engine lays every module of an adapter in one
run, so a q/k/v/o rank-8 adapter takes 2 pages, not 4 x 1).

    python -m benchmarks.kernels.paged_lora --out DIR     # GPU -> DIR/paged_lora.{json,md}
    python -m benchmarks.kernels.paged_lora --smoke       # tiny shapes in interpret mode (CPU)
    python -m benchmarks.kernels.paged_lora --out DIR --cases s1:64:decode s2:64:decode   # some cases
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.common import best_ms
from pallas_kernels.lora import tuning
from pallas_kernels.lora.common import make_row_groups
from pallas_kernels.lora.paged import PagedLayout, paged_expand, paged_shrink
from pallas_kernels.lora.unified import unified_expand, unified_shrink
from pallas_kernels.lora.unified_tiled import unified_tiled_expand, unified_tiled_shrink

MIXES = {"s1": (8,), "s2": (8, 16, 32, 64)}  # the serving benchmark's rank settings
PAGE_ROWS = 8
BLOCKS = (128, 256, 512)  # the paged kernels' column block, swept on the GPU
RANK_BLOCKS = (8, 16, 32)  # the unified kernels' rank-rows per step, swept (the tiled ones from 16)
# The per-row unified shrink's (k_splits, unroll), swept with each rank block: (1, 1) is one program
# a rank block, one chunk a loop step.
SHRINK_SPLITS = ((1, 1), (1, 4), (4, 1), (4, 4), (8, 2), (2, 8))
# The tiled unified kernels' rows a tile (pallas_kernels.lora.tuning.UNIFIED_TILED), swept: a taller tile
# reads a prefill chunk's adapter fewer times, and wastes rows of tiles that hold a decode row or two.
TILE_ROWS = (16, 32, 64)
MIXED_RUNS, MIXED_DECODE_ROWS = 7, 64  # the mixed step: prefill chunks of one adapter each, decode rows
KV_PAGE = (16, 32, 128)  # positions, KV heads, head_dim of one page of the 7B shape's KV pool


def _error(label: str, fn, want: np.ndarray, *args) -> float:
    """`fn(*args)`'s relative max error against the padded bank's `want`; raises past the tolerance."""
    got = np.asarray(fn(*args), np.float32)
    err = float(np.max(np.abs(want - got)) / (np.max(np.abs(want)) + 1e-6))
    if not np.isfinite(got).all() or err > 2e-2:
        raise RuntimeError(f"{label} differs from padded (relative max error {err:.3g})")
    return err


def _best_paged(paged_at, x, y, reps: int, blocks) -> dict:
    """Fastest paged time over the column blocks, and its block."""
    timed = {block: 1e3 * best_ms(paged_at(block), x, y, reps=reps) for block in blocks}
    block = min(timed, key=timed.get)
    return {"paged_us": timed[block], "paged_block": block}


def _case(rng, ranks: np.ndarray, hidden: int, dtype):
    """Random factors of `ranks` as a padded bank ([N+1, D, R] / [N+1, R, D], slot 0 zero) and as a
    page pool with its tables."""
    num, max_rank = len(ranks), int(ranks.max())
    max_pages = -(-max_rank // PAGE_ROWS)
    a = np.zeros((num + 1, hidden, max_rank), np.float32)
    b = np.zeros((num + 1, max_rank, hidden), np.float32)
    pages = [-(-int(r) // PAGE_ROWS) for r in ranks]
    pool = np.zeros((1 + 2 * sum(pages), PAGE_ROWS, hidden), np.float32)
    order = 1 + rng.permutation(pool.shape[0] - 1)
    tables = np.zeros((2, num, max_pages), np.int32)
    taken = 0
    for n, r in enumerate(ranks):
        a[n + 1, :, :r] = rng.standard_normal((hidden, r)) / np.sqrt(hidden)
        b[n + 1, :r] = rng.standard_normal((r, hidden)) / np.sqrt(r)
        for f, rows in enumerate((a[n + 1, :, :r].T, b[n + 1, :r])):
            for j in range(pages[n]):
                tables[f, n, j] = order[taken]
                chunk = rows[j * PAGE_ROWS : (j + 1) * PAGE_ROWS]
                pool[order[taken], : len(chunk)] = chunk
                taken += 1
    cast = lambda v: jnp.asarray(v, dtype)  # noqa: E731
    return cast(a), cast(b), cast(pool), jnp.asarray(tables[0]), jnp.asarray(tables[1])


def _unified_case(a: jax.Array, b: jax.Array, ranks: np.ndarray, kv_page: tuple[int, int, int], dtype):
    """The padded bank's factors as runs in a one-layer KV pool: slot n's run is A^T's rank-rows then
    B's, over consecutive pages; (k, v, pages [N, MP], A^T offsets, B offsets, bytes of the pages)."""
    seg = int(np.prod(kv_page))
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    hidden = a.shape[1]
    need = [-(-2 * int(r) * hidden // (2 * seg)) for r in ranks]
    flat_k = np.zeros((1 + sum(need), seg), np.float32)
    flat_v = np.zeros_like(flat_k)
    pages = np.zeros((len(ranks), max(need)), np.int32)
    first = 1
    for n, r in enumerate(ranks):
        run = np.zeros(need[n] * 2 * seg, np.float32)
        run[: r * hidden] = a[n + 1, :, :r].T.reshape(-1)
        run[r * hidden : 2 * r * hidden] = b[n + 1, :r].reshape(-1)
        for i in range(need[n]):
            pages[n, i] = first + i
            flat_k[first + i], flat_v[first + i] = (
                run[2 * i * seg : (2 * i + 1) * seg],
                run[(2 * i + 1) * seg : (2 * i + 2) * seg],
            )
        first += need[n]
    shape = (1, flat_k.shape[0], *kv_page)
    k, v = (jnp.asarray(f.reshape(shape), dtype) for f in (flat_k, flat_v))
    b_offsets = jnp.asarray(np.asarray(ranks) * hidden, jnp.int32)
    return (
        k,
        v,
        jnp.asarray(pages),
        jnp.zeros((len(ranks),), jnp.int32),
        b_offsets,
        int(sum(need) * 2 * seg * jnp.dtype(dtype).itemsize),
    )


def _rows(rng, mix: str, num_tokens: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(ranks [N] of the case's adapters, adapter [T] of each row). decode: every row its own
    adapter; mixed: a 2,048-token step as the serving engine runs it, MIXED_RUNS prefill chunks of
    one adapter each, then decode rows on their own adapters."""
    if kind == "decode":
        return rng.choice(np.asarray(MIXES[mix]), size=num_tokens).astype(np.int32), np.arange(num_tokens)
    run = (num_tokens - min(MIXED_DECODE_ROWS, num_tokens // 4)) // MIXED_RUNS
    decode = num_tokens - run * MIXED_RUNS
    ids = np.concatenate([np.repeat(np.arange(MIXED_RUNS), run), MIXED_RUNS + np.arange(decode)])
    return rng.choice(np.asarray(MIXES[mix]), size=MIXED_RUNS + decode).astype(np.int32), ids


def run_case(
    rng,
    mix: str,
    num_tokens: int,
    kind: str,
    hidden: int,
    dtype,
    interpret: bool,
    reps: int,
    tile_rows=TILE_ROWS,
    quick: bool = False,
) -> dict:
    ranks, rows = _rows(rng, mix, num_tokens, kind)
    a, b, pool, a_table, b_table = _case(rng, ranks, hidden, dtype)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
    y = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
    ids = jnp.asarray(rows, jnp.int32)
    rank_arr = jnp.asarray(ranks)
    # The step's row grouping is built once per step and shared by every layer's ops: outside the timing.
    plan = pk.lora_plan(ids + 1, num_slots=len(ranks) + 1, backend="pallas")
    groups = make_row_groups(ids, num_slots=len(ranks), seg_len=None, block_rows=tuple(tile_rows))

    @jax.jit
    def padded(x, y, plan):
        h = pk.lora_shrink(x, a, ids + 1, backend="pallas", interpret=interpret, plan=plan)
        return pk.lora_expand(y, h, b, ids + 1, backend="pallas", interpret=interpret, plan=plan)

    def paged_at(block: int):
        def paged(x, y):
            h = paged_shrink(x, pool, a_table, rank_arr, ids, block=block, interpret=interpret)
            return paged_expand(y, h, pool, b_table, rank_arr, ids, block=block, interpret=interpret)

        return jax.jit(paged)

    kv_page = KV_PAGE if not interpret else (2, 2, 8)
    k, v, pages, a_off, b_off, unified_bytes = _unified_case(a, b, ranks, kv_page, dtype)
    layer, max_rank = jnp.int32(0), int(ranks.max())
    # B's rank-rows start at r * hidden: every offset is a multiple of hidden's power of two.
    align = min(128, hidden & -hidden)

    def unified_at(rank_block: int, k_splits: int = 1, unroll: int = 1, num_stages: int = 1):
        def unified(x, y):
            common = dict(align=align, rank_block=rank_block, interpret=interpret)
            # As the engine calls it: the expand adds the splits' partial sums.
            split = dict(k_splits=k_splits, unroll=unroll, num_stages=num_stages, partials=k_splits > 1)
            h = unified_shrink(x, k, v, layer, pages, a_off, rank_arr, ids, max_rank=max_rank, **common, **split)
            return unified_expand(y, h, k, v, layer, pages, b_off, rank_arr, ids, **common)

        return jax.jit(unified)

    def tiled_at(rank_block: int, block_rows: int):
        def tiled(x, y, groups):
            common = dict(align=align, block_rows=block_rows, rank_block=rank_block, interpret=interpret)
            h = unified_tiled_shrink(x, k, v, layer, pages, a_off, rank_arr, groups, max_rank=max_rank, **common)
            return unified_tiled_expand(y, h, k, v, layer, pages, b_off, rank_arr, groups, **common)

        return jax.jit(tiled)

    # Any split and unroll takes any width (uneven splits, a tail loop); the smoke run takes two.
    splits = SHRINK_SPLITS[:1] + SHRINK_SPLITS[-1:] if interpret else SHRINK_SPLITS
    rank_blocks, first_stages = (16,) if interpret else RANK_BLOCKS, 1
    if quick:  # the per-row shrink at the engine's knobs for this row count, one paged block
        knobs = tuning.unified_shrink_knobs(num_tokens)
        splits = ((knobs["k_splits"], knobs["unroll"]),)
        rank_blocks, first_stages = (knobs["rank_block"],), knobs["num_stages"]
    want = np.asarray(padded(x, y, plan), np.float32)
    case = f"{mix} T={num_tokens}"
    err = max(
        _error(f"{case}: paged", paged_at(BLOCKS[0]), want, x, y),
        *(_error(f"{case}: tiled {br} rows", tiled_at(16, br), want, x, y, groups) for br in tile_rows),
    )
    unified_us = {}
    for rb in rank_blocks:  # every knob set is checked before it is timed
        for ks, un in splits:
            fn = unified_at(rb, ks, un, first_stages)
            err = max(err, _error(f"{case}: unified rb{rb}/ks{ks}/u{un}", fn, want, x, y))
            unified_us[(rb, ks, un, first_stages)] = 1e3 * best_ms(fn, x, y, reps=reps)
    plain = {key: t for key, t in unified_us.items() if key[1:] == (1, 1, 1)}
    best = min(unified_us, key=unified_us.get)
    for stages in () if interpret or quick else (2, 3):  # software pipelining, on the best split
        fn = unified_at(*best[:3], stages)
        err = max(err, _error(f"{case}: unified stages {stages}", fn, want, x, y))
        unified_us[(*best[:3], stages)] = 1e3 * best_ms(fn, x, y, reps=reps)
    best = min(unified_us, key=unified_us.get)
    tiled_us = {
        (rb, br): 1e3 * best_ms(tiled_at(rb, br), x, y, groups, reps=reps)
        for rb in ((16,) if interpret or quick else RANK_BLOCKS)
        if rb >= 16
        for br in tile_rows
    }
    tiled_best = min(tiled_us, key=tiled_us.get)
    itemsize = jnp.dtype(dtype).itemsize
    layout = PagedLayout(page_rows=PAGE_ROWS, width=hidden, itemsize=itemsize, max_pages=a_table.shape[1])
    return {
        "mix": mix,
        "kind": kind,
        "T": num_tokens,
        "adapters": len(ranks),
        "hidden": hidden,
        "ranks": sorted(set(ranks.tolist())),
        "padded_us": 1e3 * best_ms(padded, x, y, plan, reps=reps),
        **_best_paged(paged_at, x, y, reps, blocks=BLOCKS[:1] if interpret or quick else BLOCKS[:2]),
        "unified_us": min(unified_us.values()),
        "unified_rank_block": best[0],
        "unified_k_splits": best[1],
        "unified_unroll": best[2],
        "unified_num_stages": best[3],
        "unified_unsplit_us": min(plain.values(), default=None),
        "unified_knobs_us": {f"rb{rb}/ks{ks}/u{un}/st{st}": round(t, 2) for (rb, ks, un, st), t in unified_us.items()},
        "tiled_us": tiled_us[tiled_best],
        "tiled_rank_block": tiled_best[0],
        "tiled_tile_rows": tiled_best[1],
        "tiled_knobs_us": {f"rb{rb}/rows{br}": round(t, 2) for (rb, br), t in tiled_us.items()},
        "padded_bytes": int((a.size - a[0].size + b.size - b[0].size) * itemsize),
        "paged_bytes": int(sum(layout.module_bytes(int(r)) for r in ranks)),
        "unified_bytes": unified_bytes,
        "max_rel_err": err,
    }


def _markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"# Paged true-rank LoRA kernels vs the padded bank on {device}",
        "",
        "Shrink + expand of one 4096-wide module; microseconds per call (best knob: paged column block, "
        "unified rank block, shrink k-splits and unroll; unsplit: the best with one program a rank block "
        "and one chunk a step; tiled rank block and rows a tile); time against padded; bytes of the adapters.",
        "",
        "| mix | step | T | adapters | ranks | padded us | paged us | unified us | unified unsplit us | tiled us | paged / unified / tiled vs padded | padded MB | paged MB | unified MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:  # rows of older runs lack the knobs added since: "-"
        p = r["padded_us"]
        lines.append(
            f"| {r['mix']} | {r['kind']} | {r['T']} | {r['adapters']} | {r['ranks']} | {p:.1f} | "
            f"{r['paged_us']:.1f} ({r['paged_block']}) | "
            f"{r['unified_us']:.1f} (rb {r['unified_rank_block']}, ks {r.get('unified_k_splits', '-')}, "
            f"u {r.get('unified_unroll', '-')}, st {r.get('unified_num_stages', '-')}) | "
            f"{'-' if r.get('unified_unsplit_us') is None else format(r['unified_unsplit_us'], '.1f')} | "
            f"{r['tiled_us']:.1f} (rb {r['tiled_rank_block']}, {r.get('tiled_tile_rows', 16)} rows) | "
            f"{r['paged_us'] / p:.2f} / {r['unified_us'] / p:.2f} / {r['tiled_us'] / p:.2f} | "
            f"{r['padded_bytes'] / 1e6:.1f} | {r['paged_bytes'] / 1e6:.1f} | {r['unified_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _write(rows: list[dict], out: Path | None) -> str:
    text = _markdown(rows, jax.devices()[0].device_kind)
    if out is not None:  # after every case: a run cut short keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / "paged_lora.json").write_text(json.dumps(rows, indent=1))
        (out / "paged_lora.md").write_text(text)
    return text


def _parse_case(text: str) -> tuple[str, int, str]:
    mix, tokens, kind = text.split(":")
    if mix not in MIXES or kind not in ("decode", "mixed") or int(tokens) < 1:
        raise SystemExit(f"case {text!r}: need MIX:T:KIND with MIX in {sorted(MIXES)}, KIND decode or mixed")
    return mix, int(tokens), kind


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for paged_lora.{json,md}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument(
        "--cases", nargs="+", default=None, help="MIX:T:KIND cases (e.g. s1:64:decode s2:2048:mixed); default all"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="no knob sweep but the tiled kernels' rows a tile: rank block 16, the per-row shrink's tuned splits, "
        "the paged kernels' first column block",
    )
    parser.add_argument(
        "--tile-rows",
        nargs="+",
        type=int,
        default=None,
        help=f"the tiled kernels' rows a tile, swept (default {TILE_ROWS}; smoke 16 32)",
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.smoke:
        cases = [("s1", 4, "decode"), ("s2", 6, "decode"), ("s2", 24, "mixed")]
        hidden, dtype, interpret, reps = 64, jnp.float32, True, 1
    else:
        cases = [("s2", 2048, "mixed"), *((m, t, "decode") for m in MIXES for t in (64, 256))]
        hidden, dtype, interpret, reps = 4096, jnp.bfloat16, False, 20
    if args.cases:
        cases = [_parse_case(c) for c in args.cases]
    rows = []
    for mix, num_tokens, kind in cases:
        tile_rows = args.tile_rows or (TILE_ROWS[:2] if args.smoke else TILE_ROWS)
        rows.append(run_case(rng, mix, num_tokens, kind, hidden, dtype, interpret, reps, tile_rows, args.quick))
        text = _write(rows, args.out)
        print(f"{mix} {kind} T={num_tokens}: done", flush=True)
    print(text)


if __name__ == "__main__":
    main()
