"""Step benchmarks: the engine's jitted step alone (no scheduler), op by op and per kernel choice,
on one device or tensor parallel."""
