#!/usr/bin/env bash
# Builds .whl/ (gitignored): the wheels a device call needs beyond the device image's JAX, NumPy and
# PyTorch stack, at the versions of the local environment, plus a wheel of this checkout (its entry
# points make `jaxlora serve` exist there). Run here, then carry `.whl` in the device call and start
# its command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=.:/tmp/site || exit
# (`.` first: the checkout's code wins over the wheel's copy, whose metadata alone is used.)
#   bash benchmarks/device_wheels.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-/work/main/.venv/bin/python}"
dists=(flax optax absl-py etils msgpack treescope rich markdown-it-py mdurl Pygments typing_extensions
  grpcio grpcio-health-checking grpcio-reflection protobuf prometheus_client gguf tqdm
  starlette uvicorn h11 click anyio sniffio idna
  openai httpx2 httpcore2 truststore jiter pydantic pydantic_core annotated-types typing-inspection)
pins=$("$py" - "${dists[@]}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{d}=={md.version(d)}" for d in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
"$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
du -sh .whl && ls .whl
