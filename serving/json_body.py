"""An HTTP request body as the JSON value the API accepts, or an INVALID_ARGUMENT that says why not.

Beyond `json.loads`: the body is UTF-8; numbers are finite (`NaN`, `Infinity` and `1e400` are not
JSON numbers a sampler can use, and Python's decoder takes them); objects and arrays nest at most
MAX_DEPTH deep (deeper ones reach the interpreter's recursion limit in the decoder, or in any code
that walks the value); strings, keys included, hold no lone surrogate (a `\\ud800` escape decodes
to one, and no tokenizer or UTF-8 writer can take it).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from serving.api import ApiError, Status

MAX_DEPTH = 64
# A lone surrogate can only come from a \uD800-\uDFFF escape: bodies without one skip the walk over strings.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode(body: bytes) -> Any:
    """The JSON value of `body`.

    Raises:
      ApiError: INVALID_ARGUMENT, the message saying what is wrong and where.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"the request body is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_non_finite, parse_float=_finite_float)
    except RecursionError:
        raise _invalid(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise _invalid(f"the request body is not valid JSON: {e}") from None
    _check(value, check_strings=_SURROGATE_ESCAPE.search(body) is not None)
    return value


def _non_finite(constant: str) -> float:
    raise ValueError(f"{constant} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large to be a finite number")
    return value


def _check(value: Any, *, check_strings: bool) -> None:
    """Depth, and (with `check_strings`) lone surrogates, walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise _invalid(f"the request body nests deeper than {MAX_DEPTH} levels (at {where or 'the top'})")
            if isinstance(item, dict):
                for key, child in item.items():
                    if check_strings:
                        _check_string(key, f"{where}.{_printable(key)}" if where else _printable(key), key=True)
                    stack.append((child, f"{where}.{_printable(key)}" if where else _printable(key), depth + 1))
            else:
                stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))
        elif check_strings and isinstance(item, str):
            _check_string(item, where)


def _check_string(text: str, where: str, *, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        what = "a key" if key else where or "the body"
        raise _invalid(
            f"{what} holds a lone surrogate (\\u{ord(text[e.start]):04x} at character {e.start}): "
            "text must be valid Unicode; send characters outside the BMP as a surrogate pair"
        ) from None


def _printable(key: str) -> str:
    return key.encode("utf-8", errors="backslashreplace").decode("ascii", errors="backslashreplace")


def _invalid(message: str) -> ApiError:
    return ApiError(Status.INVALID_ARGUMENT, message)
