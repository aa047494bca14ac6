"""The multi-turn chat trace of `python -m benchmarks.serving --trace chat`: what prefix caching is for.

`make_chat_trace` draws (numpy `default_rng(seed)`):
  - one system prompt per adapter, `system_len` random token ids, fixed for the whole run: every
    conversation on an adapter starts with its adapter's system prompt;
  - `int(rate * duration)` conversations with Poisson arrivals (exponential gaps, mean 1 / rate);
  - each conversation's adapter from a power law over the adapters' popularity ranks: adapter i with
    probability proportional to (i + 1) ** -zipf (Zipf, exponent 1 by default);
  - its number of turns, uniform in `turns`; per turn the new user tokens (random ids, a length
    uniform in `user_len`), the tokens to generate (uniform in `output_len`) and the think time
    before the turn is sent (exponential, mean `think_s`). Turns that would pass the engine's
    `max_seq_len` are left off (the trace records how many).

`drive_chat` runs it closed loop per conversation: turn 1 is sent at the conversation's arrival; turn
k + 1 is sent when turn k's answer is done, plus its think time, and its prompt is the whole history
resent, as chat APIs do: system prompt, then every earlier turn's user tokens and the answer the
engine gave, then the new user tokens. Nothing but the history's repetition is shared, so the
cache's gain is what repeated prefixes are worth.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxlora.engine.engine import Engine
from jaxlora.engine.request import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from jaxlora.errors import JaxloraError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatShape:
    """The trace's shape; the ranges are inclusive."""

    num_adapters: int
    system_len: int
    turns: tuple[int, int]
    user_len: tuple[int, int]
    output_len: tuple[int, int]
    think_s: float
    zipf: float = 1.0

    @property
    def max_positions(self) -> int:
        """The longest conversation: system prompt, then every turn at its longest."""
        return self.system_len + self.turns[1] * (self.user_len[1] + self.output_len[1])


CHAT = ChatShape(num_adapters=64, system_len=1000, turns=(4, 8), user_len=(50, 200), output_len=(50, 300), think_s=1.0)
TINY_CHAT = ChatShape(num_adapters=4, system_len=16, turns=(2, 3), user_len=(2, 6), output_len=(2, 8), think_s=0.05)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversation:
    arrival_s: float  # since the start of the run
    adapter: int  # index in [0, num_adapters)
    users: tuple[tuple[int, ...], ...]  # each turn's new user token ids
    output_lens: tuple[int, ...]  # tokens each turn generates
    think_s: tuple[float, ...]  # before each turn is sent (the first one's is not used)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTrace:
    systems: list[list[int]]  # per adapter
    conversations: list[Conversation]
    turns_left_off: int  # turns past max_seq_len


