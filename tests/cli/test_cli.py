"""The `jaxlora` command line on a tiny model: generate --prompt, demo, convert, errors."""

import numpy as np
import pytest

from jaxlora.adapters import Pager
from jaxlora.cli.main import main
from jaxlora.engine import Engine
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.lora.peft_format import save_peft_adapter
from tests.factories import char_tokenizer, tiny_model

ENGINE_YAML = """engine:
  max_batch: 4
  max_seq_len: 64
  token_budgets: [16, 32]
  page_size: 8
  max_new_tokens_limit: 16
  lora: {max_slots: 4, max_rank: 4}
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = tiny_model()
    save_hf_folder(model, char_tokenizer(), root / "model")
    (root / "engine.yaml").write_text(ENGINE_YAML)
    rng = np.random.default_rng(0)
    cfg = model.config
    for name in ("upper", "lower"):
        weights = {
            m: (
                rng.normal(0, 1, (cfg.num_layers, cfg.module_shape(m)[0], 2)).astype(np.float32),
                rng.normal(0, 1, (cfg.num_layers, 2, cfg.module_shape(m)[1])).astype(np.float32),
            )
            for m in ("q_proj", "v_proj", "down_proj")
        }
        save_peft_adapter(root / "demo" / name, weights=weights, rank=2, alpha=4)
    return root


def _common(files):
    return ["--model", str(files / "model"), "--config", str(files / "engine.yaml")]


def test_generate_prompt_with_and_without_adapter(files, capsys):
    assert main(["generate", *_common(files), "--raw", "--prompt", "hello", "--max-tokens", "8"]) == 0
    base = capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                *_common(files),
                "--raw",
                "--prompt",
                "hello",
                "--max-tokens",
                "8",
                "--adapter",
                f"up={files / 'demo' / 'upper'}",
                "--use",
                "up",
            ]
        )
        == 0
    )
    adapted = capsys.readouterr().out
    assert base.strip() and adapted.strip() and base != adapted


def test_generate_prompt_warms_nothing_up(files, monkeypatch, capsys):
    """One answer compiles what it runs on first use: neither the engine's warm-up (every step
    program) nor the pager's (every slot write) runs, and the adapter still applies."""

    def refuse(*args, **kwargs):
        raise RuntimeError("a one-shot generate warmed up")

    monkeypatch.setattr(Engine, "warmup", refuse)
    monkeypatch.setattr(Pager, "warmup", refuse)
    adapter = ["--adapter", f"up={files / 'demo' / 'upper'}", "--use", "up"]
    assert main(["generate", *_common(files), "--raw", "--prompt", "hello", "--max-tokens", "8", *adapter]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_reports_unknown_adapter_and_bad_sampling(files, capsys):
    assert main(["generate", *_common(files), "--prompt", "hi", "--use", "nope", "--max-tokens", "8"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["generate", *_common(files), "--prompt", "hi", "--top-p", "1.5", "--max-tokens", "8"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_generate_samples_at_temperature_1_reproducibly_by_default(files, capsys):
    """OpenAI's temperature with a seed from --seed (default 0): two runs give the same text, greedy
    is --temperature 0, and the penalty flags reach the request (a bad value is refused by name)."""
    argv = ["generate", *_common(files), "--raw", "--prompt", "hello", "--max-tokens", "12"]
    outs = []
    for extra in ([], [], ["--temperature", "0"], ["--temperature", "0", "--repetition-penalty", "3"]):
        assert main([*argv, *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0] != outs[2] and outs[2] != outs[3]
    assert main([*argv, "--frequency-penalty", "2.5"]) == 2
    assert "frequency_penalty" in capsys.readouterr().err


def test_demo_mixes_base_and_every_demo_adapter(files, capsys):
    assert (
        main(["demo", *_common(files), "--demo-dir", str(files / "demo"), "--prompt", "hi", "--max-tokens", "6"]) == 0
    )
    out = capsys.readouterr().out
    for label in ("[base]", "[lower]", "[upper]"):
        assert label in out


def test_convert_then_load_converted(files, capsys):
    assert main(["convert", str(files / "model"), "--out", str(files / "converted")]) == 0
    assert "from the converted checkpoint" in capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                "--model",
                str(files / "converted"),
                "--config",
                str(files / "engine.yaml"),
                "--raw",
                "--prompt",
                "hello",
                "--max-tokens",
                "4",
            ]
        )
        == 0
    )


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi"]) == 2
    assert "no such model file or folder" in capsys.readouterr().err


def _engine_args(argv: list[str]):
    import argparse

    from jaxlora.cli.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_default_host_adapter_memory_is_a_share_of_the_machine(files, monkeypatch, capsys):
    from jaxlora.adapters import host_budget
    from jaxlora.adapters.registry import slot_nbytes
    from jaxlora.cli.engine_args import engine_config, engine_from_args
    from jaxlora.errors import CapacityError

    args = _engine_args(_common(files))
    slot = slot_nbytes(tiny_model().config, engine_config(args).lora, np.float32)
    monkeypatch.setattr(host_budget, "machine_memory_bytes", lambda: 4 * 3 * slot)  # a quarter: 3 adapters
    engine = engine_from_args(args)
    assert engine.config.host_capacity_bytes == 3 * slot
    err = capsys.readouterr().err
    assert "room for 3 adapters" in err and "25% of this machine's" in err, err
    for i in range(3):
        engine.register_adapter(f"a{i}", files / "demo" / "upper")
    with pytest.raises(CapacityError, match="host adapter memory is full"):
        engine.register_adapter("a3", files / "demo" / "upper")


def test_lora_bank_paged_builds_a_paged_pager_that_serves(files):
    from jaxlora.adapters import PagedPager
    from jaxlora.cli.engine_args import engine_from_args
    from jaxlora.engine import GenerationRequest, SamplingParams

    padded = engine_from_args(_engine_args([*_common(files), "--adapter", f"up={files / 'demo' / 'upper'}"]))
    paged = engine_from_args(
        _engine_args([*_common(files), "--adapter", f"up={files / 'demo' / 'upper'}", "--lora-bank", "paged"])
    )
    assert isinstance(paged.pager, PagedPager) and not isinstance(padded.pager, PagedPager)
    request = GenerationRequest(
        request_id="r", prompt_ids=[1, 5, 6], adapter="up", sampling=SamplingParams(max_tokens=4)
    )
    for engine in (padded, paged):
        engine.warmup()
    assert paged.generate([request])[0].token_ids == padded.generate([request])[0].token_ids


def test_bank_rank_follows_the_adapters_named_at_start_up(files, tmp_path):
    from jaxlora.cli.engine_args import engine_config, engine_from_args
    from jaxlora.errors import AdapterError

    cfg = tiny_model().config
    rng = np.random.default_rng(1)
    weights = {
        "q_proj": (
            rng.normal(0, 0.1, (cfg.num_layers, cfg.module_shape("q_proj")[0], 8)).astype(np.float32),
            rng.normal(0, 0.1, (cfg.num_layers, 8, cfg.module_shape("q_proj")[1])).astype(np.float32),
        )
    }
    big = save_peft_adapter(tmp_path / "rank8", weights=weights, rank=8, alpha=8)
    assert engine_config(_engine_args([*_common(files), "--adapter", f"big={big}"])).lora.max_rank == 8
    small = f"up={files / 'demo' / 'upper'}"  # rank 2: the config's max_rank (4) is the floor
    assert engine_config(_engine_args([*_common(files), "--adapter", small])).lora.max_rank == 4
    pinned = _engine_args([*_common(files), "--adapter", f"big={big}", "--max-lora-rank", "4"])
    with pytest.raises(AdapterError, match="rank 8 exceeds max_rank=4.*--max-lora-rank"):
        engine_from_args(pinned)


def test_merge_output_files_follow_the_umask(files, tmp_path):
    import os
    import stat

    out = tmp_path / "merged"
    old = os.umask(0o027)
    try:
        assert (
            main(
                [
                    "merge",
                    "--model",
                    str(files / "model"),
                    "--adapter",
                    str(files / "demo" / "upper"),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes
