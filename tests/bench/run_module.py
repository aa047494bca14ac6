"""Runs a benchmark as `python -m benchmarks.NAME ...` on the CPU, from the repository root, as its
smoke tests do (a fresh process: the benchmark's own argument parsing and imports are under test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m benchmarks.<module> *args` with JAX on the CPU; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
