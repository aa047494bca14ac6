"""Where a command's start-up goes: wall seconds per phase, printed as one line once it is ready.

    jaxlora: start-up 14.2 s: import 2.1 s, load 3.0 s, register 1.2 s, compile 5.4 s, warm-up run 2.5 s
      (compilation cache: /home/me/.cache/jaxlora/jax)

The phases, in order: "import" (the interpreter's start to the command's first line of work: JAX and
the engine's modules), "load" (the base model read and placed; the adapters register
meanwhile, on the main thread), "register" (what registering outlasts the load by, and the engine
built: the pager's bank and its slot-write programs, the KV pool), "compile" (the
step program of every token budget, served from the persistent compilation cache when it holds
them), "warm-up run" (one call of each step program and, for a server, one real request).
`generate --prompt` has neither of the last two: it warms nothing up, and the few programs one
answer runs compile (or come from the cache) on first use, inside the answer's time.
`benchmarks/engine/startup_cpu.py` and `benchmarks/serving/trace.py` read the line back (`parse_line`).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

PHASES = ("import", "load", "register", "compile", "warm-up run")
_PREFIX = "start-up "
_PART = re.compile(r"([a-z][a-z -]*?) (\d+(?:\.\d+)?) s")


class StartupClock:
    """Wall seconds per start-up phase of one command.

    Args:
      started: `time.perf_counter()` at the process's first line (the command line's `main`); the
        first `lap` counts from there.
    """

    def __init__(self, started: float | None = None) -> None:
        self._last = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """Charges the time since the last lap to `phase`."""
        now = time.perf_counter()
        self.add(phase, now - self._last)
        self._last = now

    def lap_at(self, phase: str, when: float) -> None:
        """Charges the time from the last lap to `when` (a `time.perf_counter()` reading, now or
        earlier: the end of work that ran beside the caller's) to `phase`."""
        self.add(phase, max(0.0, when - self._last))
        self._last = max(self._last, when)

    def add(self, phase: str, seconds: float) -> None:
        """Charges `seconds` measured elsewhere to `phase` (they are inside a lap: call `lap` on a
        phase measured this way with `split` instead)."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {PHASES}")
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def split(self, parts: dict[str, float]) -> None:
        """Ends a lap whose time `parts` (phase -> seconds, measured inside it) already accounts for;
        time of the lap that `parts` leave out goes to the last phase named."""
        now = time.perf_counter()
        rest = now - self._last - sum(parts.values())
        for phase, seconds in parts.items():
            self.add(phase, seconds)
        if parts and rest > 0:
            self.add(list(parts)[-1], rest)
        self._last = now

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self, cache: Path | None) -> str:
        parts = ", ".join(f"{phase} {self.seconds[phase]:.1f} s" for phase in PHASES if phase in self.seconds)
        return f"{_PREFIX}{self.total:.1f} s: {parts} (compilation cache: {cache or 'off'})"

    def print(self, command: str, cache: Path | None) -> None:
        print(f"{command}: {self.line(cache)}", file=sys.stderr, flush=True)


def parse_line(text: str) -> dict[str, float] | None:
    """The phases of the last start-up line in `text` (a command's stderr), with "total"; None if
    there is none."""
    lines = [line for line in text.splitlines() if _PREFIX in line and "(compilation cache:" in line]
    if not lines:
        return None
    line = lines[-1].split(_PREFIX, 1)[1]
    total, _, rest = line.partition(": ")
    out = {phase: float(s) for phase, s in _PART.findall(rest.rsplit(" (compilation cache:", 1)[0])}
    out["total"] = float(total.removesuffix(" s"))
    return out
