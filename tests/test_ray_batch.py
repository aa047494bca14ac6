"""`jaxlora generate --ray` and jaxlora.ray on one local Ray cluster (shared by the whole module):
the same records as the single-process job, an actor killed mid-job, a driver killed and resumed,
foreign output folders refused, and the README's Ray example run as written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

ray = pytest.importorskip("ray", reason="jaxlora[ray] is not installed")

from jaxlora.cli.main import main  # noqa: E402
from jaxlora.engine.load import EngineSpec  # noqa: E402
from jaxlora.loading.orbax_ckpt import save_converted  # noqa: E402
from jaxlora.lora.peft_format import save_peft_adapter  # noqa: E402
from jaxlora.ray import RayJob, run_ray_job  # noqa: E402
from jaxlora.ray.generator import OUTPUT_COLUMNS  # noqa: E402
from jaxlora.ray.output_folder import read_records  # noqa: E402
from tests.factories import char_tokenizer, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NUM_ROWS = 60
ADAPTERS = ("upper", "lower")
ACTOR_TITLE = "MapWorker(MapBatches(BatchGenerator))"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A tiny model, two adapters, an engine config and 60 mixed-adapter requests plus two bad ones
    (bad sampling, malformed JSON)."""
    root = tmp_path_factory.mktemp("ray")
    model = tiny_model()
    save_converted(model, char_tokenizer(), root / "model")
    cfg, rng = model.config, np.random.default_rng(0)
    for name in ADAPTERS:
        weights = {
            m: (
                rng.normal(0, 1, (cfg.num_layers, cfg.module_shape(m)[0], 2)).astype(np.float32),
                rng.normal(0, 1, (cfg.num_layers, 2, cfg.module_shape(m)[1])).astype(np.float32),
            )
            for m in ("q_proj", "v_proj", "down_proj")
        }
        save_peft_adapter(root / name, weights=weights, rank=2, alpha=4)
    engine = {
        "max_batch": 8,
        "max_seq_len": 64,
        "token_budgets": [32],
        "page_size": 8,
        "max_new_tokens_limit": 40,
        "max_queue": 16,
        "lora": {"max_slots": 3, "max_rank": 4},
    }
    (root / "engine.yaml").write_text(yaml.safe_dump({"engine": engine}))
    lines = []
    for i in range(NUM_ROWS):
        adapter = (None, *ADAPTERS)[i % 3]
        row = {"custom_id": f"req-{i}", "max_tokens": 12 + i % 7, **({"adapter": adapter} if adapter else {})}
        row |= {"prompt": f"Hello {i}"} if i % 2 else {"messages": [{"role": "user", "content": f"Hi {i}"}]}
        lines.append(json.dumps(row))
    lines.append(json.dumps({"custom_id": "bad-sampling", "prompt": "x", "temperature": -1}))
    lines.append("{not json")
    (root / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster for the module: logical CPUs for two replicas and the read tasks, and a
    shared compilation cache so that every engine after the first reads its compiles back."""
    import jax

    cache = jax.config.jax_compilation_cache_dir or tmp_path_factory.mktemp("jax-cache")  # the test run's
    os.environ["JAX_PLATFORMS"] = "cpu"
    ray.init(num_cpus=4, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
    yield {"address": ray.get_runtime_context().gcs_address, "cache": str(cache)}
    ray.shutdown()


def _spec(files: Path) -> EngineSpec:
    return EngineSpec(
        model=str(files / "model"),
        config=str(files / "engine.yaml"),
        adapters={name: str(files / name) for name in ADAPTERS},
    )


def _by_id(records: list[dict]) -> dict:
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a request answered twice"
    return {r["custom_id"]: r for r in records}


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> dict:
    """The single-process `jaxlora generate` records, by custom_id (the malformed line left out)."""
    out = tmp_path_factory.mktemp("single") / "results.jsonl"
    adapters = [f"--adapter={name}={files / name}" for name in ADAPTERS]
    argv = ["generate", "--model", str(files / "model"), "--config", str(files / "engine.yaml"), *adapters]
    assert main([*argv, "--input", str(files / "requests.jsonl"), "--output", str(out), "--no-progress"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return _by_id([r for r in records if r["custom_id"] is not None])


def _check_against(reference: dict, records: list[dict]) -> None:
    """Every request exactly once, each record equal to the single-process one (greedy)."""
    assert len(records) == NUM_ROWS + 2
    malformed = [r for r in records if r["custom_id"] is None]
    assert len(malformed) == 1 and malformed[0]["error"].startswith("malformed JSON")
    assert _by_id([r for r in records if r["custom_id"] is not None]) == reference


def test_two_replicas_give_the_single_process_records(cluster, files, reference, tmp_path, capsys):
    job = RayJob(replicas=2, compilation_cache=cluster["cache"])
    assert run_ray_job(files / "requests.jsonl", tmp_path / "out", _spec(files), job, progress=False) == 0
    _check_against(reference, read_records(tmp_path / "out"))
    assert {r["adapter"] for r in reference.values()} == {None, *ADAPTERS}
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["requests"] == NUM_ROWS + 2 and summary["errors"] == 2 and summary["replicas"] == 2
    assert summary["calls_per_replica"] == 2  # 2 x max_batch 8 = 16 rows = one block; at least two
    assert summary["generated_tokens"] == sum(len(r["token_ids"]) for r in reference.values())
    # The generation-only figure counts every row from the first replica's end of warm-up, which is
    # after the job started (the replicas load inside it).
    since = summary["since_ready"]
    assert since["requests"] == summary["requests"] and since["generated_tokens"] == summary["generated_tokens"]
    assert 0 < since["seconds"] < summary["seconds"]


@pytest.mark.parametrize(
    ("job", "max_batch", "calls"),
    [
        (RayJob(), 256, 32),  # the 7B preset: 512 rows in flight, so its 256-row batch stays full
        (RayJob(rows_per_block=100), 256, 6),  # rounded up: never fewer rows than two batches
        (RayJob(), 4, 2),  # a small engine still gets a second block while one travels back
        (RayJob(calls_per_replica=3), 256, 3),  # the job's own number wins
    ],
)
def test_calls_in_flight_keep_the_engine_batch_full(job, max_batch, calls):
    assert job.calls_in_flight(max_batch) == calls


def test_a_job_refuses_zero_calls_in_flight():
    with pytest.raises(ValueError, match="calls_per_replica=0"):
        RayJob(calls_per_replica=0)


def _actor_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"]) if ACTOR_TITLE in " ".join(p.info["cmdline"] or [])}


def _count_records(folder: Path) -> int:
    return sum(p.read_text().count("\n") for p in folder.glob("part-*.jsonl")) if folder.is_dir() else 0


def test_an_actor_killed_mid_job_leaves_each_request_once(cluster, files, reference, tmp_path):
    out = tmp_path / "out"
    killed: list[tuple[int, int]] = []  # (pid, records on disk when it was killed)

    def kill_one_actor_once_results_flow() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            pids = _actor_pids()
            if pids and _count_records(out) >= 2:
                pid = min(pids)
                killed.append((pid, _count_records(out)))
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    # Small blocks, one at a time per actor: results flow long before the job ends, and the killed
    # actor holds one in flight with more waiting for it.
    job = RayJob(replicas=2, rows_per_block=4, calls_per_replica=1, compilation_cache=cluster["cache"])
    killer = threading.Thread(target=kill_one_actor_once_results_flow, daemon=True)
    killer.start()
    assert run_ray_job(files / "requests.jsonl", out, _spec(files), job, progress=False) == 0
    killer.join(5)
    assert killed, "no actor was killed: the job finished before results flowed, or no actor was found"
    assert killed[0][1] < NUM_ROWS, "the job was done before the actor was killed; make it longer"
    _check_against(reference, read_records(out))


def _command(files: Path, out: Path, address: str) -> list[str]:
    adapters = [f"--adapter={name}={files / name}" for name in ADAPTERS]
    return [
        *(sys.executable, "-m", "jaxlora.cli.main", "generate", "--model", str(files / "model")),
        *("--config", str(files / "engine.yaml"), *adapters),
        *("--input", str(files / "requests.jsonl"), "--output", str(out)),
        *("--ray", "--ray-address", address, "--replicas", "2", "--rows-per-block", "2", "--no-progress"),
    ]


def test_resume_after_the_driver_is_killed(cluster, files, reference, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "JAXLORA_COMPILATION_CACHE": cluster["cache"]}
    driver = subprocess.Popen(_command(files, out, cluster["address"]), env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and driver.poll() is None and _count_records(out) < 2:
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait(30)
    assert driver.returncode == -signal.SIGKILL, "the job finished before its driver could be killed"
    partial = _count_records(out)
    assert 0 < partial < NUM_ROWS + 2
    with open(next(out.glob("part-*.jsonl")), "a") as f:
        f.write('{"custom_id": "req-')  # a torn write, as a driver killed mid-write leaves it
    again = subprocess.run(_command(files, out, cluster["address"]), env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stderr.strip().splitlines()[-1])["requests"] == NUM_ROWS + 2 - partial
    _check_against(reference, read_records(out))


@pytest.mark.parametrize(
    "content, found",
    [
        ({"notes.txt": "my notes\n"}, "'notes.txt', which is not a part file"),
        ({"part-00000.jsonl": "some text\n"}, "not a JSON record"),
        ({"part-00000.jsonl": '{"id": 1}\n'}, "not a result record"),
        (
            {"part-00000.jsonl": json.dumps({"custom_id": "req-1", "request_hash": "0123456789abcdef"}) + "\n"},
            "answers no request of this input",
        ),
    ],
)
def test_a_foreign_output_folder_is_refused(cluster, files, tmp_path, capsys, monkeypatch, content, found):
    import jaxlora.ray.job

    def refuse(*args, **kwargs):
        raise AssertionError("replicas were started before the output folder was checked")

    monkeypatch.setattr(jaxlora.ray.job, "_results", refuse)
    out = tmp_path / "out"
    out.mkdir()
    for name, text in content.items():
        (out / name).write_text(text)
    assert run_ray_job(files / "requests.jsonl", out, _spec(files), progress=False) == 2
    err = capsys.readouterr().err
    assert found in err and "--overwrite" in err and "Traceback" not in err
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != ".lock"} == content


def test_an_output_file_a_missing_input_and_a_bad_adapter_are_refused(cluster, files, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    out.write_text("")
    assert run_ray_job(files / "requests.jsonl", out, _spec(files), progress=False) == 2
    assert "names a folder" in capsys.readouterr().err
    assert run_ray_job(tmp_path / "missing.jsonl", tmp_path / "out", _spec(files), progress=False) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    spec = EngineSpec(model=str(files / "model"), adapters={"upper": str(tmp_path)})
    assert run_ray_job(files / "requests.jsonl", tmp_path / "out", spec, progress=False) == 2
    assert "adapter_config.json" in capsys.readouterr().err


def test_the_readme_ray_example_runs_as_written(cluster, tmp_path, monkeypatch, capsys):
    """The README's `--ray` command on the embedded model and demo adapters, with the README's
    requests.jsonl, on this module's cluster (the command's own `ray.init` is skipped when Ray is
    already initialized, as in any driver that set Ray up itself)."""
    from tests.test_readme import EXAMPLES

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "demo").symlink_to(ROOT / "checkpoints" / "demo", target_is_directory=True)
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    requests = next(e for e in EXAMPLES if e.key.startswith("cat > requests.jsonl"))
    (tmp_path / "requests.jsonl").write_text(requests.body)
    example = next(e for e in EXAMPLES if e.key.startswith("jaxlora generate") and "--ray" in e.words)
    monkeypatch.setenv("JAXLORA_COMPILATION_CACHE", cluster["cache"])
    assert main(example.words[1:]) == 0
    output = Path(example.words[example.words.index("--output") + 1])
    records = read_records(output)
    assert len(records) == requests.body.count("\n") and all(r["error"] is None and r["text"] for r in records)


def _request_rows(files: Path) -> list[dict]:
    return [json.loads(line) for line in (files / "requests.jsonl").read_text().splitlines() if line != "{not json"]


def _table(rows: list[dict]):
    """Rows as a pyarrow Table with every row's columns (from_pylist alone takes the first row's)."""
    import pyarrow as pa

    schema = pa.unify_schemas([pa.Table.from_pylist([row]).schema for row in rows])
    return pa.Table.from_pylist(rows, schema=schema)


def test_parquet_rows_have_the_fingerprints_of_their_jsonl_lines(cluster, files, tmp_path):
    import pyarrow.parquet as pq

    from jaxlora.ray.job import input_keys, read_requests

    pq.write_table(_table(_request_rows(files)), tmp_path / "requests.parquet")
    jsonl = input_keys(read_requests(str(files / "requests.jsonl")))
    parquet = input_keys(read_requests(str(tmp_path / "requests.parquet")))
    assert len(parquet) == NUM_ROWS + 1 and parquet < jsonl  # all but the malformed line


def test_the_callable_class_on_request_columns(cluster, files, reference):
    """BatchGenerator alone, as a user's map_batches runs it: JSONL fields as columns (a pyarrow
    batch), one result row per request, a bad row an error row."""
    import asyncio

    from jaxlora.ray import BatchGenerator

    rows = _request_rows(files)[:9] + [{"custom_id": "no-prompt", "max_tokens": 3}]
    generator = BatchGenerator(_spec(files))
    out = asyncio.run(generator(_table(rows)))
    results = [dict(zip(out, values)) for values in zip(*out.values())]
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in rows]
    for result in results[:9]:
        assert {k: result[k] for k in reference[result["custom_id"]]} == reference[result["custom_id"]]
    assert results[9]["finish_reason"] == "error" and results[9]["error"]
    # A user's pipeline gets the result columns only; the timing column is the job's, asked for.
    assert set(out) == {*OUTPUT_COLUMNS, "prompt_tokens"}
