#!/usr/bin/env bash
# One device call: S-LoRA's trace on the in-process engine, then through `jaxlora serve` (HTTP with
# the openai client, gRPC with serving.client), every part under one wall clock.
#   bash benchmarks/device_wheels.sh                       # here, once: builds .whl (carried)
#   bash benchmarks/serving/run_api.sh OUT_DIR TOTAL_S [SETTING ...]   # on the device; carry .whl
# SERVING_EXTRA: more benchmarks.serving.trace flags (a CPU check: SERVING_EXTRA="--tiny --duration 2").
# Writes OUT_DIR/serving.json (+ .md), log.txt and the servers' own logs (their start-up lines).
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-560}"; shift 2 || true; settings="${*:-s1 all}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
site="${SITE:-/tmp/site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  || exit 1
export PYTHONPATH=".:$site" PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"; log="$out/log.txt"; work=/tmp/serving_api
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee -a "$log"
budget=$(( $(left) - 25 ))
echo "== serving --api inprocess http grpc, settings $settings, budget ${budget} s" | tee -a "$log"
# shellcheck disable=SC2086
timeout $(( $(left) - 10 )) python3 -m benchmarks.serving.trace --api inprocess http grpc --settings $settings \
  --rates 10 40 --duration 10 --max-drain-s 15 --probe-steps 0 --budget-s "$budget" \
  --inprocess-budget-s $(( budget * 2 / 5 )) --setup-s 120 --work-dir "$work" --out "$out" ${SERVING_EXTRA:-} 2>&1 \
  | grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation" | tee -a "$log"
for f in "$work"/*/serve-*.log; do [ -f "$f" ] && cp "$f" "$out/$(basename "$(dirname "$f")")-$(basename "$f")"; done
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
