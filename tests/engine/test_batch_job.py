"""`jaxlora generate` batch mode as a subprocess: error records, input order, kill -9 and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jaxlora.loading.orbax_ckpt import save_converted
from tests.engine.fakes import char_tokenizer, tiny_model

NUM_GOOD = 24


@pytest.fixture(scope="module")
def job_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    save_converted(tiny_model(), char_tokenizer(), root / "model")
    config = {"engine": {"max_batch": 2, "max_seq_len": 64, "token_budgets": [16], "page_size": 8,
                         "max_new_tokens_limit": 40, "max_queue": 4, "lora": {"max_slots": 2, "max_rank": 4}}}
    (root / "engine.yaml").write_text(yaml.safe_dump(config))
    lines = []
    for i in range(NUM_GOOD):
        lines.append(json.dumps({"custom_id": f"req-{i}", "prompt": f"Hello {i}", "max_tokens": 30 + i % 10,
                                 **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})}))
        if i == 3:
            lines.append("{not json")
        if i == 7:
            lines.append(json.dumps({"custom_id": "bad-adapter", "prompt": "x", "adapter": "missing"}))
        if i == 11:
            lines.append(json.dumps({"custom_id": "too-long", "prompt": "y" * 80}))
    (root / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return root


def command(root: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "jaxlora.cli.main", "generate", "--model", str(root / "model"),
            "--config", str(root / "engine.yaml"), "--input", str(root / "requests.jsonl"), "--output", str(output)]


def env(root: Path) -> dict[str, str]:
    # A persistent compilation cache shared by the three runs keeps the test fast.
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu"}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kill_and_resume_gives_every_line_once_with_the_same_tokens(job_files):
    root = job_files
    full = root / "full.jsonl"
    done = subprocess.run(command(root, full), env=env(root), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["requests"] == NUM_GOOD + 3 and summary["errors"] == 3
    assert summary["compiles_after_warmup"] == 0 and summary["generated_tokens"] > 0
    reference = read(full)
    ids = [r["custom_id"] for r in reference]
    assert ids[:6] == ["req-0", "req-1", "req-2", "req-3", None, "req-4"]  # input order
    by_id = {r["custom_id"]: r for r in reference}
    assert "malformed JSON" in reference[4]["error"] and reference[4]["line"] == 5
    assert "missing" in by_id["bad-adapter"]["error"] and by_id["bad-adapter"]["finish_reason"] == "error"
    assert "max_seq_len" in by_id["too-long"]["error"]
    assert all(r["error"] is None and r["token_ids"] for r in reference if str(r["custom_id"]).startswith("req-"))

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
    third = subprocess.run(command(root, out), env=env(root), capture_output=True, text=True, timeout=300)
    assert json.loads(third.stderr.strip().splitlines()[-1])["requests"] == 0 and read(out) == reference
