"""Helpers the benchmarks share: model shapes, the HBM copy bandwidth and matmul rates, random adapter
banks, a random FP8 base drawn on the device, a toy tokenizer, and the engine's decode step timed on
its own.

Run every benchmark from the repository root as a module (`python -m benchmarks.kernels.lora ...`), so
that `benchmarks`, `jaxlora` and `pallas_kernels` import from this checkout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.engine.compiles import backend_compiles, check_no_compiles
from jaxlora.engine.runner import Runner, sampling_arrays
from jaxlora.lora.bank import Bank, init_bank
from jaxlora.model import RaggedBatch
from jaxlora.model.params import LoadedModel, abstract_model, assemble_model
from jaxlora.parallel.sharding import bank_shardings
from jaxlora.tokenizer import Tokenizer

LLAMA2_7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    max_position_embeddings=4096,
    name="llama-2-7b-shape",
)
LLAMA3_70B = ModelConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    name="llama-3-70b-shape",
)
TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    name="tiny",
)


def _best_rate(fn: Callable[[jax.Array], jax.Array], x: jax.Array, work: float, reps: int) -> float:
    """work / seconds of one fn(x) call, from `reps` calls back to back (dispatch overlaps the device
    work), the best of 3 rounds after one warm-up call."""
    fn(x).block_until_ready()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(x) for _ in range(reps)]
        jax.block_until_ready(outs)
        best = max(best, work * reps / (time.perf_counter() - t0))
        del outs
    return best


def best_ms(fn: Callable[..., jax.Array], *args: jax.Array, reps: int = 20) -> float:
    """Milliseconds of one fn(*args) call: `reps` calls back to back, the best of 3 rounds after one
    warm-up call (`_best_rate` with one unit of work a call)."""
    return 1e3 / _best_rate(lambda _: fn(*args), args[0], 1.0, reps)


def hbm_gbps(num_bytes: int = 1 << 31, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written): `reps` jitted copies back to back."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda v: v + jnp.bfloat16(0))  # one fused read + write pass
    return _best_rate(copy, x, 2 * x.nbytes, reps) / 1e9


def matmul_tflops(n: int = 8192, dtype: jnp.dtype = jnp.bfloat16, reps: int = 10) -> float:
    """Dense matmul rate in TFLOP/s: `reps` jitted [n, n] @ [n, n] products back to back, best of 3."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    return _best_rate(jax.jit(lambda x: x @ x), a, 2 * n**3, reps) / 1e12


