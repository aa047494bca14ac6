"""Time the unified kernels on one s2 case with progress prints (a hang or slow compile shows where)."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from benchmarks.kernels import paged_lora as P
from pallas_kernels.lora.unified import unified_shrink, unified_expand
import pallas_kernels as pk
t0 = time.time()
def say(*a): print(f"[{time.time()-t0:6.1f}s]", *a, flush=True)
rng = np.random.default_rng(0)
for mix, T in (("s2", 64), ("s1", 64), ("s2", 256)):
    ranks = rng.choice(np.asarray(P.MIXES[mix]), size=T).astype(np.int32)
    a, b, pool, at, bt = P._case(rng, ranks, 4096, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((T, 4096)), jnp.bfloat16); y = jnp.asarray(rng.standard_normal((T, 4096)), jnp.bfloat16)
    ids = jnp.arange(T, dtype=jnp.int32); rk = jnp.asarray(ranks)
    k, v, pages, a_off, b_off, nbytes = P._unified_case(a, b, ranks, P.KV_PAGE, jnp.bfloat16)
    say(mix, T, "case built")
    @jax.jit
    def padded(x, y):
        h = pk.lora_shrink(x, a, ids + 1, backend="pallas"); return pk.lora_expand(y, h, b, ids + 1, backend="pallas")
    want = np.asarray(padded(x, y), np.float32); say("padded ok")
    for rb in (16, 8, 32):
        f = jax.jit(lambda x, y, rb=rb: unified_expand(y, unified_shrink(x, k, v, jnp.int32(0), pages, a_off, rk, ids, max_rank=int(ranks.max()), align=128, rank_block=rb), k, v, jnp.int32(0), pages, b_off, rk, ids, align=128, rank_block=rb))
        h = jax.block_until_ready(f(x, y)); say("unified rb", rb, "compiled+ran")
        err = float(np.max(np.abs(want - np.asarray(h, np.float32))) / np.max(np.abs(want))); say("rel err", err)
        say(f"{mix} T={T} rb={rb}: unified {1e3*P.best_ms(f, x, y, reps=10):.1f} us, padded {1e3*P.best_ms(padded, x, y, reps=10):.1f} us")
