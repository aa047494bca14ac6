"""Every command example in README.md runs as written, offline on CPU, against the shipped demo
adapters (`checkpoints/demo/`: shout, json, pirate).

The examples are extracted from the README's code blocks, in order, and run in a scratch folder that
sees the repository's `checkpoints/` and `configs/` (so outputs never land in the repository):
`jaxlora` commands through the real command line in this process, files written by `cat > F <<'EOF'`
blocks, `grpcurl` requests through the Python stubs (grpcurl itself is not installed here), and the
Python client snippet with `exec`. To stay fast, every command that runs the engine shares ONE
warmed-up SmolLM2 engine (with fewer shapes than the default config) with the demo adapters
registered: each command's flags are still parsed and checked (config file, adapter folders and
their ranks), only the model load and warm-up are shared. `serve` examples start a real server
around it on a free port; the client examples talk to the last one started. An example that cannot
run here is listed in NOT_RUN with the reason; the test fails on any example that is neither run nor
listed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format
from google.protobuf.message_factory import GetMessageClass

import jaxlora.cli.engine_args
from jaxlora.cli.main import UsageParser, main
from serving.cli import serve
from serving.client import InferenceClient

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEMO_ADAPTERS = ("shout", "json", "pirate")

# Example (its first words) -> why it does not run here.
NOT_RUN = {
    "bash scripts/quickstart.sh": "builds a fresh virtual environment; CI runs the same install (scripts/test.sh)",
    "bash scripts/test.sh": "runs this very test suite",
    "jaxlora train --data train.jsonl": "200 steps of SmolLM2 take ~20 minutes on a 2-core CPU; "
    "tests/train/test_cli.py runs the command on a tiny model, and "
    "this test checks that the README's train.jsonl is valid training data",
    "jaxlora serve --model checkpoints/llama-7b": "needs a converted Llama-2-7B checkpoint and a GPU",
    "jaxlora generate --input requests.jsonl --output results/ --ray": "its replicas load their own engines; "
    "tests/test_ray_batch.py runs it as written on that module's Ray cluster",
}


@dataclasses.dataclass(frozen=True)
class Example:
    text: str  # the command as written, continuation lines joined (a heredoc: its first line)
    body: str = ""  # a heredoc's content, or the Python snippet

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def key(self) -> str:
        return self.text.removeprefix(".venv/bin/")


def _code_blocks(markdown: str) -> list[list[str]]:
    """The README's code blocks (fenced, or indented by four spaces after a blank line), as lines."""
    blocks: list[list[str]] = []
    fenced, indented, previous_blank = False, False, True
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            if fenced:
                blocks.append([])
        elif fenced:
            blocks[-1].append(line)
        elif line.startswith("    ") and (indented or previous_blank):
            if not indented:
                blocks.append([])
            indented = True
            blocks[-1].append(line[4:])
        elif line.strip():
            indented = False
        previous_blank = not line.strip()
    return blocks


def readme_examples(markdown: str) -> list[Example]:
    examples: list[Example] = []
    for block in _code_blocks(markdown):
        if any(line.startswith("from serving.client import") for line in block):
            examples.append(Example(text="python: the serving.client example", body="\n".join(block).strip() + "\n"))
            continue
        if any(line.startswith("from openai import") for line in block):
            examples.append(Example(text="python: the openai example", body="\n".join(block).strip() + "\n"))
            continue
        lines = iter(block)
        for line in lines:
            text = line.strip()
            if not text.startswith((".venv/bin/jaxlora ", "jaxlora ", "grpcurl ", "bash ", "cat ", "python")):
                continue
            while text.endswith("\\"):
                text = text[:-1].rstrip() + " " + next(lines).strip()
            body = list(iter(lambda: next(lines), "EOF")) if "<<'EOF'" in text else []
            examples.append(Example(text=text, body="".join(f"{b}\n" for b in body)))
    return examples


EXAMPLES = readme_examples(README.read_text())


def _not_run_reason(example: Example) -> str | None:
    return next((why for start, why in NOT_RUN.items() if example.key.startswith(start)), None)


