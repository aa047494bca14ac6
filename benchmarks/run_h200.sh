#!/usr/bin/env bash
# One device call for issue 8 (and the pager's S1 setting, issue 6), under a hard wall clock.
#   bash benchmarks/run_h200.sh OUT_DIR [TOTAL_S]
# Fixed-cost parts first, each under `timeout`; the engine benchmark last, with whatever is left as
# its budget (it stops adding groups when that is spent and rewrites e2e.json after every cell).
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-430}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
log="$out/log.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"

echo "== hf peer ($(left) s left)" | tee -a "$log"
timeout 110 python3 benchmarks/hf_peer.py --out "$out/hf_peer.json" --gen-len 128 --mixed-gen-len 8 2>&1 \
  | grep -v Warning | tee -a "$log"

echo "== paging s1 ($(left) s left)" | tee -a "$log"
timeout 90 python3 benchmarks/paging.py --setting s1 --exponents 1 0.1 --registered 256 --requests 512 \
  --out "$out" 2>&1 | tee -a "$log"

budget=$(( $(left) - 55 ))
echo "== e2e, budget ${budget} s" | tee -a "$log"
PYTHONPATH=. timeout $(( $(left) - 3 )) python3 -m jaxlora.cli.main bench --out "$out" --budget-s "$budget" \
  --hf-peer "$out/hf_peer.json" --no-plots 2>&1 | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
