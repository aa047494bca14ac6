"""The flags a vLLM user types: each vLLM alias gives the same engine config as its jaxlora name,
`--port` is HTTP and `--grpc-port` gRPC, and no flag is abbreviated (all parsed, nothing loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxlora.cli.engine_args import VLLM_ALIASES, base_model_name, engine_config
from jaxlora.cli.main import UsageParser, main
from serving.cli import serve

SHOUT = str(Path(__file__).resolve().parents[2] / "checkpoints" / "demo" / "shout")


def _serve_args(argv: list[str]):
    parser = UsageParser(prog="jaxlora serve")
    serve.add_args(parser)
    return parser.parse_args(argv)


# jaxlora flags -> the vLLM flags that must mean the same.
PAIRS = [
    (["--adapter", f"s={SHOUT}"], ["--lora-modules", f"s={SHOUT}"]),
    (["--max-batch", "3"], ["--max-num-seqs", "3"]),
    (["--max-seq-len", "96"], ["--max-model-len", "96"]),
    (["--kv-memory-fraction", "0.5"], ["--gpu-memory-utilization", "0.5"]),
    (["--tensor-parallel", "2"], ["--tensor-parallel-size", "2"]),
    (["--quantize", "int8"], ["--quantization", "int8"]),
    (["--max-slots", "5"], ["--max-loras", "4"]),
    (["--token-budgets", "16,64,128"], ["--max-num-batched-tokens", "128"]),
]


@pytest.mark.parametrize("jaxlora_flags, vllm_flags", PAIRS, ids=lambda flags: flags[0])
def test_each_vllm_alias_gives_the_same_config(jaxlora_flags, vllm_flags):
    ours, theirs = _serve_args(jaxlora_flags), _serve_args(vllm_flags)
    assert engine_config(ours, ours.adapter) == engine_config(theirs, theirs.adapter)
    assert (ours.adapter, ours.quantize) == (theirs.adapter, theirs.quantize)
    assert engine_config(ours, ours.adapter) != engine_config(_serve_args([]), {}) or ours.quantize or ours.adapter


def test_every_alias_is_listed_in_serve_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in [*VLLM_ALIASES.values(), "--max-num-batched-tokens", "--max-loras", "--served-model-name", "--seed"]:
        assert flag in text, flag
    assert "--grpc-port" in text and "(default: 8000)" in text


def test_lora_modules_takes_several_adapters_in_one_flag():
    args = _serve_args(["--lora-modules", f"a={SHOUT}", f"b={SHOUT}"])
    assert set(args.adapter) == {"a", "b"}


def test_seed_and_sizes_reach_the_engine_config():
    config = engine_config(_serve_args(["--seed", "3", "--max-model-len", "64", "--max-num-seqs", "2"]), {})
    assert (config.seed, config.max_seq_len, config.max_batch) == (3, 64, 2)
    assert config.with_context(model_max=8192, pool_positions=None).max_new_tokens_limit == 63


def test_served_model_name_defaults_to_the_folder_name_not_the_path():
    assert base_model_name(_serve_args(["--model", "/models/llama-7b/"])) == "llama-7b"
    assert base_model_name(_serve_args(["--model", "/m/tiny.gguf"])) == "tiny"
    assert base_model_name(_serve_args(["--model", "/m/x", "--served-model-name", "mine"])) == "mine"


def test_ports_http_on_port_grpc_on_grpc_port(monkeypatch, capsys):
    built = {}

    def fake_engine(args, clock=None):
        raise SystemExit("stop before loading")

    import jaxlora.cli.engine_args

    monkeypatch.setattr(jaxlora.cli.engine_args, "engine_from_args", fake_engine)
    monkeypatch.setattr(serve, "_check_ports_free", lambda options: built.setdefault("options", options))
    with pytest.raises(SystemExit):
        serve._build(_serve_args(["--port", "8100"]))
    options = built["options"]
    assert (options.http_port, options.port) == (8100, serve.GRPC_PORT)


@pytest.mark.parametrize("argv", [["serve", "--max-lora", "4"], ["generate", "--max-tok", "4", "--prompt", "hi"]])
def test_flags_are_never_abbreviated(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_top_level_help_lists_each_commands_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "serve: " in text and "--max-model-len" in text and "generate: " in text


def test_serve_logs_keep_jax_backend_probing_quiet(monkeypatch):
    import logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging.getLogger("jax._src.xla_bridge"), "level", logging.NOTSET)
    serve.configure_logging()
    assert logging.getLogger("serving").isEnabledFor(logging.INFO)
    assert not logging.getLogger("jax._src.xla_bridge").isEnabledFor(logging.INFO)


def test_readme_outputs_are_ignored_by_git():
    root = Path(__file__).resolve().parents[2]
    ignored = (root / ".gitignore").read_text().splitlines()
    assert "/converted/" in ignored and "/merged/" in ignored


def test_client_info_prints_aligned_lines_not_protobuf_text():
    from serving.cli.client import format_info
    from serving.gen import inference_pb2 as pb

    text = format_info(pb.ServerInfo(model="m", max_seq_len=4096, target_modules=["q_proj", "v_proj"]))
    lines = text.splitlines()
    assert "max seq len:" in text and "q_proj, v_proj" in text and '"' not in text
    values = [line.split(":", 1)[1] for line in lines]
    assert len({len(line) - len(v.lstrip()) for line, v in zip(lines, values) if v.strip()}) == 1  # one column
