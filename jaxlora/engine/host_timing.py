"""Where the engine loop's host time goes, phase by phase (cumulative, for `Engine.stats()`).

One `Engine.step` on the host is, in order (the numbers of the engine's module doc):
  schedule  take submissions and cancellations, pin adapters, stage page-ins, plan the step (1-3);
  inputs    build the step's inputs on the host (`Runner.pack`);
  dispatch  copy them to the device and call the jitted step (and the sampler), with the pager's
            slot writes (4);
  stream    hand the previous step's sampled ids to their requests: detokenize, stop checks,
            callbacks (5, without the wait);
  wait      block until the previous step's ids are on the host (5).
Host time is every phase but `wait`: what the host spends per step whatever the device does. The
loop keeps the device busy while host time per step stays under the device's step time; a dispatch
that blocks on the device shows up as dispatch time, not as wait.
"""

from __future__ import annotations

import time

PHASES = ("schedule", "inputs", "dispatch", "stream", "wait")
HOST_PHASES = PHASES[:-1]


class HostTimes:
    """Cumulative seconds per phase (PHASES), and how many engine steps they cover. The engine loop
    alone writes it; `as_dict` from another thread (stats of a serving engine) may mix two steps.

        times.start()            # at the top of Engine.step
        ...; times.lap("schedule")  # charges the time since the previous lap (or start) to a phase
    """

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = 0  # Engine.step calls timed
        self.steps = 0  # of those, the calls that dispatched a step
        self._last = 0.0

    def start(self) -> None:
        self.calls += 1
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def as_dict(self) -> dict[str, float | int]:
        """{"calls", "steps", "<phase>_ms" for each phase, "host_ms" (all but wait)}: cumulative."""
        out: dict[str, float | int] = {"calls": self.calls, "steps": self.steps}
        out.update({f"{p}_ms": round(self.seconds[p] * 1e3, 3) for p in PHASES})
        out["host_ms"] = round(sum(self.seconds[p] for p in HOST_PHASES) * 1e3, 3)
        return out


def per_step(before: dict, after: dict) -> dict[str, float | None]:
    """Milliseconds per dispatched step of each phase between two `as_dict()` snapshots (None when no
    step was dispatched in between)."""
    steps = after["steps"] - before["steps"]
    keys = [f"{p}_ms" for p in PHASES] + ["host_ms"]
    return {k: (round((after[k] - before[k]) / steps, 4) if steps else None) for k in keys}
