"""Tokenize slots: bounded, and handed out round-robin by client, for threads and coroutines alike."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serving.tokenize_slots import TokenizeSlots
from tests.serving.support import wait_until


def _waiter(slots: TokenizeSlots, client: str, order: list[str], release: threading.Event) -> threading.Thread:
    def run() -> None:
        with slots.hold(client):
            order.append(client)
            release.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_burst_from_one_client_does_not_keep_another_waiting_behind_it():
    slots = TokenizeSlots(1)
    order: list[str] = []
    go = threading.Event()
    go.set()  # each holder releases at once
    with slots.hold("flood"):  # the slot is busy while the queue forms
        threads = []
        for i in range(5):
            threads.append(_waiter(slots, "flood", order, go))
            wait_until(lambda: slots.num_waiting == i + 1)
        threads.append(_waiter(slots, "probe", order, go))
        wait_until(lambda: slots.num_waiting == 6)
    for t in threads:
        t.join(10)
    assert order == ["flood", "probe", "flood", "flood", "flood", "flood"]
    assert slots.num_waiting == 0


def test_a_cancelled_wait_gives_up_its_place_and_never_leaks_a_slot():
    async def scenario() -> list[str]:
        slots = TokenizeSlots(1)
        order: list[str] = []

        async def use(client: str) -> None:
            async with slots.hold_async(client):
                order.append(client)
                await asyncio.sleep(0.01)

        async with slots.hold_async("holder"):
            abandoned = asyncio.ensure_future(use("gone"))
            later = asyncio.ensure_future(use("later"))
            await asyncio.sleep(0.05)
            assert slots.num_waiting == 2
            abandoned.cancel()
            await asyncio.sleep(0)
        await later
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        async with slots.hold_async("again"):  # the one slot is free again
            order.append("again")
        return order

    assert asyncio.run(scenario()) == ["later", "again"]


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="size=0"):
        TokenizeSlots(0)
