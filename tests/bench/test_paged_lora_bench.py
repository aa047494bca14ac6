"""python -m benchmarks.kernels.paged_lora runs end to end on tiny shapes in interpret mode (the GPU run is
the real one): the paged, unified (KV-pool, per row) and tiled unified kernels agree with the padded
bank on decode and mixed steps, and neither layout costs more bytes."""

from __future__ import annotations

import json

import pytest

from pallas_kernels.lora.tuning import unified_shrink_knobs
from tests.bench.run_module import run_benchmark


def test_paged_lora_bench_smoke(tmp_path):
    run = run_benchmark("kernels.paged_lora", "--smoke", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "paged_lora.json").read_text())
    assert {(r["mix"], r["kind"]) for r in rows} == {("s1", "decode"), ("s2", "decode"), ("s2", "mixed")}
    for r in rows:
        assert r["max_rel_err"] < 2e-2 and min(r[f"{k}_us"] for k in ("padded", "paged", "unified", "tiled")) > 0
        assert set(r["tiled_knobs_us"]) == {"rb16/rows16", "rb16/rows32"}  # each tile height checked, then timed
        assert r["tiled_us"] == pytest.approx(min(r["tiled_knobs_us"].values()), abs=0.01) and r["tiled_tile_rows"] in (
            16,
            32,
        )
        for layout in ("paged", "unified"):
            ratio = r[f"{layout}_bytes"] / r["padded_bytes"]
            assert ratio <= 1.01 if r["ranks"] == [max(r["ranks"])] else ratio < 0.95, (layout, r)
    assert "| s2 |" in (tmp_path / "paged_lora.md").read_text()


def test_quick_run_times_the_engine_knobs_and_every_tile_height(tmp_path):
    run = run_benchmark("kernels.paged_lora", "--smoke", "--quick", "--cases", "s2:24:mixed", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads((tmp_path / "paged_lora.json").read_text())
    knobs = unified_shrink_knobs(24)
    k = f"rb{knobs['rank_block']}/ks{knobs['k_splits']}/u{knobs['unroll']}/st{knobs['num_stages']}"
    assert list(row["unified_knobs_us"]) == [k]
    assert row["unified_unsplit_us"] is None
    assert set(row["tiled_knobs_us"]) == {"rb16/rows16", "rb16/rows32"} and row["max_rel_err"] < 2e-2
