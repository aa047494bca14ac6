#!/usr/bin/env bash
# One device call: `jaxlora bench`'s first group in bf16, FP8 and int8 in one process (the quantized
# bases against the bf16 step of the same run), then the closed-loop rows of every LoRA backend.
#   bash benchmarks/run_e2e_formats_probe.sh OUT_DIR TOTAL_S FORMATS_S
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-580}"; formats_s="${3:-190}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out/quant" "$out/e2e"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }

echo "== e2e formats, budget ${formats_s} s ($(left) s left)" | tee -a "$log"
timeout $(( formats_s + 60 )) python3 -m benchmarks.engine.e2e --backend pallas --quantize bf16 fp8 int8 \
  --budget-s "$formats_s" --no-plots --out "$out/quant" 2>&1 | quiet | grep -v '^  {' | tee -a "$log"
budget=$(( $(left) - 50 ))
echo "== e2e backends, budget ${budget} s ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 5 )) python3 -m benchmarks.engine.e2e --backend pallas --backend xla --budget-s "$budget" \
  --no-plots --out "$out/e2e" 2>&1 | quiet | grep -v '^  {' | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
