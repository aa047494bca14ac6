#!/usr/bin/env bash
# One device call: the shipped engine checked on the GPU (fused layout + cuBLAS + Pallas against the
# separate layout + XLA: same greedy tokens), then `jaxlora bench`'s closed-loop rows (issue 18).
#   bash benchmarks/run_e2e_probe.sh OUT_DIR TOTAL_S
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-560}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }

echo "== engine_gpu_check ($(left) s left)" | tee -a "$log"
timeout 150 python3 -m benchmarks.engine.gpu_check --out "$out" 2>&1 | quiet | tail -5 | tee -a "$log"
budget=$(( $(left) - 45 ))
echo "== e2e, budget ${budget} s ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 8 )) python3 -m benchmarks.engine.e2e --backend pallas --backend xla --budget-s "$budget" \
  --no-plots --out "$out" 2>&1 | quiet | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
