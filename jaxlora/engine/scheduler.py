"""Who runs next, and which tokens each step computes. Plain Python, no JAX.

Every step is one flat batch of at most `max(token_budgets)` tokens (vLLM V1's policy):
  1. decode tokens first: one for every decoding request, oldest first. A decode token that needs
     a KV page when none is free preempts the newest running request (its pages and row are freed,
     it goes back to waiting and is recomputed later; see `Request`);
  2. then prompt chunks of requests already prefilling, oldest first, as far as the budget and the
     free pages go (a long prompt is prefilled across several steps);
  3. then new admissions, in arrival order, while a row, the budget and pages for the first chunk
     are free.
The step is then padded to the smallest static budget that holds it (`StepPlan.budget`).

How many tokens a step may hold is chosen first, from the work at hand: the decode tokens plus the
prompt tokens the running prefills and the admissible waiting requests could take. All of it fits
the smallest budget that holds it, unless that would leave more than `MAX_PADDING` of the step
empty while decode rows are running: then the step fills the largest budget that the work fills
exactly, and the rest of the prompt tokens ride along with the next step, which those decode rows
make happen anyway. Padding is compute spent on nothing once steps are compute-bound (under load);
an idle engine (no decode row) still takes a prompt in one step, for its first token's latency.

Adapter slots are the other admission resource. Before the pager stages its copies,
`pin_adapters` pins the adapters of the waiting requests the free rows could take (`acquire`, which
queues a page-in for an adapter not on the device), unless that would exceed the cap on distinct
adapters per batch or the pager could not place it without waiting. A pinned request whose page-in
is pending is skipped, so hot requests behind it run. A request whose adapter the pager's coming
commit writes (`slot_at_commit`) is admitted, and the plan says the commit must precede the step. Once a request
has waited `max_wait_steps` steps it becomes a blocker: it pins regardless, and while it has no
slot, later requests may not pin other adapters, so slot pins and the adapter cap drain towards it
(no starvation). Requests already holding a pin, and base-model requests, still run.

This class alone changes a request's scheduling state (phase, row, slot, pages, computed and pending
counts); the engine reports sampled tokens and finishes through it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import typing
from typing import TYPE_CHECKING

from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.request import Phase, Request
from jaxlora.errors import JaxloraError

if TYPE_CHECKING:  # the scheduler stays importable without JAX
    from jaxlora.adapters.source import AdapterSource

BASE_SLOT = 0
# The most of a step left empty when the work could instead fill a smaller budget exactly and
# defer prompt tokens to the next step (see the module doc).
MAX_PADDING = 0.1


class Chunk(typing.NamedTuple):
    """Positions [start, start + length) of one request, computed in one step on batch row `row`.
    (A NamedTuple: the host makes one per running row every step, and a frozen dataclass costs
    several times more to build.)

    samples: the chunk ends the tokens the request knows, so the token sampled after its last
      position is the request's next output (a decode token, or the end of a prompt).
    from_device: a one-token chunk whose input is the request's previous output, still on the
      device (sampled by the step before, not read yet).
    """

    request: Request
    row: int
    start: int
    length: int
    samples: bool
    from_device: bool = False
    is_decode: bool = False


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step: chunks in the order the runner packs them, padded to `budget` tokens."""

    chunks: tuple[Chunk, ...]
    budget: int
    needs_commit: bool  # a chunk reads an adapter slot that the pager's coming commit writes

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.is_decode for c in self.chunks)


