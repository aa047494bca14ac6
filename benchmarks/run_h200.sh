#!/usr/bin/env bash
# Device calls for issues 8 and 6, each under a hard wall clock (one call may run 600 s at most).
#   bash benchmarks/run_h200.sh OUT_DIR TOTAL_S 1                   # e2e plan head, paging, HF peer
#   bash benchmarks/run_h200.sh OUT_DIR TOTAL_S 2 SKIP PART1_JSON   # the rest of the e2e plan
# Part 1 runs the engine benchmark first (its top groups carry the targets), then the paging
# benchmark, then the Hugging Face peer in its own process; each part gets a share of the budget
# and stops adding cases when it is spent (results are rewritten after every case).
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-580}"; part="${3:-1}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
log="$out/log_part$part.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"

if [ "$part" = 2 ]; then
  budget=$(( $(left) - 25 ))
  echo "== e2e part 2 from group $4, budget ${budget} s" | tee -a "$log"
  PYTHONPATH=. timeout $(( $(left) - 5 )) python3 -m jaxlora.cli.main bench --out "$out" --budget-s "$budget" \
    --skip-groups "$4" --merge-json "$5" --no-plots 2>&1 | grep -v "^WARNING\|Deprecation" | tee -a "$log"
  echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
  exit 0
fi

budget=$(( $(left) - 300 ))
echo "== e2e part 1, budget ${budget} s" | tee -a "$log"
PYTHONPATH=. timeout $(( budget + 40 )) python3 -m jaxlora.cli.main bench --out "$out" --budget-s "$budget" \
  --no-plots 2>&1 | grep -v "^WARNING\|Deprecation" | tee -a "$log"

echo "== paging ($(left) s left)" | tee -a "$log"
PYTHONPATH=. timeout $(( $(left) - 150 )) python3 benchmarks/paging.py --setting s1 --exponents 1 0.1 \
  --registered 2000 --requests 512 --budget-s $(( $(left) - 175 )) --out "$out" 2>&1 | tee -a "$log"

echo "== hf peer ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 5 )) python3 benchmarks/hf_peer.py --out "$out/hf_peer.json" --gen-len 128 \
  --mixed-gen-len 4 2>&1 | grep -v Warning | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
