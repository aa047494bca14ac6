"""Checks shared by every way an adapter enters the engine (folder load, gRPC Load, CLI flags)."""

from __future__ import annotations

import re

from jaxlora.errors import AdapterError

# Names travel in requests, metrics labels and file names: keep them to a safe alphabet.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_adapter_name(name: object) -> str:
    """Returns `name` if it is a usable adapter name, else raises AdapterError saying why.

    A name is 1-128 characters from `A-Z a-z 0-9 . _ -`, and not "." or ".." (it may become a path).
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise AdapterError(
            f"adapter name {name!r} is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - (not '.' or '..')"
        )
    return name
