"""Runs the tensor-parallel checks on fake CPU devices and prints one JSON object.

Started by test_tensor_parallel.py as `python -m tests.parallel.tp_worker` (from the repository root) with
XLA_FLAGS=--xla_force_host_platform_device_count=4 in its environment: the flag must be set before
jax is imported, which a pytest process has already done.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import TARGET_MODULES, LoraConfig, ModelConfig
from jaxlora.engine.build import build_engine
from jaxlora.engine.engine import Engine
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.engine.runner import ragged_step
from jaxlora.engine.sampling import SamplingArrays
from jaxlora.engine.static_arg import Hashed
from jaxlora.kernels import StepKernels
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.model import RaggedBatch, init_kv_cache, init_paged_kv_cache
from jaxlora.model.forward import forward_logits
from jaxlora.model.params import quantized_model, random_model
from jaxlora.parallel import MeshConfig, make_mesh
from jaxlora.parallel.sharding import (
    KV_SPEC,
    bank_specs,
    shard_bank,
    shard_kv,
    shard_model,
)
from tests.engine.conftest import engine_config
from tests.factories import char_tokenizer, random_adapter, tiny_model

TENSOR_SIZES = (2, 4)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")

# Raw forward: vocab 96 is split by vocabulary (tied embedding), q/k/v and o carry biases.
RAW_CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    tie_word_embeddings=True,
    attention_bias=True,
    o_proj_bias=True,
    max_position_embeddings=64,
)
RAW_LORA = LoraConfig(max_slots=5, max_rank=4)
RAW_SLOTS = (3, 0, 1, 4, 2, 1)  # shuffled, a base row, a repeated adapter
PROMPT_LEN, NEW_TOKENS = 5, 6


def raw_bank(config: ModelConfig, lora: LoraConfig) -> dict:
    """Four adapters with different module sets and ranks in slots 1..4 (slot 0 stays the base)."""
    rng = np.random.default_rng(1)
    module_sets = (
        TARGET_MODULES,
        ("q_proj", "v_proj", "o_proj"),
        ("gate_proj", "up_proj", "down_proj"),
        ("k_proj", "down_proj"),
    )
    bank = init_bank(config, lora)
    for slot, (modules, rank) in enumerate(zip(module_sets, (4, 2, 3, 1)), start=1):
        weights = {
            m: (
                rng.standard_normal((config.num_layers, config.module_shape(m)[0], rank), np.float32) * 0.4,
                rng.standard_normal((config.num_layers, rank, config.module_shape(m)[1]), np.float32) * 0.4,
            )
            for m in modules
        }
        bank = set_slot(bank, slot, slot_arrays(weights, config, lora))
    return bank


def raw_greedy(model, bank, mesh, backend: str) -> tuple[list[list[int]], np.ndarray]:
    """Prefill every row (one segment each), then NEW_TOKENS - 1 batched decode steps; greedy ids
    per row and the prefill logits."""
    cfg = model.config
    rows = len(RAW_SLOTS)
    kernels = StepKernels.for_platform(backend)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (rows, PROMPT_LEN)), jnp.int32)
    slots = jnp.asarray(RAW_SLOTS, jnp.int32)
    kv = init_kv_cache(cfg, rows, PROMPT_LEN + NEW_TOKENS)
    params = model.params
    if mesh is not None:
        params, bank, kv = shard_model(model, mesh).params, shard_bank(bank, mesh), shard_kv(kv, mesh)

    def forward(tok, pos, kv):
        return forward_logits(model.graphdef, params, tok, pos, kv, bank, slots, kernels=kernels, mesh=mesh)

    positions = jnp.broadcast_to(jnp.arange(PROMPT_LEN, dtype=jnp.int32), (rows, PROMPT_LEN))
    logits, kv = forward(tokens, positions, kv)
    prefill_logits = np.asarray(logits)
    out = [[int(t)] for t in prefill_logits[:, -1].argmax(-1)]
    for i in range(NEW_TOKENS - 1):
        last = jnp.asarray([[r[-1]] for r in out], jnp.int32)
        logits, kv = forward(last, jnp.full((rows, 1), PROMPT_LEN + i, jnp.int32), kv)
        for r, t in zip(out, np.asarray(logits)[:, -1].argmax(-1)):
            r.append(int(t))
    if mesh is not None:
        assert _same_spec(kv.k.sharding.spec, KV_SPEC), kv.k.sharding  # the donated cache kept its layout
    return out, prefill_logits


def check_raw(result: dict) -> None:
    model = random_model(RAW_CONFIG, seed=3, std=0.2)
    bank = raw_bank(RAW_CONFIG, RAW_LORA)
    ref_tokens, ref_logits = raw_greedy(model, bank, None, "xla")
    result["raw"] = {"reference": ref_tokens}
    for n in TENSOR_SIZES:
        tokens, logits = raw_greedy(model, bank, make_mesh(MeshConfig(tensor=n)), "xla")
        result["raw"][f"tp{n}"] = tokens
        result["raw"][f"tp{n}_max_logit_diff"] = float(np.abs(logits - ref_logits).max())
    # Pallas kernels per shard (interpreted on CPU: slow, so decode-shaped prefill of one token).
    mesh = make_mesh(MeshConfig(tensor=2))
    kernels = StepKernels.for_platform("pallas")
    tok = jnp.asarray(np.arange(len(RAW_SLOTS))[:, None] + 7, jnp.int32)
    pos = jnp.zeros_like(tok)
    slots = jnp.asarray(RAW_SLOTS, jnp.int32)
    ref, _ = forward_logits(
        model.graphdef,
        model.params,
        tok,
        pos,
        init_kv_cache(RAW_CONFIG, len(RAW_SLOTS), 4),
        bank,
        slots,
        kernels=kernels,
    )
    got, _ = forward_logits(
        model.graphdef,
        shard_model(model, mesh).params,
        tok,
        pos,
        shard_kv(init_kv_cache(RAW_CONFIG, len(RAW_SLOTS), 4), mesh),
        shard_bank(bank, mesh),
        slots,
        mesh=mesh,
        kernels=kernels,
    )
    result["raw"]["pallas_tp2_max_logit_diff"] = float(np.abs(np.asarray(got) - np.asarray(ref)).max())


# Engine: the char tokenizer's vocabulary (99) divides by neither 2 nor 4, so embedding and LM head
# are split by hidden size here (the other layout from the raw check).
ENGINE_MODEL = {"num_heads": 8, "num_kv_heads": 4, "head_dim": 4, "hidden_size": 32, "intermediate_size": 64}
ENGINE_ADAPTERS = ("a0", "a1", "a2", "a3", "a4")  # five adapters over three slots: evictions too


def engine_requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    adapters = [None, *ENGINE_ADAPTERS]
    return [
        GenerationRequest(
            request_id=f"r{i}",
            adapter=adapters[i % len(adapters)],
            prompt_ids=[1, *rng.integers(4, 99, int(rng.integers(2, 20))).tolist()],
            # Two rows sample (seeded): the sampler program runs under the mesh too. With top_k=1 it
            # draws the argmax: a free draw cannot match across mesh sizes token for token: a
            # logit can differ in its last bits between mesh sizes (the split all-reduce sums in
            # another order), which now and then moves a draw across a CDF boundary (seen in CI at
            # temperature 0.7).
            # Row 3 is penalised (greedy after the penalties: its token history lives on the mesh)
            # and row 7 asks for logprobs: the sampler's other variants run under the mesh too.
            sampling=SamplingParams(
                max_tokens=int(rng.integers(4, 10)),
                temperature=0.7 * (i in (2, 5)),
                top_k=int(i in (2, 5)),
                seed=i,
                repetition_penalty=1.5 if i == 3 else 1.0,
                logprobs=3 if i == 7 else None,
            ),
        )
        for i in range(9)
    ]


def run_engine(model, tokenizer, adapters, tensor: int) -> tuple[Engine, list[list[int]]]:
    config = engine_config(mesh=MeshConfig(tensor=tensor))
    engine = build_engine(config, model, tokenizer, adapters)  # one mesh for the pager's bank and the runner
    engine.warmup()
    finals = engine.generate(engine_requests())
    assert engine.compiles_after_warmup == 0, engine.compiles_after_warmup
    assert all(f.error is None for f in finals), [f.error for f in finals]
    return engine, [list(f.token_ids) for f in finals]


def check_engine(result: dict) -> Engine:
    model, tokenizer = tiny_model(**ENGINE_MODEL), char_tokenizer()
    lora = engine_config().lora
    adapters = {
        n: random_adapter(n, model.config, modules=lora.target_modules, rng=i + 1)
        for i, n in enumerate(ENGINE_ADAPTERS)
    }
    result["engine"] = {}
    engine = None
    for n in (1, *TENSOR_SIZES):
        engine, tokens = run_engine(model, tokenizer, adapters, n)
        result["engine"][f"tp{n}"] = tokens
    bank = engine.pager.bank  # after page-ins and evictions: still split as bank_specs says
    want = jax.tree.leaves(bank_specs(bank), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    got = [x.sharding.spec for x in jax.tree.leaves(bank)]
    result["engine"]["bank_layout_kept"] = all(_same_spec(g, w) for g, w in zip(got, want))
    result["engine"]["kv_spec"] = str(engine.runner.kv.k.sharding.spec)
    result["engine"]["page_ins"] = engine.pager.metrics.page_ins
    return engine


def _same_spec(a, b) -> bool:
    strip = lambda s: tuple(s) + (None,) * (8 - len(tuple(s)))
    return strip(a) == strip(b)


def _computations(hlo: str) -> dict[str, str]:
    """name -> body text of each HLO computation."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and name is None:
            name, lines = m.group(1), []
        elif line == "}" and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


