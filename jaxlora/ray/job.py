"""`jaxlora generate --ray`: a batch job over a pool of Ray actors, one warmed engine each.

    requests (JSONL or Parquet, read by Ray Data)
      -> keys pass: every request's fingerprint; the output folder is checked against them
      -> drop the requests the folder already answers (resume)
      -> map_batches(BatchGenerator) on `replicas` actors (jaxlora.ray.generator)
      -> this driver writes each result batch to its part file (jaxlora.ray.output_folder)

The driver writes every record itself, keyed by fingerprint, and skips a key it has already
written: when an actor dies, Ray restarts it and re-runs the blocks it held, and a block that had
already produced some results before the death cannot put them in the folder twice. Results are a
few hundred bytes a request, so one writer is never what limits a job whose rows each take a model's
generation.

A request's identity is its fingerprint (custom_id, request_hash); Ray rows have no line numbers,
so an input whose rows repeat a fingerprint (the same line twice) is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray
import ray.data
import ray.exceptions

from jaxlora.engine.batch_job import LineDefaults
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.load import EngineSpec, engine_config
from jaxlora.engine.results_file import ResultsFileError
from jaxlora.errors import JaxloraError
from jaxlora.ray.generator import OUTPUT_COLUMNS, BatchGenerator
from jaxlora.ray.output_folder import OutputFolder, record_key
from jaxlora.ray.rows import LINE_COLUMN, as_lines, drop_done, keys

# Rows per block and per call: small enough that every replica gets blocks of a short input, and
# that an engine's batch holds rows of many blocks.
ROWS_PER_BLOCK = 16
# Rows an actor holds, in engine batches, when the job does not say: one batch decoding and one
# waiting in the engine's queue, so that a finished row is replaced at the next step; and at least
# two blocks, so that the engine decodes one while the other's results travel back. With fewer rows
# than max_batch in flight the engine decodes a smaller batch for the whole job
# (benchmarks/DECISIONS.md#ray-calls-in-flight).
BATCHES_IN_FLIGHT = 2
MIN_CALLS_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayJob:
    """How the job runs on the cluster.

    Attributes:
      replicas: actors, one engine each.
      cpus_per_replica: CPUs Ray reserves for each actor.
      gpus_per_replica: GPUs for each actor; None: 1 when the cluster has GPUs, else 0.
      rows_per_block: rows per Ray Data block (and per call of an actor).
      calls_per_replica: blocks one actor works on at once (their rows share the engine's batch);
        None: enough for BATCHES_IN_FLIGHT times the engine's max_batch rows (calls_in_flight).
      compilation_cache: JAX's persistent compilation cache folder for the actors, or None.
    """

    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float | None = None
    rows_per_block: int = ROWS_PER_BLOCK
    calls_per_replica: int | None = None
    compilation_cache: str | None = None

    def __post_init__(self) -> None:
        for name in ("replicas", "rows_per_block", "calls_per_replica"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica={self.cpus_per_replica} must be > 0")

    def calls_in_flight(self, max_batch: int) -> int:
        """Blocks one actor works on at once, for an engine of `max_batch` rows."""
        if self.calls_per_replica is not None:
            return self.calls_per_replica
        return max(MIN_CALLS_IN_FLIGHT, math.ceil(BATCHES_IN_FLIGHT * max_batch / self.rows_per_block))


def run_ray_job(
    input_path: str | Path,
    output_path: str | Path,
    spec: EngineSpec,
    job: RayJob = RayJob(),
    *,
    address: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    defaults: LineDefaults = LineDefaults(),
) -> int:
    """Runs the job (connecting to the cluster at `address`, or starting a local one), prints the
    JSON summary on stderr. `defaults`: what rows that leave a field out get, as in `jaxlora
    generate`. Exit code as `jaxlora generate`: 0 when every request has a record, 2
    for unusable input or output, 1 when results cannot be written."""
    spec, input_path = _absolute_paths(spec), _absolute(str(input_path))
    try:
        config = engine_config(spec)  # a bad config file or adapter folder fails here, not in every replica
        if "://" not in input_path and not Path(input_path).exists():
            raise OSError(f"--input {input_path}: no such file or folder")
    except (JaxloraError, ValueError, OSError) as e:
        print(f"jaxlora generate: {e}", file=sys.stderr)
        return 2
    if not ray.is_initialized():
        _start_ray(address, job)
    try:
        source = read_requests(input_path, job.rows_per_block)
        expected = input_keys(source, defaults.fingerprint)
        folder = OutputFolder.open(output_path, expected=expected, overwrite=overwrite)
    except ResultsFileError as e:
        print(f"jaxlora generate: {e}", file=sys.stderr)
        return 2
    with folder:
        try:
            calls = job.calls_in_flight(config.max_batch)
            summary = _generate(source, folder, set(expected) - folder.done, spec, job, calls, progress, defaults)
        except ResultsFileError as e:
            print(f"jaxlora generate: {e}", file=sys.stderr)
            return 1
        except ray.exceptions.RayError as e:  # a replica cannot start (its model), or its engine failed
            print(f"jaxlora generate: the Ray job failed; the same command resumes it: {e}", file=sys.stderr)
            return 1
    print(json.dumps(summary), file=sys.stderr, flush=True)
    return 0


def _start_ray(address: str | None, job: RayJob) -> None:
    """Connects to the cluster at `address`; without one, starts a local cluster with room for every
    replica plus a CPU for reading: on a machine with fewer cores the replicas' reservations would
    leave Ray Data's read tasks waiting forever."""
    if address is not None:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        return
    cpus = max(os.cpu_count() or 1, math.ceil(job.replicas * job.cpus_per_replica) + 1)
    ray.init(num_cpus=cpus, log_to_driver=False, logging_level="ERROR")


def _absolute(path: str) -> str:
    """A local path made absolute (Ray workers do not run in this process's folder); a URI as is."""
    return path if "://" in path else str(Path(path).resolve())


def _absolute_paths(spec: EngineSpec) -> EngineSpec:
    config = (
        spec.config if isinstance(spec.config, EngineConfig) or spec.config is None else _absolute(str(spec.config))
    )
    return dataclasses.replace(
        spec,
        model=None if spec.model is None else _absolute(spec.model),
        config=config,
        adapters={name: _absolute(str(path)) for name, path in spec.adapters.items()},
    )


def read_requests(path: str, rows_per_block: int = ROWS_PER_BLOCK) -> ray.data.Dataset:
    """One row per request, in one column `request_line` (the request as JSON text): a JSONL file
    line by line (blank lines skipped), or Parquet rows (their non-null columns)."""
    if path.endswith(".parquet") or (Path(path).is_dir() and any(Path(path).glob("*.parquet"))):
        ds = ray.data.read_parquet(path).map_batches(as_lines, batch_format="pyarrow")
    else:
        ds = ray.data.read_text(path).rename_columns({"text": LINE_COLUMN})
    return ds.repartition(target_num_rows_per_block=rows_per_block)


def input_keys(source: ray.data.Dataset, job: str = "") -> set[str]:
    """The fingerprint of every request in a job whose flags have the fingerprint `job`;
    ResultsFileError if one repeats (see the module docstring)."""
    counts: Counter[str] = Counter()
    by_key = functools.partial(keys, job=job)
    for batch in source.map_batches(by_key, batch_format="pyarrow").iter_batches(batch_format="pyarrow"):
        counts.update(batch.column("key").to_pylist())
    repeated = [key for key, n in counts.items() if n > 1]
    if repeated:
        raise ResultsFileError(
            f"--input: {len(repeated)} request(s) appear more than once (custom_id, request_hash: "
            f"{', '.join(repeated[:3])}); with --ray every request must be unique"
        )
    return set(counts)


def _generate(
    source: ray.data.Dataset,
    folder: OutputFolder,
    todo: set[str],
    spec: EngineSpec,
    job: RayJob,
    calls: int,
    progress: bool,
    defaults: LineDefaults,
) -> dict[str, Any]:
    start = time.perf_counter()
    written: list[dict[str, Any]] = []
    ready_at: float | None = None  # the earliest replica's end of warm-up (time.time(), its own clock)
    if todo:
        if folder.done:
            source = source.map_batches(
                functools.partial(drop_done, done=frozenset(folder.done), job=defaults.fingerprint),
                batch_format="pyarrow",
            )
        with _bar(len(todo), progress) as bar:
            for batch in _results(source, spec, job, calls, defaults).iter_batches(
                batch_size=None, batch_format="pyarrow"
            ):
                new = _new_records(batch.to_pylist(), todo, folder.done)
                folder.append([{k: r[k] for k in OUTPUT_COLUMNS} for r in new])
                written += new
                bar.update(len(new))
                if batch.num_rows and "replica_ready_at" in batch.column_names:
                    earliest = min(batch.column("replica_ready_at").to_pylist())
                    ready_at = earliest if ready_at is None else min(ready_at, earliest)
    seconds = time.perf_counter() - start
    summary = {**_summary(written, seconds, job), "calls_per_replica": calls}
    if ready_at is not None:
        # Replicas load and warm up inside the job: the engines' own rate counts every row from
        # the first replica's end of warm-up (wall clocks of one machine, or of synchronized ones).
        summary["since_ready"] = {
            "requests": len(written),
            "generated_tokens": sum(len(r["token_ids"]) for r in written),
            "seconds": round(max(0.0, time.time() - ready_at), 3),
        }
    return summary


def _new_records(rows: list[dict[str, Any]], todo: set[str], done: set[str]) -> list[dict[str, Any]]:
    """The rows that answer a request of this job not yet in the folder, each once."""
    new = {}
    for row in rows:
        key = record_key(row["custom_id"], row["request_hash"])
        if key in todo and key not in done:
            new.setdefault(key, row)
    return list(new.values())


def _summary(written: list[dict[str, Any]], seconds: float, job: RayJob) -> dict[str, Any]:
    generated = sum(len(r["token_ids"]) for r in written)
    return {
        "requests": len(written),
        "errors": sum(r["error"] is not None for r in written),
        "prompt_tokens": sum(r["prompt_tokens"] for r in written),
        "generated_tokens": generated,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 2) if seconds > 0 else 0.0,
        "adapters_used": len({r["adapter"] for r in written if r["adapter"] and r["error"] is None}),
        "replicas": job.replicas,
    }


def _results(
    source: ray.data.Dataset, spec: EngineSpec, job: RayJob, calls: int, defaults: LineDefaults
) -> ray.data.Dataset:
    gpus = job.gpus_per_replica
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    return source.map_batches(
        BatchGenerator,
        fn_constructor_kwargs={
            "spec": spec,
            "defaults": defaults,
            "compilation_cache": job.compilation_cache,
            "report_ready_at": True,
        },
        batch_size=job.rows_per_block,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(
            size=job.replicas,
            max_tasks_in_flight_per_actor=calls,
            max_concurrent_calls_per_actor=calls,
        ),
        num_cpus=job.cpus_per_replica,
        num_gpus=gpus,
    )


def _bar(total: int, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, disable=not (progress and sys.stderr.isatty()))
