"""The output folder of a Ray batch job: part files of result records, owned by one job, resumable.

Results arrive in whatever order the replicas finish them, so a Ray job cannot resume from "the
first N lines" as the single-process job does (jaxlora.engine.results_file); it resumes from the set
of fingerprints already written. A record's key is its fingerprint: `custom_id` and `request_hash`
(see `record_key`). Opening a folder for a job applies the single-process rules to the whole folder:

- `--output` must be a folder (made if missing); the job locks it (`flock` on `.lock`), so a second
  job on the same folder is refused at once.
- Every file in it must be a part file (`part-NNNNN.jsonl`) whose lines are records answering this
  job's input, each request at most once. Anything else (other files, text, JSON that is not a
  record, another job's records) is refused before any work starts; `overwrite=True` deletes the
  part files instead.
- A torn last line of a part file (a driver killed mid-write) is cut off.

Each run writes a new part file: one `write` per batch of records, then `fsync`, so records are
either wholly on disk or (torn tail) cut on the next open.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxlora.engine.results_file import RECORD_START, ResultsFileError, preview

LOCK_NAME = ".lock"
_PART = re.compile(r"part-(\d{5,})\.jsonl")


def record_key(custom_id: Any, request_hash: Any) -> str:
    """The fingerprint of a request and of its result record, as one hashable string."""
    return json.dumps([custom_id, request_hash], ensure_ascii=False)


class OutputFolder:
    """An open, locked output folder. Use `open`; close it (or use it as a context manager).

    Attributes:
      path: the folder.
      done: keys of the records already in it when it was opened.
    """

    def __init__(self, path: Path, lock_fd: int, done: set[str], part: Path) -> None:
        self.path = path
        self.done = done
        self._lock_fd = lock_fd
        self._part = part
        self._fd = -1

    @classmethod
    def open(cls, path: str | Path, *, expected: Collection[str], overwrite: bool = False) -> OutputFolder:
        """Opens `path` for the job whose requests have the keys `expected` (record_key).

        Raises:
          ResultsFileError: `path` is not a folder, is locked by another job, cannot be written, or
            holds anything but records of this job (unless `overwrite`).
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ResultsFileError(f"--output {path} is a file; with --ray, --output names a folder of part files")
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise ResultsFileError(f"--output {path}: cannot write there ({e.strerror})") from None
        try:
            _lock(lock_fd, path)
            parts = _part_files(path)
            if overwrite:
                for part in parts:
                    part.unlink()
                parts = []
            done = _read_done(path, parts, expected)
        except BaseException:
            os.close(lock_fd)
            raise
        number = max((int(_PART.fullmatch(p.name)[1]) for p in parts), default=-1) + 1
        return cls(path, lock_fd, done, path / f"part-{number:05d}.jsonl")

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Writes `records` to this run's part file durably (one write, then fsync)."""
        if not records:
            return
        data = b"".join(_encode(r) for r in records)
        try:
            if self._fd < 0:
                self._fd = os.open(self._part, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError as e:
            raise ResultsFileError(
                f"cannot write {self._part} ({e.strerror}); run the same command again to resume"
            ) from None
        self.done.update(record_key(r["custom_id"], r["request_hash"]) for r in records)

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)  # the lock file's close releases the lock
        self._fd = self._lock_fd = -1

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record in the part files of a finished job's folder (in no particular order)."""
    return [json.loads(line) for part in _part_files(Path(path)) for line in part.read_text().splitlines()]


def _encode(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode("utf-8", errors="backslashreplace") + b"\n"


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ResultsFileError(
            f"--output {path} is in use by another running job; wait for it to finish or choose another --output"
        ) from None


def _part_files(path: Path) -> list[Path]:
    """The folder's part files; ResultsFileError if it holds anything else."""
    parts = []
    for entry in sorted(path.iterdir()):
        if entry.name == LOCK_NAME:
            continue
        if not (_PART.fullmatch(entry.name) and entry.is_file()):
            raise _foreign(path, f"{entry.name!r}, which is not a part file of a jaxlora job")
        parts.append(entry)
    return parts


def _read_done(path: Path, parts: list[Path], expected: Collection[str]) -> set[str]:
    done: set[str] = set()
    for part in parts:
        for i, raw in enumerate(_whole_lines(part)):
            key = _check_record(part, i, raw, expected)
            if key in done:
                raise _foreign(path, f"a second result for request {key} ({part.name} line {i + 1})")
            done.add(key)
    return done


def _whole_lines(part: Path) -> list[bytes]:
    """The part file's complete lines; a torn last record is cut off the file."""
    data = part.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()
    if tail:
        if not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
            raise _foreign(part.parent, f"unrelated text {preview(tail)} at the end of {part.name}")
        os.truncate(part, len(data) - len(tail))
    return lines


def _check_record(part: Path, i: int, raw: bytes, expected: Collection[str]) -> str:
    where = f"{part.name} line {i + 1}"
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _foreign(part.parent, f"text that is not a JSON record {preview(raw)} ({where})") from None
    if not isinstance(record, dict) or "request_hash" not in record:
        raise _foreign(part.parent, f"JSON that is not a result record {preview(raw)} ({where})")
    key = record_key(record.get("custom_id"), record["request_hash"])
    if key not in expected:
        raise _foreign(
            part.parent,
            f"a result for custom_id={record.get('custom_id')!r}, request_hash={record['request_hash']!r} "
            f"that answers no request of this input ({where}: another job's results, or the input changed)",
        )
    return key


def _foreign(path: Path, what: str) -> ResultsFileError:
    return ResultsFileError(
        f"--output {path} is not this job's output folder: it holds {what}. "
        "Choose another --output, or pass --overwrite to replace its part files"
    )