def _collectives(text: str) -> list[tuple[str, str]]:
    """(op, result shape) of every collective instruction in `text`."""
    ops = "|".join(COLLECTIVES)
    return re.findall(rf"= (\S+) ({ops})(?:-start)?\(", text)


def check_hlo(engine: Engine, result: dict) -> None:
    """Collectives of the engine's compiled step on a decode-only batch (tp=4, T = max_batch tokens),
    split into the layer scan's body and the rest."""
    from benchmarks.common import decode_inputs

    runner = engine.runner
    inputs = decode_inputs(runner, np.zeros(engine.config.max_batch, np.int32), 0)
    hlo = (
        ragged_step.lower(
            runner.params, engine.pager.bank, runner.kv, last_ids=runner.last_ids, **inputs, **runner.step_static
        )
        .compile()
        .as_text()
    )
    result["hlo"] = _split_collectives(hlo)


def check_bench_timer(engine: Engine, result: dict) -> None:
    """`jaxlora bench`'s step timer on the tp=4 engine: its timed steps must compile nothing (it
    raises if they do). Its ids fed back are replicated over the mesh, unlike the first host tokens."""
    from benchmarks.common import slot_pattern, time_decode

    B = engine.config.max_batch
    try:
        result["bench_timer"] = {"step_ms": time_decode(engine.runner, engine.pager.bank, slot_pattern(B, 2), 5, 2)}
    except RuntimeError as e:
        result["bench_timer"] = {"error": str(e)}