def matmul_tflops_8bit(n: int = 8192, dtype: jnp.dtype = jnp.float8_e4m3fn, reps: int = 10) -> float:
    """[n, n] @ [n, n] of two 8-bit operands (XLA's FP8 / int8 GEMM: float32 / int32 result), TFLOP/s."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).clip(-100, 100).astype(dtype)
    acc = jnp.int32 if jnp.dtype(dtype) == jnp.int8 else jnp.float32
    dot = jax.jit(lambda x: jax.lax.dot_general(x, x, (((1,), (1,)), ((), ())), preferred_element_type=acc))
    return _best_rate(dot, a, 2 * n**3, reps) / 1e12


def random_fp8_model(config: ModelConfig, *, dtype: jnp.dtype = jnp.bfloat16, seed: int = 0) -> LoadedModel:
    """A model in the serving layout with FP8 projections, drawn on the device in that format: no
    dense copy of a projection ever exists (a 70B shape's would need 140 GB).

    Each stacked FP8 leaf [L, in, out] (or K-major [L, out, in], the serving layout's default) is
    drawn one layer at a time as random bytes with the top exponent bit cleared (|q| <= 1.875: no
    NaN pattern, 0x7F / 0xFF, can occur), with per-channel scales 1 / sqrt(in) so that a projection
    keeps its input's scale; the rest (embeddings, norms, head) is N(0, 0.02) in `dtype`, norm
    scales 1.
    """
    _, expected = abstract_model(config, dtype, "fp8", fused=True)
    names = sorted(expected)

    def fp8_layers(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        def one(i):
            bits = jax.random.bits(jax.random.fold_in(key, i), shape[1:], jnp.uint8) & jnp.uint8(0xBF)
            return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)

        return jax.lax.map(one, jnp.arange(shape[0], dtype=jnp.int32))

    def value(key: jax.Array, name: str) -> jax.Array:
        leaf = expected[name]
        if leaf.dtype == jnp.float8_e4m3fn:
            return fp8_layers(key, leaf.shape)
        if name.endswith(".qscale"):  # the serving layout may store the weights K-major ([L, out, in])
            prefix = name.removesuffix(".qscale")
            kmajor = f"{prefix}.qkernel_t" in expected
            depth = expected[f"{prefix}.qkernel_t" if kmajor else f"{prefix}.qkernel"].shape[-1 if kmajor else -2]
            return jnp.full(leaf.shape, 1.0 / math.sqrt(depth), leaf.dtype)
        if name.endswith(".scale"):
            return jnp.ones(leaf.shape, leaf.dtype)
        return (0.02 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)

    draw = jax.jit(lambda key: {n: value(jax.random.fold_in(key, i), n) for i, n in enumerate(names)})
    arrays = draw(jax.random.key(seed))
    return assemble_model(config, arrays, dtype=dtype, quantization="fp8", fused=True, source="random_fp8_model")


def random_bank(
    model: ModelConfig, lora: LoraConfig, num_adapters: int, dtype, seed: int = 0, mesh: Mesh | None = None
) -> Bank:
    """A bank with adapters in slots 1..num_adapters (random, never zero), drawn on the device.

    Slot 0 and slots past num_adapters stay zero, as the pager leaves them. With a mesh, the bank is
    drawn directly in its tensor-parallel shards (`jaxlora.parallel.sharding.bank_specs`), with the
    same values as on one device.
    """
    shapes = jax.eval_shape(lambda: init_bank(model, lora, dtype))
    leaves, treedef = jax.tree_util.tree_flatten(shapes)

    def draw(key):
        out = []
        for i, leaf in enumerate(leaves):
            slots = jnp.arange(leaf.shape[1])
            live = ((slots >= 1) & (slots <= num_adapters)).reshape((1, -1) + (1,) * (leaf.ndim - 2))
            std = 1.0 / math.sqrt(leaf.shape[2]) if i % 2 == 0 else 0.02
            w = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32) * std
            out.append(jnp.where(live, w, 0).astype(leaf.dtype))
        return out

    out_shardings = None
    if mesh is not None:
        out_shardings = jax.tree_util.tree_leaves(bank_shardings(shapes, mesh))
    return jax.tree_util.tree_unflatten(treedef, jax.jit(draw, out_shardings=out_shardings)(jax.random.key(seed)))


def adapter_name(i: int) -> str:
    return f"a{i}"


def word_tokenizer(vocab_size: int):
    """One word per id (w0, w1, ...) and no end-of-sequence id: every request runs to max_tokens."""
    hf = HFTokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(hf=hf, chat_template=None, eos_token_ids=(), bos_token_id=None)


def slot_pattern(batch: int, distinct: int) -> np.ndarray:
    """Row i on slot 1 + i % distinct (distinct = 0: every row on the base slot)."""
    if distinct == 0:
        return np.zeros(batch, np.int32)
    return (1 + np.arange(batch) % distinct).astype(np.int32)


def decode_inputs(runner: Runner, slot_ids: np.ndarray, position: int, budget: int | None = None) -> dict:
    """The step's inputs for a decode-only step of n = len(slot_ids) <= max_batch rows: row b's one
    token at `position`, over its own pages (rows take consecutive pages of the pool), on slot
    slot_ids[b], padded to `budget` tokens (default max_batch) as the engine pads a step: rows
    n.. absent, tokens n.. padding (no source, KV writes dropped)."""
    B, page = runner.config.max_batch, runner.config.page_size
    n = len(slot_ids)
    T = B if budget is None else budget
    if not 1 <= n <= min(B, T):
        raise ValueError(f"{n} rows must be between 1 and min(max_batch={B}, budget={T})")
    pages = (np.arange(B * runner.pages_per_seq, dtype=np.int32) % runner.num_pages).reshape(B, -1)
    live = np.arange(B) < n
    batch = RaggedBatch(
        q_start=np.where(live, np.arange(B), 0).astype(np.int32),
        q_len=live.astype(np.int32),
        kv_len=np.where(live, position + 1, 0).astype(np.int32),
        block_tables=np.where(live[:, None], pages, 0).astype(np.int32),
        write_page=np.full(T, runner.num_pages, np.int32),  # padding tokens write nowhere
        write_offset=np.zeros(T, np.int32),
    )
    batch.write_page[:n] = pages[:n, position // page]
    batch.write_offset[:n] = position % page
    tokens = np.zeros(T, np.int32)
    tokens[:n] = np.random.default_rng(0).integers(0, runner.model.config.vocab_size, n, dtype=np.int32)
    slots = np.zeros(T, np.int32)
    slots[:n] = slot_ids
    positions = np.zeros(T, np.int32)
    positions[:n] = position
    src = np.full(T, -1, np.int32)
    src[:n] = np.arange(n)  # as the engine's decode tokens: row b's input is its previous output
    return dict(
        tokens=tokens,
        src=src,
        positions=positions,
        slot_ids=slots,
        batch=batch,
        sampling=sampling_arrays([], B),
    )


def time_decode(
    runner: Runner, bank: Bank, slot_ids: np.ndarray, position: int, steps: int, budget: int | None = None
) -> float:
    """Milliseconds per call of the engine's jitted step on a decode-only batch of len(slot_ids)
    rows, one token each, padded to `budget` tokens (default max_batch; the engine's call shape:
    its packed inputs, placed as the runner places them), `steps` calls back to back."""
    from jaxlora.engine.runner import packed_step
    from jaxlora.engine.step_inputs import StepLayout

    B = runner.config.max_batch
    layout = StepLayout(budget=B if budget is None else budget, rows=B, pages_per_seq=runner.pages_per_seq)
    inputs = decode_inputs(runner, slot_ids, position, layout.budget)
    packed = jax.device_put(layout.pack(**inputs), runner.input_sharding)
    static = runner.step_static
    # Warm up with the timed loop's own arguments: the second call feeds back the first's ids and
    # pool, as every timed call does (jit compiles one program per argument placement).
    kv, ids = runner.kv, runner.last_ids
    for _ in range(2):
        ids, kv, _ = packed_step(runner.params, bank, kv, packed, ids, layout=layout, **static)
    ids.block_until_ready()
    compiles = backend_compiles()
    t0 = time.perf_counter()
    for _ in range(steps):
        ids, kv, _ = packed_step(runner.params, bank, kv, packed, ids, layout=layout, **static)
    ids.block_until_ready()
    seconds = time.perf_counter() - t0
    check_no_compiles(compiles, "the timed decode steps")
    runner.kv, runner.last_ids = kv, ids
    return seconds / steps * 1e3
