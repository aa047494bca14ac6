#!/usr/bin/env bash
# Device calls for issues 8 and 6, each under a hard wall clock (one call may run 600 s at most).
#   bash benchmarks/run_h200.sh OUT_DIR TOTAL_S 1 [SKIP EARLIER_JSON]  # `jaxlora bench`, plan order
#   bash benchmarks/run_h200.sh OUT_DIR TOTAL_S 2                      # paging (S1), then the HF peer
# Every benchmark stops adding cases when its budget is spent and rewrites its results after every
# case, so a cut run keeps what it measured. The HF peer runs last, in its own process (torch).
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-580}"; part="${3:-1}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
log="$out/log_part$part.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"

if [ "$part" = 1 ]; then
  budget=$(( $(left) - 40 ))
  echo "== e2e, budget ${budget} s" | tee -a "$log"
  PYTHONPATH=. timeout $(( $(left) - 5 )) python3 -m benchmarks.engine.e2e --out "$out" --budget-s "$budget" \
    --no-plots ${4:+--skip-groups "$4" --merge-json "$5"} 2>&1 | grep -v "^WARNING\|Deprecation" | tee -a "$log"
  echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
  exit 0
fi

echo "== paging ($(left) s left)" | tee -a "$log"
PYTHONPATH=. timeout $(( $(left) - 150 )) python3 -m benchmarks.engine.paging --setting s1 --exponents 1 0.1 \
  --registered 2000 --requests 512 --budget-s $(( $(left) - 175 )) --out "$out" 2>&1 | tee -a "$log"

echo "== hf peer ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 5 )) python3 -m benchmarks.engine.hf_peer --out "$out/hf_peer.json" --gen-len 128 \
  --mixed-gen-len 4 2>&1 | grep -v Warning | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
