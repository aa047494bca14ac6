"""`jaxlora generate` batch mode: error records, input order, kill -9 and resume, a full disk (as
subprocesses); who owns the results file (in-process, refused before any model loads)."""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import jaxlora.cli.engine_args
from jaxlora.cli.main import main
from jaxlora.engine.batch_job import LineDefaults, _Line, line_seed, read_input, result_record
from jaxlora.engine.request import FinalOutput, FinishReason, TokenLogprob
from jaxlora.engine.results_file import ResultsFile
from jaxlora.loading.orbax_ckpt import save_converted
from tests.factories import char_tokenizer, tiny_model

NUM_GOOD = 24


@pytest.fixture(scope="module")
def job_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    save_converted(tiny_model(), char_tokenizer(), root / "model")
    config = {
        "engine": {
            "max_batch": 2,
            "max_seq_len": 64,
            "token_budgets": [16],
            "page_size": 8,
            "max_new_tokens_limit": 40,
            "max_queue": 4,
            "lora": {"max_slots": 2, "max_rank": 4},
        }
    }
    (root / "engine.yaml").write_text(yaml.safe_dump(config))
    lines = []
    for i in range(NUM_GOOD):
        lines.append(
            json.dumps(
                {
                    "custom_id": f"req-{i}",
                    "prompt": f"Hello {i}",
                    "max_tokens": 30 + i % 10,
                    **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {}),
                    **({"repetition_penalty": 1.3, "frequency_penalty": 0.5} if i % 3 == 1 else {}),
                }
            )
        )
        if i == 3:
            lines.append("{not json")
        if i == 7:
            lines.append(json.dumps({"custom_id": "bad-value", "prompt": "x", "temperature": -1}))
        if i == 11:
            lines.append(json.dumps({"custom_id": "too-long", "prompt": "y" * 80}))
    (root / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return root


def command(root: Path, output: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxlora.cli.main",
        "generate",
        "--model",
        str(root / "model"),
        "--config",
        str(root / "engine.yaml"),
        "--input",
        str(root / "requests.jsonl"),
        "--output",
        str(output),
    ]


def env(root: Path) -> dict[str, str]:
    # A persistent compilation cache shared by the three runs keeps the test fast.
    return {**os.environ, "JAXLORA_COMPILATION_CACHE": str(root / "jax-cache"), "JAX_PLATFORMS": "cpu"}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(job_files) -> list[dict]:
    """The records of one uninterrupted run."""
    root = job_files
    full = root / "full.jsonl"
    done = subprocess.run(command(root, full), env=env(root), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["requests"] == NUM_GOOD + 3 and summary["errors"] == 3
    assert summary["compiles_after_warmup"] == 0 and summary["generated_tokens"] > 0
    assert _cache_entries(root), "the first run left nothing in the persistent compilation cache"
    return read(full)


def _cache_entries(root: Path) -> set[str]:
    return {p.name for p in (root / "jax-cache").iterdir()}


def test_full_run_answers_every_line_in_order(reference):
    ids = [r["custom_id"] for r in reference]
    assert ids[:6] == ["req-0", "req-1", "req-2", "req-3", None, "req-4"]  # input order
    by_id = {r["custom_id"]: r for r in reference}
    assert "malformed JSON" in reference[4]["error"] and reference[4]["line"] == 5
    assert "temperature=-1" in by_id["bad-value"]["error"] and by_id["bad-value"]["finish_reason"] == "error"
    assert "max_seq_len" in by_id["too-long"]["error"]
    assert all(r["error"] is None and r["token_ids"] for r in reference if str(r["custom_id"]).startswith("req-"))
    assert len({r["request_hash"] for r in reference}) == len(reference)


def test_kill_and_resume_gives_every_line_once_with_the_same_tokens(job_files, reference):
    root = job_files
    # Kill -9 as soon as a few results are on disk, then resume (twice: the second run is a no-op).
    out = root / "resumed.jsonl"
    proc = subprocess.Popen(command(root, out), env=env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(30)
    killed_early = proc.returncode == -signal.SIGKILL
    partial = out.read_text().count("\n")
    with open(out, "a") as f:
        f.write('{"custom_id": "req-')  # a torn write, as a crash mid-line leaves it
    again = subprocess.run(command(root, out), env=env(root), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stderr.strip().splitlines()[-1])["requests"] == len(reference) - partial
    assert read(out) == reference
    assert killed_early, "the job finished before it could be killed; make it longer"
    assert f"resuming: {partial} of {len(reference)} done" in again.stderr
    cached = _cache_entries(root)
    third = subprocess.run(command(root, out), env=env(root), capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "already holds all" in third.stderr and read(out) == reference
    assert _cache_entries(root) == cached


# Runs the rest of argv with writes past LIMIT bytes failing (EFBIG), as on a full disk: the write that
# crosses the limit is cut short, the next one fails. SIGXFSZ is ignored (it would kill the process),
# and both settings survive the exec. A wrapper instead of preexec_fn: forking this multithreaded
# test process to run Python in the child can deadlock.
_WITH_FILE_SIZE_LIMIT = """import os, resource, signal, sys
limit = int(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def test_a_full_disk_leaves_whole_records_then_resumes(job_files, reference):
    root = job_files
    out = root / "full-disk.jsonl"
    out.write_text("results of some other experiment\n")
    limit = 1000  # a few records, then a write torn by the limit
    limited = [sys.executable, "-c", _WITH_FILE_SIZE_LIMIT, str(limit), *command(root, out)[1:], "--overwrite"]
    full = subprocess.run(limited, env=env(root), capture_output=True, text=True, timeout=300)
    assert full.returncode == 1, full.stderr
    assert "Traceback" not in full.stderr
    assert f"cannot write --output {out}" in full.stderr.strip().splitlines()[-1]
    data = out.read_bytes()
    assert 0 < len(data) <= limit and data.endswith(b"\n")  # --overwrite emptied it; no torn line
    assert read(out) == reference[: len(read(out))]
    again = subprocess.run(command(root, out), env=env(root), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert read(out) == reference


# Who owns --output: everything below is refused before the model loads, and leaves the file as it was.


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the output file was checked")

    monkeypatch.setattr(jaxlora.cli.engine_args, "engine_from_args", refuse)


def _records(root: Path, count: int, defaults: LineDefaults = LineDefaults(), **changes) -> list[dict]:
    """Result records this job (with the flags `defaults` stands for) would write for its first
    `count` lines (fields overridden by `changes`)."""
    lines = read_input(root / "requests.jsonl", defaults)[:count]
    return [
        {
            **x.fingerprint,
            "adapter": None,
            "text": "t",
            "token_ids": [5],
            "finish_reason": "length",
            "error": None,
            **changes,
        }
        for x in lines
    ]


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _refused(root: Path, output: Path, capsys, *extra: str) -> str:
    argv = [
        "generate",
        "--model",
        str(root / "model"),
        "--config",
        str(root / "engine.yaml"),
        "--input",
        str(root / "requests.jsonl"),
        "--output",
        str(output),
        *extra,
    ]
    before = output.read_bytes() if output.is_file() else None
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (output.read_bytes() if output.is_file() else None) == before
    return err


@pytest.mark.parametrize(
    "content, found",
    [
        ("my notes, not results\n", "not a JSON record"),  # unrelated text
        ("my notes, no newline", "unrelated text"),  # not mistaken for a torn last record
        ('{"id": 1, "answer": 42}\n', "not a result record"),  # unrelated JSON
    ],
)
def test_an_output_holding_other_things_is_refused(job_files, tmp_path, no_engine, capsys, content, found):
    output = tmp_path / "out.jsonl"
    output.write_text(content)
    err = _refused(job_files, output, capsys)
    assert found in err and "--overwrite" in err


def test_a_bad_line_among_results_is_refused_not_cut(job_files, tmp_path, no_engine, capsys):
    records = _records(job_files, 6)
    output = tmp_path / "out.jsonl"
    output.write_text(_jsonl(records[:3]) + "a stray line\n" + _jsonl(records[3:]))
    assert "line 4 holds text that is not a JSON record" in _refused(job_files, output, capsys)


def test_results_of_another_job_with_the_same_custom_ids_are_refused(job_files, tmp_path, no_engine, capsys):
    output = tmp_path / "out.jsonl"
    output.write_text(_jsonl(_records(job_files, 4, request_hash="0123456789abcdef")))
    assert "does not answer input request 1" in _refused(job_files, output, capsys)
    foreign = [{k: v for k, v in r.items() if k != "request_hash"} for r in _records(job_files, 4)]
    output.write_text(_jsonl(foreign))  # same custom_ids, no fingerprint at all
    assert "not a result record" in _refused(job_files, output, capsys)


def test_output_equal_to_input_is_refused_also_through_links(job_files, tmp_path, no_engine, capsys):
    requests = job_files / "requests.jsonl"
    assert "is the input file" in _refused(job_files, requests, capsys)
    symlink, hardlink = tmp_path / "sym.jsonl", tmp_path / "hard.jsonl"
    symlink.symlink_to(requests)
    os.link(requests, hardlink)
    for link in (symlink, hardlink):
        assert "is the input file" in _refused(job_files, link, capsys)


def test_a_second_job_on_the_same_output_is_refused_at_once(job_files, tmp_path, no_engine, capsys):
    output = tmp_path / "out.jsonl"
    lines = read_input(job_files / "requests.jsonl")
    with ResultsFile.open(output, input_path=job_files / "requests.jsonl", expected=[x.fingerprint for x in lines]):
        start = time.perf_counter()
        assert "in use by another running job" in _refused(job_files, output, capsys)
        assert time.perf_counter() - start < 5


def test_resume_keeps_own_records_and_cuts_only_a_torn_record(job_files, tmp_path):
    requests = job_files / "requests.jsonl"
    expected = [x.fingerprint for x in read_input(requests)]
    output = tmp_path / "out.jsonl"
    whole = _jsonl(_records(job_files, 5))
    output.write_text(whole + '{"custom_id": "req-5", "requ')
    with ResultsFile.open(output, input_path=requests, expected=expected) as results:
        assert results.num_done == 5
    assert output.read_text() == whole
    with ResultsFile.open(output, input_path=requests, expected=expected, overwrite=True) as results:
        assert results.num_done == 0
    assert output.read_text() == ""


def _read_only_file(tmp_path: Path) -> Path:
    """A file this process cannot open for writing (root ignores file modes: then a sysfs file)."""
    if os.geteuid() != 0:
        path = tmp_path / "read-only.jsonl"
        path.write_text("")
        path.chmod(0o444)
        return path
    notes = Path("/sys/kernel/notes")  # read-only for everyone, root included
    if not notes.is_file():
        pytest.skip("running as root without /sys/kernel/notes: no file here refuses root's writes")
    return notes


@pytest.mark.parametrize(
    "where, reason",
    [
        ("read-only", "Permission denied"),
        ("no-parent", "No such file or directory"),
        ("folder", "Is a directory"),
    ],
)
def test_an_unwritable_output_is_refused_before_loading(job_files, tmp_path, no_engine, capsys, where, reason):
    output = {
        "read-only": lambda: _read_only_file(tmp_path),
        "no-parent": lambda: tmp_path / "no" / "out.jsonl",
        "folder": lambda: tmp_path,
    }[where]()
    assert reason in _refused(job_files, output, capsys)


# What a line says is what runs: unknown fields refused (with the nearest known name), `model` picks
# the adapter as in the HTTP API, OpenAI Batch-format lines read, the generate flags as defaults.


def _lines(tmp_path: Path, *objects: dict, defaults: LineDefaults = LineDefaults(base_model="base")) -> list:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return read_input(path, defaults)


@pytest.mark.parametrize(
    "line, message",
    [
        ({"adaptor": "shout"}, "unknown field 'adaptor'; did you mean 'adapter'?"),
        ({"max_token": 5}, "did you mean 'max_tokens'?"),
        ({"response_format": {"type": "json_object"}}, "unknown field 'response_format'"),
        ({"model": "a", "adapter": "b"}, "disagree"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "not both"),
    ],
)
def test_a_line_with_an_unknown_or_conflicting_field_is_an_error_record(tmp_path, line, message):
    (parsed,) = _lines(tmp_path, {"custom_id": "a", "prompt": "hi", **line})
    assert parsed.request is None and message in parsed.record["error"]


def test_model_names_the_adapter_and_the_base_model_by_its_name(tmp_path):
    by_model, by_base, by_adapter, alias = _lines(
        tmp_path,
        {"custom_id": 1, "prompt": "hi", "model": "shout"},
        {"custom_id": 2, "prompt": "hi", "model": "base"},
        {"custom_id": 3, "prompt": "hi", "adapter": "shout", "model": "shout"},
        {"custom_id": 4, "prompt": "hi", "max_completion_tokens": 7},
    )
    assert by_model.request.adapter == "shout" and by_adapter.request.adapter == "shout"
    assert by_base.request.adapter is None
    assert alias.request.sampling.max_tokens == 7


def test_openai_batch_lines_are_read_from_their_body(tmp_path):
    chat, completion, wrong_url, wrong_kind, typo = _lines(
        tmp_path,
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "shout", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9},
        },
        {"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"model": "base", "prompt": "hi"}},
        {"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}},
        {"custom_id": "k", "method": "POST", "url": "/v1/completions", "body": {"messages": []}},
        {"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "hi", "temprature": 0.5}},
    )
    assert chat.request.messages and chat.request.adapter == "shout" and chat.request.sampling.max_tokens == 9
    assert completion.request.prompt == "hi" and completion.request.adapter is None
    assert "url='/v1/embeddings'" in wrong_url.record["error"]
    assert "takes 'prompt', not 'messages'" in wrong_kind.record["error"]
    assert "did you mean 'temperature'?" in typo.record["error"]


def test_penalties_and_logprobs_in_both_forms_reach_the_request(tmp_path):
    completion, chat, chat_default, body, off, bad = _lines(
        tmp_path,
        {"custom_id": 1, "prompt": "hi", "logprobs": 3, "repetition_penalty": 1.2, "presence_penalty": -0.5},
        {"custom_id": 2, "prompt": "hi", "logprobs": True, "top_logprobs": 7},
        {"custom_id": 3, "prompt": "hi", "logprobs": True},
        {
            "custom_id": 4,
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        },
        {"custom_id": 5, "prompt": "hi", "logprobs": False},
        {"custom_id": 6, "prompt": "hi", "top_logprobs": 2},
    )
    s = completion.request.sampling
    assert (s.logprobs, s.repetition_penalty, s.presence_penalty) == (3, 1.2, -0.5)
    assert chat.request.sampling.logprobs == 7 and chat_default.request.sampling.logprobs == 0
    assert body.request.sampling.logprobs == 2
    assert off.request.sampling.logprobs is None
    assert "top_logprobs needs logprobs: true" in bad.record["error"]


def test_a_record_carries_logprobs_only_when_asked():
    line = _Line(number=1, request_hash="h", input_bytes=10, custom_id="a", has_id=True)
    entries = (TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0))),)
    final = FinalOutput(
        request_id="x",
        text="a",
        token_ids=(5,),
        finish_reason=FinishReason.LENGTH,
        prompt_tokens=2,
        completion_tokens=1,
    )
    assert "logprobs" not in result_record(line, final)
    record = result_record(line, dataclasses.replace(final, logprobs=entries))
    assert record["logprobs"] == [{"token_id": 5, "logprob": -0.25, "top_logprobs": [[5, -0.25], [9, -2.0]]}]


def test_lines_sample_at_openai_s_temperature_with_a_seed_of_their_own(tmp_path):
    """Temperature 1 unless a line or a flag says otherwise, and a seed that depends on the job's seed
    and the line's custom_id alone (not on its place in the file, nor on the run)."""
    a, b, own, greedy = _lines(
        tmp_path,
        {"custom_id": "a", "prompt": "hi"},
        {"custom_id": "b", "prompt": "hi"},
        {"custom_id": "c", "prompt": "hi", "seed": 7},
        {"custom_id": "d", "prompt": "hi", "temperature": 0},
    )
    assert a.request.sampling.temperature == 1.0 and greedy.request.sampling.temperature == 0
    assert a.request.sampling.seed == line_seed(0, "a") != b.request.sampling.seed == line_seed(0, "b")
    assert own.request.sampling.seed == 7
    moved, other_job = _lines(tmp_path, {"custom_id": "x", "prompt": "y"}, {"custom_id": "a", "prompt": "hi"})
    assert other_job.request.sampling.seed == a.request.sampling.seed  # line 2 now, same seed
    (reseeded,) = _lines(tmp_path, {"custom_id": "a", "prompt": "hi"}, defaults=LineDefaults(seed=3))
    assert reseeded.request.sampling.seed == line_seed(3, "a") != a.request.sampling.seed
    assert 0 <= line_seed(0, "a") < 2**32 and line_seed(0, 1) != line_seed(0, "1")


def test_the_flags_are_defaults_a_line_overrides(tmp_path):
    defaults = LineDefaults(sampling={"max_tokens": 100, "temperature": 0.9})
    plain, own = _lines(
        tmp_path,
        {"custom_id": 1, "prompt": "hi"},
        {"custom_id": 2, "prompt": "hi", "max_tokens": 3},
        defaults=defaults,
    )
    assert (plain.request.sampling.max_tokens, plain.request.sampling.temperature) == (100, 0.9)
    assert (own.request.sampling.max_tokens, own.request.sampling.temperature) == (3, 0.9)


def test_unregistered_adapters_and_a_finished_job_are_found_before_loading(job_files, tmp_path, no_engine, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "prompt": "x", "model": "missing"}) + "\n")
    argv = ["generate", "--model", str(job_files / "model"), "--input", str(requests), "--output", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "line 1: 'missing'" in err and "--adapter" in err
    done = tmp_path / "done.jsonl"
    done.write_text(_jsonl(_records(job_files, NUM_GOOD + 3)))
    assert main([*command(job_files, done)[3:]]) == 0
    assert "already holds all" in capsys.readouterr().err


@pytest.mark.parametrize(
    "first, then",
    [
        (["--seed", "1"], ["--seed", "2"]),
        (["--seed", "1"], []),
        ([], ["--temperature", "0.5"]),
        (["--max-tokens", "9"], ["--max-tokens", "10"]),
    ],
)
def test_a_job_resumed_with_other_sampling_flags_is_refused(job_files, tmp_path, no_engine, capsys, first, then):
    """The lines without a seed sample with one derived from --seed, and every line that leaves a
    field out takes the flag's value: resuming with other flags would mix two jobs in one file."""
    from jaxlora.cli import generate
    from jaxlora.cli.main import UsageParser

    def defaults(flags: list[str]) -> LineDefaults:
        parser = UsageParser(prog="generate")
        generate.add_args(parser)
        return generate.line_defaults(parser.parse_args([*command(job_files, tmp_path / "x")[4:], *flags]))

    done = tmp_path / "done.jsonl"
    done.write_text(_jsonl(_records(job_files, NUM_GOOD + 3, defaults(first))))
    assert main([*command(job_files, done)[3:], *first]) == 0  # the same flags: complete, as written
    assert "already holds all" in capsys.readouterr().err
    assert "--seed changed" in _refused(job_files, done, capsys, *then)


# Special files: refused in one line before the model loads, whichever flag names them.


@pytest.fixture(params=["/dev/zero", "/dev/full", "/dev/null", "fifo", "socket"])
def special_file(request, tmp_path) -> Iterator[tuple[Path, str]]:
    if request.param.startswith("/dev/"):
        yield Path(request.param), "character device"
    elif request.param == "fifo":
        os.mkfifo(tmp_path / "fifo")
        yield tmp_path / "fifo", "FIFO"
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(tmp_path / "sock"))
            yield tmp_path / "sock", "No such device or address"  # a socket file cannot be opened at all


def test_a_special_output_is_refused_before_loading(job_files, special_file, no_engine, capsys):
    path, what = special_file
    err = _refused(job_files, path, capsys)
    assert what in err and "--output" in err


def test_a_special_input_is_refused_before_loading(job_files, special_file, tmp_path, no_engine, capsys):
    path, what = special_file
    output = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(job_files / "model"), "--input", str(path), "--output", str(output)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert what in err and "--input" in err and not output.exists()


def test_a_results_file_longer_than_the_input_can_produce_is_refused(job_files, tmp_path, no_engine, capsys):
    lines = read_input(job_files / "requests.jsonl")
    output = tmp_path / "out.jsonl"
    output.write_text(_jsonl(_records(job_files, 2)) + '{"custom_id": "req-2", "text": "' + "z" * 2_000_000)
    err = _refused(job_files, output, capsys)
    assert f"line 3 holds a line longer than its result can be ({lines[2].max_record_bytes} bytes)" in err


def test_a_byte_order_mark_is_dropped_and_bad_utf8_is_an_error_record(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        codecs.BOM_UTF8
        + b'{"custom_id": "first", "prompt": "a"}\n'
        + b'{"custom_id": "bad-\xff-id", "prompt": "b"}\n'
        + b'{"custom_id": "third", "prompt": "c\xc3\xa9"}\n'
    )
    first, bad, third = read_input(path)
    assert first.record is None and first.custom_id == "first"
    assert bad.record is not None and bad.custom_id is None and bad.fingerprint["line"] == 2
    assert "line 2: not valid UTF-8 (byte 20: invalid start byte)" in bad.record["error"]
    assert third.record is None and third.request.prompt == "cé"


@pytest.mark.parametrize(
    "defaults", [LineDefaults(), LineDefaults(seed=4), LineDefaults(sampling={"temperature": 0.3})]
)
def test_ray_row_keys_are_the_fingerprints_of_the_records_a_job_writes(job_files, defaults):
    """jaxlora.ray finds the rows already done by these keys: they must follow the job's flags as
    the records' request_hash does."""
    from jaxlora.ray.output_folder import record_key
    from jaxlora.ray.rows import line_key

    texts = [t for t in (job_files / "requests.jsonl").read_text().splitlines() if t.strip()]
    lines = read_input(job_files / "requests.jsonl", defaults)
    assert [line_key(t, defaults.fingerprint) for t in texts] == [
        record_key(x.custom_id, x.request_hash) for x in lines
    ]
    assert len(
        {x.request_hash for x in lines} & {x.request_hash for x in read_input(job_files / "requests.jsonl")}
    ) == (len(lines) if defaults == LineDefaults() else 0)
