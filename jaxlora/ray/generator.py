"""`BatchGenerator`: the callable class `Dataset.map_batches` runs, one warmed engine per Ray actor.

    ds = ray.data.read_parquet("requests.parquet")
    results = ds.map_batches(
        BatchGenerator,
        fn_constructor_kwargs={"spec": EngineSpec(adapters={"shout": "checkpoints/demo/shout"})},
        compute=ray.data.ActorPoolStrategy(size=8, max_concurrent_calls_per_actor=4),
        num_gpus=1,
        batch_format="pyarrow",
    )

Input columns: the batch JSONL's own fields (`custom_id`, `prompt` or `messages`, `adapter`,
`max_tokens`, the sampling fields, `stop`), or one column `request_line` holding whole JSONL lines
(how `jaxlora generate --ray` reads JSONL: a malformed line still becomes an error row). Output
columns: the JSONL result fields (`custom_id`, `request_hash`, `adapter`, `text`, `token_ids`,
`finish_reason`, `error`) and `prompt_tokens`, one row per input row; with `report_ready_at`, also
`replica_ready_at` (the `time.time()` at which this actor's engine finished warming up, the same in
every row: `jaxlora generate --ray` counts its generation-only rate from the earliest). Each row is parsed and
fingerprinted by jaxlora.engine.batch_job, so a row gives the record `jaxlora generate` writes for
the same line; a bad row gets an `error`, never a failed block.

`__call__` is a coroutine: Ray Data runs every call of one actor on one event loop, so the calls of
several blocks in flight (max_concurrent_calls_per_actor) submit into the same engine and each step
decodes the rows of all of them; the GPU does not idle while one block's results travel back.
This module does not import ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any

from jaxlora.engine.batch_job import LineDefaults, error_record, parse_line, result_record
from jaxlora.engine.load import EngineSpec, load_engine
from jaxlora.errors import CapacityError, JaxloraError
from jaxlora.ray.rows import request_lines

OUTPUT_COLUMNS = ("custom_id", "request_hash", "adapter", "text", "token_ids", "finish_reason", "error")


class BatchGenerator:
    """Loads and warms one engine from `spec`; each call turns a batch of request rows into results.

    Args:
      spec: what to load (model, engine config, adapters, quantization); picklable.
      defaults: what rows that leave a field out get (sampling defaults, the base model's name), as
        for `jaxlora generate`'s lines.
      compilation_cache: a folder for JAX's persistent compilation cache in this actor's process, so
        that a restarted actor reads its compiles back (None: off).
      report_ready_at: add the `replica_ready_at` column (see the module docstring).
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        defaults: LineDefaults = LineDefaults(),
        compilation_cache: str | None = None,
        report_ready_at: bool = False,
    ) -> None:
        self.defaults = defaults
        self.report_ready_at = report_ready_at
        if compilation_cache:
            _use_compilation_cache(compilation_cache)
        self.engine = load_engine(spec)
        self.engine.warmup()
        self.ready_at = time.time()
        self._request_ids = itertools.count()

    async def __call__(self, batch: Any) -> dict[str, list]:
        """`batch`: a pyarrow Table, or a mapping of column name -> values (any batch_format)."""
        lines = [
            parse_line(0, text.encode("utf-8", errors="surrogatepass"), self.defaults) for text in request_lines(batch)
        ]
        handles = {}
        for i, line in enumerate(lines):
            if line.record is None:
                request = dataclasses.replace(line.request, request_id=f"ray-{next(self._request_ids)}")
                outcome = await self._submit(request)
                if isinstance(outcome, str):
                    line.record = error_record(line, outcome)
                else:
                    handles[i] = outcome
        while not all(h.done for h in handles.values()):
            await self._step()
        prompt_tokens = [0] * len(lines)
        for i, handle in handles.items():
            result = handle.result()
            lines[i].record, prompt_tokens[i] = result_record(lines[i], result), result.prompt_tokens
        records = [_positionless(line.record) for line in lines]
        columns = {name: [r[name] for r in records] for name in OUTPUT_COLUMNS}
        out = {**columns, "prompt_tokens": prompt_tokens}
        if self.report_ready_at:
            out["replica_ready_at"] = [self.ready_at] * len(lines)
        return out

    async def _submit(self, request):
        """The request's handle, or the error message of a request the engine refuses."""
        while True:
            try:
                return self.engine.submit(request, stream=False)
            except CapacityError:
                await self._step()  # the queue is full: decode until it has room
            except (JaxloraError, ValueError, TypeError) as e:
                return str(e)

    async def _step(self) -> None:
        # One engine step for every call in flight, then let the other calls submit and collect.
        self.engine.step()
        await asyncio.sleep(0)


def _positionless(record: dict[str, Any]) -> dict[str, Any]:
    """A Ray row has no line number: drop the one parse_line was given, from the record and from
    the error message ("line 0: ...")."""
    record = {k: v for k, v in record.items() if k != "line"}
    if record["error"] and record["error"].startswith("line 0: "):
        record["error"] = record["error"][len("line 0: ") :]
    return record


def _use_compilation_cache(folder: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
