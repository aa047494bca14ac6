"""The start-up line the commands print (jaxlora.cli.startup), and its parser the benchmarks use."""

from pathlib import Path

import pytest

from jaxlora.cli.startup import PHASES, StartupClock, parse_line


def test_line_round_trips_through_the_parser():
    clock = StartupClock()
    for phase, seconds in zip(PHASES, (2.25, 3.5, 1.0, 4.75, 0.5)):
        clock.add(phase, seconds)
    line = clock.line(Path("/cache"))
    parsed = parse_line(f"noise\njaxlora serve: {line}\nmore noise")
    assert parsed == {"import": 2.2, "load": 3.5, "register": 1.0, "compile": 4.8, "warm-up run": 0.5, "total": 12.0}
    assert line.endswith("(compilation cache: /cache)") and "(compilation cache: off)" in clock.line(None)
    assert parse_line("no start-up line here") is None


def test_split_charges_what_the_parts_leave_out_to_the_last_part():
    clock = StartupClock(started=0.0)  # perf_counter is far past 0: the lap is long
    clock.split({"compile": 1.0, "warm-up run": 2.0})
    assert clock.seconds["compile"] == 1.0 and clock.seconds["warm-up run"] > 2.0
    with pytest.raises(ValueError, match="unknown start-up phase"):
        clock.add("coffee", 1.0)


def test_lap_at_charges_up_to_an_earlier_reading_and_the_rest_to_the_next_lap():
    clock = StartupClock(started=10.0)
    clock.lap_at("load", 14.0)  # work that ended at 14.0, beside the caller's
    assert clock.seconds == {"load": 4.0}
    clock.lap_at("register", 12.0)  # earlier than the last lap: nothing charged, the clock never runs back
    assert clock.seconds == {"load": 4.0, "register": 0.0}
    clock.lap("register")  # from 14.0 to now
    assert clock.seconds["register"] > 0.0
