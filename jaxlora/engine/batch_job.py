"""Offline batch generation: JSONL requests in, JSONL results out, resumable after any crash.

Input lines: {"custom_id", "prompt" | "messages", "adapter"?, "max_tokens"?, "temperature"?, "top_p"?,
"top_k"?, "seed"?, "stop"?, "stop_token_ids"?}. Output lines: {"custom_id", "adapter", "text",
"token_ids", "finish_reason", "error"}, exactly one per input line, in input order.

Crash safety: results are written in input order as soon as every earlier line is done, one line per
`write`, flushed and fsync'd. A re-run reads the output, drops a torn last line, and skips the input
lines already answered (matched by custom_id, counting repeats; lines without one by line number),
so after `kill -9` nothing is lost or written twice.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from jaxlora.engine.engine import Engine, RequestHandle
from jaxlora.engine.request import FinalOutput, GenerationRequest, SamplingParams
from jaxlora.errors import CapacityError, JaxloraError

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")


@dataclasses.dataclass
class _Line:
    """One input line: where it is, how it is keyed for resume, and its outcome."""

    number: int  # 1-based line number in the input
    key: str
    custom_id: Any = None
    adapter: str | None = None
    request: GenerationRequest | None = None
    record: dict[str, Any] | None = None  # the output record once known


def run_batch_job(args: argparse.Namespace) -> int:
    """Loads the model and adapters, runs the job, prints the JSON summary on stderr. Exit code 0
    when every line got a record (error records included), 2 for unusable arguments.

    `args` carries the engine flags of jaxlora.cli.engine_args plus input, output and no_progress.
    """
    from jaxlora.cli.engine_args import build_engine

    if not args.input.is_file():
        print(f"error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    try:
        engine = build_engine(args)
    except (JaxloraError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine.warmup()
    summary = BatchJob(engine, args.input, args.output, progress=not args.no_progress).run()
    print(json.dumps(summary), file=sys.stderr, flush=True)
    return 0


class BatchJob:
    """Runs the not-yet-answered lines of `input_path` through `engine`, appending to `output_path`."""

    def __init__(self, engine: Engine, input_path: Path, output_path: Path, *, progress: bool = True) -> None:
        self.engine = engine
        self.input_path = Path(input_path)
        self.output_path = Path(output_path)
        self.progress = progress

    def run(self) -> dict[str, Any]:
        done = _answered_keys(self.output_path)
        todo = [line for line in self._read_input() if not _consume(done, line.key)]
        start = time.perf_counter()
        stats_before = self.engine.stats()
        with open(self.output_path, "a", encoding="utf-8") as out, self._bar(len(todo)) as bar:
            self._generate(todo, out, bar)
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

    def _read_input(self) -> list[_Line]:
        lines = []
        with open(self.input_path, encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, start=1):
                if text.strip():
                    lines.append(_parse_line(number, text))
        return lines

    def _generate(self, todo: list[_Line], out: TextIO, bar) -> None:
        in_flight: dict[int, RequestHandle] = {}  # index into todo -> handle
        next_submit = next_write = 0
        while next_write < len(todo):
            while next_submit < len(todo):  # feed the engine while its queue has room
                line = todo[next_submit]
                if line.record is None:
                    try:
                        in_flight[next_submit] = self.engine.submit(line.request)
                    except CapacityError:
                        break
                    except JaxloraError as e:
                        line.record = _error_record(line, str(e))
                next_submit += 1
            if in_flight:
                self.engine.step()
            for i in [i for i, h in in_flight.items() if h.done]:
                todo[i].record = _result_record(todo[i], in_flight.pop(i).result())
            while next_write < len(todo) and todo[next_write].record is not None:
                _append_durably(out, todo[next_write].record)
                next_write += 1
                bar.update(1)


def _parse_line(number: int, text: str) -> _Line:
    """A request, or an error record for a line that is not one (the job goes on)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        line = _Line(number=number, key=f"line:{number}")
        line.record = _error_record(line, f"line {number}: malformed JSON ({e.msg})")
        return line
    if not isinstance(obj, dict):
        line = _Line(number=number, key=f"line:{number}")
        line.record = _error_record(line, f"line {number}: expected a JSON object")
        return line
    cid = obj.get("custom_id")
    has_id = isinstance(cid, (str, int)) and not isinstance(cid, bool)
    line = _Line(number=number, key=f"id:{json.dumps(cid)}" if has_id else f"line:{number}", custom_id=cid,
                 adapter=obj.get("adapter") if isinstance(obj.get("adapter"), str) else None)
    try:
        if not has_id:
            raise JaxloraError(f"line {number}: custom_id must be a string or an integer")
        sampling = SamplingParams(**{k: obj[k] for k in _SAMPLING_FIELDS if obj.get(k) is not None})
        line.request = GenerationRequest(request_id=f"line-{number}", prompt=obj.get("prompt"),
                                         messages=obj.get("messages"), adapter=obj.get("adapter") or None,
                                         sampling=sampling)
    except (JaxloraError, TypeError) as e:
        line.record = _error_record(line, str(e))
    return line


def _result_record(line: _Line, result: FinalOutput) -> dict[str, Any]:
    return {"custom_id": line.custom_id, "adapter": line.adapter, "text": result.text,
            "token_ids": list(result.token_ids), "finish_reason": result.finish_reason.value, "error": result.error}


def _error_record(line: _Line, error: str) -> dict[str, Any]:
    record = {"custom_id": line.custom_id, "adapter": line.adapter, "text": "", "token_ids": [],
              "finish_reason": "error", "error": error}
    if line.key.startswith("line:"):
        record["line"] = line.number  # no usable custom_id: resume matches by line number
    return record


def _record_key(record: dict[str, Any]) -> str:
    if "line" in record:
        return f"line:{record['line']}"
    return f"id:{json.dumps(record.get('custom_id'))}"


def _answered_keys(path: Path) -> collections.Counter[str]:
    """Keys of the complete records in `path`; a torn last line (crash mid-write) is cut off."""
    keys: collections.Counter[str] = collections.Counter()
    if not path.exists():
        return keys
    data = path.read_bytes()
    good = 0  # bytes of complete, parseable lines
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            break
        keys[_record_key(record)] += 1
        good += len(raw)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return keys


def _consume(done: collections.Counter[str], key: str) -> bool:
    if done[key] > 0:
        done[key] -= 1
        return True
    return False


def _append_durably(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    os.fsync(out.fileno())
