"""Where a benchmark's results live: `benchmarks/results/<group>/<name>/` for
`benchmarks/<group>/<name>.py`, the latest files at the top and dated runs under `runs/<date>-<label>/`.
Standard library only: the runner and the reference-environment scripts import it without JAX."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"


def benchmark_name(module: str) -> str:
    """`benchmarks.serving.trace` or `serving.trace` -> `serving/trace` (the results sub-path)."""
    parts = module.removeprefix("benchmarks.").split(".")
    if len(parts) != 2 or not all(p.isidentifier() for p in parts):
        raise ValueError(f"{module=} is not a benchmark module: expected GROUP.NAME, e.g. serving.trace")
    return "/".join(parts)


def module_file(module: str) -> Path:
    """The source file of a benchmark module, e.g. `serving.trace` -> benchmarks/serving/trace.py."""
    return BENCHMARKS / f"{benchmark_name(module)}.py"


def results_dir(source_file: str | Path) -> Path:
    """The results folder of the benchmark whose source file this is (call with `__file__`)."""
    relative = Path(source_file).resolve().relative_to(BENCHMARKS).with_suffix("")
    return RESULTS / relative