def _split_collectives(hlo: str) -> dict:
    """The collectives of the layer scan's while body, and those of the whole module."""
    comps = _computations(hlo)
    bodies = re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)
    layer_bodies = [b for b in bodies if _collectives(comps.get(b, ""))]
    return {
        "num_while_with_collectives": len(layer_bodies),
        "layer_body": [list(c) for c in _collectives(comps[layer_bodies[0]])] if layer_bodies else [],
        "all": [list(c) for c in _collectives(hlo)],
    }


def check_quantized(result: dict) -> None:
    """The raw mixed-adapter check on weight-only quantized bases (q/k/v/gate/up scales split with
    their columns, o/down scales whole), and the int8 step's collectives."""
    dense = random_model(RAW_CONFIG, seed=3, std=0.2)
    bank = raw_bank(RAW_CONFIG, RAW_LORA)
    result["quantized"] = {}
    for quantization in ("int8", "fp8"):
        model = quantized_model(dense, quantization)
        ref_tokens, ref_logits = raw_greedy(model, bank, None, "xla")
        out = result["quantized"][quantization] = {"reference": ref_tokens}
        for n in TENSOR_SIZES:
            tokens, logits = raw_greedy(model, bank, make_mesh(MeshConfig(tensor=n)), "xla")
            out[f"tp{n}"] = tokens
            out[f"tp{n}_max_logit_diff"] = float(np.abs(logits - ref_logits).max())
    check_raw_hlo(result, quantization="int8")


