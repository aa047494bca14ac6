"""Offline batch generation: JSONL requests in, JSONL results out, resumable after any crash.

Input lines: {"custom_id", "prompt" | "messages", "adapter"?, "max_tokens"?, "temperature"?, "top_p"?,
"top_k"?, "seed"?, "stop"?, "stop_token_ids"?}; `prompt` is raw text to complete, `messages` a chat
rendered with the model's chat template. Output lines: {"custom_id", "request_hash", "adapter",
"text", "token_ids", "finish_reason", "error"}, exactly one per input line, in input order.

Crash safety: results are written in input order as soon as every earlier line is done, one line per
`write`, fsync'd. A re-run checks that the output holds this input's results (see
jaxlora.engine.results_file: fingerprints, lock, torn-line repair), then skips the lines already
answered, so after `kill -9` nothing is lost or written twice, and a file that is not this job's is
refused instead of overwritten. Everything about the input and output files is checked before the
engine (and its model) is built.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxlora.engine.engine import Engine, RequestHandle
from jaxlora.engine.request import FinalOutput, GenerationRequest, SamplingParams
from jaxlora.engine.results_file import ResultsFile, ResultsFileError, request_hash
from jaxlora.engine.runner import WarmupProgress
from jaxlora.errors import CapacityError, JaxloraError

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")


@dataclasses.dataclass
class _Line:
    """One input line: where it is, its fingerprint, and its outcome."""

    number: int  # 1-based line number in the input
    request_hash: str
    custom_id: Any = None
    has_id: bool = False  # custom_id is usable (a string or an integer)
    adapter: str | None = None
    request: GenerationRequest | None = None
    record: dict[str, Any] | None = None  # the output record once known

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The record fields that tie a result to this line (results_file checks them on resume)."""
        out = {"custom_id": self.custom_id, "request_hash": self.request_hash}
        if not self.has_id:
            out["line"] = self.number
        return out


def run_batch_job(
    input_path: Path,
    output_path: Path,
    make_engine: Callable[[], Engine],
    *,
    overwrite: bool = False,
    progress: bool = True,
    warmup_progress: WarmupProgress | None = None,
) -> int:
    """Checks the files, builds the engine (`make_engine`, called only once the files are fine), runs
    the job, prints the JSON summary on stderr. Exit code 0 when every line got a record (error
    records included), 2 for unusable files or an engine that cannot be built, 1 when the results
    cannot be written.
    """
    try:
        lines = read_input(input_path)
        results = ResultsFile.open(
            output_path, input_path=input_path, expected=[x.fingerprint for x in lines], overwrite=overwrite
        )
    except ResultsFileError as e:
        print(f"jaxlora generate: {e}", file=sys.stderr)
        return 2
    with results:
        try:
            engine = make_engine()
        except (JaxloraError, ValueError, OSError) as e:
            print(f"jaxlora generate: {e}", file=sys.stderr)
            return 2
        engine.warmup(progress=warmup_progress)
        try:
            summary = BatchJob(engine, lines, results, progress=progress).run()
        except ResultsFileError as e:
            print(f"jaxlora generate: {e}", file=sys.stderr)
            return 1
    print(json.dumps(summary), file=sys.stderr, flush=True)
    return 0


def read_input(path: Path) -> list[_Line]:
    """The non-blank lines of the input file, parsed; ResultsFileError if it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [parse_line(number, text) for number, text in enumerate(f, start=1) if text.strip()]
    except OSError as e:
        raise ResultsFileError(f"--input {path}: {e.strerror}") from None


class BatchJob:
    """Runs the input lines not yet answered in `results` through `engine`, appending to `results`."""

    def __init__(self, engine: Engine, lines: list[_Line], results: ResultsFile, *, progress: bool = True) -> None:
        self.engine = engine
        self.lines = lines
        self.results = results
        self.progress = progress

    def run(self) -> dict[str, Any]:
        todo = self.lines[self.results.num_done :]
        start = time.perf_counter()
        stats_before = self.engine.stats()
        with self._bar(len(todo)) as bar:
            self._generate(todo, bar)
        seconds = time.perf_counter() - start
        stats = self.engine.stats()
        generated = sum(len(line.record["token_ids"]) for line in todo)
        pager = stats.get("pager", {})
        return {
            "requests": len(todo),
            "errors": sum(line.record["error"] is not None for line in todo),
            "prompt_tokens": stats["prompt_tokens"] - stats_before["prompt_tokens"],
            "generated_tokens": generated,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(generated / seconds, 2) if seconds > 0 else 0.0,
            "compiles_after_warmup": stats["compiles_after_warmup"],
            "adapters_used": len({line.adapter for line in todo if line.adapter and line.record["error"] is None}),
            "page_ins": pager.get("page_ins", 0),
        }

    def _bar(self, total: int):
        from tqdm import tqdm

        return tqdm(total=total, unit="req", file=sys.stderr, disable=not (self.progress and sys.stderr.isatty()))

    def _generate(self, todo: list[_Line], bar) -> None:
        in_flight: dict[int, RequestHandle] = {}  # index into todo -> handle
        next_submit = next_write = 0
        while next_write < len(todo):
            while next_submit < len(todo):  # feed the engine while its queue has room
                line = todo[next_submit]
                if line.record is None:
                    try:
                        in_flight[next_submit] = self.engine.submit(line.request, stream=False)
                    except CapacityError:
                        break
                    except JaxloraError as e:
                        line.record = error_record(line, str(e))
                next_submit += 1
            if in_flight:
                self.engine.step()
            for i in [i for i, h in in_flight.items() if h.done]:
                todo[i].record = result_record(todo[i], in_flight.pop(i).result())
            while next_write < len(todo) and todo[next_write].record is not None:
                self.results.append(todo[next_write].record)
                next_write += 1
                bar.update(1)


def parse_line(number: int, text: str) -> _Line:
    """A request, or an error record for a line that is not one (the job goes on)."""
    digest = request_hash(text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        line = _Line(number=number, request_hash=digest)
        line.record = error_record(line, f"line {number}: malformed JSON ({e.msg})")
        return line
    if not isinstance(obj, dict):
        line = _Line(number=number, request_hash=digest)
        line.record = error_record(line, f"line {number}: expected a JSON object")
        return line
    cid = obj.get("custom_id")
    has_id = isinstance(cid, (str, int)) and not isinstance(cid, bool)
    line = _Line(
        number=number,
        request_hash=digest,
        custom_id=cid,
        has_id=has_id,
        adapter=obj.get("adapter") if isinstance(obj.get("adapter"), str) else None,
    )
    try:
        if not has_id:
            raise JaxloraError(f"line {number}: custom_id must be a string or an integer")
        sampling = SamplingParams(**{k: obj[k] for k in _SAMPLING_FIELDS if obj.get(k) is not None})
        line.request = GenerationRequest(
            request_id=f"line-{number}",
            prompt=obj.get("prompt"),
            messages=obj.get("messages"),
            adapter=obj.get("adapter") or None,
            sampling=sampling,
        )
    except (JaxloraError, TypeError) as e:
        line.record = error_record(line, str(e))
    return line


def result_record(line: _Line, result: FinalOutput) -> dict[str, Any]:
    return {
        **line.fingerprint,
        "adapter": line.adapter,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason.value,
        "error": result.error,
    }


def error_record(line: _Line, error: str) -> dict[str, Any]:
    return {
        **line.fingerprint,
        "adapter": line.adapter,
        "text": "",
        "token_ids": [],
        "finish_reason": "error",
        "error": error,
    }
