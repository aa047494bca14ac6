"""The results file of a batch job: owned by one job, resumed only from its own records, never torn.

A batch job writes one record per input line, in input order, so a results file is always a prefix
of the records its input asks for. Every record carries its input line's fingerprint: the
`custom_id` (for a line without a usable one, its `line` number) and `request_hash`, a hash of the
request itself. Opening a file for a job:

- `--output` naming the input file (also through a link) is refused.
- The job takes an exclusive lock on the file (`flock`); a second job on the same file is refused
  at once, so two jobs never interleave their records.
- Existing content must be this input's records, record i answering input line i, fingerprints
  equal. Anything else (text, records of another job or of an edited input, more records than
  lines) is refused before any work starts, with a message saying what was found; `overwrite=True`
  empties the file instead.
- A torn last line (a crash mid-write: no newline, and it starts like a record) is cut off.
- Only a regular file is taken (jaxlora.engine.job_files), and it is read record by record, each
  within the most bytes its input line's answer can take: a file larger than this input's results
  could be is refused as not this job's, after reading no more than that.

Writes: one `write` per record, then `fsync`. When a write or its fsync fails (a full disk), the
file is truncated back to the end of the last whole record and ResultsFileError is raised, so the
file never ends in a torn line and a re-run resumes from it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxlora.engine.job_files import JobFileError, open_regular

# How every record line starts (`custom_id` is the first key written): a last line without a
# newline that starts like this, or is a prefix of it, is a torn write of ours.
RECORD_START = b'{"custom_id": '
MAX_RECORD_BYTES = 64 * 2**20  # a record's bound when the caller gives none
_CHUNK = 1 << 20


class ResultsFileError(JobFileError):
    """The results file cannot be used or written; the message names the file and says why."""


def request_hash(text: str, job: str = "") -> str:
    """Fingerprint of one input line: the first 16 hex digits of the SHA-256 of its canonical JSON
    (sorted keys, no spaces), or of its stripped text when it is not JSON; followed by `job`, what
    of the job decides its answer too (`LineDefaults.fingerprint`: the sampling flags and the
    seed), when there is any."""
    try:
        canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError:
        canonical = text.strip()
    if job:
        canonical = f"{canonical}\n{job}"
    return hashlib.sha256(_encode(canonical)).hexdigest()[:16]


def _encode(text: str) -> bytes:
    # A JSON string may hold a lone surrogate ("\ud800" in the input); written back as that escape
    # it parses to the same string again.
    return text.encode("utf-8", errors="backslashreplace")


class ResultsFile:
    """An open, locked results file. Use `open`; close it (or use it as a context manager) when done.

    Attributes:
      path: the file.
      num_done: records already in the file when it was opened (they answer the first input lines).
    """

    def __init__(self, path: Path, fd: int, num_done: int, size: int) -> None:
        self.path = path
        self.num_done = num_done
        self._fd = fd
        self._size = size  # bytes of whole records

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        input_path: str | Path,
        expected: Sequence[Mapping[str, Any]],
        max_record_bytes: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> ResultsFile:
        """Opens `path` for the job whose input lines have the fingerprints `expected` (in order).

        Args:
          max_record_bytes: for each input line, the most bytes its record can take, newline
            included (default: MAX_RECORD_BYTES each).

        Raises:
          ResultsFileError: the file is not a regular file, is the input, is locked by another job,
            cannot be opened for writing, or holds anything but a prefix of this job's records
            (unless `overwrite`).
        """
        path = Path(path)
        try:
            fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, flag="--output")
        except JobFileError as e:
            raise ResultsFileError(str(e).replace("cannot open it", "cannot open it for writing")) from None
        limits = list(max_record_bytes) if max_record_bytes is not None else [MAX_RECORD_BYTES] * len(expected)
        try:
            _check_not_input(fd, path, Path(input_path))
            _lock(fd, path)
            if overwrite:
                os.ftruncate(fd, 0)
            num_done, size = _resume_point(fd, path, expected, limits)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, num_done, size)

    def append(self, record: Mapping[str, Any]) -> None:
        """Writes one record durably, or raises ResultsFileError with the file cut back to whole records."""
        data = _encode(json.dumps(record, ensure_ascii=False)) + b"\n"
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError as e:
            self._cut_back()
            raise ResultsFileError(
                f"cannot write --output {self.path} ({e.strerror}); it ends with the last whole result. "
                "Make room and run the same command again to resume"
            ) from None
        self._size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # also releases the lock
            self._fd = -1

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError:
            pass  # the write error is what the caller reports; the torn tail is cut on resume


def _check_not_input(fd: int, path: Path, input_path: Path) -> None:
    out, inp = os.fstat(fd), os.stat(input_path)
    if (out.st_dev, out.st_ino) == (inp.st_dev, inp.st_ino):
        raise ResultsFileError(
            f"--output {path} is the input file {input_path}: results would overwrite the "
            "requests; choose another --output"
        )


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ResultsFileError(
            f"--output {path} is in use by another running job; wait for it to finish or choose another --output"
        ) from None


def _resume_point(fd: int, path: Path, expected: Sequence[Mapping[str, Any]], limits: Sequence[int]) -> tuple[int, int]:
    """(records already done, their bytes); cuts off a torn last record; refuses anything else,
    reading no further than the first record that is not this job's."""
    num_done = size = 0
    for raw, has_newline in _records(fd, path, limits):
        if not has_newline:
            if not (raw.startswith(RECORD_START) or RECORD_START.startswith(raw)):
                raise _foreign(path, num_done + 1, f"unrelated text {preview(raw)}")
            os.ftruncate(fd, size)
            os.fsync(fd)
            break
        _check_record(path, num_done, raw, expected)
        num_done += 1
        size += len(raw) + 1
    return num_done, size


