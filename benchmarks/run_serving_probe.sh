#!/usr/bin/env bash
# One device call: S-LoRA's trace on the shipped engine (fused layout, cuBLAS GEMMs), and the K-major
# W8A8 GEMMs for quantized bases (issue 20), each part under its own timeout inside a total wall clock.
#   bash benchmarks/run_serving_probe.sh OUT_DIR TOTAL_S
# Parts:
#   gemm     benchmarks.kernels.quant_gemm --layers 8: bf16-fused against fp8-kmajor / int8-kmajor (W8A8 on the
#            tensor cores, weights stored [out, in]), default flags and cuBLAS -> quant_gemm_kmajor*.json
#   serving  benchmarks.serving.trace --settings s1 --rates 40 10 4 (25 s of arrivals, 20 s drain cap)
#            -> serving.json, serving.log
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-570}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
work=/tmp/serving_probe; mkdir -p "$work" "$out"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee -a "$log"

for flags in "--xla_gpu_enable_triton_gemm=false" ""; do
  name=kmajor${flags:+_cublas}
  echo "== $name (XLA_FLAGS='$flags', $(left) s left)" | tee -a "$log"
  XLA_FLAGS="$flags" timeout 75 python3 -m benchmarks.kernels.quant_gemm --layers 8 --batch 16 64 256 \
    --formats bf16-fused fp8-kmajor int8-kmajor --out "$work/$name" 2>&1 | quiet | tee -a "$log"
  cp "$work/$name/quant_gemm.json" "$out/quant_gemm_$name.json" 2>/dev/null
done

budget=$(( $(left) - 15 ))
echo "== serving s1, budget ${budget} s ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 5 )) python3 -m benchmarks.serving.trace --settings s1 --rates 40 10 4 --duration 25 \
  --max-drain-s 20 --budget-s "$budget" --setup-s 150 --out "$out" 2>&1 | quiet | tee "$out/serving.log" | tail -40 | tee -a "$log"
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
