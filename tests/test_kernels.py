"""The kernel choice (`jaxlora.kernels`): the `kernels:` config section, its resolution per platform
and model layout, and the per-step-size rules a resolved StepKernels applies. Plain Python: no step
is compiled here (the engine and model tests run the kernels the choice names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxlora import kernels as kernels_module
from jaxlora.config import AttentionBackend, LoraBackend, LoraBank, LoraConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.kernels import (
    QUANT_KERNEL_MAX_TOKENS,
    GemmBackend,
    KernelConfig,
    QuantMatmul,
    QuantRule,
    StepKernels,
    gemm_compiler_options,
)

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_spells_out_its_kernels_section(preset):
    """Each preset names every choice of the section, so a run's kernels are read off its config."""
    import yaml

    section = yaml.safe_load(preset.read_text())["engine"]["kernels"]
    assert set(section) == {f.name for f in dataclasses.fields(KernelConfig)}
    config = EngineConfig.from_yaml(preset)
    assert config.kernels == KernelConfig.from_dict(section)
    assert config.step_kernels(fused_projections=True, platform="cpu").lora is LoraBackend(config.lora.backend)


def test_auto_resolves_per_platform_and_layout():
    auto = KernelConfig()
    gpu = auto.resolve("pallas", "gpu", fused_projections=True, compute_capability="9.0")
    assert (gpu.attention, gpu.unroll_layers, gpu.gemm, gpu.interpret) == (
        AttentionBackend.PALLAS,
        True,
        GemmBackend.CUBLAS,
        False,
    )
    assert (gpu.quant_matmul, gpu.quant_kernel_max_tokens) == (QuantMatmul.BEST, QUANT_KERNEL_MAX_TOKENS)
    separate = auto.resolve("pallas", "gpu", fused_projections=False, compute_capability="9.0")
    assert separate.gemm is GemmBackend.XLA and separate.quant_matmul is QuantMatmul.XLA
    cpu = auto.resolve("pallas", "cpu")
    assert (cpu.attention, cpu.unroll_layers, cpu.gemm, cpu.quant_matmul) == (
        AttentionBackend.XLA,
        False,
        GemmBackend.XLA,
        QuantMatmul.XLA,
    )
    assert cpu.interpret  # the Pallas LoRA kernels run in the interpreter on CPU
    assert not auto.resolve("xla", "cpu").interpret


def test_a_paged_bank_runs_the_paged_pallas_kernels():
    """lora.bank=paged: the paged kernels are Pallas, so CPU interprets them whatever lora.backend is."""
    paged = KernelConfig().resolve("xla", "cpu", lora_bank="paged")
    assert paged.lora_bank is LoraBank.PAGED and paged.interpret
    assert "lora=paged" in paged.describe(8)
    on_gpu = KernelConfig().resolve("xla", "gpu", lora_bank=LoraBank.PAGED, compute_capability="9.0")
    assert not on_gpu.interpret
    config = EngineConfig(lora=LoraConfig(bank="paged"))
    assert config.step_kernels(fused_projections=True, platform="cpu").lora_bank is LoraBank.PAGED
    assert EngineConfig().step_kernels(fused_projections=True, platform="cpu").lora_bank is LoraBank.PADDED
    with pytest.raises(ValueError, match="bank="):
        LoraConfig(bank="ragged")
    with pytest.raises(ValueError, match="page_rows=6 must be a power of two"):
        LoraConfig(page_rows=6)
    with pytest.raises(ValueError, match="pool_pages=0"):
        LoraConfig(pool_pages=0)


def test_named_choices_win_over_auto():
    named = KernelConfig(
        attention="xla", unroll_layers=False, gemm="xla", quant_matmul="pallas", concurrent_min_tokens=9
    )
    got = named.resolve("xla", "gpu", compute_capability="9.0")
    assert (got.attention, got.unroll_layers, got.gemm) == (AttentionBackend.XLA, False, GemmBackend.XLA)
    assert got.quant_matmul is QuantMatmul.PALLAS and got.quant_kernel_max_tokens is None
    assert got.concurrent_min_tokens == 9
    assert (
        KernelConfig(quant_matmul="best", quant_kernel_max_tokens=64).resolve("xla", "cpu").quant_kernel_max_tokens
        == 64
    )


def test_the_auto_quant_rule_comes_from_its_table(monkeypatch):
    """A new rule is one row of QUANT_AUTO: the resolution reads the table, not a copy of it."""
    monkeypatch.setitem(kernels_module.QUANT_AUTO, "gpu", QuantRule(QuantMatmul.PALLAS, 32))
    got = KernelConfig().resolve("xla", "gpu", compute_capability="8.0")
    assert got.quant_matmul_at(32) is QuantMatmul.PALLAS and got.quant_matmul_at(33) is QuantMatmul.XLA


def test_per_step_size_rules():
    kernels = StepKernels(
        gemm="cublas",
        concurrent_min_tokens=16,
        quant_matmul="pallas",
        quant_kernel_max_tokens=64,
        unroll_layers=True,
        unroll_max_tokens=128,
    )
    assert kernels.compiler_options(8) == gemm_compiler_options("cublas", concurrent=False)
    assert kernels.compiler_options(16) == gemm_compiler_options("cublas", concurrent=True)
    assert gemm_compiler_options("cublas", concurrent=True) != gemm_compiler_options("cublas", concurrent=False)
    assert [kernels.uses_quant_kernel(n) for n in (1, 64, 65)] == [True, True, False]
    assert [kernels.unrolls(n) for n in (1, 128, 129)] == [True, True, False]
    assert not kernels.unrolls(4, tokens_per_row=2)  # prompt rows of several tokens keep the scan
    small, large = kernels.describe(8), kernels.describe(256)
    for part in ("lora=xla", "attention=xla", "gemm=cublas"):
        assert part in small and part in large
    assert "layers=unrolled" in small and "quant=pallas" in small and "concurrent" not in small
    assert "layers=scan" in large and "quant=xla" in large and "concurrent" in large


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(attention="flash"), "attention='flash' must be one of"),
        (dict(unroll_layers="sometimes"), "unroll_layers='sometimes' must be"),
        (dict(quant_matmul="int4"), "quant_matmul='int4' must be one of"),
        (dict(gemm="cutlass"), "gemm='cutlass' must be one of"),
        (dict(concurrent_min_tokens=0), "concurrent_min_tokens=0 must be a positive int"),
        (dict(unroll_max_tokens=True), "unroll_max_tokens=True must be a positive int"),
        (dict(quant_kernel_max_tokens=-1), "quant_kernel_max_tokens=-1 must be a positive int or None"),
    ],
)
def test_bad_kernel_config_is_refused_with_its_field(fields, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**fields)


def test_resolved_choices_are_never_auto_and_kernels_config_must_be_a_record():
    with pytest.raises(ValueError, match="gemm='auto' must be one of"):
        StepKernels(gemm="auto")
    with pytest.raises(ValueError, match="kernels=.* must be a KernelConfig"):
        EngineConfig(kernels={"gemm": "xla"})
    with pytest.raises(ValueError, match=r"unknown kernels config key\(s\) \['lora'\]"):
        KernelConfig.from_dict({"lora": "pallas"})  # the LoRA backend is lora.backend