def _records(fd: int, path: Path, limits: Sequence[int]) -> Iterator[tuple[bytes, bool]]:
    """The file's lines (without the newline) and whether each ends in one, read in chunks; a line
    longer than its record's limit is refused."""
    offset, pending, number = 0, b"", 0
    while True:
        chunk = os.pread(fd, _CHUNK, offset)
        offset += len(chunk)
        pending += chunk
        lines = []
        if b"\n" in chunk:
            *lines, pending = pending.split(b"\n")
        for raw in lines:
            yield raw, True
            number += 1
        limit = limits[number] if number < len(limits) else _CHUNK  # past the last: _check_record refuses
        if len(pending) >= limit:
            if number >= len(limits):
                raise _foreign(path, number + 1, f"more results than the input has lines ({len(limits)})")
            raise _foreign(path, number + 1, f"a line longer than its result can be ({limit} bytes)")
        if not chunk:
            break
    if pending:
        yield pending, False


def _check_record(path: Path, i: int, raw: bytes, expected: Sequence[Mapping[str, Any]]) -> None:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _foreign(path, i + 1, f"text that is not a JSON record {preview(raw)}") from None
    if not isinstance(record, dict) or "request_hash" not in record:
        raise _foreign(path, i + 1, f"JSON that is not a result record {preview(raw)}")
    if i >= len(expected):
        raise _foreign(path, i + 1, f"more results than the input has lines ({len(expected)})")
    if any(record.get(k) != v for k, v in expected[i].items()):
        found = {k: record.get(k) for k in expected[i]}
        raise _foreign(
            path,
            i + 1,
            f"a result {found} that does not answer input request {i + 1} "
            f"{dict(expected[i])} (another job's results, or the input or the job's sampling flags or "
            "--seed changed)",
        )


def _foreign(path: Path, line: int, what: str) -> ResultsFileError:
    return ResultsFileError(
        f"--output {path} is not this job's results file: line {line} holds {what}. "
        "Choose another --output, or pass --overwrite to replace its contents"
    )


def preview(raw: bytes, limit: int = 60) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")
