"""Request rows as Ray Data sees them, and their fingerprints; light enough for Ray Data's read and
filter tasks (no JAX here).

A request row is one JSON request text, in the column `request_line`: a JSONL line as it is in the
file, or a Parquet/columnar row's non-null fields as JSON. Fingerprints are jaxlora.engine.batch_job's
(custom_id, request_hash), so a row and the line of a JSONL file with the same request agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxlora.engine.results_file import request_hash
from jaxlora.ray.output_folder import record_key

LINE_COLUMN = "request_line"


def request_lines(batch: Any) -> list[str]:
    """One JSON request text per row: the `request_line` column, or each row's non-null fields."""
    rows = batch.to_pylist() if hasattr(batch, "to_pylist") else _mapping_rows(batch)
    if rows and LINE_COLUMN in rows[0]:
        return [row[LINE_COLUMN] for row in rows]
    return [json.dumps({k: _plain(v) for k, v in row.items() if v is not None}, ensure_ascii=False) for row in rows]


def _mapping_rows(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    if hasattr(batch, "to_dict"):  # a pandas DataFrame
        return batch.to_dict("records")
    names = list(batch)
    return [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (numpy/pandas batches) as the JSON values they stand for."""
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def as_lines(table) -> dict[str, list[str]]:
    """Ray Data batch function: request rows as one `request_line` column."""
    return {LINE_COLUMN: request_lines(table)}


def keys(table, job: str = "") -> dict[str, list[str]]:
    """Ray Data batch function: the fingerprint (record_key) of each request row, column `key`;
    `job`: `LineDefaults.fingerprint` of the job's flags."""
    return {"key": [line_key(text, job) for text in table.column(LINE_COLUMN).to_pylist()]}


def line_key(text: str, job: str = "") -> str:
    """record_key of the record jaxlora.engine.batch_job.parse_line gives this line in a job whose
    flags have the fingerprint `job`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return record_key(custom_id, request_hash(text, job))


def drop_done(table, done: frozenset[str], job: str = ""):
    """Ray Data batch function: the request rows whose fingerprints are not in `done`."""
    keep = [line_key(text, job) not in done for text in table.column(LINE_COLUMN).to_pylist()]
    return table.filter(keep)