def make_chat_trace(
    shape: ChatShape, *, rate: float, duration_s: float, vocab: int, max_seq_len: int, seed: int = 42
) -> ChatTrace:
    """The trace of the module docstring."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"need rate and duration_s > 0; got {rate=} {duration_s=}")
    if shape.system_len + shape.user_len[0] + shape.output_len[0] > max_seq_len:
        raise ValueError(f"not even one turn of {shape} fits max_seq_len={max_seq_len}")
    rng = np.random.default_rng(seed)
    n = shape.num_adapters
    systems = [rng.integers(0, vocab, shape.system_len).tolist() for _ in range(n)]
    popularity = np.arange(1, n + 1, dtype=np.float64) ** -shape.zipf
    count = int(rate * duration_s)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
    adapters = rng.choice(n, size=count, p=popularity / popularity.sum())
    conversations, left_off = [], 0

    def uniform(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    for t, adapter in zip(arrivals.tolist(), adapters.tolist()):
        turns = uniform(shape.turns)
        users, outputs, thinks, length = [], [], [], shape.system_len
        for k in range(turns):
            user, output = uniform(shape.user_len), uniform(shape.output_len)
            if length + user + output > max_seq_len:
                left_off += turns - k
                break
            users.append(tuple(rng.integers(0, vocab, user).tolist()))
            outputs.append(output)
            thinks.append(float(rng.exponential(shape.think_s)))
            length += user + output
        conversations.append(
            Conversation(
                arrival_s=t, adapter=adapter, users=tuple(users), output_lens=tuple(outputs), think_s=tuple(thinks)
            )
        )
    return ChatTrace(systems=systems, conversations=conversations, turns_left_off=left_off)


@dataclasses.dataclass
class Turn:
    """What the callback saw of one turn (perf_counter seconds); `arrival` is when it was sent."""

    arrival: float
    prompt_len: int
    output_len: int
    request_id: str = ""
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finished: float | None = None
    reason: FinishReason | None = None
    rejected: str | None = None


@dataclasses.dataclass
class ChatRun:
    turns: list[Turn]
    token_times: list[float]
    lag_s: list[float]
    t_close: float
    conversations_done: int


class _Chat:
    """The closed loop's state, shared by the driver and the engine's callbacks (under `cond`)."""

    def __init__(self, trace: ChatTrace, t0: float) -> None:
        self.trace = trace
        self.cond = threading.Condition()
        self.ready = [(t0 + c.arrival_s, i, 0) for i, c in enumerate(trace.conversations)]  # (send at, conv, turn)
        heapq.heapify(self.ready)
        self.history = [list(trace.systems[c.adapter]) for c in trace.conversations]
        self.open = len(trace.conversations)
        self.turns: list[Turn] = []
        self.token_times: list[float] = []
        self.closed = False

    def callback(self, i: int, k: int, turn: Turn) -> Callable[[RequestOutput], None]:
        answer: list[int] = []

        def on_output(out: RequestOutput) -> None:
            now = time.perf_counter()
            with self.cond:
                if self.closed:
                    return
                if out.token_ids:
                    turn.first = now if turn.first is None else turn.first
                    turn.last = now
                    turn.tokens += len(out.token_ids)
                    answer.extend(out.token_ids)
                    self.token_times.extend([now] * len(out.token_ids))
                if out.finished:
                    turn.finished, turn.reason = now, out.finish_reason
                    self._next_turn(i, k, answer, now, out.finish_reason)

        return on_output

    def _next_turn(self, i: int, k: int, answer: list[int], now: float, reason: FinishReason | None) -> None:
        conv = self.trace.conversations[i]
        if reason is FinishReason.LENGTH and k + 1 < len(conv.users):
            self.history[i] += [*conv.users[k], *answer]
            heapq.heappush(self.ready, (now + conv.think_s[k + 1], i, k + 1))
        else:
            self.open -= 1
        self.cond.notify_all()

    def next_due(self, cap: float) -> tuple[float, int, int] | None:
        """Waits for the next turn due before `cap` and takes it; None when every conversation is
        done or the cap passed."""
        with self.cond:
            while self.open and time.perf_counter() < cap:
                now = time.perf_counter()
                if self.ready and self.ready[0][0] <= now:
                    return heapq.heappop(self.ready)
                until = min(self.ready[0][0] if self.ready else cap, cap)
                self.cond.wait(max(0.0, until - now))
            return None


def drive_chat(engine: Engine, trace: ChatTrace, *, max_drain_s: float, run_id: str) -> ChatRun:
    """Runs the trace on the running engine (module doc) until every conversation is done, or
    `max_drain_s` after the last conversation's arrival; then cancels what is in flight and waits
    until the engine is idle."""
    t0 = time.perf_counter() + 0.05
    chat = _Chat(trace, t0)
    last = trace.conversations[-1].arrival_s if trace.conversations else 0.0
    cap = t0 + last + max_drain_s
    lag: list[float] = []
    while (due := chat.next_due(cap)) is not None:
        sent, i, k = due
        conv = trace.conversations[i]
        with chat.cond:
            prompt = chat.history[i] + list(conv.users[k])
            turn = Turn(
                arrival=sent, prompt_len=len(prompt), output_len=conv.output_lens[k], request_id=f"{run_id}-{i}-{k}"
            )
            chat.turns.append(turn)
        request = GenerationRequest(
            request_id=turn.request_id,
            adapter=f"a{conv.adapter}",
            prompt_ids=prompt,
            sampling=SamplingParams(max_tokens=conv.output_lens[k], stop_token_ids=()),
        )
        lag.append(time.perf_counter() - sent)
        try:
            engine.submit(request, callback=chat.callback(i, k, turn))
        except JaxloraError as e:
            with chat.cond:
                turn.rejected = f"{type(e).__name__}: {e}"
                chat.open -= 1
    with chat.cond:
        chat.closed = True
        t_close = time.perf_counter()
        unfinished = [t.request_id for t in chat.turns if t.finished is None and t.rejected is None]
        done = len(trace.conversations) - chat.open
    for rid in unfinished:
        engine.cancel(rid)
    return ChatRun(turns=chat.turns, token_times=chat.token_times, lag_s=lag, t_close=t_close, conversations_done=done)


def conversation_fields(trace: ChatTrace, run: ChatRun, shape: ChatShape) -> dict:
    """The chat row's own fields (serving.py adds the per-turn latencies)."""
    sent: Sequence[Turn] = run.turns
    return {
        "conversations": len(trace.conversations),
        "conversations_done": run.conversations_done,
        "turns_planned": sum(len(c.users) for c in trace.conversations),
        "turns_left_off": trace.turns_left_off,
        "turns_sent": len(sent),
        "mean_turns": round(float(np.mean([len(c.users) for c in trace.conversations])), 2) if sent else None,
        "chat": dataclasses.asdict(shape),
    }
