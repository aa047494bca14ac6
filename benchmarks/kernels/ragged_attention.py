"""Ragged paged attention on the GPU: the Triton kernel (compiled) against the plain-JAX reference.

For each case (random pages in a shuffled pool, NaN in every page no sequence references, padding
tokens at the end), it prints the kernel's largest error against the reference, times the kernel
and the reference per layer, and sweeps block_q x block_k (every swept setting is checked too):

    python -m benchmarks.kernels.ragged_attention --out DIR    # DIR/ragged_attention.json
    python -m benchmarks.kernels.ragged_attention --out DIR --smoke  # tiny, interpret mode (CPU)

Timing: one jitted call runs the op over `--layers` layers in a fori_loop, each layer's output fed
to the next as its queries (so nothing is hoisted or dropped); a layer's time is the median over 20
calls of call time / layers. The floor is the bytes the step must move (the KV positions each
sequence in the step attends to, plus q read and the output written) over 4.1 TB/s of HBM.
Every case runs inside try/except: a failure prints its traceback and the run goes on; the JSON is
rewritten after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.ragged import ragged_paged_attention
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from pallas_kernels.tolerances import KERNEL_TOLERANCES

HBM_BYTES_PER_S = 4.1e12
DTYPE = jnp.bfloat16
PAGE_SIZE = 16
SHAPES = {
    "llama-7b": dict(heads=32, kv_heads=32, head_dim=128),
    "smollm2": dict(heads=9, kv_heads=3, head_dim=64),
    "tiny": dict(heads=4, kv_heads=2, head_dim=16),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scale:
    """Sizes of one run: the real H200 one, or a tiny interpret-mode smoke run on CPU."""

    interpret: bool = False
    pages_per_seq: int = 64  # 1,024 positions per sequence
    reps: int = 20
    block_q: tuple[int, ...] = (16, 32, 64)
    block_k: tuple[int, ...] = (32, 64, 128)


GPU = Scale()
SMOKE = Scale(interpret=True, pages_per_seq=4, reps=2, block_q=(16,), block_k=(16, 32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    shape: str  # a key of SHAPES
    num_tokens: int  # the step's token budget T; rows past the sequences' tokens are padding
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence


def make_cases(rng: np.random.Generator, scale: Scale) -> list[Case]:
    if scale.interpret:
        return [Case(name="smoke_mixed", shape="tiny", num_tokens=32, seqs=((1, 40), (1, 7), (12, 12), (9, 50)))]
    decode = tuple((1, int(n)) for n in rng.integers(300, 1001, 128))
    mixed_decode = tuple((1, int(n)) for n in rng.integers(300, 1001, 64))
    # 300-token chunks: whole prompts (kv_len == q_len) and chunks after a cached prefix.
    chunks = tuple((300, 300 + int(p)) for p in (0, 0, 0, 300, 450, 700))
    return [
        Case(name="decode_128_7b", shape="llama-7b", num_tokens=256, seqs=decode),
        Case(name="mixed_2048_7b", shape="llama-7b", num_tokens=2048, seqs=mixed_decode + chunks),
        Case(name="decode_128_smollm2", shape="smollm2", num_tokens=256, seqs=decode),
    ]


def build(case: Case, *, layers: int, seed: int, pages_per_seq: int) -> tuple[tuple, np.ndarray]:
    """Device arguments of the op (layer excluded) and the [T] mask of real (non-padding) tokens."""
    shape = SHAPES[case.shape]
    rng = np.random.default_rng(seed)
    q_len = np.array([n for n, _ in case.seqs], np.int32)
    kv_len = np.array([c for _, c in case.seqs], np.int32)
    used = -(-kv_len // PAGE_SIZE)
    num_pages = int(used.sum()) + 8
    ids = rng.permutation(num_pages)
    tables = rng.integers(-num_pages, 2 * num_pages, (len(case.seqs), pages_per_seq)).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(used)])
    for s in range(len(case.seqs)):
        tables[s, : used[s]] = ids[offsets[s] : offsets[s + 1]]
    unused = ids[offsets[-1] :]
    key_k, key_v, key_q = jax.random.split(jax.random.key(seed), 3)
    pages_shape = (layers, num_pages, PAGE_SIZE, shape["kv_heads"], shape["head_dim"])
    k = jax.random.normal(key_k, pages_shape, DTYPE).at[:, unused].set(jnp.nan)
    v = jax.random.normal(key_v, pages_shape, DTYPE).at[:, unused].set(jnp.nan)
    q = jax.random.normal(key_q, (case.num_tokens, shape["heads"], shape["head_dim"]), DTYPE)
    q_start = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int32)
    if q_len.sum() > case.num_tokens:
        raise ValueError(f"{case.name}: {q_len.sum()} tokens exceed T={case.num_tokens}")
    is_token = np.arange(case.num_tokens) < q_len.sum()
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return (q, k, v, i32(q_start), i32(q_len), i32(kv_len), i32(tables)), is_token


def floor_us(case: Case) -> float:
    shape = SHAPES[case.shape]
    item = jnp.dtype(DTYPE).itemsize
    kv = sum(c for n, c in case.seqs if n) * 2 * shape["kv_heads"] * shape["head_dim"] * item
    q_and_out = 2 * case.num_tokens * shape["heads"] * shape["head_dim"] * item
    return (kv + q_and_out) / HBM_BYTES_PER_S * 1e6


def over_layers(attn, layers: int):
    """jit(args) running `attn` on layers 0..layers-1, each layer's output the next one's queries."""

    def run(q, k, v, q_start, q_len, kv_len, tables):
        body = lambda i, x: attn(x, k, v, i, q_start, q_len, kv_len, tables).astype(x.dtype)  # noqa: E731
        return jax.lax.fori_loop(0, layers, body, q)

    return jax.jit(run)


def time_per_layer_us(fn, args, layers: int, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / layers * 1e6


def errors(out, ref, is_token: np.ndarray) -> dict:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    tol = KERNEL_TOLERANCES["bfloat16"]
    return dict(
        max_abs_err=float(np.abs(out - ref)[is_token].max()),
        finite=bool(np.isfinite(out).all()),
        padding_zero=bool(not out[~is_token].any()),
        within_tolerance=bool(np.allclose(out, ref, atol=tol["atol"], rtol=tol["rtol"])),
    )


def kernel_fn(scale: Scale, **knobs):
    return lambda *a: ragged_paged_attention(*a, interpret=scale.interpret, **knobs)


def run_case(case: Case, *, scale: Scale, layers: int, seed: int, deadline: float) -> dict:
    args, is_token = build(case, layers=layers, seed=seed, pages_per_seq=scale.pages_per_seq)
    row = dict(
        case=case.name,
        shape=case.shape,
        num_tokens=case.num_tokens,
        num_seqs=len(case.seqs),
        real_tokens=int(is_token.sum()),
        floor_us=floor_us(case),
        layers=layers,
    )
    last = layers - 1
    ref = jax.jit(ragged_paged_attention_reference)(*args[:3], jnp.int32(last), *args[3:])
    out = jax.jit(kernel_fn(scale))(*args[:3], jnp.int32(last), *args[3:])
    row["check"] = errors(out, ref, is_token)
    print(f"{case.name}: {row['check']}", flush=True)
    row["kernel_us"] = time_per_layer_us(over_layers(kernel_fn(scale), layers), args, layers, scale.reps)
    print(f"  kernel {row['kernel_us']:.1f} us/layer (floor {row['floor_us']:.1f})", flush=True)
    try:
        row["reference_us"] = time_per_layer_us(
            over_layers(ragged_paged_attention_reference, layers), args, layers, scale.reps
        )
        print(f"  reference {row['reference_us']:.1f} us/layer", flush=True)
    except Exception as e:  # noqa: BLE001 - a reference that does not fit must not hide the kernel's figures
        traceback.print_exc()
        row["reference_error"] = repr(e)
    row["sweep"] = sweep(args, ref, is_token, scale=scale, layers=layers, last=last, deadline=deadline)
    timed = [s for s in row["sweep"] if "us" in s and s["check"]["within_tolerance"]]
    if timed:
        row["best"] = min(timed, key=lambda s: s["us"])
        print(
            f"  best block_q={row['best']['block_q']} block_k={row['best']['block_k']}: "
            f"{row['best']['us']:.1f} us/layer ({row['floor_us'] / row['best']['us']:.0%} of the floor)",
            flush=True,
        )
    return row


def sweep(args, ref, is_token, *, scale: Scale, layers: int, last: int, deadline: float) -> list[dict]:
    results = []
    for block_q, block_k in itertools.product(scale.block_q, scale.block_k):
        if time.perf_counter() > deadline:
            print("  sweep: budget spent, stopping", flush=True)
            break
        entry = dict(block_q=block_q, block_k=block_k)
        try:
            fn = kernel_fn(scale, block_q=block_q, block_k=block_k)
            entry["check"] = errors(jax.jit(fn)(*args[:3], jnp.int32(last), *args[3:]), ref, is_token)
            entry["us"] = time_per_layer_us(over_layers(fn, layers), args, layers, scale.reps)
            print(
                f"  block_q={block_q:3d} block_k={block_k:3d}: {entry['us']:8.1f} us/layer, "
                f"max err {entry['check']['max_abs_err']:.2e}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - one setting that fails to compile must not end the sweep
            traceback.print_exc()
            entry["error"] = repr(e)
        results.append(entry)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for ragged_attention.json")
    parser.add_argument("--layers", type=int, default=4, help="layers in the page pool, run per timed call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting sweep settings after this")
    parser.add_argument("--smoke", action="store_true", help="tiny case in interpret mode (checks the script on CPU)")
    args = parser.parse_args()
    scale = SMOKE if args.smoke else GPU
    deadline = time.perf_counter() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "ragged_attention.json"
    print(f"devices: {jax.devices()}", flush=True)
    rows = []
    for case in make_cases(np.random.default_rng(args.seed), scale):
        try:
            rows.append(run_case(case, scale=scale, layers=args.layers, seed=args.seed, deadline=deadline))
        except Exception as e:  # noqa: BLE001 - report the case and go on with the next
            traceback.print_exc()
            rows.append(dict(case=case.name, error=repr(e)))
        path.write_text(json.dumps(dict(device=str(jax.devices()[0]), rows=rows), indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