def test_every_readme_example_is_run_or_listed_with_a_reason():
    kinds = {"jaxlora", "grpcurl", "cat", "python:"}
    unhandled = [e.text for e in EXAMPLES if _not_run_reason(e) is None and e.key.split()[0] not in kinds]
    assert not unhandled, f"README examples this test neither runs nor lists in NOT_RUN: {unhandled}"
    stale = [s for s in NOT_RUN if not any(e.key.startswith(s) for e in EXAMPLES)]
    assert not stale, f"NOT_RUN names examples the README no longer has: {stale}"
    assert sum(e.key.startswith("jaxlora ") for e in EXAMPLES) >= 10  # the extraction found them


def test_readme_examples_name_only_adapters_that_ship():
    text = "\n".join(e.text + "\n" + e.body for e in EXAMPLES)
    named = set(re.findall(r"--adapter[ =]([A-Za-z0-9._-]+)=", text))
    named |= set(re.findall(r'"adapter": "([^"]+)"', text)) | set(re.findall(r'adapter="([^"]+)"', text))
    named |= set(re.findall(r"--adapter ([a-z]+) ", text))
    assert named and named <= set(DEMO_ADAPTERS), named - set(DEMO_ADAPTERS)
    for name in DEMO_ADAPTERS:
        assert (ROOT / "checkpoints" / "demo" / name / "adapter_config.json").is_file()


class Harness:
    """One shared engine, the server around it, and the scratch folder the examples run in."""

    def __init__(self, workdir: Path, engine) -> None:
        self.workdir = workdir
        self.engine = engine
        self.server = None
        self.served_once = False

    def engine_from_args(self, args, extra_adapters=None, clock=None, *, compile_ahead=True):
        """Stands in for jaxlora.cli.engine_args.engine_from_args: checks the flags, returns the
        shared engine (warmed up once, whatever `compile_ahead` asks)."""
        adapters = {**(extra_adapters or {}), **args.adapter}
        jaxlora.cli.engine_args.engine_config(args, adapters)  # the config file and adapter folders are valid
        assert args.model is None, "README examples that run here use the default model"
        registered = {a.name: Path(a.source).resolve() for a in self.engine.list_adapters()}
        for name, path in adapters.items():
            assert registered.get(name) == (self.workdir / path).resolve(), (name, path)
        return self.engine

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.shutdown(grace_seconds=0)
            self.server = None

    @property
    def address(self) -> str:
        assert self.server is not None, "a client example comes before any `jaxlora serve` example"
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module")
def harness(tmp_path_factory, smollm2_gguf_path, monkeypatch_module):
    from jaxlora.adapters import Pager
    from jaxlora.engine import Engine, EngineConfig
    from jaxlora.loading import load_model

    workdir = tmp_path_factory.mktemp("readme")
    (workdir / "checkpoints").mkdir()
    (workdir / "checkpoints" / "demo").symlink_to(ROOT / "checkpoints" / "demo", target_is_directory=True)
    (workdir / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    model, tokenizer = load_model(None)
    # Fewer and smaller shapes than the default config the commands name: warm-up compiles are
    # most of this test's time, and what it checks (flags, files, adapters, prompts, outputs) does
    # not depend on the engine's shapes.
    config = EngineConfig(max_batch=4, max_seq_len=512, token_budgets=(16, 64), page_size=16)
    pager = Pager(model.config, config.lora, dtype=model.dtype, max_page_ins_per_commit=2)
    for name in DEMO_ADAPTERS:
        pager.register(name, workdir / "checkpoints" / "demo" / name)
    engine = Engine(model, tokenizer, config, pager)
    engine.warmup()
    monkeypatch_module.setattr(engine, "warmup", lambda *args, **kwargs: None)  # once is enough
    h = Harness(workdir, engine)
    monkeypatch_module.setattr(jaxlora.cli.engine_args, "engine_from_args", h.engine_from_args)
    monkeypatch_module.chdir(workdir)
    yield h
    h.stop_server()
    for output in ("converted", "merged"):  # the full-size model copies the examples write
        shutil.rmtree(workdir / output, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.key[:70] for e in EXAMPLES])
def test_readme_example_runs_as_written(example, harness):
    reason = _not_run_reason(example)
    if example.key.startswith("jaxlora train"):
        _check_training_data(harness.workdir / "train.jsonl", harness.engine.tokenizer)
    if reason is not None:
        pytest.skip(f"listed in NOT_RUN: {reason}")
    kind = example.key.split()[0]
    if kind == "cat":
        (harness.workdir / example.words[2]).write_text(example.body)
    elif kind == "grpcurl":
        _run_grpcurl(example, harness)
    elif kind == "python:":
        _run_python(example, harness)
    else:
        _run_jaxlora(example.words[1:], harness)


