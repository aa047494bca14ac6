"""python -m benchmarks.serving.trace: S-LoRA's trace generator, the chat trace, the rate bisection, and
toy runs on CPU."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving.chat_trace import TINY_CHAT, make_chat_trace
from benchmarks.serving.trace import make_trace, merge_rows, next_sweep_rate, num_fitting, rate_spec, row_key
from jaxlora.adapters import Pager
from jaxlora.config import ATTENTION_MODULES, LoraConfig
from tests.factories import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _gaps(trace) -> np.ndarray:
    return np.diff([0.0] + [r.arrival_s for r in trace])


@pytest.mark.parametrize("cv", [1.0, 2.0, 0.5])
def test_long_trace_has_the_asked_rate_and_cv(cv):
    trace = make_trace(n=100, alpha=1.0, rate=10.0, cv=cv, duration_s=20_000)
    gaps = _gaps(trace)
    assert len(trace) == 200_000
    assert abs(gaps.mean() - 0.1) < 0.002  # 200,000 gaps: the mean's standard error is 0.1 * cv / 447
    assert abs(gaps.std() / gaps.mean() - cv) < 0.03 * cv
    assert np.all(gaps >= 0)  # cv > 1: Gamma(shape < 1) draws gaps that round to 0


def test_lengths_are_uniform_in_8_to_511():
    trace = make_trace(n=10, alpha=1.0, rate=50.0, cv=1.0, duration_s=400)
    for lengths in ([r.prompt_len for r in trace], [r.output_len for r in trace]):
        assert min(lengths) == 8 and max(lengths) == 511  # 20,000 draws over 504 values reach both ends
        assert abs(np.mean(lengths) - (8 + 511) / 2) < 5


def test_smaller_alpha_concentrates_requests_on_fewer_adapters():
    n = 2000

    def top_share(alpha: float) -> float:  # share of requests that go to the 20 most requested adapters
        counts = np.bincount(
            [r.adapter for r in make_trace(n=n, alpha=alpha, rate=100.0, cv=1.0, duration_s=200)], minlength=n
        )
        return float(np.sort(counts)[::-1][:20].sum() / counts.sum())

    shares = [top_share(a) for a in (1.0, 0.5, 0.1)]
    assert shares[0] < shares[1] < shares[2]
    assert shares[0] < 0.03  # uniform: 20 of 2,000 adapters get about 1%
    assert shares[2] > 0.5  # power(0.1): P(index < 20) = (20 / 2000) ** 0.1 = 0.63
    skewed = [r.adapter for r in make_trace(n=n, alpha=0.1, rate=100.0, cv=1.0, duration_s=20)]
    assert min(skewed) >= 0 and max(skewed) < n
    assert skewed.count(0) > skewed.count(n - 1)


def test_trace_is_s_loras_draw_for_draw():
    """S-LoRA's generate_requests seeds numpy's global generator and draws adapters, input lengths,
    output lengths, then gaps; the same seed must give the same trace."""
    np.random.seed(7)
    total = int(3.0 * 10)
    adapters = (np.random.power(0.5, total) * 50).astype(int)
    inputs = np.random.randint(8, 512, total)
    outputs = np.random.randint(8, 512, total)
    arrivals = np.cumsum(np.random.gamma(1 / 4.0, 4.0 / 3.0, total))  # cv 2, rate 3
    trace = make_trace(n=50, alpha=0.5, rate=3.0, cv=2.0, duration_s=10, seed=7)
    assert [r.adapter for r in trace] == adapters.tolist()
    assert [r.prompt_len for r in trace] == inputs.tolist()
    assert [r.output_len for r in trace] == outputs.tolist()
    np.testing.assert_allclose([r.arrival_s for r in trace], arrivals)
    assert make_trace(n=50, alpha=0.5, rate=3.0, cv=2.0, duration_s=10, seed=8) != trace


def test_trace_rejects_bad_parameters():
    with pytest.raises(ValueError, match="rate"):
        make_trace(n=10, alpha=1.0, rate=0.0, cv=1.0, duration_s=10)
    with pytest.raises(ValueError, match="input_range"):
        make_trace(n=10, alpha=1.0, rate=1.0, cv=1.0, duration_s=10, input_range=(8, 8))


def test_sweep_bisects_between_the_best_pass_and_the_first_miss():
    assert next_sweep_rate({4.0: 1.0, 10.0: 0.5, 40.0: 0.0}) == 7.0
    assert next_sweep_rate({4.0: 1.0, 7.0: 0.95, 10.0: 0.5}) == 8.5
    assert next_sweep_rate({4.0: 1.0, 4.5: 0.2}) is None  # narrower than the resolution
    assert next_sweep_rate({4.0: 1.0, 10.0: 0.95}) == 20.0  # nothing missed yet: go higher
    assert next_sweep_rate({4.0: 0.3, 10.0: 0.1}) == 2.0  # nothing passed yet: go lower
    assert next_sweep_rate({}) is None


def test_merge_replaces_rows_of_the_same_key():
    def row(engine, rate, value, **extra):
        return {
            "engine": engine,
            "setting": "s1",
            "n": 2000,
            "rate": rate,
            "duration_s": 25.0,
            "cv": 1.0,
            "alpha": 1.0,
            "value": value,
        } | extra

    # A row without "temperature" (written before the field) is a greedy row: temperature 0.
    merged = merge_rows(
        [row("bucketed", 4.0, 1), row("bucketed", 10.0, 2), row("ragged", 4.0, 5, temperature=1.0)],
        [row("bucketed", 4.0, 3), row("ragged", 4.0, 4, temperature=0.0), row("ragged", 4.0, 6, duration_s=120.0)],
    )
    assert sorted((r["engine"], r["rate"], r["value"]) for r in merged) == [
        ("bucketed", 4.0, 3),
        ("bucketed", 10.0, 2),
        ("ragged", 4.0, 4),
        ("ragged", 4.0, 5),  # a sampled run is not replaced by a greedy one
        ("ragged", 4.0, 6),  # nor a 25 s run by a 120 s one
    ]
    assert len({row_key(r) for r in merged}) == 5


def _run(out: Path, *args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.serving.trace",
            "--tiny",
            "--engine-commit",
            "test",
            "--out",
            str(out),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "serving.json").read_text())


@pytest.mark.parametrize("bank", ["paged", "unified"])
def test_tiny_true_rank_bank_run_has_its_bank_and_pool_columns(tmp_path, bank):
    """--bank paged | unified: the rows say so, get their own key, and carry the pool shares (a
    unified bank has no bytes of its own: its adapters' share is of the KV pool)."""
    payload = _run(tmp_path, "--settings", "s2", "--bank", bank, "--rates", "8@1", "--max-drain-s", "60")
    (row,) = payload["rows"]
    assert row["bank"] == bank and row["completed"] == row["requests"] == 8 and row["page_ins"] > 0
    assert 0 < row["pool_adapter_share"] < 1 and 0 < row["pool_kv_share"] < 1
    assert (row["pool_adapter_bytes"] > 0) == (bank == "paged") and row["pool_kv_bytes"] > 0
    assert row_key(row) != row_key({**row, "bank": "padded"})
    assert row_key({k: v for k, v in row.items() if k != "bank"}) == row_key({**row, "bank": "padded"})


def test_tiny_s70_serves_its_fp8_base_and_bounds_every_row(tmp_path):
    """s70's FP8 base drawn in the serving layout (K-major FP8 by default): the rows say "fp8" and
    carry the bound, the smaller of its compute and bytes parts."""
    payload = _run(tmp_path, "--settings", "s70", "--rates", "4@1", "--max-drain-s", "60", "--probe-steps", "0")
    (row,) = payload["rows"]
    assert row["setting"] == "s70" and row["weights"] == "fp8" and row["completed"] == row["requests"] == 4
    assert row["bound_req_s"] == min(row["bound_compute_req_s"], row["bound_bytes_req_s"]) > 0
    assert row["hbm_GBps"] > 0 and row["fp8_TFLOPs"] > 0


def test_host_budget_counts_each_adapter_at_its_rank_class():
    pager = Pager(tiny_config(), LoraConfig(max_slots=3, max_rank=8, target_modules=ATTENTION_MODULES))
    ranks = (8, 4, 2, 1)  # classes 8, 4, 4, 4
    sizes = [pager.host_nbytes(r) for r in ranks]
    assert sizes[0] == 2 * sizes[1] and sizes[1] == sizes[2] == sizes[3]
    two_rounds = 2 * sum(sizes)
    assert num_fitting(pager, ranks, 100, two_rounds + sizes[0] - 1) == 8  # the ninth (rank 8) does not fit
    assert num_fitting(pager, ranks, 100, two_rounds + sizes[0]) == 9
    assert num_fitting(pager, ranks, 5, None) == 5 and num_fitting(pager, ranks, 3, 10**12) == 3


def test_tiny_open_loop_run_accounts_for_every_request(tmp_path):
    payload = _run(
        tmp_path,
        *("--settings", "s1", "--rates", "8@1.5", "--duration", "9", "--max-drain-s", "60"),
        *("--budgets", "32", "8", "16", "--temperature", "0.8", "--probe-steps", "2"),
    )
    assert isinstance(payload["device"], str) and isinstance(payload["jax_version"], str)
    assert payload["engine_commit"] == "test"
    (row,) = payload["rows"]
    assert row["engine"] == "ragged" and row["setting"] == "s1" and row["rate"] == 8.0 and row["duration_s"] == 1.5
    assert row["paged"] and row["n"] > row["slots"] and row["page_ins"] > 0
    assert row["token_budgets"] == [8, 16, 32] and row["temperature"] == 0.8
    assert row["requests"] == int(8 * 1.5)
    assert row["completed"] + row["unfinished"] + row["rejected"] + row["stopped_other"] == row["requests"]
    assert row["completed"] == row["requests"]  # a toy load with a minute to drain
    assert 0 <= row["slo_attainment"] <= 1
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"]
    assert row["e2e_ms_p50"] >= row["ttft_ms_p50"]
    assert row["served_req_s"] > 0 and row["served_tok_s"] > 0
    assert 0 < row["arrival_span_s"] <= row["window_s"] and row["served_req_s"] <= row["realized_rate"]
    assert row["steps"] > 0 and row["decode_tokens_per_step"] > 0 and row["prefill_tokens_per_step"] > 0
    assert 0 < row["padding_share"] < 1 and row["compiles_during_run"] == 0
    loop = row["loop_ms_per_step"]  # the loop's time a step by phase: within the run's wall time a step
    assert set(loop) == {"schedule", "inputs", "dispatch", "stream", "wait", "idle_calls_per_step"}
    assert all(v >= 0 for v in loop.values()) and loop["dispatch"] > 0 and loop["inputs"] > 0
    assert sum(loop[p] for p in ("schedule", "inputs", "dispatch", "stream", "wait")) * row["steps"] <= (
        row["run_s"] * 1e3
    )
    # The decode-only step at the run's batch, on the run's engine, padded as the scheduler pads it.
    assert row["decode_step_rows"] == min(max(1, round(row["decode_tokens_per_step"])), 8)
    assert row["decode_step_budget"] == min(b for b in (8, 16, 32) if b >= row["decode_step_rows"])
    assert row["decode_step_ms"] > 0
    assert row["tpot_over_decode_step"] == pytest.approx(row["tpot_ms_p50"] / row["decode_step_ms"], rel=1e-2)
    assert (tmp_path / "serving.md").read_text().startswith("# Open-loop serving")
    assert (tmp_path / "serving.png").stat().st_size > 0


def test_budget_stops_before_a_setting_and_still_writes(tmp_path):
    payload = _run(tmp_path, "--budget-s", "0")
    assert payload["rows"] == [] and payload["not_run"] == ["all", "s1", "s2"]


def test_rate_spec_takes_a_rate_and_optional_seconds():
    assert rate_spec("10") == (10.0, None) and rate_spec("2.5@120") == (2.5, 120.0)
    for bad in ("x", "10@", "10@y", "@5", "0", "-1@5", "4@0", "nan", "inf", "4@inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            rate_spec(bad)


def test_split_every_group_runs_every_module_group_as_two_launches(monkeypatch):
    """--lora-groups split: the A/B arm without the one-launch kernel or the tile expand, whatever
    the rank and rows."""
    from benchmarks.serving.trace import split_every_group
    from pallas_kernels.lora import tuning

    for table in tuning.GROUP_TABLES.values():  # restored after the test
        for key in list(table):
            monkeypatch.setitem(table, key, dict(table[key]))
    cells = [(mode, t, r) for mode in tuning.GROUP_TABLES for t in (16, 256, 1024, 4096) for r in (8, 16, 64)]
    assert any(tuning.lookup_group(*c)["impl"] == "fused" for c in cells)
    assert any(tuning.lookup_group(*c)["impl"] == "split_tiles" for c in cells)
    split_every_group()
    assert all(tuning.lookup_group(*c)["impl"] == "split" for c in cells)


def test_the_full_size_engine_is_the_h200_preset():
    """The serving rows' engine is configs/llama2-7b-h200.yaml: the `all` setting's engine equals the
    preset field for field but the open-loop queue, and the paged settings change only the bank."""
    import dataclasses

    from benchmarks.serving.trace import OPEN_LOOP_QUEUE, PRESET, engine_config, scale, settings
    from jaxlora.config import LoraConfig
    from jaxlora.engine.config import EngineConfig

    preset = EngineConfig.from_yaml(PRESET)
    size, every = scale(tiny=False, model="llama2-7b"), settings(tiny=False)
    assert (preset.max_batch, preset.token_budgets) == (256, (32, 64, 128, 256, 512, 1024, 2048))
    setting = every["all"]
    bank = LoraConfig(max_slots=setting.slots + 1, max_rank=setting.max_rank, target_modules=setting.modules)
    measured = engine_config(setting, size, dataclasses.replace(bank, backend=preset.lora.backend))
    assert measured == dataclasses.replace(preset, max_queue=OPEN_LOOP_QUEUE)
    for name in ("s1", "s2"):
        s = every[name]
        lora = LoraConfig(max_slots=s.slots + 1, max_rank=s.max_rank, target_modules=s.modules)
        assert dataclasses.replace(engine_config(s, size, lora), lora=preset.lora) == measured


def test_chat_trace_draws_conversations_within_the_shape_and_the_positions():
    shape = TINY_CHAT
    trace = make_chat_trace(shape, rate=50.0, duration_s=40, vocab=128, max_seq_len=48, seed=1)
    assert len(trace.conversations) == 2000 and len(trace.systems) == shape.num_adapters
    assert all(len(s) == shape.system_len for s in trace.systems) and len({tuple(s) for s in trace.systems}) == 4
    for c in trace.conversations:
        assert len(c.users) == len(c.output_lens) == len(c.think_s) <= shape.turns[1]
        assert all(shape.user_len[0] <= len(u) <= shape.user_len[1] for u in c.users)
        assert all(shape.output_len[0] <= o <= shape.output_len[1] for o in c.output_lens)
        assert shape.system_len + sum(map(len, c.users)) + sum(c.output_lens) <= 48
    planned = sum(len(c.users) for c in trace.conversations)
    assert trace.turns_left_off > 0 and planned > 2000 * shape.turns[0] - trace.turns_left_off
    counts = np.bincount([c.adapter for c in trace.conversations], minlength=4)
    assert counts[0] > counts[1] > counts[3]  # Zipf: the first adapter twice the second's share, ...
    gaps = np.diff([0.0] + [c.arrival_s for c in trace.conversations])
    assert abs(gaps.mean() - 1 / 50) < 0.002 and abs(gaps.std() / gaps.mean() - 1) < 0.1  # Poisson


def test_smoke_chat_run_has_a_row_with_and_one_without_the_prefix_cache(tmp_path):
    payload = _run(tmp_path, "--smoke", "--trace", "chat", "--prefix-cache", "both", "--probe-steps", "0")
    off, on = payload["rows"]
    assert [(r["trace"], r["prefix_cache"]) for r in (off, on)] == [("chat", False), ("chat", True)]
    for row in (off, on):
        assert row["setting"] == "chat" and row["conversations"] == 4 and row["conversations_done"] == 4
        assert row["completed"] == row["requests"] == row["turns_sent"] == row["turns_planned"]
        assert row["served_turns_s"] == row["served_req_s"] > 0 and row["compiles_during_run"] == 0
    # The same trace and greedy answers: the same turns, whose history the cache serves when on.
    assert on["mean_prompt_len"] == off["mean_prompt_len"] and on["turns_sent"] > on["conversations"]
    assert off["prefix_cache_hit_share"] is None and 0.3 < on["prefix_cache_hit_share"] < 1


def test_smoke_through_the_server(tmp_path):
    """--api http grpc: `jaxlora serve` started as a subprocess on a model folder, PEFT folders and a
    preset, driven by the openai client and by the gRPC client; rows carry the server's start-up."""
    rows = _run(tmp_path, "--smoke", "--api", "http", "grpc", "--starts", "1")["rows"]
    assert sorted((r["api"], r["start"]) for r in rows) == [("grpc", "first"), ("http", "first")]
    for r in rows:
        assert r["completed"] == r["requests"] > 0 and r["errors"] == [] and r["server_ready_s"] > 0
        assert set(r["startup"]) == {"import", "load", "register", "compile", "warm-up run", "total"}
        assert r["startup"]["total"] <= r["server_ready_s"]
        assert r["ttft_ms_p50"] > 0 and r["tpot_ms_p50"] > 0 and r["steps"] is None  # engine counters: not seen
        assert r["loop_ms_per_step"] is None
        assert r["prefix_cache"] is True  # the preset's engine, which the server runs


def test_smoke_through_the_server_on_the_paged_bank_with_other_code(tmp_path):
    """--bank paged with a server api: the preset asks for the paged bank, the server runs the paged
    kernels (its warm-up log says so), and the rows say "paged". --server-code: the server runs
    another source tree (here an export of this one, holding a marker module), rows record its commit.
    A compilation cache an earlier run left in --work-dir is emptied: the first start is "first"."""
    work, code = tmp_path / "work", tmp_path / "code"
    code.mkdir()
    stale = work / "compilation-cache" / "s1" / "left-by-an-earlier-run"
    stale.parent.mkdir(parents=True)
    stale.write_text("x")
    root = Path(__file__).resolve().parents[2]
    for package in ("jaxlora", "serving"):
        shutil.copytree(root / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "jaxlora" / "cli" / "main.py").write_text(
        (root / "jaxlora" / "cli" / "main.py")
        .read_text()
        .replace("def main(", 'print("running the exported tree", flush=True)\n\n\ndef main(', 1)
    )
    argv = ["--smoke", "--api", "http", "--starts", "1", "--bank", "paged", "--work-dir", str(work)]
    rows = _run(tmp_path, *argv, "--server-code", str(code), "--server-commit", "exported")["rows"]
    assert [(r["api"], r["bank"], r["engine_commit"], r["start"]) for r in rows] == [
        ("http", "paged", "exported", "first")
    ]
    assert not stale.exists()
    assert rows[0]["completed"] == rows[0]["requests"] > 0 and rows[0]["errors"] == []
    assert "bank: paged" in (work / "s1" / "engine.yaml").read_text()
    log = (work / "s1" / "serve-1-first-code.log").read_text()
    assert "lora=paged" in log and "running the exported tree" in log


def test_flags_the_server_would_not_honour_are_refused(capsys):
    """The server runs the preset's engine: a prefix cache asked off for a server api is an error,
    not a row that says off while the server ran it on."""
    from benchmarks.serving.trace import parse_args

    for cache in ("off", "both"):
        with pytest.raises(SystemExit):
            parse_args(["--smoke", "--api", "http", "--prefix-cache", cache])
        assert "in-process only" in capsys.readouterr().err
    assert parse_args(["--smoke", "--api", "inprocess", "--prefix-cache", "off"]).prefix_cache == "off"
