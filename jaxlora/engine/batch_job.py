"""Offline batch generation: JSONL requests in, JSONL results out, resumable after any crash.

Input lines, one request each, in either of two forms:
- jaxlora's: {"custom_id", "prompt" | "messages", "model" | "adapter"?, and sampling fields:
  "max_tokens" (or "max_completion_tokens"), "temperature", "top_p", "top_k", "seed", "stop",
  "stop_token_ids", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "presence_penalty",
  "frequency_penalty", "logprobs" (an integer, 0 to 20 alternatives per token; or as in chat,
  true with "top_logprobs")};
- OpenAI's Batch format (what `vllm run-batch` reads): {"custom_id", "method": "POST", "url":
  "/v1/chat/completions" | "/v1/completions", "body": {the same fields}}.
`prompt` is raw text to complete, `messages` a chat rendered with the model's chat template. `model`
names an adapter, or the base model by its served name; `adapter` is jaxlora's older name for it.
A field not listed is refused for its line (the message names the nearest known field), never
dropped. Sampling fields a line leaves out take the job's defaults (`LineDefaults`: the generate
flags), then the defaults of every API: temperature DEFAULT_TEMPERATURE (1, OpenAI's), then
SamplingParams' own. A line without a `seed` gets `line_seed(job seed, custom_id)`: its tokens depend
on the line alone, so a resumed job, or the same line in another job or on another Ray replica,
gives the same tokens. Output lines: {"custom_id", "request_hash", "adapter", "text",
"token_ids", "finish_reason", "error"}, exactly one per input line, in input order; a line that asks
for logprobs gets "logprobs" too: per token {"token_id", "logprob", "top_logprobs": [[id, logprob],
...]}, the model's raw log-probabilities.

Crash safety: results are written in input order as soon as every earlier line is done, one line per
`write`, fsync'd. A re-run checks that the output holds this input's results (see
jaxlora.engine.results_file: fingerprints, lock, torn-line repair), then skips the lines already
answered, so after `kill -9` nothing is lost or written twice, and a file that is not this job's is
refused instead of overwritten. Everything about the input and output files, the adapters the lines
name and whether the job is already complete is checked before the engine (and its model) is built.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from jaxlora.engine import job_files
from jaxlora.engine.engine import Engine, RequestHandle
from jaxlora.engine.job_files import JobFileError
from jaxlora.engine.request import DEFAULT_TEMPERATURE, FinalOutput, GenerationRequest, SamplingParams
from jaxlora.engine.results_file import ResultsFile, ResultsFileError, request_hash
from jaxlora.engine.runner import WarmupProgress
from jaxlora.errors import CapacityError, JaxloraError
from jaxlora.fields import first_unknown

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_REQUEST_FIELDS = frozenset(
    {"prompt", "messages", "model", "adapter", "max_completion_tokens", "top_logprobs", *SAMPLING_FIELDS}
)
_LINE_FIELDS = _REQUEST_FIELDS | {"custom_id"}
_OPENAI_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
_OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LineDefaults:
    """What the job gives the lines that leave a field out.

    Attributes:
      sampling: SamplingParams fields (the generate flags that were given).
      base_model: the base model's served name: a line whose `model` is this picks no adapter.
      seed: the job's seed (`--seed`): a line without one samples with `line_seed(seed, custom_id)`.
    """

    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    base_model: str | None = None
    seed: int = 0

    @property
    def fingerprint(self) -> str:
        """What of these defaults goes into every line's request_hash: the sampling flags and the
        seed, as canonical JSON, so that a job resumed with other flags is refused instead of
        mixing two jobs' answers in one file; "" for a job that gives no flag and seed 0 (its
        hashes are its lines' own, as before jobs had flags)."""
        if not self.sampling and self.seed == 0:
            return ""
        return json.dumps({"sampling": dict(self.sampling), "seed": self.seed}, sort_keys=True, separators=(",", ":"))


def line_seed(job_seed: int, custom_id: Any) -> int:
    """The sampling seed of a line that gives none: a 32-bit hash of the job's seed and the line's
    custom_id, the same in every run of the job (Python's `hash` of a string is not)."""
    digest = hashlib.sha256(json.dumps([job_seed, custom_id]).encode()).digest()
    return int.from_bytes(digest[:4], "little")


# A result record's bound: fixed fields and an error message; one token's text (JSON-escaped, a
# control byte takes six) and id. Generous: it only has to refuse files no run of this input wrote.
_RECORD_OVERHEAD_BYTES = 4096
_MAX_TOKEN_RECORD_BYTES = 1024
_MAX_LOGPROB_RECORD_BYTES = 64  # one [token id, logprob] pair of a token's logprobs
# A line without max_tokens gets its default from the engine, unknown while the files are checked
# (before the model loads): bounded by the longest context a model has.
_MAX_CONTEXT_TOKENS = 2**20


