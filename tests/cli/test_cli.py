"""The `jaxlora` command line on a tiny model: generate --prompt, demo, convert, errors."""

import numpy as np
import pytest

from jaxlora.cli.main import main
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.lora.peft_format import save_peft_adapter
from tests.engine.fakes import char_tokenizer, tiny_model

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
        weights = {m: (rng.normal(0, 1, (cfg.num_layers, cfg.module_shape(m)[0], 2)).astype(np.float32),
                       rng.normal(0, 1, (cfg.num_layers, 2, cfg.module_shape(m)[1])).astype(np.float32))
                   for m in ("q_proj", "v_proj", "down_proj")}
        save_peft_adapter(root / "demo" / name, weights=weights, rank=2, alpha=4)
    return root


def _common(files):
    return ["--model", str(files / "model"), "--config", str(files / "engine.yaml")]


def test_generate_prompt_with_and_without_adapter(files, capsys):
    assert main(["generate", *_common(files), "--raw", "--prompt", "hello", "--max-tokens", "8"]) == 0
    base = capsys.readouterr().out
    assert main(["generate", *_common(files), "--raw", "--prompt", "hello", "--max-tokens", "8",
                 "--adapter", f"up={files / 'demo' / 'upper'}", "--use", "up"]) == 0
    adapted = capsys.readouterr().out
    assert base.strip() and adapted.strip() and base != adapted


def test_generate_reports_unknown_adapter_and_bad_sampling(files, capsys):
    assert main(["generate", *_common(files), "--prompt", "hi", "--use", "nope", "--max-tokens", "8"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["generate", *_common(files), "--prompt", "hi", "--top-p", "1.5", "--max-tokens", "8"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_demo_mixes_base_and_every_demo_adapter(files, capsys):
    assert main(["demo", *_common(files), "--demo-dir", str(files / "demo"), "--prompt", "hi",
                 "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    for label in ("[base]", "[lower]", "[upper]"):
        assert label in out


def test_convert_then_load_converted(files, capsys):
    assert main(["convert", str(files / "model"), "--out", str(files / "converted")]) == 0
    assert "from the converted checkpoint" in capsys.readouterr().out
    assert main(["generate", "--model", str(files / "converted"), "--config", str(files / "engine.yaml"),
                 "--raw", "--prompt", "hello", "--max-tokens", "4"]) == 0


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi"]) == 2
    assert "no such model file or folder" in capsys.readouterr().err
