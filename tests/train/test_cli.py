"""`jaxlora train` end to end on a tiny model that shares SmolLM2's tokenizer (so the chat template and
response masking are the real ones), then --resume."""

from __future__ import annotations

import json
import os
import stat

import pytest

import jaxlora.loading
from jaxlora.model.params import random_model
from jaxlora.train.cli import main
from jaxlora.train.loop import moving_average
from tests.factories import tiny_config


@pytest.fixture
def tiny_with_smollm2_tokenizer(monkeypatch, smollm2_tokenizer):
    model = random_model(tiny_config(vocab_size=smollm2_tokenizer.vocab_size), seed=0)
    monkeypatch.setattr(jaxlora.loading, "load_model", lambda source, **kw: (model, smollm2_tokenizer))
    return model


def test_train_cli_writes_a_peft_folder_and_resumes(tiny_with_smollm2_tokenizer, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i}!"}) + "\n" for i in range(12)))
    out = tmp_path / "adapter"
    argv = [
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "4",
        "--batch",
        "2",
        "--rank",
        "2",
        "--targets",
        "q_proj,v_proj",
        "--lr",
        "1e-2",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "2",
        "--save-every",
        "2",
        "--no-progress",
        "--save-dtype",
        "bfloat16",
    ]
    old_umask = os.umask(0o027)
    try:
        assert main(argv) == 0
    finally:
        os.umask(old_umask)
    assert {"adapter_config.json", "adapter_model.safetensors", "train_log.json", "train_state"} <= {
        p.name for p in out.iterdir()
    }
    # Every file follows the umask, the weights included (safetensors alone writes them 0600).
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o640}, modes
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 16.0, ["q_proj", "v_proj"])
    log = json.loads((out / "train_log.json").read_text())
    assert (log["train_examples"], log["eval_examples"]) == (9, 3)
    assert [h["step"] for h in log["history"]] == [1, 2, 3, 4]
    assert sum("eval_loss" in h for h in log["history"]) == 2
    out_text = capsys.readouterr()
    assert "s per step" in out_text.err and "min for the 1 steps left of 4" in out_text.err
    # One loss figure: the moving average the progress bar shows, named as such.
    assert "train loss" in out_text.out and "moving average" in out_text.out
    assert out_text.out.count("loss") == 2  # train loss and the held-out loss
    assert log["final_train_loss"] == pytest.approx(moving_average([h["loss"] for h in log["history"]]))
    # Resuming a finished run trains no further step and rewrites the same adapter.
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "train_log.json").read_text())["history"] == log["history"]


def test_train_cli_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "only a prompt"}\n')
    assert main(["--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["--data", str(bad), "--out", str(tmp_path / "o"), "--targets", "q_proj,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_handful_of_examples_holds_none_out_and_says_so(tiny_with_smollm2_tokenizer, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i}!"}) + "\n" for i in range(2)))
    out = tmp_path / "adapter"
    argv = ["--data", str(data), "--out", str(out), "--steps", "1", "--batch", "2", "--rank", "2", "--no-progress"]
    assert main(argv) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert (log["train_examples"], log["eval_examples"]) == (2, 0)
    assert "none is held out" in capsys.readouterr().err
