"""The packed step inputs (jaxlora.engine.step_inputs) hold, field for field, what a per-chunk loop
over the plan builds, through preemption, row reuse and both token budgets; the layout round-trips
every field bit for bit; a buffer is not rewritten while its copy may still read it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.engine.sampling import SamplingArrays
from jaxlora.engine.scheduler import StepPlan
from jaxlora.engine.step_inputs import ROW_FIELDS, TOKEN_FIELDS, StepLayout
from jaxlora.model import RaggedBatch
from tests.engine.conftest import ADAPTERS, make_engine

PRINTABLE_IDS = np.arange(4, 99)


def reference_fields(plan: StepPlan, pages, *, rows: int, pages_per_seq: int, num_pages: int) -> dict:
    """The step's fields by a loop over chunks and tokens (no shared index math with the packer)."""
    T, P = plan.budget, pages.page_size
    out = {
        "tokens": np.zeros(T, np.int64),
        "src": np.full(T, -1, np.int64),
        "positions": np.zeros(T, np.int64),
        "slot_ids": np.zeros(T, np.int64),
        "write_page": np.full(T, num_pages, np.int64),
        "write_offset": np.zeros(T, np.int64),
        "q_start": np.zeros(rows, np.int64),
        "q_len": np.zeros(rows, np.int64),
        "kv_len": np.zeros(rows, np.int64),
        "temperature": np.zeros(rows, np.float64),
        "top_k": np.zeros(rows, np.int64),
        "top_p": np.ones(rows, np.float64),
        "seed": np.zeros(rows, np.int64),
        "counter": np.zeros(rows, np.int64),
        "prompt_len": np.zeros(rows, np.int64),
        "reset": np.zeros(rows, bool),
        "repetition_penalty": np.ones(rows, np.float64),
        "presence_penalty": np.zeros(rows, np.float64),
        "frequency_penalty": np.zeros(rows, np.float64),
    }
    tables = {}
    t = 0
    for c in plan.chunks:
        owned = pages.pages_of(c.row)
        tables[c.row] = list(owned)
        out["q_start"][c.row], out["q_len"][c.row], out["kv_len"][c.row] = t, c.length, c.start + c.length
        for i in range(c.length):
            p = c.start + i
            if c.from_device:
                out["src"][t] = c.row
            else:
                out["tokens"][t] = c.request.tokens(p, p + 1)[0]
            out["positions"][t], out["slot_ids"][t] = p, c.request.slot
            out["write_page"][t], out["write_offset"][t] = owned[p // P], p % P
            t += 1
        s = c.request.sampling
        out["prompt_len"][c.row], out["reset"][c.row] = c.request.num_prompt, c.start == c.request.num_cached
        out["repetition_penalty"][c.row], out["presence_penalty"][c.row] = s.repetition_penalty, s.presence_penalty
        out["frequency_penalty"][c.row] = s.frequency_penalty
        if c.samples:
            s = c.request.sampling
            out["temperature"][c.row], out["top_k"][c.row], out["top_p"][c.row] = s.temperature, s.top_k, s.top_p
            out["seed"][c.row], out["counter"][c.row] = c.request.seed, c.request.num_dispatched
    return out, tables


def unpacked(layout: StepLayout, buffer: np.ndarray) -> dict:
    """The fields the jitted step sees, by the step's own unpacking (run eagerly)."""
    f = layout.unpack(jnp.asarray(buffer.copy()))
    batch, sampling = f.pop("batch"), f.pop("sampling")
    f.update(
        {k: getattr(batch, k) for k in ("q_start", "q_len", "kv_len", "block_tables", "write_page", "write_offset")}
    )
    f.update(vars(sampling))
    return {k: np.asarray(v) for k, v in f.items()}


def test_packed_inputs_equal_a_per_token_build_through_preemption(parts, monkeypatch):
    """A pool of a quarter of what the rows could use (preemptions, rows reused, pages freed and
    taken again), sampled and greedy rows, adapters and the base model: every step's packed fields
    equal the reference, and the run needs no block-table row it was not sent."""
    engine = make_engine(parts, num_pages=20)
    runner = engine.runner
    checked = {"steps": 0, "restarts": 0, "sampled_steps": 0}
    pack = runner.pack

    def checking_pack(plan, pages):
        inputs = pack(plan, pages)
        want, tables = reference_fields(
            plan, pages, rows=engine.config.max_batch, pages_per_seq=runner.pages_per_seq, num_pages=runner.num_pages
        )
        got = unpacked(inputs.layout, inputs.buffer)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value.astype(got[name].dtype), err_msg=name)
        for row, owned in tables.items():
            np.testing.assert_array_equal(got["block_tables"][row, : len(owned)], owned, err_msg=f"row {row}")
        assert inputs.has_adapter == any(c.request.slot for c in plan.chunks)
        penalties = any(c.request.sampling.has_penalties for c in plan.chunks)
        assert inputs.extended == penalties  # no request here asks for logprobs
        assert inputs.samples == penalties or any(c.samples and c.request.sampling.temperature > 0 for c in plan.chunks)
        checked["sampled_steps"] += inputs.samples
        checked["steps"] += bool(plan.chunks)
        checked["restarts"] += sum(c.start == 0 and c.request.num_preemptions > 0 for c in plan.chunks)
        return inputs

    monkeypatch.setattr(runner, "pack", checking_pack)
    rng = np.random.default_rng(5)
    requests = [
        GenerationRequest(
            request_id=f"pk{i}",
            prompt_ids=[1, *rng.choice(PRINTABLE_IDS, int(rng.integers(10, 20))).tolist()],
            adapter=(None, *ADAPTERS)[i % 4],
            sampling=SamplingParams(
                max_tokens=int(rng.integers(16, 29)),
                temperature=0.8 * (i % 2),
                top_k=5,
                seed=i,
                repetition_penalty=1.5 if i == 6 else 1.0,
                frequency_penalty=0.5 if i == 4 else 0.0,
            ),
        )
        for i in range(7)
    ]
    outs = engine.generate(requests)
    assert all(o.error is None for o in outs)
    assert engine.stats()["preemptions"] > 0 and checked["restarts"] > 0 and checked["steps"] > 20
    assert 0 < checked["sampled_steps"] < checked["steps"]
    assert engine.compiles_after_warmup == 0


