"""serving.handoff: the engine thread's updates reach every request's queue, in order, with one
wake-up of the event loop per burst; and several waiting updates join into one."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxlora.engine.request import FinishReason, RequestOutput, token_output
from serving.handoff import EngineStopped, LoopHandoff, coalesce, request_updates


def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up():
    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        handoff = LoopHandoff(loop)
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakes
            wakes += 1
            return real(*args)

        loop.call_soon_threadsafe = counting
        queues = [asyncio.Queue() for _ in range(3)]
        callbacks = [handoff.callback(q) for q in queues]

        def engine_step() -> None:  # one step's tokens for every request, then a second step
            for step in range(2):
                for i, cb in enumerate(callbacks):
                    cb(token_output(f"r{i}", "x", 10 * i + step, 1, step + 1))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        got = [[(await q.get()).token_ids[0] for _ in range(2)] for q in queues]
        return got, wakes

    got, wakes = asyncio.run(run())
    assert got == [[0, 1], [10, 11], [20, 21]]
    assert wakes == 1  # the loop did not run while the thread appended: one drain took all six


def test_coalesce_joins_text_and_ids_and_keeps_the_last_fields():
    outs = [token_output("r", "a", 5, 3, 1), token_output("r", "b", 6, 3, 2)]
    final = RequestOutput(
        request_id="r", text="c", token_ids=(7,), finished=True, finish_reason=FinishReason.LENGTH,
        prompt_tokens=3, completion_tokens=3,
    )  # fmt: skip
    joined = coalesce([*outs, final])
    assert joined == final._replace(text="abc", token_ids=(5, 6, 7))
    assert coalesce(outs[:1]) is outs[0]


def test_request_updates_joins_what_waits_and_ends_at_the_final_update():
    async def run() -> list[RequestOutput]:
        updates = asyncio.Queue()
        for i in range(3):
            updates.put_nowait(token_output("r", "ab"[i % 2], i, 2, i + 1))
        final = token_output("r", "", 9, 2, 4)._replace(finished=True, finish_reason=FinishReason.STOP)
        updates.put_nowait(final)
        return [out async for out in request_updates(updates, lambda: True)]

    (out,) = asyncio.run(run())  # all four were waiting: one update, the final one's fields
    assert out.finished and out.text == "aba" and out.token_ids == (0, 1, 2, 9)


def test_request_updates_raises_engine_stopped_when_nothing_is_waiting():
    async def run() -> None:
        async for _ in request_updates(asyncio.Queue(), lambda: False):
            pass

    with pytest.raises(EngineStopped):
        asyncio.run(run())
