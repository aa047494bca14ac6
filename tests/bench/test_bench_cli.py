"""`jaxlora bench --tiny` runs end to end on the CPU and writes results in the e2e.json format, with
a dense and an int8 base in one run (issue 20's "weights" column)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from benchmarks.engine import e2e
from jaxlora.cli.main import main

ROW_KEYS = {
    "system",
    "backend",
    "weights",
    "batch",
    "distinct_adapters",
    "rank",
    "targets",
    "prompt_len",
    "gen_len",
    "tokens_per_s",
    "step_ms",
    "floor_step_ms",
    "ttft_ms",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert (
        main(["bench", "--tiny", "--backend", "xla", "--steps", "2", "--quantize", "bf16", "int8", "--out", str(out)])
        == 0
    )
    return out, json.loads((out / "e2e.json").read_text())


def test_writes_json_table_and_plots(results):
    out, _ = results
    assert (out / "e2e.md").read_text().startswith("# End to end")
    assert (out / "e2e_throughput.png").stat().st_size > 0
    assert (out / "e2e_floor.png").stat().st_size > 0


def test_json_has_the_issue_format(results):
    _, payload = results
    assert isinstance(payload["device"], str) and isinstance(payload["jax_version"], str)
    assert payload["hbm_GBps"] > 0
    assert payload["rows"] and not payload["not_run"]
    for row in payload["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["system"] == "jaxlora" and row["backend"] == "xla" and row["targets"] in ("all", "qkvo")
        assert row["step_ms"] > 0 and row["floor_step_ms"] > 0
        assert row["roofline_step_ms"] >= row["floor_step_ms"]  # the same bytes, FLOPs counted too
    e2e_rows = [r for r in payload["rows"] if r["tokens_per_s"] is not None]
    assert {(r["weights"], r["distinct_adapters"]) for r in e2e_rows} == {
        ("f32", 0),
        ("f32", 2),
        ("int8", 0),
        ("int8", 2),
    }
    assert all(r["ttft_ms"] > 0 for r in e2e_rows)
    step_only = [r for r in payload["rows"] if r["tokens_per_s"] is None]
    assert step_only and all(r["ttft_ms"] is None for r in step_only)
    e2e.validate(payload)


def test_weights_memory_per_format(results):
    _, payload = results
    dense, int8 = payload["weights_bytes"]["f32"], payload["weights_bytes"]["int8"]
    # TINY (hidden 64, q 64, k/v 32 wide, intermediate 96): 2 layers x (2 x 64^2 + 2 x 64 x 32 + 3 x 64 x 96)
    # = 61,440 projection weights, 4 bytes each in f32 and 1 in int8, plus int8's float32 scales for
    # 2 x (64 + 32 + 32 + 64 + 96 + 96 + 64) = 896 channels: 3,584 bytes. Everything else is the same.
    assert dense - int8 == 61_440 * 3 - 3_584


def test_no_compiles_after_warmup(results):
    _, payload = results
    assert all(d["compiles_after_setup"] == 0 for d in payload["details"])


def test_floor_counts_base_kv_and_adapters():
    # Llama-2-7B shape, bf16: 32 layers x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096 norms) + LM head
    # 4096 x 32000 + final norm 4096 = 6,607,343,616 params -> 13,214,687,232 bytes.
    model = e2e.LLAMA2_7B
    assert e2e.base_weight_bytes(model, 2) == 13_214_687_232
    # K and V: 2 x 32 layers x 4096 x 2 bytes = 524,288 bytes per token of context.
    assert e2e.kv_bytes(model, 1, 1, 2) == 524_288
    # Rank 16 on all seven: 32 x 16 x (4 x 8192 + 3 x 15104) x 2 = 79,953,920 bytes (~80 MB);
    # rank 8 on q, k, v, o: 32 x 8 x 4 x 8192 x 2 = 16,777,216 bytes (~17 MB).
    assert e2e.adapter_bytes(model, 16, e2e.TARGETS["all"], 2) == 79_953_920
    assert e2e.adapter_bytes(model, 8, e2e.TARGETS["qkvo"], 2) == 16_777_216
    group = e2e.Group(backend="pallas", rank=16, targets="all", batch=64, prompt_len=128, gen_len=128, distinct=(64,))
    expected = (13_214_687_232 + 64 * 192 * 524_288 + 64 * 79_953_920) / 4000e9 * 1e3
    assert math.isclose(e2e.floor_ms(model, group, 64, 4000.0, 2), expected)


def test_roofline_counts_the_gemm_flops_where_they_bound_the_step():
    # GEMM weights: 32 x 202,375,168 projections + 4096 x 32000 LM head = 6,607,077,376; x 2 FLOPs a
    # row: 13,214,154,752 at B=1. At 500 TFLOP/s B=256 takes 6.766 ms of arithmetic, more than the
    # 3.304 ms the bf16 weights take to stream at 4 TB/s; B=1 takes 0.026 ms, far less.
    model = e2e.LLAMA2_7B
    assert e2e.gemm_flops(model, 1) == 13_214_154_752
    streamed = 256 * 192 * 524_288 + 64 * 79_953_920  # KV at the mean context + 64 adapters
    big = e2e.Group(backend="pallas", rank=16, targets="all", batch=256, prompt_len=128, gen_len=128, distinct=(64,))
    want = 256 * 13_214_154_752 / 500e12 * 1e3 + streamed / 4000e9 * 1e3
    assert math.isclose(e2e.roofline_ms(model, big, 64, 4000.0, 500.0, 2), want)
    assert e2e.roofline_ms(model, big, 64, 4000.0, 500.0, 2) > e2e.floor_ms(model, big, 64, 4000.0, 2)
    one = dataclasses.replace(big, batch=1, distinct=(1,))
    assert math.isclose(e2e.roofline_ms(model, one, 1, 4000.0, 500.0, 2), e2e.floor_ms(model, one, 1, 4000.0, 2))


def test_quantized_floor_counts_one_byte_weights_and_their_scales():
    # Per layer: 202,375,168 projection weights at 1 byte; float32 scales for 4 x 4096 + 2 x 11008 +
    # 4096 = 42,496 output channels = 169,984 bytes; two bf16 norms 16,384 bytes -> 202,561,536.
    # x 32 layers + bf16 LM head and final norm (131,072,000 + 4,096) x 2 = 6,744,121,344 bytes.
    model = e2e.LLAMA2_7B
    for quantization in ("fp8", "int8"):
        assert e2e.base_weight_bytes(model, 2, quantization) == 6_744_121_344
    group = e2e.Group(
        backend="pallas",
        rank=16,
        targets="all",
        batch=64,
        prompt_len=128,
        gen_len=128,
        distinct=(64,),
        quantization="int8",
    )
    expected = (6_744_121_344 + 64 * 192 * 524_288 + 64 * 79_953_920) / 4000e9 * 1e3
    assert math.isclose(e2e.floor_ms(model, group, 64, 4000.0, 2), expected)


def test_quantized_targets_compare_with_the_bf16_step():
    cell = {
        "system": "jaxlora",
        "backend": "pallas",
        "batch": 64,
        "distinct_adapters": 64,
        "rank": 16,
        "targets": "all",
        "prompt_len": 128,
        "gen_len": 128,
        "tokens_per_s": None,
        "ttft_ms": None,
    }
    rows = [
        {**cell, "weights": "bf16", "step_ms": 10.0, "floor_step_ms": 6.0},
        {**cell, "weights": "fp8", "step_ms": 5.5, "floor_step_ms": 4.5},
        {**cell, "weights": "int8", "step_ms": 7.0, "floor_step_ms": 4.5},
    ]
    targets = {t["target"].split(" decode")[0]: t for t in e2e.quantized_targets(rows)}
    assert targets["fp8"]["measured"] == 0.55 and targets["fp8"]["met"]
    assert targets["int8"]["measured"] == 0.7 and not targets["int8"]["met"]
    floor = targets["every quantized"]
    assert floor["measured"] == 1.56 and not floor["met"] and floor["detail"].startswith("int8")


def test_floor_targets_split_adapter_steps_from_bank_free_steps():
    # A d = 0 row times the bank-free step, the same program for every LoRA backend: it is held to
    # the base-only bar (1.25x) and is no backend comparison; rows with adapters are held to 1.4x.
    cell = {
        "system": "jaxlora",
        "weights": "bf16",
        "batch": 64,
        "rank": 16,
        "targets": "all",
        "prompt_len": 128,
        "gen_len": 128,
        "tokens_per_s": None,
        "ttft_ms": None,
    }
    rows = [
        {**cell, "backend": "pallas", "distinct_adapters": 64, "step_ms": 8.3, "floor_step_ms": 6.0},  # 1.38x
        {**cell, "backend": "xla", "distinct_adapters": 64, "step_ms": 9.0, "floor_step_ms": 6.0},
        {**cell, "backend": "pallas", "distinct_adapters": 0, "step_ms": 6.5, "floor_step_ms": 5.0},  # 1.30x
        {**cell, "backend": "xla", "distinct_adapters": 0, "step_ms": 6.4, "floor_step_ms": 5.0},  # faster: ignored
        {**cell, "backend": "pallas", "batch": 8, "distinct_adapters": 8, "step_ms": 9.0, "floor_step_ms": 3.0},
    ]
    targets = {t["target"].split(" (")[0].split(" within")[0]: t for t in e2e.targets_summary(rows)}
    lora = targets["every pallas decode step with adapters at batch >= 16"]
    assert lora["measured"] == 1.38 and lora["met"] and lora["detail"].startswith("B=64 d=64")
    base = targets["every base-only"]
    assert base["measured"] == 1.3 and not base["met"] and base["detail"].startswith("B=64 d=0")
    versus = targets["pallas faster than xla and ragged at every batch >= 16 with adapters"]
    assert versus["measured"] == "1/1 comparisons won" and versus["met"]


@pytest.mark.parametrize(
    "bad",
    [
        {"rows": [{"system": "vllm"}]},
        {"rows": [{"weights": "int4"}]},
        {"hbm_GBps": "fast"},
        {"rows": [{"step_ms": -1.0}]},
        {"rows": [{"tokens_per_s": float("nan")}]},
    ],
)
def test_validate_rejects_malformed(bad):
    row = {
        "system": "jaxlora",
        "backend": "xla",
        "weights": "f32",
        "batch": 4,
        "distinct_adapters": 0,
        "rank": 4,
        "targets": "all",
        "prompt_len": 8,
        "gen_len": 4,
        "tokens_per_s": 1.0,
        "step_ms": 1.0,
        "floor_step_ms": 1.0,
        "ttft_ms": 1.0,
    }
    payload = {"device": "cpu", "jax_version": "0", "hbm_GBps": 1.0, "rows": [row]}
    e2e.validate(payload)
    if "rows" in bad:
        payload["rows"] = [{**row, **bad["rows"][0]}]
    else:
        payload.update(bad)
    with pytest.raises(ValueError):
        e2e.validate(payload)


def test_groups_pick_plan_groups_and_refuse_unknown_ones(tmp_path):
    """--groups runs only the named plan groups (here the tiny plan's step-only group, index 1 with one
    backend); an index past the plan, a repeated one, or --skip-groups beside it is refused before
    anything runs."""
    out = tmp_path / "g"
    assert main(["bench", "--tiny", "--backend", "xla", "--steps", "1", "--groups", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "e2e.json").read_text())["rows"]
    assert rows and all(r["tokens_per_s"] is None for r in rows)  # step-only: no engine run
    with pytest.raises(ValueError, match="distinct groups of the plan.s 0..1"):
        main(["bench", "--tiny", "--backend", "xla", "--groups", "2", "--out", str(tmp_path / "h")])
    with pytest.raises(ValueError, match="distinct groups"):
        main(["bench", "--tiny", "--backend", "xla", "--groups", "1", "1", "--out", str(tmp_path / "h")])
    with pytest.raises(ValueError, match="give one of them"):
        main(
            ["bench", "--tiny", "--backend", "xla", "--groups", "1", "--skip-groups", "1", "--out", str(tmp_path / "h")]
        )
