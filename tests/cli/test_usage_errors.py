"""Every `jaxlora` command given bad arguments: exit code 2, one line on stderr, no traceback, and
no model loaded first (each case here fails before the expensive part)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import jaxlora.loading
from jaxlora.cli.main import main

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
SHOUT, JSON_ADAPTER = str(DEMO / "shout"), str(DEMO / "json")


@pytest.fixture
def files(tmp_path, monkeypatch):
    """An input file, an output that is not a results file, and a model loader that must not run."""
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "hi"}\n')
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "other.jsonl").write_text('{"custom_id": "a", "prompt": "hi", "model": "shout"}\n')

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(jaxlora.loading, "load_model", no_load)
    monkeypatch.setattr(jaxlora.loading, "timed_load", no_load)
    return tmp_path


CASES = {
    "generate adapter without a path": (["generate", "--adapter", "shout", "--prompt", "hi"], "NAME=PATH"),
    "generate adapter twice": (
        ["generate", "--adapter", f"s={SHOUT}", "--adapter", f"s={JSON_ADAPTER}", "--prompt", "hi"],
        "given twice",
    ),
    "generate adapter bad name": (["generate", "--adapter", f"a/b={SHOUT}", "--prompt", "hi"], "invalid"),
    "generate adapter missing folder": (
        ["generate", "--adapter", "x={tmp}/nothing", "--prompt", "hi"],
        "adapter_config.json",
    ),
    "generate unknown --use": (
        ["generate", "--adapter", f"shout={SHOUT}", "--use", "nosuch", "--prompt", "hi"],
        "--use nosuch",
    ),
    "generate --use without adapters": (["generate", "--use", "nosuch", "--prompt", "hi"], "--use nosuch"),
    "generate --output without --input": (["generate", "--prompt", "hi", "--output", "{tmp}/o.jsonl"], "--output"),
    "generate --input without --output": (["generate", "--input", "{tmp}/in.jsonl"], "--output"),
    "generate missing input": (["generate", "--input", "{tmp}/none.jsonl", "--output", "{tmp}/o.jsonl"], "none.jsonl"),
    "generate output is the input": (
        ["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/in.jsonl"],
        "is the input file",
    ),
    "generate output missing folder": (
        ["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/no/o.jsonl"],
        "No such file or directory",
    ),
    "generate output is a folder": (["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}"], "Is a directory"),
    "generate output holds other text": (
        ["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/notes.txt"],
        "--overwrite",
    ),
    "generate bad number": (["generate", "--prompt", "hi", "--max-tokens", "many"], "--max-tokens"),
    "demo adapter without a path": (["demo", "--adapter", "pirate"], "NAME=PATH"),
    "demo missing demo dir": (["demo", "--demo-dir", "{tmp}/nothing"], "--demo-dir"),
    "serve adapter without a path": (["serve", "--adapter", "shout"], "NAME=PATH"),
    "serve bad port": (["serve", "--port", "70000"], "port=70000"),
    "serve bad gRPC port": (["serve", "--grpc-port", "70000"], "port=70000"),
    "serve busy port": (["serve", "--port", "{busy}"], "cannot listen"),
    "generate abbreviated flag": (["generate", "--max-tok", "5", "--prompt", "hi"], "unrecognized arguments"),
    "generate batch naming an unknown adapter": (
        ["generate", "--input", "{tmp}/other.jsonl", "--output", "{tmp}/o.jsonl"],
        "no --adapter NAME=PATH registers",
    ),
    "serve missing adapter root": (["serve", "--adapter-root", "{tmp}/nothing"], "nothing"),
    "serve no streams": (["serve", "--max-concurrent-streams", "0"], "max_concurrent_streams"),
    "merge missing adapter": (["merge", "--adapter", "{tmp}/nothing", "--out", "{tmp}/m"], "adapter_config.json"),
    "merge without --out": (["merge", "--adapter", SHOUT], "--out"),
    "train missing data": (["train", "--data", "{tmp}/none.jsonl", "--out", "{tmp}/t"], "none.jsonl"),
    "train bad targets": (["train", "--data", "{tmp}/in.jsonl", "--out", "{tmp}/t", "--targets", "nope"], "nope"),
    "convert bad dtype": (["convert", "--out", "{tmp}/c", "--dtype", "int3"], "--dtype"),
    "bench zero steps": (["bench", "--tiny", "--steps", "0"], "--steps"),
    "client nothing to do": (["client"], "one of the arguments"),
    "unknown command": (["frobnicate"], "invalid choice"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code


@pytest.mark.parametrize("case", CASES)
def test_bad_arguments_exit_2_with_one_line(case, files, capsys):
    argv, expected = CASES[case]
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    with busy:
        argv = [a.replace("{tmp}", str(files)).replace("{busy}", str(busy.getsockname()[1])) for a in argv]
        _check_refused(argv, expected, files, capsys)


def _check_refused(argv: list[str], expected: str, files: Path, capsys) -> None:
    before = (files / "notes.txt").read_bytes(), (files / "in.jsonl").read_bytes()
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert expected in err, err
    assert ((files / "notes.txt").read_bytes(), (files / "in.jsonl").read_bytes()) == before


def test_client_without_a_server_says_so_in_one_line(capsys):
    # Not a usage error (exit 1: the call failed), but no traceback either.
    assert _run(["client", "--port", str(_free_port()), "--prompt", "hi", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "UNAVAILABLE" in err