def _run_jaxlora(argv: list[str], harness: Harness) -> None:
    command = argv[0]
    if command == "serve":
        return _serve(argv, harness)
    if command == "client":
        argv = [*argv, "--port", harness.address.rsplit(":", 1)[1]]
    elif command == "generate":
        # A server's shutdown stops the shared engine for good; the README lists generate first.
        assert not harness.served_once, "generate examples must come before serve examples"
    code, out, err = _main(argv)
    assert code == 0, err
    if command in ("generate", "client") and "--input" not in argv:
        assert out.strip(), err
    if "--input" in argv:
        records = [json.loads(line) for line in Path(argv[argv.index("--output") + 1]).read_text().splitlines()]
        assert records and all(r["error"] is None and r["text"].strip() for r in records), records


def _serve(argv: list[str], harness: Harness) -> None:
    """Builds and starts the server the example describes (on free ports) around the shared engine."""
    parser = UsageParser(prog="jaxlora serve")
    serve.add_args(parser)
    args = parser.parse_args(argv[1:])
    args.port = None if args.no_http else 0
    args.grpc_port = None if args.no_grpc else 0
    if args.metrics_port is not None:
        args.metrics_port = 0
    harness.stop_server()
    server = serve._build(args)
    server.start()
    server.warm_up()
    harness.server, harness.served_once = server, True
    with InferenceClient(harness.address, timeout=60) as client:
        assert client.health() == "SERVING"


def _run_grpcurl(example: Example, harness: Harness) -> None:
    words = example.words
    target = next(w for w in words if re.fullmatch(r"[\d.]+:\d+", w))
    assert target == "127.0.0.1:50051"
    channel = grpc.insecure_channel(harness.address)
    try:
        if words[-1] == "list":
            from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
                ProtoReflectionDescriptorDatabase,
            )

            assert "jaxlora.v1.Inference" in ProtoReflectionDescriptorDatabase(channel).get_services()
            return
        body = words[words.index("-d") + 1]
        headers = [tuple(h.split(": ", 1)) for i, h in enumerate(words) if i and words[i - 1] == "-H"]
        service, method = words[-1].rsplit("/", 1)
        request_class, response_class, streaming = _method_types(service, method)
        request = json_format.Parse(body, request_class())
        call = (channel.unary_stream if streaming else channel.unary_unary)(
            f"/{service}/{method}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        reply = call(request, timeout=120, metadata=[(k.lower(), v) for k, v in headers])
        replies = list(reply) if streaming else [reply]
        assert replies
        if method == "Generate":
            assert "".join(r.text for r in replies).strip()
    finally:
        channel.close()


def _method_types(service: str, method: str):
    """(request class, response class, server streaming?) of a method of the jaxlora or health service."""
    from grpc_health.v1 import health_pb2  # noqa: F401  (registers the health messages)

    from serving.gen import inference_pb2  # noqa: F401  (registers the jaxlora messages)

    m = descriptor_pool.Default().FindServiceByName(service).methods_by_name[method]
    return GetMessageClass(m.input_type), GetMessageClass(m.output_type), m.server_streaming


def _run_python(example: Example, harness: Harness) -> None:
    if "openai" in example.text:
        assert "127.0.0.1:8000" in example.body and harness.server.http_port
        body = example.body.replace("127.0.0.1:8000", f"127.0.0.1:{harness.server.http_port}")
    else:
        assert "127.0.0.1:50051" in example.body
        body = example.body.replace("127.0.0.1:50051", harness.address)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(body, "README.md", "exec"), {})
    lines = out.getvalue().strip().splitlines()
    if "openai" in example.text:
        # The chat completion's default length is the rest of the context: a whole answer, ended by
        # the model ("stop"), not cut at 16 tokens.
        assert len(lines) >= 2 and lines[0].strip() and lines[-1] == "stop", out.getvalue()
        return
    assert len(lines) >= 3 and all(line.strip() for line in lines), out.getvalue()


def _check_training_data(path: Path, tokenizer) -> None:
    from jaxlora.train.data import read_jsonl, tokenize_conversation

    conversations = read_jsonl(path)
    assert conversations and all(tokenize_conversation(tokenizer, c).loss_mask.any() for c in conversations)