@dataclasses.dataclass
class _Line:
    """One input line: where it is, its fingerprint, and its outcome."""

    number: int  # 1-based line number in the input
    request_hash: str
    input_bytes: int  # of the line as read
    custom_id: Any = None
    has_id: bool = False  # custom_id is usable (a string or an integer)
    adapter: str | None = None
    request: GenerationRequest | None = None
    record: dict[str, Any] | None = None  # the output record once known

    @property
    def max_record_bytes(self) -> int:
        """The most bytes this line's result record can take: what it repeats of the line (custom_id,
        adapter, in an error message), the fixed fields, and `max_tokens` tokens as text and ids."""
        max_tokens = 0 if self.request is None else self.request.sampling.max_tokens or _MAX_CONTEXT_TOKENS
        logprobs = None if self.request is None else self.request.sampling.logprobs
        per_token = _MAX_TOKEN_RECORD_BYTES + (0 if logprobs is None else (logprobs + 1) * _MAX_LOGPROB_RECORD_BYTES)
        return _RECORD_OVERHEAD_BYTES + 3 * self.input_bytes + max_tokens * per_token

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
    defaults: LineDefaults = LineDefaults(),
    adapters: Collection[str] | None = None,
) -> int:
    """Checks the files, builds the engine (`make_engine`, called only once the files are fine), runs
    the job, prints the JSON summary on stderr. Exit code 0 when every line got a record (error
    records included) or the output already held them all, 2 for unusable files, lines naming an
    adapter not in `adapters` (None: not checked) or an engine that cannot be built, 1 when the
    results cannot be written.
    """
    try:
        lines = read_input(input_path, defaults)
        if adapters is not None:
            _check_adapters(lines, adapters)
        results = ResultsFile.open(
            output_path,
            input_path=input_path,
            expected=[x.fingerprint for x in lines],
            max_record_bytes=[x.max_record_bytes for x in lines],
            overwrite=overwrite,
        )
    except JobFileError as e:
        print(f"jaxlora generate: {e}", file=sys.stderr)
        return 2
    with results:
        if results.num_done == len(lines):
            print(
                f"jaxlora generate: {output_path} already holds all {len(lines)} results (--overwrite to run again)",
                file=sys.stderr,
            )
            return 0
        if results.num_done:
            print(f"jaxlora generate: resuming: {results.num_done} of {len(lines)} done", file=sys.stderr, flush=True)
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


def read_input(path: Path, defaults: LineDefaults = LineDefaults()) -> list[_Line]:
    """The non-blank lines of the input file (a regular file; a UTF-8 byte order mark at its start
    is dropped), parsed; JobFileError if it cannot be read."""
    data = job_files.read_input(path).removeprefix(codecs.BOM_UTF8)
    return [parse_line(number, raw, defaults) for number, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]


