#!/usr/bin/env bash
# One device call part: the full-depth engine host loop (benchmarks.engine.host_loop, 7B shape) once per
# XLA_FLAGS setting, each under its own timeout; host ms a step and the token digest per setting.
#   bash benchmarks/run_host_flags_probe.sh OUT_DIR SECONDS_EACH CASES "FLAGS_1" "FLAGS_2" ...
# An empty FLAGS string is XLA's defaults; each run writes OUT_DIR/host_loop_<i>.json.
set -o pipefail
out="${1:?OUT_DIR}"; each="${2:?SECONDS_EACH}"; cases="${3:?CASES}"; shift 3
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"
log="$out/host_log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }
i=0
for flags in "$@"; do
  echo "== host_loop $i, XLA_FLAGS='$flags'" | tee -a "$log"
  XLA_FLAGS="$flags" timeout "$each" python3 -m benchmarks.engine.host_loop --cases $cases --steps 60 \
    --warmup-steps 20 --profile-steps 0 --probe-reps 0 --out "/tmp/hl_$i" 2>&1 | quiet | tail -8 | tee -a "$log"
  cp "/tmp/hl_$i/host_loop.json" "$out/host_loop_$i.json" 2>/dev/null
  i=$(( i + 1 ))
done
