"""benchmarks/run.py and its recipes: every recipe names modules and flags that exist (checked against
the modules' sources, so a renamed flag fails here, not on the device), placeholders fill, budgets
split as documented, and a real run lands in its benchmark's dated run folder (test_pagein_probe.py)."""

from __future__ import annotations

import re

import pytest

from benchmarks import run
from benchmarks.paths import benchmark_name, module_file, results_dir
from benchmarks.recipes import RECIPES, Part, Recipe


def declared_flags(module: str) -> set[str]:
    return set(re.findall(r"""["'](--[\w-]+)["']""", module_file(module).read_text()))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_runs_modules_and_flags_that_exist(name, tmp_path):
    recipe = RECIPES[name]
    for part in recipe.parts:
        assert module_file(part.module).exists(), part.module
        flags = {a for a in part.words if a.startswith("--")}
        assert flags <= declared_flags(part.module), (part.module, flags - declared_flags(part.module))
        values = {**recipe.variables, "out": str(tmp_path), "budget_s": "100"}
        assert all(run.fill(a, values) for a in part.words)  # every placeholder has a value
    labels = [(p.module, p.label) for p in recipe.parts]
    assert len(set(labels)) == len(labels), "two parts of one module need labels to keep their folders apart"


def test_fill_splits_a_whole_placeholder_and_names_a_missing_one():
    values = {"cases": "64:64 256:256", "out": "/o"}
    assert run.fill("{cases}", values) == ["64:64", "256:256"]
    assert run.fill("{out}/hf_peer.json", values) == ["/o/hf_peer.json"]
    with pytest.raises(SystemExit, match="rate"):
        run.fill("{rate}", values)


def test_part_timeout_keeps_the_reserve_and_the_cap():
    assert run.part_timeout_s(Part(module="engine.e2e", reserve_s=100), 500.5) == 400
    assert run.part_timeout_s(Part(module="engine.e2e", cap_s=60, reserve_s=100), 500) == 60
    assert run.part_timeout_s(Part(module="engine.e2e", cap_s=60, reserve_s=100), 130) == 30
    assert run.part_timeout_s(Part(module="engine.e2e", reserve_s=20, share=0.5), 400) == 190


def test_a_part_that_no_longer_fits_is_skipped(tmp_path, capsys):
    recipe = Recipe(doc="", total_s=40, parts=(Part(module="engine.e2e", reserve_s=30, min_s=25),))
    assert run.run(recipe, tmp_path, "t", {}, dry_run=False) == 0
    assert "not run" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_results_live_under_the_benchmarks_group_and_name():
    assert benchmark_name("benchmarks.serving.trace") == benchmark_name("serving.trace") == "serving/trace"
    assert results_dir(module_file("kernels.lora")).parts[-3:] == ("results", "kernels", "lora")
    with pytest.raises(ValueError, match="GROUP.NAME"):
        benchmark_name("serving")


def test_a_module_run_gets_its_output_folder_unless_it_names_one():
    part = run.module_recipe("kernels.quant_gemm", ["--tiny", "--formats", "a b"], None, 100).parts[0]
    assert part.words == ["--tiny", "--formats", "a b", "--out", "{out}"]
    assert run.module_recipe("engine.hf_peer", [], None, 100).parts[0].words == ["--out", "{out}/hf_peer.json"]
    assert run.module_recipe("kernels.quant_gemm", ["--out", "x"], None, 100).parts[0].words == ["--out", "x"]
    with pytest.raises(SystemExit, match="no benchmark"):
        run.module_recipe("kernels.nothing", [], None, 100)
