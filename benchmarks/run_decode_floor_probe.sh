#!/usr/bin/env bash
# One device call: the 8-bit GEMMs in the serving layout (kernel against XLA's dequantize-then-GEMM
# and bf16 cuBLAS, 16-256 rows), the engine's host loop at full depth with a profile of the device's
# idle gap between steps, and the LoRA kernel benchmark (kernels.json).
#   bash benchmarks/run_decode_floor_probe.sh OUT_DIR TOTAL_S
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-560}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out/q" "$out/h" "$out/k"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }

echo "== quant_gemm ($(left) s left)" | tee -a "$log"
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 130 python3 -m benchmarks.kernels.quant_gemm --layers 8 \
  --batch 16 64 128 256 --formats bf16-fused int8-fused int8-fused-pallas fp8-fused-pallas \
  --time-budget 110 --out "$out/q" 2>&1 | quiet | grep "^best\|Error\|error" | tee -a "$log"

echo "== host_loop ($(left) s left)" | tee -a "$log"
timeout 170 python3 -m benchmarks.engine.host_loop --cases 64:64 256:256 --steps 60 --warmup-steps 20 \
  --profile-steps 12 --probe-reps 5 --out "$out/h" 2>&1 | quiet | tail -12 | tee -a "$log"

budget=$(( $(left) - 40 ))
echo "== kernels, budget ${budget} s ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 10 )) python3 benchmarks/kernels/lora.py all --out "$out/k" --budget-s "$budget" --layers 8 \
  2>&1 | quiet | tail -30 | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