@pytest.mark.parametrize("budget, rows, pages_per_seq", [(8, 4, 16), (5, 3, 1), (16, 16, 7)])
def test_layout_round_trips_every_field(budget, rows, pages_per_seq):
    """Random values in every field, floats and uint32 seeds above int32's range included, come back
    bit for bit through pack and the step's unpack; the spans tile the buffer with no gap or overlap."""
    layout = StepLayout(budget=budget, rows=rows, pages_per_seq=pages_per_seq)
    spans = sorted(layout.spans.values(), key=lambda s: s.start)
    assert spans[0].start == 0 and spans[-1].stop == layout.size
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
    assert len(spans) == 1 + len(ROW_FIELDS) + len(TOKEN_FIELDS)
    rng = np.random.default_rng(budget)

    def ints(*shape):
        return rng.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32)

    batch = RaggedBatch(
        q_start=ints(rows),
        q_len=ints(rows),
        kv_len=ints(rows),
        block_tables=ints(rows, pages_per_seq),
        write_page=ints(budget),
        write_offset=ints(budget),
    )
    sampling = SamplingArrays(
        temperature=rng.uniform(0.1, 2.0, rows).astype(np.float32),
        top_k=ints(rows),
        top_p=rng.uniform(0.1, 1.0, rows).astype(np.float32),
        seed=rng.integers(2**31, 2**32, rows, dtype=np.uint64).astype(np.uint32),
        counter=ints(rows),
        min_p=rng.uniform(0.0, 1.0, rows).astype(np.float32),
        min_tokens=ints(rows),
        repetition_penalty=rng.uniform(0.1, 2.0, rows).astype(np.float32),
        presence_penalty=rng.uniform(-2.0, 2.0, rows).astype(np.float32),
        frequency_penalty=rng.uniform(-2.0, 2.0, rows).astype(np.float32),
    )
    fields = dict(tokens=ints(budget), src=ints(budget), positions=ints(budget), slot_ids=ints(budget))
    history = dict(prompt_len=ints(rows), reset=rng.integers(0, 2, rows).astype(np.int32))
    got = unpacked(layout, layout.pack(**fields, batch=batch, sampling=sampling, **history))
    want = {
        **fields,
        **vars(batch),
        **vars(sampling),
        "prompt_len": history["prompt_len"],
        "reset": history["reset"] != 0,
    }
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    with pytest.raises(ValueError, match="tokens has shape"):
        layout.pack(**{**fields, "tokens": ints(budget + 1)}, batch=batch, sampling=sampling)
    with pytest.raises(ValueError, match="expected"):
        layout.unpack(jnp.zeros(layout.size + 1, jnp.int32))


def test_pack_waits_for_the_copy_that_last_read_its_buffer_and_no_other(engine):
    """A host->device copy may read its buffer after device_put returns, so packing into a buffer
    first waits for that buffer's previous copy, and only that one (the other buffer's copy feeds
    the step in flight, which the loop must not wait for)."""
    runner = engine.runner
    waits: list[int] = []

    class Copy:
        def __init__(self, index: int):
            self.index = index

        def block_until_ready(self):
            waits.append(self.index)

    saved = list(runner._sent)
    runner._sent[:] = [Copy(i) for i in range(len(saved))]
    try:
        empty = StepPlan(chunks=(), budget=engine.config.token_budgets[0], needs_commit=False)
        first = runner.packer.next_buffer
        indices = [runner.pack(empty, engine.pages).index for _ in range(3)]
    finally:
        runner._sent[:] = saved
    assert indices == [first, 1 - first, first] and waits == indices