def _check_adapters(lines: list[_Line], adapters: Collection[str]) -> None:
    """ResultsFileError naming the lines whose adapter is not registered (checked before loading)."""
    unknown = [
        (x.number, x.adapter) for x in lines if x.request is not None and x.adapter and x.adapter not in adapters
    ]
    if unknown:
        shown = ", ".join(f"line {n}: {a!r}" for n, a in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        given = ", ".join(sorted(adapters)) or "none"
        raise ResultsFileError(
            f"{len(unknown)} line(s) name an adapter that no --adapter NAME=PATH registers ({shown}; "
            f"registered: {given})"
        )


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


def parse_line(number: int, raw: bytes, defaults: LineDefaults) -> _Line:
    """A request, or an error record for a line that is not one (the job goes on)."""
    text = raw.decode("utf-8", errors="backslashreplace")
    digest = request_hash(text, defaults.fingerprint)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:  # a replaced character would change custom_id or the prompt unseen
        line = _Line(number=number, request_hash=digest, input_bytes=len(raw))
        line.record = error_record(line, f"line {number}: not valid UTF-8 (byte {e.start + 1}: {e.reason})")
        return line
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        line = _Line(number=number, request_hash=digest, input_bytes=len(raw))
        line.record = error_record(line, f"line {number}: malformed JSON ({e.msg})")
        return line
    if not isinstance(obj, dict):
        line = _Line(number=number, request_hash=digest, input_bytes=len(raw))
        line.record = error_record(line, f"line {number}: expected a JSON object")
        return line
    cid = obj.get("custom_id")
    has_id = isinstance(cid, (str, int)) and not isinstance(cid, bool)
    line = _Line(number=number, request_hash=digest, input_bytes=len(raw), custom_id=cid, has_id=has_id)
    try:
        if not has_id:
            raise JaxloraError(f"line {number}: custom_id must be a string or an integer")
        fields = _request_fields(obj, number)
        line.adapter = _adapter(fields, number, defaults.base_model)
        line.request = GenerationRequest(
            request_id=f"line-{number}",
            prompt=fields.get("prompt"),
            messages=fields.get("messages"),
            adapter=line.adapter,
            sampling=_sampling(fields, number, defaults, cid),
        )
    except (JaxloraError, TypeError) as e:
        line.record = error_record(line, str(e))
    return line


def _request_fields(obj: dict[str, Any], number: int) -> dict[str, Any]:
    """The request's fields: the line itself, or an OpenAI Batch line's `body`, each field known."""
    if not {"body", "url", "method"} & obj.keys():
        _refuse_unknown(obj, _LINE_FIELDS, f"line {number}")
        return obj
    _refuse_unknown(obj, _OPENAI_LINE_FIELDS, f"line {number}")
    if obj.get("method", "POST") != "POST":
        raise JaxloraError(f"line {number}: method={obj['method']!r}: only POST is supported")
    kind = _OPENAI_URLS.get(obj.get("url"))
    if kind is None:
        raise JaxloraError(f"line {number}: url={obj.get('url')!r} must be one of {sorted(_OPENAI_URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise JaxloraError(f"line {number}: body must be a JSON object (the request of {obj['url']})")
    _refuse_unknown(body, _REQUEST_FIELDS - {"adapter"}, f"line {number}: body")
    other = "prompt" if kind == "messages" else "messages"
    if other in body:
        raise JaxloraError(f"line {number}: {obj['url']} takes {kind!r}, not {other!r}")
    return body


def _refuse_unknown(fields: dict[str, Any], known: Collection[str], where: str) -> None:
    unknown = first_unknown(fields, known)
    if unknown is not None:
        raise JaxloraError(f"{where}: {unknown[1]}")


def _adapter(fields: dict[str, Any], number: int, base_model: str | None) -> str | None:
    """The adapter a line names with `model` (OpenAI's name) or `adapter`; None for the base model."""
    names = {}
    for key in ("model", "adapter"):
        value = fields.get(key)
        if value is not None and not isinstance(value, str):
            raise JaxloraError(f"line {number}: {key}={value!r} must be a string")
        if value and value != base_model:
            names[key] = value
    if len(set(names.values())) > 1:
        raise JaxloraError(f"line {number}: model={names['model']!r} and adapter={names['adapter']!r} disagree")
    return next(iter(names.values()), None)


def _sampling(fields: dict[str, Any], number: int, defaults: LineDefaults, custom_id: Any) -> SamplingParams:
    given = {k: fields[k] for k in SAMPLING_FIELDS if fields.get(k) is not None}
    alias = fields.get("max_completion_tokens")
    if alias is not None:
        if given.get("max_tokens", alias) != alias:
            raise JaxloraError(f"line {number}: give max_completion_tokens or max_tokens, not both")
        given["max_tokens"] = alias
    given.pop("logprobs", None)
    given.update(_logprobs(fields, number))
    sampling = {"temperature": DEFAULT_TEMPERATURE, **defaults.sampling, **given}
    sampling.setdefault("seed", line_seed(defaults.seed, custom_id))
    return SamplingParams(**sampling)


def _logprobs(fields: dict[str, Any], number: int) -> dict[str, Any]:
    """SamplingParams' `logprobs` from a line's: an integer (completions' form), or true with
    `top_logprobs` (chat's form)."""
    wanted, top = fields.get("logprobs"), fields.get("top_logprobs")
    if wanted is True:
        return {"logprobs": 0 if top is None else top}
    if top is not None:
        raise JaxloraError(f"line {number}: top_logprobs needs logprobs: true")
    if wanted is None or wanted is False:
        return {}
    return {"logprobs": wanted}  # SamplingParams checks the integer


def result_record(line: _Line, result: FinalOutput) -> dict[str, Any]:
    record = {
        **line.fingerprint,
        "adapter": line.adapter,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason.value,
        "error": result.error,
    }
    if result.logprobs is not None:
        record["logprobs"] = [
            {"token_id": e.token_id, "logprob": e.logprob, "top_logprobs": [list(t) for t in e.top]}
            for e in result.logprobs
        ]
    return record


def error_record(line: _Line, error: str) -> dict[str, Any]:
    return {
        **line.fingerprint,
        "adapter": line.adapter,
        "text": "",
        "token_ids": [],
        "finish_reason": "error",
        "error": error,
    }
