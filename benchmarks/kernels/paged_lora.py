"""Paged true-rank LoRA kernels against the padded bank, on the serving benchmark's rank mixes.

One decode shrink + expand (4096 -> 4096, bf16), every row on its own adapter. `padded`: the shipped
Pallas kernels over a bank padded to the mix's max rank; `paged`: `pallas_kernels.lora.paged` reading
each adapter's true-rank pages through its page table; `unified`: `pallas_kernels.lora.unified`
reading each adapter out of a 7B-layer KV pool's pages (16 positions, 32 KV heads of 128: S-LoRA's
unified pool). All run on the same factors (the padded bank holds them zero-padded), and their
results are compared before timing. Bytes: the device bytes the adapters of the case take in each
layout.

    python -m benchmarks.kernels.paged_lora --out DIR     # GPU -> DIR/paged_lora.{json,md}
    python -m benchmarks.kernels.paged_lora --smoke       # tiny shapes in interpret mode (CPU)
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
from pallas_kernels.lora.paged import PagedLayout, paged_expand, paged_shrink
from pallas_kernels.lora.unified import unified_expand, unified_shrink

MIXES = {"s1": (8,), "s2": (8, 16, 32, 64)}  # the serving benchmark's rank settings
PAGE_ROWS = 8
BLOCKS = (128, 256, 512)  # the paged kernels' column block, swept on the GPU
RANK_BLOCKS = (8, 16, 32)  # the unified kernels' rank-rows per step, swept with the column block
KV_PAGE = (16, 32, 128)  # positions, KV heads, head_dim of one page of the 7B shape's KV pool


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


def _best_unified(unified_at, x, y, reps: int, knobs) -> dict:
    timed = {knob: 1e3 * best_ms(unified_at(*knob), x, y, reps=reps) for knob in knobs}
    knob = min(timed, key=timed.get)
    return {"unified_us": timed[knob], "unified_block": knob[0], "unified_rank_block": knob[1]}


def run_case(rng, mix: str, num_tokens: int, hidden: int, dtype, interpret: bool, reps: int) -> dict:
    ranks = rng.choice(np.asarray(MIXES[mix]), size=num_tokens).astype(np.int32)
    a, b, pool, a_table, b_table = _case(rng, ranks, hidden, dtype)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
    y = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
    ids = jnp.arange(num_tokens, dtype=jnp.int32)
    rank_arr = jnp.asarray(ranks)

    @jax.jit
    def padded(x, y):
        h = pk.lora_shrink(x, a, ids + 1, backend="pallas", interpret=interpret)
        return pk.lora_expand(y, h, b, ids + 1, backend="pallas", interpret=interpret)

    def paged_at(block: int):
        def paged(x, y):
            h = paged_shrink(x, pool, a_table, rank_arr, ids, block=block, interpret=interpret)
            return paged_expand(y, h, pool, b_table, rank_arr, ids, block=block, interpret=interpret)

        return jax.jit(paged)

    kv_page = KV_PAGE if not interpret else (2, 2, 8)
    k, v, pages, a_off, b_off, unified_bytes = _unified_case(a, b, ranks, kv_page, dtype)
    layer, max_rank = jnp.int32(0), int(ranks.max())

    def unified_at(block: int, rank_block: int):
        def unified(x, y):
            # B's rank-rows start at r * hidden: every offset is a multiple of hidden's power of two.
            common = dict(align=min(128, hidden & -hidden), block=block, rank_block=rank_block, interpret=interpret)
            h = unified_shrink(x, k, v, layer, pages, a_off, rank_arr, ids, max_rank=max_rank, **common)
            return unified_expand(y, h, k, v, layer, pages, b_off, rank_arr, ids, **common)

        return jax.jit(unified)

    want = np.asarray(padded(x, y), np.float32)
    err = 0.0
    for name, fn in (("paged", paged_at(BLOCKS[0])), ("unified", unified_at(BLOCKS[0], RANK_BLOCKS[1]))):
        got = np.asarray(fn(x, y), np.float32)
        err_of = float(np.max(np.abs(want - got)) / (np.max(np.abs(want)) + 1e-6))
        if not np.isfinite(got).all() or err_of > 2e-2:
            raise RuntimeError(f"{mix} T={num_tokens}: {name} differs from padded (relative max error {err_of:.3g})")
        err = max(err, err_of)
    knobs = [(BLOCKS[0], RANK_BLOCKS[1])] if interpret else [(bl, rb) for bl in BLOCKS[:2] for rb in RANK_BLOCKS]
    itemsize = jnp.dtype(dtype).itemsize
    layout = PagedLayout(page_rows=PAGE_ROWS, width=hidden, itemsize=itemsize, max_pages=a_table.shape[1])
    return {
        "mix": mix,
        "T": num_tokens,
        "hidden": hidden,
        "ranks": sorted(set(ranks.tolist())),
        "padded_us": 1e3 * best_ms(padded, x, y, reps=reps),
        **_best_paged(paged_at, x, y, reps, blocks=BLOCKS[:1] if interpret else BLOCKS),
        **_best_unified(unified_at, x, y, reps, knobs),
        "padded_bytes": int((a.size - a[0].size + b.size - b[0].size) * itemsize),
        "paged_bytes": int(sum(layout.module_bytes(int(r)) for r in ranks)),
        "unified_bytes": unified_bytes,
        "max_rel_err": err,
    }


def _markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"# Paged true-rank LoRA kernels vs the padded bank on {device}",
        "",
        "Decode shrink + expand, every row on its own adapter; microseconds per call (paged: best column block); bytes of the adapters.",
        "",
        "| mix | T | ranks | padded us | paged us (block) | unified us (block, rank block) | paged / unified time vs padded | padded MB | paged MB | unified MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mix']} | {r['T']} | {r['ranks']} | {r['padded_us']:.1f} | {r['paged_us']:.1f} ({r['paged_block']}) | "
            f"{r['unified_us']:.1f} ({r['unified_block']}, {r['unified_rank_block']}) | "
            f"{r['paged_us'] / r['padded_us']:.2f} / {r['unified_us'] / r['padded_us']:.2f} | "
            f"{r['padded_bytes'] / 1e6:.1f} | {r['paged_bytes'] / 1e6:.1f} | {r['unified_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for paged_lora.{json,md}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.smoke:
        cases, hidden, dtype, interpret, reps = [("s1", 4), ("s2", 6)], 64, jnp.float32, True, 1
    else:
        cases = [(m, t) for m in MIXES for t in (64, 256)]
        hidden, dtype, interpret, reps = 4096, jnp.bfloat16, False, 20
    rows = [run_case(rng, m, t, hidden, dtype, interpret, reps) for m, t in cases]
    text = _markdown(rows, jax.devices()[0].device_kind)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paged_lora.json").write_text(json.dumps(rows, indent=1))
        (args.out / "paged_lora.md").write_text(text)


if __name__ == "__main__":
    main()
