"""`--quantize` on the command line: convert writes a quantized checkpoint, generate serves it, a
format mismatch is a usage error."""

from __future__ import annotations

import json

import pytest

from jaxlora.cli.main import main
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.loading.orbax_ckpt import MARKER
from tests.factories import char_tokenizer, tiny_model

ENGINE_YAML = """engine:
  max_batch: 2
  max_seq_len: 32
  token_budgets: [16]
  page_size: 8
  max_new_tokens_limit: 8
  lora: {max_slots: 2, max_rank: 2}
"""


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize_cli")
    save_hf_folder(tiny_model(), char_tokenizer(), root / "model")
    (root / "engine.yaml").write_text(ENGINE_YAML)
    assert main(["convert", str(root / "model"), "--out", str(root / "int8"), "--quantize", "int8"]) == 0
    return root


def test_convert_quantize_writes_a_quantized_checkpoint(converted, capsys):
    assert json.loads((converted / "int8" / MARKER).read_text())["quantization"] == "int8"
    assert (
        main(
            [
                "generate",
                "--model",
                str(converted / "int8"),
                "--config",
                str(converted / "engine.yaml"),
                "--raw",
                "--prompt",
                "hello",
                "--max-tokens",
                "4",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()


def test_quantize_mismatch_with_the_checkpoint_is_a_usage_error(converted, capsys):
    assert main(["generate", "--model", str(converted / "int8"), "--quantize", "fp8", "--prompt", "hi"]) == 2
    assert "holds int8 weights" in capsys.readouterr().err


def test_quantize_rejects_unknown_formats(converted, capsys):
    with pytest.raises(SystemExit):
        main(["convert", str(converted / "model"), "--out", str(converted / "x"), "--quantize", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
