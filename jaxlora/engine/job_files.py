"""Opening a batch job's files: regular files only, read within a known bound.

A device, FIFO or socket given as `--input` or `--output` never ends (`/dev/zero`), swallows every
write (`/dev/null`), fails every write (`/dev/full`) or cannot seek (a FIFO). Each file is opened
without blocking (a FIFO with no writer would hang `open`), `fstat`'d, and refused unless it is a
regular file, before any model loads.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from jaxlora.errors import JaxloraError

_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


class JobFileError(JaxloraError):
    """A batch job's file cannot be used; the message names the flag and the file and says why."""


def open_regular(path: Path, flags: int, *, flag: str, mode: int = 0o666) -> int:
    """`os.open(path, flags)` for a regular file, blocking I/O once open; the fd.

    Raises:
      JobFileError: it cannot be opened, or it is not a regular file.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode)
    except OSError as e:
        raise JobFileError(f"{flag} {path}: cannot open it ({e.strerror})") from None
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            what = next((name for test, name in _KINDS if test(kind)), "not a regular file")
            raise JobFileError(f"{flag} {path} is {what}; give a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_input(path: Path, *, flag: str = "--input") -> bytes:
    """The bytes of a regular file, at most its size when opened (a file growing meanwhile is cut
    there).

    Raises:
      JobFileError: see `open_regular`, or a read error.
    """
    fd = open_regular(path, os.O_RDONLY, flag=flag)
    try:
        size = os.fstat(fd).st_size
        chunks, offset = [], 0
        while offset < size and (chunk := os.pread(fd, min(1 << 20, size - offset), offset)):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise JobFileError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
