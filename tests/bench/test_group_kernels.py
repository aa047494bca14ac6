"""python -m benchmarks.kernels.lora_groups runs end to end on tiny shapes in interpret mode (the H200 run is
the real one): every variant agrees with XLA, and the best row per T comes out of the rows."""

from __future__ import annotations

import json

from tests.bench.run_module import run_benchmark


def test_group_kernels_smoke(tmp_path):
    run = run_benchmark(
        "kernels.lora_groups", "--smoke", "--tokens", "40", "--ranks", "4", "--check-ranks", "2", "--out", str(tmp_path)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads((tmp_path / "group_kernels.json").read_text())
    rows = doc["rows"]
    at_rank = lambda rank: {(r["variant"], r["pattern"]) for r in rows if r["rank"] == rank}  # noqa: E731
    patterns = {"d1", "d8"}  # T=40 on an 8-adapter bank: 1, T/4 (10, capped to the bank's 8) and every slot
    assert at_rank(4) == {(v, p) for v in ("split", "xla", "tiles0", "fused0") for p in patterns}
    # The second rank checks the split form and XLA against the best row of the first rank only.
    best = doc["best"]["4"]["40"]["variant"]
    assert at_rank(2) == {(v, p) for v in {"split", "xla", best} for p in patterns}
    assert all(r["max_abs_diff_vs_xla"] < 0.1 and r["us"] > 0 and r["floor_us"] > 0 for r in rows)
