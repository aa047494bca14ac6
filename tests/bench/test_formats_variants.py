"""benchmarks.engine.formats: the variants the FP8 layout A/B runs in one process (labels, the
models each one gets, vs_bf16 whatever the order). The timed run itself is its --smoke."""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import pytest

from benchmarks.common import TINY
from benchmarks.engine.formats import (
    GPU_CASES,
    VARIANTS,
    Variant,
    build_models,
    selected_variants,
    set_vs_bf16,
    skip_reason,
)
from jaxlora.kernels import KMAJOR_SERVING
from jaxlora.model.params import random_model


def test_labels_are_unique_and_name_both_fp8_layouts():
    labels = [v.label for v in VARIANTS]
    assert len(set(labels)) == len(labels)
    for gemm in ("weight-only", "w8a8"):
        assert {f"fp8-{gemm}", f"fp8-kmajor-{gemm}"} <= set(labels)
    assert "fp8-kmajor-weight-only-mgpu" in labels
    with pytest.raises(ValueError, match="layout must be one of"):
        Variant("fp8", "w8a8", "transposed")


def test_variants_are_picked_in_the_order_given():
    opts = argparse.Namespace(variants=["fp8-kmajor-w8a8", "bf16-dense"])
    assert [v.label for v in selected_variants(opts)] == ["fp8-kmajor-w8a8", "bf16-dense"]
    with pytest.raises(SystemExit, match="fp8-transposed"):
        selected_variants(argparse.Namespace(variants=["fp8-transposed"]))


def test_each_layout_gets_its_own_model_of_the_same_weights():
    dense = random_model(TINY, dtype=jnp.float32, fused=True)
    variants = selected_variants(argparse.Namespace(variants=[]))
    models = build_models(dense, variants)
    assert models[("fp8", True)].kmajor and not models[("fp8", False)].kmajor
    assert models[("int8", None)].kmajor is KMAJOR_SERVING[jnp.dtype(jnp.int8)]
    assert models[("bf16", None)] is dense
    a, b = models[("fp8", True)].flat_params(), models[("fp8", False)].flat_params()
    name = "layers.mlp.down_proj.qkernel"
    assert (a[name].view(jnp.uint8) == b[name].view(jnp.uint8)).all()


def test_vs_bf16_does_not_depend_on_the_order():
    rows = [
        {"case_label": "mixed-2048", "gemm": "w8a8", "step_ms": 6.0},
        {"case_label": "mixed-2048", "gemm": "dense", "step_ms": 4.0},
        {"case_label": "decode-64", "gemm": "w8a8", "step_ms": 2.0},
    ]
    set_vs_bf16(rows)
    assert [r["vs_bf16"] for r in rows] == [1.5, 1.0, None]


def test_only_the_mosaic_variant_skips_steps_above_its_limit():
    mgpu = Variant("fp8", "weight-only", "kmajor", kernel="mgpu")
    skipped = {c.label for c in GPU_CASES if skip_reason(mgpu, c)}
    assert skipped == {"mixed-512", "mixed-2048"}
    assert not any(skip_reason(v, c) for v in VARIANTS if v.kernel == "auto" for c in GPU_CASES)


def test_profiled_cases_get_an_op_split_and_the_others_none(tmp_path):
    from benchmarks.engine.formats import main

    argv = ["--smoke", "--out", str(tmp_path), "--cases", "decode-4", "mixed-24", "--variants", "bf16-dense"]
    assert main([*argv, "--profile", "mixed-24"]) == 0
    rows = {r["case_label"]: r for r in json.loads((tmp_path / "formats.json").read_text())["rows"]}
    assert "ops_ms" not in rows["decode-4"]
    # On the CPU the trace has no GPU plane: the split is there, with nothing in it.
    assert set(rows["mixed-24"]["ops_ms"]) == {"attention", "gemm", "lora", "other", "launches", "top"}