def check_raw_hlo(result: dict, quantization: str | None = None) -> None:
    """Collectives of a decode-shaped sharded forward (tp=4) with the vocab-parallel layout."""
    model, mesh = random_model(RAW_CONFIG, seed=3, quantization=quantization), make_mesh(MeshConfig(tensor=4))
    rows = len(RAW_SLOTS)
    tok = jnp.zeros((rows, 1), jnp.int32)
    hlo = (
        forward_logits.lower(
            model.graphdef,
            shard_model(model, mesh).params,
            tok,
            tok,
            shard_kv(init_kv_cache(RAW_CONFIG, rows, 8), mesh),
            shard_bank(raw_bank(RAW_CONFIG, RAW_LORA), mesh),
            jnp.asarray(RAW_SLOTS, jnp.int32),
            mesh=mesh,
            kernels=StepKernels.for_platform("xla"),
        )
        .compile()
        .as_text()
    )
    result["raw_hlo" if quantization is None else f"raw_hlo_{quantization}"] = _split_collectives(hlo)


# The engine's step on a decode-only batch (one token per row) at the Llama-2-7B shape with many
# slots and rows, compiled for TP=2 from abstract arguments (no 7B array is ever built). XLA's partitioner places the jit around the
# shard_map: a bank or weight in a layout the step does not expect would come back as a collective
# (or a host transfer) on bank- or weight-sized operands.
ENGINE_SHAPE_BATCH, ENGINE_SHAPE_SLOTS, ENGINE_SHAPE_RANK, ENGINE_SHAPE_LEN = 256, 257, 16, 256
ENGINE_SHAPE_PAGE = 16  # every row can hold ENGINE_SHAPE_LEN positions: B * LEN / PAGE pages
HOST_MARKERS = (" send(", " recv(", " infeed(", " outfeed(", "S(5)", "host_compute", "MoveToHost", "MoveToDevice")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def _abstract(x, mesh, spec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def _local_bytes(x: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize


def _result_bytes(shape: str) -> int:
    m = re.match(r"(\w+)\[([\d,]*)\]", shape)
    return int(np.prod([int(d) for d in m.group(2).split(",") if d])) * _DTYPE_BYTES[m.group(1)]


def check_engine_shape_hlo(result: dict) -> None:
    """Collectives, their sizes and any host transfer in the TP=2 decode-only step at the 7B shape."""
    from flax import nnx

    from benchmarks.common import LLAMA2_7B
    from jaxlora.model import Llama
    from jaxlora.parallel.sharding import param_specs

    cfg, B, S = LLAMA2_7B, ENGINE_SHAPE_BATCH, ENGINE_SHAPE_SLOTS
    mesh = make_mesh(MeshConfig(tensor=2))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda x, spec: _abstract(x, mesh, spec), state, param_specs(state, 2))
    lora = LoraConfig(max_slots=S, max_rank=ENGINE_SHAPE_RANK, backend="xla")
    bank_shapes = jax.eval_shape(lambda: init_bank(cfg, lora, jnp.bfloat16))
    bank = jax.tree.map(lambda x, spec: _abstract(x, mesh, spec), bank_shapes, bank_specs(bank_shapes))
    pages_per_seq = ENGINE_SHAPE_LEN // ENGINE_SHAPE_PAGE
    kv = jax.tree.map(
        lambda x: _abstract(x, mesh, KV_SPEC),
        jax.eval_shape(lambda: init_paged_kv_cache(cfg, B * pages_per_seq, ENGINE_SHAPE_PAGE, jnp.bfloat16)),
    )
    rows = jax.ShapeDtypeStruct((B,), jnp.int32)  # T = S = B: one token per row
    batch = RaggedBatch(
        q_start=rows,
        q_len=rows,
        kv_len=rows,
        write_page=rows,
        write_offset=rows,
        block_tables=jax.ShapeDtypeStruct((B, pages_per_seq), jnp.int32),
    )
    sampling = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), SamplingArrays.zeros(B))
    kernels = StepKernels(lora="xla", attention="xla", unroll_layers=False)
    hlo = (
        ragged_step.trace(
            params,
            bank,
            kv,
            rows,
            rows,
            rows,
            rows,
            batch,
            sampling,
            rows,
            graphdef=Hashed(graphdef),
            kernels=kernels,
            mesh=mesh,
        )
        .lower()
        .compile()
        .as_text()
    )
    split = _split_collectives(hlo)
    weights = [_local_bytes(x) for x in jax.tree.leaves(params) if x.ndim == 3]  # stacked [L, in, out] kernels
    result["engine_shape_hlo"] = {
        **split,
        "batch": B,
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "max_collective_bytes": max((_result_bytes(s) for s, _ in split["all"]), default=0),
        "smallest_bank_leaf_bytes": min(_local_bytes(x) for x in jax.tree.leaves(bank)),
        "smallest_weight_bytes": min(weights),
        "host_transfers": [line.strip()[:200] for line in hlo.splitlines() if any(m in line for m in HOST_MARKERS)],
    }


