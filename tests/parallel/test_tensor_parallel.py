"""Tensor parallelism on 4 fake CPU devices: a mixed-adapter batch gives the one-device greedy
tokens with the model split 2 and 4 ways (raw forward and the Engine), and the compiled step holds
only the Megatron collectives: two all-reduces per layer (o_proj, down_proj, their LoRA terms
included), one for the embedding and one for the logits; nothing on weights or the adapter bank,
at toy shapes and at the Llama-2-7B shape with 257 slots (compiled from abstract arguments). The
bench's step timer compiles nothing inside its timed loop on a split engine.

The checks run in one subprocess (tp_worker.py): the fake-device flag must be in XLA_FLAGS before
jax is imported, and one process shares its compiles across the checks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result() -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.parallel.tp_worker"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("tensor", [2, 4])
def test_raw_forward_greedy_tokens_match_one_device(result, tensor):
    raw = result["raw"]
    assert raw[f"tp{tensor}"] == raw["reference"]
    assert raw[f"tp{tensor}_max_logit_diff"] <= TOLERANCES["float32"]["atol"]


def test_rows_differ_by_adapter(result):
    """The batch really is mixed: rows on different slots generate different tokens."""
    assert len({tuple(r) for r in result["raw"]["reference"]}) == len(result["raw"]["reference"])


def test_pallas_kernels_run_per_shard(result):
    assert result["raw"]["pallas_tp2_max_logit_diff"] <= TOLERANCES["float32"]["atol"]


@pytest.mark.parametrize("tensor", [2, 4])
def test_engine_greedy_tokens_match_one_device(result, tensor):
    assert result["engine"][f"tp{tensor}"] == result["engine"]["tp1"]


def test_split_pager_widens_every_rank_class(result):
    classes = result["pager_classes"]
    assert classes["slots_equal"] == [True] * 4 and classes["bank_split_kept"]
    # ranks 1, 5, 8, 3 travel as classes 4, 8, 8, 4 of R = 8: two half slots and two whole ones
    assert classes["bytes_moved"] == 3 * classes["whole_slot_bytes"]


def test_engine_bank_and_cache_keep_their_layout(result):
    engine = result["engine"]
    assert engine["page_ins"] >= 5  # five adapters over three slots: written, evicted, rewritten
    assert engine["bank_layout_kept"]
    assert engine["kv_spec"] == "P(None, None, None, 'tensor')"


def _shape(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.match(r"\w+\[([\d,]*)\]", s).group(1).split(",") if d)


def _check_layer_body(hlo: dict, rows: int, hidden: int) -> None:
    assert hlo["num_while_with_collectives"] == 1
    # o_proj and down_proj, each with its LoRA partial sum folded in: two [rows, hidden] all-reduces.
    assert [(op, _shape(s)) for s, op in hlo["layer_body"]] == [("all-reduce", (rows, hidden))] * 2


def _outside_body(hlo: dict) -> list[tuple[str, tuple[int, ...]]]:
    rest = [tuple(c) for c in hlo["all"]]
    for c in hlo["layer_body"]:
        rest.remove(tuple(c))
    return sorted((op, _shape(s)) for s, op in rest)


def test_vocab_parallel_step_collectives(result):
    """Raw forward, vocab 96 split by vocabulary, 6 rows, hidden 32: embedding all-reduce, logits all-gather."""
    hlo = result["raw_hlo"]
    _check_layer_body(hlo, rows=6, hidden=32)
    assert _outside_body(hlo) == [("all-gather", (6, 1, 96)), ("all-reduce", (6, 1, 32))]


def test_hidden_parallel_engine_decode_step_collectives(result):
    """Engine decode step, vocab 99 (indivisible) split by hidden: embedding all-gather of activations,
    logits all-reduce; 4 rows, hidden 32. No weight or bank shape appears in any collective."""
    hlo = result["hlo"]
    _check_layer_body(hlo, rows=4, hidden=32)
    assert _outside_body(hlo) == [("all-gather", (4, 1, 32)), ("all-reduce", (4, 99))]


def test_engine_shape_step_moves_no_bank_or_weight_bytes(result):
    """The engine's decode step at the 7B shape, TP=2, 256 rows over 257 slots: only the Megatron
    collectives, each far below one bank or weight leaf per device, and no host transfer."""
    hlo = result["engine_shape_hlo"]
    rows, hidden, vocab = hlo["batch"], hlo["hidden"], hlo["vocab"]
    _check_layer_body(hlo, rows=rows, hidden=hidden)
    assert _outside_body(hlo) == [("all-gather", (rows, vocab)), ("all-reduce", (rows, 1, hidden))]
    # The largest is the logits all-gather, rows x vocab x 4 bytes (32.8 MB); the smallest stacked
    # weight shard is 32 x 4096 x 2048 x 2 bytes (537 MB), the smallest bank leaf 539 MB per device.
    assert hlo["max_collective_bytes"] == rows * vocab * 4
    assert hlo["max_collective_bytes"] * 8 < min(hlo["smallest_weight_bytes"], hlo["smallest_bank_leaf_bytes"])
    assert hlo["host_transfers"] == []


def test_bench_step_timer_compiles_nothing_in_its_timed_loop(result):
    timer = result["bench_timer"]
    assert "error" not in timer, timer.get("error")
    assert timer["step_ms"] > 0


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("tensor", [2, 4])
def test_quantized_base_greedy_tokens_match_one_device(result, quantization, tensor):
    """Weight-only quantized projections split like their dense kernels, scales with them."""
    runs = result["quantized"][quantization]
    assert runs[f"tp{tensor}"] == runs["reference"]
    assert runs[f"tp{tensor}_max_logit_diff"] <= TOLERANCES["float32"]["atol"]


def test_quantized_step_has_the_dense_step_collectives(result):
    """Scales are applied per shard (o/down: to the partial sums), so no collective is added."""
    assert result["raw_hlo_int8"] == result["raw_hlo"]
