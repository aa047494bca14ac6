"""Scheduler without JAX: token budget, prompt chunks, KV pages and preemption, admission, adapter cap,
cold adapters, starvation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.request import GenerationRequest, Phase, Request, SamplingParams
from jaxlora.engine.scheduler import Scheduler, StepPlan
from jaxlora.errors import UnknownAdapterError


class FakeSlots:
    """Pager protocol over plain dicts: `num_slots` adapter slots, a page-in lands one `land()` later."""

    def __init__(self, num_slots: int, known: set[str]) -> None:
        self.num_slots = num_slots
        self.known = known
        self.assigned: dict[str, int] = {}
        self.ready: set[str] = set()
        self.pins: dict[str, int] = {}
        self.pending: list[str] = []  # pinned, waiting for a slot or for the write

    def acquire(self, name: str) -> int | None:
        if name not in self.known:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        self.pins[name] = self.pins.get(name, 0) + 1
        if name in self.ready:
            return self.assigned[name]
        if name not in self.pending:
            self.pending.append(name)
        return None

    def is_ready(self, name: str) -> int | None:
        return self.assigned[name] if name in self.ready else None

    def slot_at_commit(self, name: str) -> int | None:
        return self.is_ready(name)  # no staged copies in this fake: a page-in lands at land()

    def release(self, name: str) -> None:
        assert self.pins.get(name, 0) > 0, f"release of {name} without acquire"
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]
            if name in self.pending:
                self.pending.remove(name)

    def slot_of(self, name: str) -> int | None:
        return self.assigned.get(name)

    def identity(self, name: str) -> bytes:
        return name.encode()  # the fake's adapters never change weights

    def can_place(self, name: str) -> bool:
        return name in self.assigned or self._free_slot() is not None or self._victim() is not None

    def land(self) -> None:
        """commit(): every pending adapter that can get a slot gets one and becomes ready."""
        for name in list(self.pending):
            slot = self._free_slot()
            if slot is None:
                victim = self._victim()
                if victim is None:
                    return
                slot = self.assigned.pop(victim)
                self.ready.discard(victim)
            self.assigned[name] = slot
            self.ready.add(name)
            self.pending.remove(name)

    def _free_slot(self) -> int | None:
        used = set(self.assigned.values())
        return next((s for s in range(1, self.num_slots + 1) if s not in used), None)

    def _victim(self) -> str | None:
        return next((n for n in self.assigned if n not in self.pins and n not in self.pending), None)


_arrivals = iter(range(10**9))


def make_request(rid: str, *, adapter: str | None = None, prompt_len: int = 5, max_tokens: int = 4) -> Request:
    g = GenerationRequest(
        request_id=rid,
        prompt_ids=list(range(prompt_len)),
        adapter=adapter,
        sampling=SamplingParams(max_tokens=max_tokens),
    )
    return Request(g, list(range(prompt_len)), seed=0, arrival=next(_arrivals))


def make_scheduler(slots=None, *, num_pages: int = 64, page_size: int = 4, **kw) -> Scheduler:
    args = dict(max_batch=2, token_budgets=(4, 16), max_adapters_per_batch=3, max_wait_steps=3, slots=slots)
    args.update(kw)
    pages = PageTable(num_pages, page_size, max_pages_per_seq=16)
    return Scheduler(pages=pages, **args)


def run_step(s: Scheduler) -> tuple[StepPlan | None, list]:
    """pin, plan, dispatch; every sampled token is read back at once (token 7); a request that has
    all its tokens finishes."""
    failed = s.pin_adapters()
    plan = s.schedule()
    if plan is not None:
        s.dispatched(plan)
        for c in plan.chunks:
            if c.samples:
                s.token_read(c.request, 7)
                if c.request.num_output == c.request.sampling.max_tokens:
                    s.finish(c.request)
    s.pages.check()
    return plan, failed


def admitted(plan: StepPlan | None) -> list[str]:
    """Requests that started this step (their first chunk)."""
    return [] if plan is None else [c.request.request_id for c in plan.chunks if c.start == 0 and not c.is_decode]


def layout(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.length, c.is_decode) for c in plan.chunks]


def test_first_come_admission_and_row_reuse():
    s = make_scheduler()
    reqs = [make_request(f"r{i}", max_tokens=8) for i in range(4)]
    for r in reqs:
        s.add(r)
    plan, failed = run_step(s)
    assert admitted(plan) == ["r0", "r1"] and not failed
    assert sorted(r.row for r in reqs[:2]) == [0, 1] and all(r.slot == 0 for r in reqs[:2])
    plan, _ = run_step(s)  # no free row: only the two decode tokens
    assert admitted(plan) == [] and plan.num_decode_tokens == 2 and plan.budget == 4
    row = reqs[1].row
    s.finish(reqs[1])
    plan, _ = run_step(s)
    assert admitted(plan) == ["r2"] and reqs[2].row == row
    assert s.num_running == 2 and s.num_waiting == 1


def test_decode_tokens_first_then_prompt_chunks_within_the_budget():
    s = make_scheduler(max_batch=3, token_budgets=(4, 8, 16))
    long_, short = make_request("l", prompt_len=30, max_tokens=3), make_request("s", prompt_len=3, max_tokens=3)
    s.add(long_)
    s.add(short)
    plan, _ = run_step(s)  # the long prompt takes the whole budget: prefilled across steps
    assert layout(plan) == [("l", 0, 16, False)] and plan.budget == 16 and not plan.chunks[0].samples
    plan, _ = run_step(s)
    assert layout(plan) == [("l", 16, 14, False), ("s", 0, 2, False)] and plan.budget == 16
    plan, _ = run_step(s)  # decode of "l" first, then the rest of "s"'s prompt
    assert layout(plan) == [("l", 30, 1, True), ("s", 2, 1, False)] and plan.budget == 4
    assert plan.chunks[1].samples and long_.num_output == 2 and short.num_output == 1
    third = make_request("t", prompt_len=2, max_tokens=1)
    s.add(third)
    plan, _ = run_step(s)
    assert layout(plan) == [("l", 31, 1, True), ("s", 3, 1, True), ("t", 0, 2, False)] and plan.budget == 4
    assert long_.is_finished and third.is_finished and s.pages.num_free < s.pages.num_pages


def test_under_load_a_step_fills_a_smaller_budget_rather_than_pad_a_larger_one():
    s = make_scheduler(max_batch=3, token_budgets=(4, 8, 16))
    a = make_request("a", prompt_len=3, max_tokens=10)
    s.add(a)
    run_step(s)
    b = make_request("b", prompt_len=8, max_tokens=2)
    s.add(b)
    # 1 decode token + 8 prompt tokens: 16 would be 7/16 padding, so 8 is filled exactly and the
    # prompt's last token rides along with the next decode step.
    plan, _ = run_step(s)
    assert layout(plan) == [("a", 3, 1, True), ("b", 0, 7, False)] and plan.budget == 8
    plan, _ = run_step(s)
    assert layout(plan) == [("a", 4, 1, True), ("b", 7, 1, False)] and plan.budget == 4
    assert plan.chunks[1].samples


def test_an_idle_engine_takes_a_whole_prompt_in_one_step():
    s = make_scheduler(max_batch=3, token_budgets=(4, 8, 16))
    s.add(make_request("p", prompt_len=9, max_tokens=2))
    plan, _ = run_step(s)
    assert layout(plan) == [("p", 0, 9, False)] and plan.budget == 16  # no decode row: latency first


def test_close_fits_are_padded_not_split():
    s = make_scheduler(max_batch=3, token_budgets=(4, 8, 32))
    s.add(make_request("a", prompt_len=3, max_tokens=10))
    run_step(s)
    s.add(make_request("b", prompt_len=30, max_tokens=2))
    plan, _ = run_step(s)  # 31 tokens in 32: within MAX_PADDING, one step
    assert layout(plan)[1] == ("b", 0, 30, False) and plan.budget == 32


def test_decode_tokens_that_fill_a_budget_do_not_starve_prompts():
    # 128 decode tokens plus a 50-token prompt: shrinking the step to 128 would leave the prompt no
    # room, step after step; it is padded to 256 instead and the prompt runs at once.
    s = make_scheduler(max_batch=256, num_pages=4096, token_budgets=(128, 256, 512))
    for i in range(128):
        s.add(make_request(f"d{i}", prompt_len=3, max_tokens=300))
    run_step(s)
    s.add(make_request("p", prompt_len=50, max_tokens=2))
    plan, _ = run_step(s)
    assert plan.num_decode_tokens == 128 and admitted(plan) == ["p"] and plan.budget == 256
    assert layout(plan)[-1] == ("p", 0, 50, False)


def test_a_preempted_request_knowing_more_than_the_pool_outside_the_reserve_comes_back():
    # 4 pages of 16, one kept in reserve at admission: "b" grows into the reserve, is preempted
    # knowing 49 tokens (4 pages), and must still come back once "a" is done.
    s = make_scheduler(max_batch=2, num_pages=4, page_size=16, token_budgets=(16,), reserve_pages=1)
    a, b = make_request("a", prompt_len=2, max_tokens=14), make_request("b", prompt_len=40, max_tokens=20)
    s.add(a)
    s.add(b)
    for _ in range(200):
        if run_step(s)[0] is None and s.is_idle:
            break
    assert a.is_finished and b.is_finished and b.num_preemptions >= 1 and s.pages.num_free == 4


def test_positions_and_pages_follow_lengths_not_max_seq_len():
    s = make_scheduler(max_batch=2, num_pages=8, page_size=4)
    r = make_request("r", prompt_len=5, max_tokens=6)
    s.add(r)
    run_step(s)
    assert len(s.pages.pages_of(r.row)) == 2  # 5 positions: two pages of four
    for _ in range(3):
        run_step(s)  # positions 5..7 fit the second page
    assert len(s.pages.pages_of(r.row)) == 2
    run_step(s)  # position 8 needs a third page
    assert len(s.pages.pages_of(r.row)) == 3


def test_out_of_pages_preempts_the_newest_and_recomputes_it_later():
    # 6 pages of 4 positions: two requests of 9 prompt tokens take 3 pages each; the first decode
    # token past position 11 needs a page, so the newest request is preempted.
    s = make_scheduler(max_batch=2, num_pages=6, page_size=4, token_budgets=(4, 32))
    old, new = make_request("old", prompt_len=9, max_tokens=8), make_request("new", prompt_len=9, max_tokens=8)
    s.add(old)
    s.add(new)
    plan, _ = run_step(s)
    assert admitted(plan) == ["old", "new"] and s.pages.num_free == 0
    for _ in range(3):
        plan, _ = run_step(s)  # positions 9, 10, 11
        assert plan.num_decode_tokens == 2
    plan, _ = run_step(s)  # position 12 of "old" needs a page: "new" is preempted
    assert layout(plan) == [("old", 12, 1, True)] and s.num_preemptions == 1
    assert new.phase is Phase.WAITING and new.row is None and new.num_output == 4 and new.num_preemptions == 1
    assert s.waiting == [new]
    while not old.is_finished:
        run_step(s)
    plan, _ = run_step(s)  # re-admitted: its prompt and its 4 outputs are recomputed in one chunk
    assert layout(plan) == [("new", 0, 13, False)] and plan.chunks[0].samples
    while not new.is_finished:
        run_step(s)
    assert new.num_output == 8 and s.pages.num_free == 6 and s.is_idle


def test_the_oldest_request_progresses_when_pages_run_out_in_prefill():
    s = make_scheduler(max_batch=2, num_pages=4, page_size=4, token_budgets=(8,))
    a, b = make_request("a", prompt_len=12, max_tokens=2), make_request("b", prompt_len=12, max_tokens=2)
    s.add(a)
    s.add(b)
    for _ in range(20):
        run_step(s)
        if a.is_finished and b.is_finished:
            break
    assert a.is_finished and b.is_finished and s.pages.num_free == 4


def test_cold_adapter_does_not_block_hot_ones_and_lands_next_step():
    slots = FakeSlots(2, {"hot", "cold"})
    slots.acquire("hot"), slots.land(), slots.release("hot")  # "hot" is resident
    s = make_scheduler(slots, max_batch=3)
    cold, hot1, hot2 = (
        make_request("c", adapter="cold"),
        make_request("h1", adapter="hot"),
        make_request("h2", adapter="hot"),
    )
    for r in (cold, hot1, hot2):
        s.add(r)
    plan, _ = run_step(s)
    assert admitted(plan) == ["h1", "h2"]  # the cold one waits for its page-in, the hot ones run
    assert cold.phase is Phase.WAITING and cold.has_pin and slots.pins == {"cold": 1, "hot": 2}
    slots.land()
    plan, _ = run_step(s)
    assert admitted(plan) == ["c"] and cold.slot == slots.assigned["cold"]
    for r in (cold, hot1, hot2):
        s.finish(r)
    assert slots.pins == {}  # exactly one release per acquire


def test_cap_on_distinct_adapters_per_batch():
    slots = FakeSlots(4, {"a", "b", "c"})
    s = make_scheduler(slots, max_batch=4, max_adapters_per_batch=2)
    reqs = [
        make_request("1", adapter="a", max_tokens=20),
        make_request("2", adapter="b", max_tokens=20),
        make_request("3", adapter="c"),
        make_request("4", adapter="a", max_tokens=20),
    ]
    for r in reqs:
        s.add(r)
    run_step(s)
    slots.land()
    plan, _ = run_step(s)
    assert admitted(plan) == ["1", "2", "4"] and s.active_adapters() == {"a", "b"}
    assert not reqs[2].has_pin  # over the cap: not even pinned
    s.finish(reqs[1])
    run_step(s)
    slots.land()
    plan, _ = run_step(s)
    assert admitted(plan) == ["3"]


def test_starving_cold_request_blocks_newcomers_until_admitted():
    # One adapter slot, held by a stream of "hot" requests; the "cold" request must still run.
    slots = FakeSlots(1, {"hot", "cold"})
    s = make_scheduler(slots, max_batch=2, max_wait_steps=3)
    s.add(make_request("h0", adapter="hot", max_tokens=3))
    cold = make_request("cold", adapter="cold")
    s.add(cold)
    for step in range(40):
        s.add(make_request(f"h{step + 1}", adapter="hot", max_tokens=3))  # a new hot request every step
        plan, _ = run_step(s)
        slots.land()
        if "cold" in admitted(plan):
            break
    else:
        pytest.fail("the cold request starved")
    assert step <= 3 + 4  # max_wait_steps, then the hot rows drain


def test_blocker_lets_pinned_requests_drain():
    # The cap (2) is held by requests that pinned while the only row was busy; an older request for
    # a third adapter starves. Blocking everyone behind it would deadlock: pinned ones must run.
    slots = FakeSlots(3, {"a", "b", "c"})
    s = make_scheduler(slots, max_batch=1, max_adapters_per_batch=2, max_wait_steps=1)
    busy = make_request("busy", max_tokens=1)
    s.add(busy)
    run_step(s)  # takes the only row and finishes
    old, pa, pb = make_request("old", adapter="c"), make_request("pa", adapter="a"), make_request("pb", adapter="b")
    for r in (old, pa, pb):
        s.add(r)
    for r in (pa, pb):  # as if considered earlier: pinned, page-in queued, no row yet
        assert s.adapters.pin(r, is_starving=False) is False
    slots.land()
    done = []
    for _ in range(24):
        plan, _ = run_step(s)
        slots.land()
        done += admitted(plan)
    assert sorted(done) == ["old", "pa", "pb"] and slots.pins == {}


def test_unknown_adapter_fails_alone():
    slots = FakeSlots(2, {"a"})
    s = make_scheduler(slots)
    bad, good = make_request("bad", adapter="gone"), make_request("good")
    s.add(bad)
    s.add(good)
    plan, failed = run_step(s)
    assert admitted(plan) == ["good"]
    assert [(r.request_id, type(e)) for r, e in failed] == [("bad", UnknownAdapterError)]
    assert bad.phase is Phase.FINISHED and s.num_waiting == 0


def test_cancel_while_waiting_releases_the_pin():
    slots = FakeSlots(1, {"a"})
    s = make_scheduler(slots)
    r = make_request("r", adapter="a")
    s.add(r)
    run_step(s)
    assert slots.pins == {"a": 1}
    s.finish(r)
    assert slots.pins == {} and s.is_idle
    s.finish(r)  # idempotent
    assert slots.pins == {}


def test_scheduler_imports_without_jax():
    code = (
        "import sys, jaxlora.engine.scheduler, jaxlora.engine.request, jaxlora.engine.kv_pages; "
        "assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
