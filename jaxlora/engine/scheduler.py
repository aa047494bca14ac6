"""Who runs next, and which tokens each step computes. Plain Python and numpy, no JAX.

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

Adapter slots are the other admission resource, kept by `AdapterAdmission` (pins, the cap on
distinct adapters, the slot a step may read), which the scheduler asks for a request's slot. Before
the pager stages its copies, `pin_adapters` pins the adapters of the waiting requests the free rows
could take (`acquire`, which queues a page-in for an adapter not on the device), unless that would
exceed the cap on distinct adapters per batch or the pager could not place it without waiting. A pinned request whose page-in
is pending is skipped, so hot requests behind it run. A request whose adapter the pager's coming
commit writes (`slot_at_commit`) is admitted, and the plan says the commit must precede the step. Once a request
has waited `max_wait_steps` steps it becomes a blocker: it pins regardless, and while it has no
slot, later requests may not pin other adapters, so slot pins and the adapter cap drain towards it
(no starvation). Requests already holding a pin, and base-model requests, still run.

Prefix caching (`prefix_caching`): a request's full pages are keyed (`jaxlora.engine.prefix_hash`:
its weights' identity, then each page's token ids, chained) and registered in the page table when
a prompt chunk that fills them is dispatched, and when the request leaves its row (finished,
cancelled or preempted) for the pages its decode tokens filled. Admission looks the request's keys
up: the longest run of cached pages is attached to its row, it needs pages only for the rest, and
its first chunk starts after them. At least its last known token is always computed (it samples
the next one), so a prefix that ends inside a page is recomputed from that page's start. Keys are
made once per page, off the decode path: at admission, at prompt chunks and when a row is left.

This class alone changes a request's scheduling state (phase, row, slot, pages, computed and pending
counts); the engine reports sampled tokens and finishes through it.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import operator
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxlora.engine.adapter_admission import AdapterAdmission
from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.prefix_hash import extend_keys
from jaxlora.engine.request import Phase, Request
from jaxlora.errors import JaxloraError

if TYPE_CHECKING:  # the scheduler stays importable without JAX
    from jaxlora.adapters.source import AdapterSource

_ARRIVAL = operator.attrgetter("arrival")
# The most of a step left empty when the work could instead fill a smaller budget exactly and
# defer prompt tokens to the next step (see the module doc).
MAX_PADDING = 0.1


class Chunk(typing.NamedTuple):
    """Positions [start, start + length) of one request, computed in one step on batch row `row`.
    (A NamedTuple: cheaper to build than a frozen dataclass. A step's decode tokens are not chunks
    but arrays, `DecodeRows`; `StepPlan.chunks` builds chunks of them on demand.)

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


class DecodeRows(typing.NamedTuple):
    """A step's decode tokens, one per decoding row, oldest request first: token i is row `rows[i]`'s
    token at `positions[i]`, and it samples. Under load they are nearly every token of every step,
    so they travel as arrays (packed, counted and read back with numpy) rather than as a `Chunk`
    each, whose building and reading cost the host microseconds per row per step.

    from_device: the token's input is the request's previous output, still on the device.
    """

    requests: list[Request]
    rows: np.ndarray  # [D] int32
    positions: np.ndarray  # [D] int32
    from_device: np.ndarray  # [D] bool

    @classmethod
    def of(cls, requests: list[Request], rows: list[int], positions: list[int], from_device: list[bool]) -> DecodeRows:
        return cls(requests, np.array(rows, np.int32), np.array(positions, np.int32), np.array(from_device, np.bool_))


NO_DECODE = DecodeRows.of([], [], [], [])


