"""Does a jitted call's dispatch wait for queued device work? Host ms of one call while two steps are
queued, for each way a step's arguments can arrive: a donated (in-place) buffer or not, the small
inputs as a numpy array or already on the device, the previous step's output fed back or not.

    PYTHONPATH=. python3 benchmarks/probes/dispatch.py [--out DIR]

A step here is ~`--iters` skinny matmuls (a few ms on an H200) plus an in-place update of a large
buffer, the shape of the engine's step (weights read, KV pool donated and written).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _double(y):
    """A one-block Pallas kernel (Triton on GPU): does a custom call in the step change dispatch?"""
    from jax.experimental import pallas as pl

    def kernel(y_ref, o_ref):
        o_ref[...] = y_ref[...] * 2

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), interpret=jax.default_backend() == "cpu"
    )(y)


def make_step(donate: bool, iters: int, pallas: bool = False, unrolled: bool = False):
    def step(pool, small, w, prev):
        def body(_, y):
            return jnp.tanh(y @ w)

        # unrolled: straight-line kernels (one thunk each), as the engine's unrolled layers; else a
        # while loop, whose iterations the host launches one by one unless a command buffer holds it.
        y = jax.lax.fori_loop(
            0,
            iters,
            body,
            jnp.broadcast_to(small[:, None], (small.shape[0], w.shape[0])).astype(w.dtype),
            unroll=iters if unrolled else 1,
        )
        if pallas:
            y = _double(y[:, :128])
        out = y.sum(axis=1).astype(jnp.int32) + prev
        return pool.at[small[0] % pool.shape[0]].set(y[0, 0].astype(pool.dtype)), out

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def probe(
    donate: bool,
    small_on_device: bool,
    feed_back: bool,
    *,
    iters: int,
    pool_mb: int,
    reps: int,
    pallas: bool = False,
    unrolled: bool = False,
) -> dict:
    fn = make_step(donate, iters, pallas, unrolled)
    pool = jnp.zeros((pool_mb << 20) // 2, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16) * 0.01
    small_np = np.arange(64, dtype=np.int32)
    prev = jnp.zeros(64, jnp.int32)
    out = prev
    hlo = fn.lower(pool, small_np, w, prev).compile().as_text()
    times, step_ms, idle = [], [], []
    for _ in range(reps + 2):
        out.block_until_ready()
        t0 = time.perf_counter()  # nothing queued: the call's own host cost
        pool, out = fn(pool, small_np, w, out if feed_back else prev)
        idle.append((time.perf_counter() - t0) * 1e3)
        out.block_until_ready()
        small = jax.device_put(small_np) if small_on_device else small_np
        # Queue two steps, then time the third call's dispatch.
        for _ in range(2):
            pool, out = fn(pool, small, w, out if feed_back else prev)
        t0 = time.perf_counter()
        res = fn(pool, small, w, out if feed_back else prev)
        times.append((time.perf_counter() - t0) * 1e3)
        pool, out = res
        t1 = time.perf_counter()
        out.block_until_ready()
        step_ms.append((time.perf_counter() - t1) * 1e3)
    times, step_ms, idle = times[2:], step_ms[2:], idle[2:]
    return dict(
        donate=donate,
        pallas=pallas,
        unrolled=unrolled,
        idle_dispatch_ms_median=round(float(np.median(idle)), 3),
        # Does XLA run the step as CUDA graphs? (regions it outlined into command buffers)
        hlo_command_buffers=hlo.count("command_buffer"),
        small_on_device=small_on_device,
        feed_back=feed_back,
        dispatch_ms_median=round(float(np.median(times)), 3),
        dispatch_ms_max=round(float(np.max(times)), 3),
        wait_after_ms_median=round(float(np.median(step_ms)), 3),
    )


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--pool-mb", type=int, default=2048)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="three cases: loop, unrolled, unrolled + Pallas")
    args = p.parse_args()
    rows = []
    # (donate, inputs on device, feed back, pallas, unrolled)
    cases = [(d, o, f, False, False) for d in (True, False) for o in (False, True) for f in (True, False)]
    cases += [(True, False, True, True, False), (True, True, True, True, False)]
    cases += [(True, False, True, False, True), (False, True, False, False, True), (True, False, True, True, True)]
    if args.quick:
        cases = [cases[0], cases[-3], cases[-1]]
    for donate, on_device, feed_back, pallas, unrolled in cases:
        row = probe(
            donate,
            on_device,
            feed_back,
            iters=args.iters,
            pool_mb=args.pool_mb,
            reps=args.reps,
            pallas=pallas,
            unrolled=unrolled,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            payload = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__, rows=rows)
            (args.out / "dispatch_probe.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
