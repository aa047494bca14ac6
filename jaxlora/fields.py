"""Unknown fields are refused, never dropped: one check shared by every API surface (batch lines,
HTTP bodies, gRPC messages), whose message names the field and the nearest known name, so a typo
(`adaptor`, `max_token`) fails loudly instead of running with a default."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable


def unknown_field(name: str, known: Collection[str]) -> str | None:
    """The message refusing `name`, or None if it is one of `known`."""
    if name in known:
        return None
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"
    return f"unknown field {name!r}{hint}"


def first_unknown(names: Iterable[str], known: Collection[str]) -> tuple[str, str] | None:
    """(field, message) for the first of `names` not in `known`, or None if all are known."""
    for name in names:
        message = unknown_field(name, known)
        if message is not None:
            return name, message
    return None