def check_pager_rank_classes(result: dict) -> None:
    """A pager split 2 ways with adapters of both rank classes of R = 8 (4 and 8): every
    page-in's slot, gathered, equals the adapter padded straight to R (`slot_arrays`), and the
    bank keeps its split."""
    from jaxlora.adapters import Pager

    model = tiny_model(**ENGINE_MODEL)
    lora = LoraConfig(max_slots=3, max_rank=8, target_modules=TARGET_MODULES)
    pager = Pager(model.config, lora, mesh=make_mesh(MeshConfig(tensor=2)))
    specs = [x.sharding.spec for x in jax.tree.leaves(pager.bank)]
    ok = []
    for i, rank in enumerate((1, 5, 8, 3)):  # two usable slots: later ones evict earlier ones
        a = random_adapter(f"c{i}", model.config, modules=TARGET_MODULES, rank=rank, rng=40 + i)
        pager.register(a.name, a)
        pager.acquire(a.name)
        pager.commit()
        slot = pager.is_ready(a.name)
        want = slot_arrays(a.weights, model.config, lora)
        got = jax.tree.map(lambda full, slot=slot: np.asarray(full[:, slot]), pager.bank)
        ok.append(all(np.array_equal(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
        pager.release(a.name)
    kept = [x.sharding.spec for x in jax.tree.leaves(pager.bank)] == specs
    result["pager_classes"] = {"slots_equal": ok, "bank_split_kept": kept, "bytes_moved": pager.metrics.bytes_moved}
    result["pager_classes"]["whole_slot_bytes"] = pager.slot_nbytes


def main() -> None:
    assert jax.device_count() >= 4, f"need 4 fake devices, found {jax.devices()}"
    result: dict = {}
    check_engine_shape_hlo(result)
    check_raw(result)
    check_raw_hlo(result)
    check_quantized(result)
    engine = check_engine(result)
    check_hlo(engine, result)
    check_bench_timer(engine, result)
    check_pager_rank_classes(result)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
