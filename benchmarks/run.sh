#!/usr/bin/env bash
# The device runner (benchmarks/run.py): a benchmark module or a named recipe under one wall clock,
# from the repository root.   bash benchmarks/run.sh --list | [options] RECIPE | [options] GROUP.NAME [args...]
cd "$(dirname "$0")/.." && PYTHONPATH=. exec "${PYTHON:-python3}" -m benchmarks.run "$@"
