#!/usr/bin/env bash
# One device call: 8-bit GEMMs without a slice of the stacked weights (issue 20), then `jaxlora bench`'s
# closed-loop rows (issue 18: the 0-adapter rows now time the bank-free step) and its first group
# with fp8 / int8 bases on the current engine. Each part under its own timeout in a total wall clock.
#   bash benchmarks/run_e2e_quant_probe.sh OUT_DIR TOTAL_S
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-575}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
work=/tmp/e2e_quant_probe; mkdir -p "$work" "$out"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }
cublas=--xla_gpu_enable_triton_gemm=false

gemm() {  # gemm NAME CAP_S "XLA_FLAGS" quant_gemm args...
  local name="$1" cap="$2" flags="$3"; shift 3
  echo "== gemm $name (XLA_FLAGS='$flags', $(left) s left)" | tee -a "$log"
  XLA_FLAGS="$flags" timeout "$cap" python3 -m benchmarks.kernels.quant_gemm --layers 8 --out "$work/$name" "$@" 2>&1 | quiet | tee -a "$log"
  cp "$work/$name/quant_gemm.json" "$out/quant_gemm_$name.json" 2>/dev/null
}
gemm layers 80 "$cublas" --batch 16 64 256 --formats bf16-fused fp8-kmajor-layers int8-kmajor-layers
gemm dsfusion 45 "$cublas --xla_gpu_enable_dynamic_slice_fusion=true" --batch 64 --formats fp8-kmajor int8-kmajor

budget=$(( $(left) - 190 ))
echo "== e2e bf16, budget ${budget} s ($(left) s left)" | tee -a "$log"
timeout $(( budget + 40 )) python3 -m benchmarks.engine.e2e --backend pallas --backend xla --budget-s "$budget" \
  --no-plots --out "$out" 2>&1 | quiet | tee -a "$log"
budget=$(( $(left) - 45 ))
echo "== e2e fp8 / int8, budget ${budget} s ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 5 )) python3 -m benchmarks.engine.e2e --backend pallas --quantize fp8 int8 --budget-s "$budget" \
  --no-plots --out "$work/quant" 2>&1 | quiet | tee -a "$log"
cp "$work/quant/e2e.json" "$out/e2e_quant.json" 2>/dev/null
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