class Scheduler:
    """The policy in the module docstring, over `pages` and the adapter source `slots`.

    Args:
      max_adapters_per_batch: distinct adapters pinned at once (None: every slot of `slots` but
        the base slot).
      slots: where adapters get their device slots (`jaxlora.adapters.AdapterSource`; it uses the
        slot members); None serves the base model only.
    """

    def __init__(
        self,
        *,
        max_batch: int,
        token_budgets: tuple[int, ...],
        pages: PageTable,
        max_adapters_per_batch: int | None,
        max_wait_steps: int,
        slots: AdapterSource | None,
        reserve_pages: int = 0,
    ) -> None:
        self.max_batch = max_batch
        self.token_budgets = tuple(sorted(token_budgets))
        if self.token_budgets[-1] < max_batch:
            raise ValueError(
                f"the largest token budget {self.token_budgets[-1]} must hold a decode token for "
                f"each of the {max_batch} rows"
            )
        self.pages = pages
        if max_adapters_per_batch is None:
            max_adapters_per_batch = 0 if slots is None else slots.max_slots - 1
        self.max_adapters_per_batch = max_adapters_per_batch
        self.max_wait_steps = max_wait_steps
        self.slots = slots
        self.reserve_pages = reserve_pages  # kept free at admission, so running requests can grow
        self.waiting: list[Request] = []  # arrival order
        self.running: dict[int, Request] = {}  # row -> request
        self._free_rows = list(range(max_batch))  # a heap
        self._adapter_users: collections.Counter[str] = collections.Counter()  # pins per adapter
        self._enqueued: dict[str, int] = {}  # request_id -> step it joined the queue
        self.num_steps = 0
        self.num_preemptions = 0

    # Queries.
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def active_adapters(self) -> set[str]:
        """Adapters pinned by running or waiting requests (the batch's distinct adapters)."""
        return set(self._adapter_users)

    def upcoming_adapters(self, limit: int) -> list[str]:
        """Adapters of the first `limit` waiting requests that hold no pin yet, in arrival order
        (what the engine prefetches)."""
        return list(dict.fromkeys(r.adapter for r in self.waiting[:limit] if r.adapter is not None and not r.has_pin))

    # Mutations.
    def add(self, req: Request) -> None:
        req.phase = Phase.WAITING
        self._enqueue(req)

    def schedule(self) -> StepPlan | None:
        """Plans the next step (None: nothing to run). Call `pin_adapters` first, then stage the
        pager's copies, so that requests whose adapters those copies bring can be admitted."""
        self.num_steps += 1
        chunks: list[Chunk] = []
        decode = self._plan_decode(chunks)
        budget = self._step_size(decode, decode + self._prompt_demand()) - decode
        budget -= self._plan_prefill(chunks, budget)
        needs_commit = self._admit(chunks, budget)
        if not chunks:
            return None
        num_tokens = sum(c.length for c in chunks)
        padded = next(b for b in self.token_budgets if b >= num_tokens)
        return StepPlan(chunks=tuple(chunks), budget=padded, needs_commit=needs_commit)

    def dispatched(self, plan: StepPlan) -> None:
        """Records that the plan's step was dispatched: its positions are computed, and each sampling
        chunk has one more output in flight."""
        for c in plan.chunks:
            req = c.request
            req.num_computed = c.start + c.length
            if c.samples:
                req.num_pending += 1
                req.phase = Phase.DECODE

    def token_read(self, req: Request, token: int) -> None:
        """A sampled token of the request came back to the host."""
        req.num_pending -= 1
        req.output_ids.append(token)

    def finish(self, req: Request) -> None:
        """Takes a request out of the queues (finished, cancelled or failed), freeing row, pages and pin."""
        if req.phase is Phase.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.row is not None and self.running.get(req.row) is req:
            self._release_row(req)
        if req.has_pin:
            req.has_pin = False
            self._adapter_users[req.adapter] -= 1
            if not self._adapter_users[req.adapter]:
                del self._adapter_users[req.adapter]
            self.slots.release(req.adapter)
        self._enqueued.pop(req.request_id, None)
        req.phase = Phase.FINISHED

    # Planning.
    def _prompt_demand(self) -> int:
        """Prompt tokens this step could take if the budget were unbounded: the rest of every running
        prefill, plus the prompts of the waiting requests the free rows could admit now (pages are
        not counted: the planners stop at them anyway)."""
        demand = sum(r.num_known - r.num_computed for r in self.running.values() if r.phase is Phase.PREFILL)
        rows = len(self._free_rows)
        for req in self.waiting:
            if rows <= 0:
                break
            if req.num_pending or self._slot(req)[0] is None:
                continue
            demand += req.num_known
            rows -= 1
        return demand

    def _step_size(self, decode: int, work: int) -> int:
        """Tokens the step may hold, for `decode` decode tokens within `work` tokens (module doc)."""
        budgets = self.token_budgets
        if work >= budgets[-1]:
            return budgets[-1]
        fits = next(b for b in budgets if b >= work)
        # A smaller budget only if prompts still get a share of it: else a step whose decode tokens
        # just fill a budget would leave prompts no room, step after step (starving them).
        filled = [b for b in budgets if decode < b <= work and b - decode >= MAX_PADDING * b]
        if decode and filled and fits - work > MAX_PADDING * fits:
            return filled[-1]
        return fits

    def _plan_decode(self, chunks: list[Chunk]) -> int:
        """One token for each decoding request that still has tokens to produce, oldest first."""
        decoding = sorted(
            (r for r in self.running.values() if r.phase is Phase.DECODE and r.num_dispatched < r.sampling.max_tokens),
            key=lambda r: r.arrival,
        )
        used = 0
        for req in decoding:
            if req.phase is not Phase.DECODE:  # preempted by an older request in this loop
                continue
            position = req.next_position
            if position >= self.pages.capacity(req.row):  # its next position needs another page
                if not self._make_room(req, position + 1):
                    continue
                self.pages.grow(req.row, position + 1)
            chunks.append(
                Chunk(req, req.row, position, 1, samples=True, from_device=req.num_pending > 0, is_decode=True)
            )
            used += 1
        return used

    def _make_room(self, req: Request, num_positions: int) -> bool:
        """Preempts the newest running requests until `req` can hold num_positions; False if `req`
        itself was the newest and got preempted."""
        while not self.pages.can_grow(req.row, num_positions):
            victim = max(self.running.values(), key=lambda r: r.arrival)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _plan_prefill(self, chunks: list[Chunk], budget: int) -> int:
        """Next chunks of requests already prefilling, oldest first, within the budget and free pages."""
        used = 0
        for req in sorted((r for r in self.running.values() if r.phase is Phase.PREFILL), key=lambda r: r.arrival):
            if budget - used <= 0:
                break
            if req.phase is not Phase.PREFILL:  # preempted to make room for an older request
                continue
            length = self._chunk_length(req, budget - used, reserve=0)
            if not length and not chunks and req.phase is Phase.PREFILL:
                # Nothing else progresses this step: free pages from newer requests (or this one).
                if self._make_room(req, req.num_computed + min(req.num_known - req.num_computed, budget - used)):
                    length = self._chunk_length(req, budget - used, reserve=0)
            if length:
                self._add_chunk(chunks, req, length)
                used += length
        return used

    def _chunk_length(self, req: Request, budget: int, *, reserve: int) -> int:
        """Tokens of req's next prompt chunk that fit the budget and the free pages (whole pages)."""
        start = req.num_computed
        length = min(req.num_known - start, budget)
        if self.pages.can_grow(req.row, start + length, reserve=reserve):
            return length
        held = self.pages.capacity(req.row) if req.row is not None else 0
        room = (self.pages.num_free - reserve) * self.pages.page_size + held - start
        return max(0, min(length, room))

    def _add_chunk(self, chunks: list[Chunk], req: Request, length: int) -> None:
        self.pages.grow(req.row, req.num_computed + length)
        chunks.append(Chunk(req, req.row, req.num_computed, length, samples=req.num_computed + length == req.num_known))

    def _admit(self, chunks: list[Chunk], budget: int) -> bool:
        """Admits waiting requests in arrival order while a row, budget and pages are free, each on
        its adapter's slot if a step dispatched after the pager's next commit may read it; returns
        whether an admitted request reads a slot that only that commit writes."""
        used, needs_commit = 0, False
        for req in list(self.waiting):
            if not self._free_rows or budget - used <= 0:
                break
            if req.num_pending:  # preempted with an output still in flight: its tokens are not all known
                continue
            slot, staged = self._slot(req)
            if slot is None:
                continue
            first = min(req.num_known, budget - used)
            # A preempted request comes back only when all it knows fits: taking it back in small
            # chunks while pages are short would preempt it again (thrashing). The reserve applies
            # to the first chunk only: running requests grow into it, so a preempted one may know
            # more than the pool holds outside the reserve.
            fits = self.pages.can_grow(None, first, reserve=self.reserve_pages)
            if not fits or (req.num_preemptions and not self.pages.can_grow(None, req.num_known)):
                break  # first come, first served: no pages for this one, none for later ones
            self._assign_row(req, slot)
            self._add_chunk(chunks, req, first)
            used += first
            needs_commit |= staged
        return needs_commit

    def _slot(self, req: Request) -> tuple[int | None, bool]:
        """(slot, staged): the request's slot if a step dispatched after the pager's next commit may
        read it (staged: only after that commit); None while its adapter is not pinned or not there."""
        if req.adapter is None:
            return BASE_SLOT, False
        if not req.has_pin:
            return None, False
        slot = self.slots.is_ready(req.adapter)
        if slot is not None:
            return slot, False
        slot = self.slots.slot_at_commit(req.adapter)
        return slot, slot is not None

    def pin_adapters(self) -> list[tuple[Request, JaxloraError]]:
        """Pins the adapters of the waiting requests the free rows could take, in arrival order, so
        that their page-ins are queued before the pager stages its copies; returns the requests
        that failed (their adapter is gone), which are out of the queue."""
        failed: list[tuple[Request, JaxloraError]] = []
        blocker: Request | None = None
        rows = len(self._free_rows)
        for req in list(self.waiting):
            if rows <= 0:
                break
            if blocker is not None and req.adapter not in (None, blocker.adapter) and not req.has_pin:
                continue  # no new pins until the blocker has one; pinned requests drain
            is_starving = self.num_steps - self._enqueued[req.request_id] > self.max_wait_steps
            try:
                placed = self._pin(req, is_starving)
            except JaxloraError as e:
                self.finish(req)
                failed.append((req, e))
                continue
            if placed:
                rows -= 1
            elif blocker is None and is_starving:
                blocker = req  # it has no slot: pins drain towards it
        return failed

    def _pin(self, req: Request, is_starving: bool) -> bool:
        """Pins the request's adapter if it holds no pin yet (within the cap on distinct adapters and,
        unless starving, only if the pager can place it without waiting); returns whether the adapter
        has a slot (written, or its page-in queued)."""
        name = req.adapter
        if name is None:
            return True
        if self.slots is None:
            raise JaxloraError(f"adapter {name!r} requested but the engine has no adapter pager")
        if not req.has_pin:
            if name not in self._adapter_users:
                if len(self._adapter_users) >= self.max_adapters_per_batch:
                    return False
                if not is_starving and not self.slots.can_place(name):
                    return False
            self.slots.acquire(name)
            req.has_pin = True
            self._adapter_users[name] += 1
        return self.slots.slot_of(name) is not None

    # Rows and pages.
    def _assign_row(self, req: Request, slot: int) -> None:
        self.waiting.remove(req)
        self._enqueued.pop(req.request_id, None)
        req.row = heapq.heappop(self._free_rows)
        req.slot = slot
        req.phase = Phase.PREFILL
        req.num_computed = 0
        self.running[req.row] = req

    def _release_row(self, req: Request) -> None:
        self.pages.free(req.row)
        del self.running[req.row]
        heapq.heappush(self._free_rows, req.row)
        req.row = None

    def _preempt(self, req: Request) -> None:
        """Frees the request's row and pages and queues it again (recomputed when re-admitted). It
        keeps its adapter pin, so its slot stays resident."""
        self._release_row(req)
        req.phase = Phase.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        self._enqueued[req.request_id] = self.num_steps
        keys = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.arrival), req)
