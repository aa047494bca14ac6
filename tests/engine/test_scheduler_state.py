"""The scheduler keeps per-phase lists and per-row decode positions for planning (so that a step's
plan costs numpy operations, not a pass over every row). Random workloads check that this kept
state never drifts from the requests, and that each step's decode tokens are exactly what the
requests alone say: every decoding request with a token left, oldest first, at its next position.
With prefix caching, prompts share prefixes: after every step the page allocator's invariants hold
(`PageTable.check`) and every keyed page a request holds carries that request's own key."""

from __future__ import annotations

import random

import pytest

from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.request import GenerationRequest, Phase, Request, SamplingParams
from jaxlora.engine.scheduler import Scheduler
from tests.engine.test_scheduler import FakeSlots


def _scheduler(rng: random.Random, slots: FakeSlots, prefix_caching: bool) -> Scheduler:
    pages = PageTable(rng.choice([6, 8, 12, 40]), rng.choice([2, 4]), max_pages_per_seq=64)
    rows = rng.choice([2, 3, 4, 8])
    return Scheduler(
        max_batch=rows,
        token_budgets=tuple(sorted({rows, 8, 16, 32})),
        pages=pages,
        max_adapters_per_batch=2,
        max_wait_steps=3,
        slots=slots,
        reserve_pages=rng.choice([0, 1]),
        prefix_caching=prefix_caching,
    )


def _expected_decode(s: Scheduler) -> list[tuple[str, int, int]]:
    """(request, row, position) of every decoding request with a token left, oldest first."""
    decoding = sorted((r for r in s.running.values() if r.phase is Phase.DECODE), key=lambda r: r.arrival)
    return [(r.request_id, r.row, r.next_position) for r in decoding if r.num_dispatched < r.sampling.max_tokens]


def _check_shared_pages(s: Scheduler) -> None:
    """Each keyed page on a running request's row is keyed with the request's own key for it: a
    page shared with another request holds the same tokens on the same weights."""
    for req in s.running.values():
        for i, page in enumerate(s.pages.pages_of(req.row)):
            key = s.pages.key_of(page)
            if key is not None:
                assert i < len(req.page_keys) and key == req.page_keys[i], (req, i)


def _prompt(rng: random.Random) -> list[int]:
    """1-11 tokens; most begin with part of one shared stem, so that prefixes repeat."""
    stem = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5][: rng.randrange(0, 11)] if rng.random() < 0.7 else []
    return (stem + [rng.randrange(100) for _ in range(rng.randrange(1, 12))])[: rng.randrange(1, 12)]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("seed", range(40))
def test_kept_state_follows_the_requests_through_preemption_and_cancels(seed, prefix_caching):
    rng = random.Random(seed)
    slots = FakeSlots(2, {"a", "b", "c"})
    s = _scheduler(rng, slots, prefix_caching)
    arrival, requests, in_flight = 0, [], None
    for _ in range(120):
        for _ in range(rng.choice([0, 0, 1, 2])):  # arrivals: short prompts, 1-9 tokens, some adapters
            sampling = SamplingParams(max_tokens=rng.choice([1, 1, 2, 3, 5, 9]))
            gen = GenerationRequest(
                request_id=f"r{arrival}",
                prompt_ids=[1],
                adapter=rng.choice([None, None, "a", "b", "c"]),
                sampling=sampling,
            )
            requests.append(Request(gen, _prompt(rng), seed=0, arrival=arrival))
            s.add(requests[-1])
            arrival += 1
        live = [r for r in requests if r.phase is not Phase.FINISHED]
        if live and rng.random() < 0.1:  # a cancel, at any phase
            s.finish(rng.choice(live))
        s.pin_adapters()
        preemptions = s.num_preemptions
        want = _expected_decode(s)
        plan = s.schedule()
        slots.land()
        if plan is not None:
            got = list(
                zip(
                    (r.request_id for r in plan.decode.requests),
                    plan.decode.rows.tolist(),
                    plan.decode.positions.tolist(),
                )
            )
            if s.num_preemptions == preemptions:  # making room may preempt: then fewer rows decode
                assert got == want
            s.dispatched(plan)
        if in_flight is not None:  # one step behind, as the engine reads its tokens
            for c in in_flight.chunks:
                if c.samples and c.request.phase is not Phase.FINISHED:
                    s.token_read(c.request, 5)
                    if rng.random() < 0.1 or c.request.num_output >= c.request.sampling.max_tokens:
                        s.finish(c.request)
        in_flight = plan
        s.pages.check()
        s.check()
        _check_shared_pages(s)
    assert s.num_steps == 120
    assert (s.num_prefix_queries > 0) is prefix_caching


def test_prefix_caching_hits_in_the_random_workloads():
    hits = 0
    for seed in range(10):
        rng = random.Random(seed)
        slots = FakeSlots(2, {"a", "b", "c"})
        s = _scheduler(rng, slots, True)
        for i in range(30):
            gen = GenerationRequest(request_id=f"r{i}", prompt_ids=[1], sampling=SamplingParams(max_tokens=16))
            s.add(Request(gen, _prompt(rng), seed=0, arrival=i))
            s.pin_adapters()
            plan = s.schedule()
            if plan is not None:
                s.dispatched(plan)
                for c in plan.chunks:
                    if c.samples:
                        s.token_read(c.request, 5)
                        if c.request.num_output >= c.request.sampling.max_tokens:
                            s.finish(c.request)
            s.pages.check()
        hits += s.num_prefix_hits
    assert hits > 0