class StepPlan:
    """One step: its decode tokens (`decode`), then its other chunks (`prompt_chunks`: prompt chunks
    from the scheduler; a tool may put any chunk there), in the order the runner packs them, padded
    to `budget` tokens. Read-only once built.

    needs_commit: a chunk reads an adapter slot that the pager's coming commit writes.
    """

    def __init__(
        self,
        *,
        chunks: Sequence[Chunk] = (),
        budget: int,
        needs_commit: bool,
        decode: DecodeRows = NO_DECODE,
    ) -> None:
        self.decode = decode
        self.prompt_chunks = tuple(chunks)
        self.budget = budget
        self.needs_commit = needs_commit

    @functools.cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk of the step in packing order, the decode tokens as chunks of one token (built
        on first use, for tests and tools: the engine's loop reads `decode` and `prompt_chunks`)."""
        d = self.decode
        decode = (
            Chunk(req, row, position, 1, samples=True, from_device=on_device, is_decode=True)
            for req, row, position, on_device in zip(
                d.requests, d.rows.tolist(), d.positions.tolist(), d.from_device.tolist()
            )
        )
        return (*decode, *self.prompt_chunks)

    @property
    def num_tokens(self) -> int:
        return len(self.decode.requests) + sum(c.length for c in self.prompt_chunks)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode.requests) + sum(c.is_decode for c in self.prompt_chunks)

    def __repr__(self) -> str:
        return (
            f"StepPlan(decode={len(self.decode.requests)} rows, prompt_chunks={self.prompt_chunks}, "
            f"budget={self.budget}, needs_commit={self.needs_commit})"
        )


class Scheduler:
    """The policy in the module docstring, over `pages` and the adapter source `slots`.

    Args:
      max_adapters_per_batch: distinct adapters pinned at once (None: every slot of `slots` but
        the base slot).
      slots: where adapters get their device slots (`jaxlora.adapters.AdapterSource`; its slot
        members are used through `AdapterAdmission`); None serves the base model only.
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
        prefix_caching: bool = False,
    ) -> None:
        self.max_batch = max_batch
        self.token_budgets = tuple(sorted(token_budgets))
        if self.token_budgets[-1] < max_batch:
            raise ValueError(
                f"the largest token budget {self.token_budgets[-1]} must hold a decode token for "
                f"each of the {max_batch} rows"
            )
        self.pages = pages
        self.adapters = AdapterAdmission(slots, max_adapters_per_batch)
        self.max_wait_steps = max_wait_steps
        self.reserve_pages = reserve_pages  # kept free at admission, so running requests can grow
        self.prefix_caching = prefix_caching
        self.num_prefix_queries = 0  # tokens admissions looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found cached
        self.waiting: list[Request] = []  # arrival order
        self.running: dict[int, Request] = {}  # row -> request
        # The running requests by phase, each list in arrival order (the order steps take them in),
        # kept as they change, so that planning a step neither filters nor sorts every row.
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        # Per row, while its request decodes (set when it starts decoding, `_start_decode`): the
        # position of its next decode token, which each dispatched decode token advances, and the
        # position past which it has no token to produce (num_prompt + max_tokens - 1). Decode
        # planning reads them for every decoding row at once.
        self._next_position = np.zeros(max_batch, np.int32)
        self._end_position = np.zeros(max_batch, np.int32)
        self._decoding_rows: np.ndarray | None = None  # rows of _decoding, in order (None: stale)
        self._free_rows = list(range(max_batch))  # a heap
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
        return self.adapters.active()

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
        decode = self._plan_decode()
        num_decode = len(decode.requests)
        budget = self._step_size(num_decode, num_decode + self._prompt_demand()) - num_decode
        chunks: list[Chunk] = []
        budget -= self._plan_prefill(chunks, budget, alone=not num_decode)
        needs_commit = self._admit(chunks, budget)
        if not num_decode and not chunks:
            return None
        num_tokens = num_decode + sum(c.length for c in chunks)
        padded = next(b for b in self.token_budgets if b >= num_tokens)
        return StepPlan(chunks=chunks, budget=padded, needs_commit=needs_commit, decode=decode)

    def dispatched(self, plan: StepPlan) -> None:
        """Records that the plan's step was dispatched: its positions are computed, and each sampling
        chunk has one more output in flight."""
        d = plan.decode
        for req, position in zip(d.requests, d.positions.tolist()):  # already decoding
            req.num_computed = position + 1
            req.num_pending += 1
        self._next_position[d.rows] += 1
        for c in plan.prompt_chunks:
            req = c.request
            req.num_computed = c.start + c.length
            if self.prefix_caching:
                self._register_pages(req)
            if c.samples:
                req.num_pending += 1
                self._start_decode(req)

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
        self.adapters.release(req)
        self._enqueued.pop(req.request_id, None)
        req.phase = Phase.FINISHED

    # Planning.
    def check(self) -> None:
        """Raises RuntimeError unless the state kept for planning (the phase lists, the per-row decode
        positions, the cached decode rows) agrees with the running requests themselves. For tests
        and debugging: planning reads only the kept state."""
        for phase, kept in ((Phase.PREFILL, self._prefilling), (Phase.DECODE, self._decoding)):
            want = sorted((r for r in self.running.values() if r.phase is phase), key=_ARRIVAL)
            if [r.request_id for r in kept] != [r.request_id for r in want]:
                raise RuntimeError(f"kept {phase.name} list {[r.request_id for r in kept]} != running {want}")
        for req in self._decoding:
            got = (int(self._next_position[req.row]), int(self._end_position[req.row]))
            want = (req.next_position, req.num_prompt + req.sampling.max_tokens - 1)
            if got != want:
                raise RuntimeError(f"row {req.row} ({req.request_id}): kept (next, end) {got} != {want}")
        rows = self._decoding_rows
        if rows is not None and rows.tolist() != [r.row for r in self._decoding]:
            raise RuntimeError(f"cached decode rows {rows.tolist()} are stale")

    def _prompt_demand(self) -> int:
        """Prompt tokens this step could take if the budget were unbounded: the rest of every running
        prefill, plus the prompts of the waiting requests the free rows could admit now (pages are
        not counted: the planners stop at them anyway)."""
        demand = sum(r.num_known - r.num_computed for r in self._prefilling)
        rows = len(self._free_rows)
        for req in self.waiting:
            if rows <= 0:
                break
            if req.num_pending or self.adapters.slot(req).slot is None:
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

    def _plan_decode(self) -> DecodeRows:
        """One token for each decoding request that still has tokens to produce, oldest first. Over
        arrays of the decoding rows: only rows whose next position needs another page loop."""
        if not self._decoding:
            return NO_DECODE
        order = list(self._decoding)  # a copy: making room preempts newer requests
        rows = self._rows_decoding()
        positions = self._next_position[rows]
        wanted = positions < self._end_position[rows]
        preemptions = self.num_preemptions
        short = wanted & (positions >= self.pages.held(rows) * self.pages.page_size)
        for i in np.flatnonzero(short).tolist():
            req, end = order[i], int(positions[i]) + 1
            if req.phase is Phase.DECODE and self._make_room(req, end):  # not preempted, in this loop or now
                self.pages.grow(req.row, end)
        if self.num_preemptions != preemptions:
            wanted &= np.fromiter((r.phase is Phase.DECODE for r in order), np.bool_, len(order))
        keep = np.flatnonzero(wanted)
        requests = order if len(keep) == len(order) else [order[i] for i in keep.tolist()]
        from_device = np.fromiter((r.num_pending > 0 for r in requests), np.bool_, len(requests))
        return DecodeRows(requests, rows[keep], positions[keep], from_device)

    def _rows_decoding(self) -> np.ndarray:
        if self._decoding_rows is None:
            self._decoding_rows = np.array([r.row for r in self._decoding], np.int32)
        return self._decoding_rows

    def _start_decode(self, req: Request) -> None:
        """The request's prompt is computed and its first output sampled: from now on it decodes."""
        if req.phase is Phase.PREFILL:
            self._prefilling.remove(req)
            bisect.insort(self._decoding, req, key=_ARRIVAL)
            self._decoding_rows = None
        req.phase = Phase.DECODE
        self._next_position[req.row] = req.next_position
        self._end_position[req.row] = req.num_prompt + req.sampling.max_tokens - 1

    def _make_room(self, req: Request, num_positions: int) -> bool:
        """Preempts the newest running requests until `req` can hold num_positions; False if `req`
        itself was the newest and got preempted."""
        while not self.pages.can_grow(req.row, num_positions):
            victim = max(self.running.values(), key=lambda r: r.arrival)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _plan_prefill(self, chunks: list[Chunk], budget: int, *, alone: bool) -> int:
        """Next chunks of requests already prefilling, oldest first, within the budget and free pages.
        alone: the step has no decode token."""
        used = 0
        for req in list(self._prefilling):  # a copy: making room preempts newer requests
            if budget - used <= 0:
                break
            if req.phase is not Phase.PREFILL:  # preempted to make room for an older request
                continue
            length = self._chunk_length(req, budget - used, reserve=0)
            if not length and alone and not chunks and req.phase is Phase.PREFILL:
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
            slot, staged = self.adapters.slot(req)
            if slot is None:
                continue
            cached = self._cached_pages(req)
            start = len(cached) * self.pages.page_size
            first = min(req.num_known - start, budget - used)
            # A preempted request comes back only when all it knows fits: taking it back in small
            # chunks while pages are short would preempt it again (thrashing). The reserve applies
            # to the first chunk only: running requests grow into it, so a preempted one may know
            # more than the pool holds outside the reserve.
            fits = self.pages.can_admit(cached, start + first, reserve=self.reserve_pages)
            if not fits or (req.num_preemptions and not self.pages.can_admit(cached, req.num_known)):
                break  # first come, first served: no pages for this one, none for later ones
            self._assign_row(req, slot)
            if self.prefix_caching:
                self.pages.attach(req.row, cached)
                req.num_computed = req.num_cached = start
                req.num_keyed = len(cached)
                self.num_prefix_queries += req.num_known
                self.num_prefix_hits += start
            self._add_chunk(chunks, req, first)
            used += first
            needs_commit |= staged
        return needs_commit

    def _cached_pages(self, req: Request) -> list[int]:
        """The cached pages of the request's longest cached prefix, leaving at least its last known
        token to compute (module doc); none without prefix caching, and none for a request with a
        penalty: its token history is built on the device from the tokens its steps feed
        (`jaxlora.engine.sampling.TokenHistory`), and a cached prefix is never fed."""
        if not self.prefix_caching or req.sampling.has_penalties:
            return []
        num = (req.num_known - 1) // self.pages.page_size
        self._extend_keys(req, num)
        return self.pages.lookup(req.page_keys[:num])

    def _extend_keys(self, req: Request, num_pages: int) -> None:
        """Makes the keys of the request's first num_pages pages (those not made yet)."""
        done, size = len(req.page_keys), self.pages.page_size
        if num_pages > done:
            root = req.page_keys[-1] if done else self.adapters.identity(req)
            extend_keys(req.page_keys, root, req.tokens(done * size, num_pages * size), size)

    def _register_pages(self, req: Request) -> None:
        """Keys the request's full pages on its row whose positions are computed (dispatched: the
        device writes them before any later step reads them) and whose tokens the host knows."""
        num = min(req.num_computed, req.num_known) // self.pages.page_size
        if num <= req.num_keyed:
            return
        self._extend_keys(req, num)
        self.pages.register(req.row, req.page_keys, req.num_keyed, num)
        req.num_keyed = num

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
                placed = self.adapters.pin(req, is_starving=is_starving)
            except JaxloraError as e:
                self.finish(req)
                failed.append((req, e))
                continue
            if placed:
                rows -= 1
            elif blocker is None and is_starving:
                blocker = req  # it has no slot: pins drain towards it
        return failed

    # Rows and pages.
    def _assign_row(self, req: Request, slot: int) -> None:
        self.waiting.remove(req)
        self._enqueued.pop(req.request_id, None)
        req.row = heapq.heappop(self._free_rows)
        req.slot = slot
        req.phase = Phase.PREFILL
        req.num_computed = req.num_cached = req.num_keyed = 0
        self.running[req.row] = req
        bisect.insort(self._prefilling, req, key=_ARRIVAL)

    def _release_row(self, req: Request) -> None:
        if req.phase is Phase.DECODE:
            self._decoding.remove(req)
            self._decoding_rows = None
        else:
            self._prefilling.remove(req)
        if self.prefix_caching:
            self._register_pages(req)
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
