#!/usr/bin/env bash
# One device call: the step before and after the serving layout (q|k|v, gate|up fused) and cuBLAS
# GEMMs, in one process (issue 18), and the H200's native FP8 GEMM (issue 20).
#   bash benchmarks/run_layout_probe.sh OUT_DIR TOTAL_S
# Parts:
#   steps   benchmarks.step.profile --layers 8: no adapters and 64 rank-16 all-module adapters
#           (pallas; xla on the shipped variant), decode 64 / 256 rows and a 512-token prefill,
#           variants separate/xla (before), fused/xla, fused/cublas (shipped) -> step_profile.json
#   fp8     benchmarks.kernels.quant_gemm --layers 8: bf16 vs fp8-native (W8A8 on FP8 tensor cores) and the
#           int8 Pallas kernel, default flags and cuBLAS -> quant_gemm_fp8.json
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-540}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
work=/tmp/layout_probe; mkdir -p "$work" "$out"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }

cap=$(( $(left) - 150 )); [ "$cap" -gt 330 ] && cap=330
echo "== steps (cap ${cap} s, $(left) s left)" | tee -a "$log"
timeout "$cap" python3 -m benchmarks.step.profile --layers 8 --settings none all --backends pallas \
  --mixes d64 d256 p512 --variants separate/xla fused/xla fused/cublas --reps 20 --out "$work/steps" 2>&1 | quiet | tee -a "$log"
cp "$work/steps/step_profile.json" "$out/step_profile.json" 2>/dev/null
cap=$(( $(left) - 120 )); [ "$cap" -gt 60 ] && cap=60
echo "== steps xla backend (cap ${cap} s, $(left) s left)" | tee -a "$log"
timeout "$cap" python3 -m benchmarks.step.profile --layers 8 --settings all --backends xla \
  --mixes d64 d256 --variants separate/xla fused/cublas --reps 20 --out "$work/steps_xla" 2>&1 | quiet | tee -a "$log"
cp "$work/steps_xla/step_profile.json" "$out/step_profile_xla.json" 2>/dev/null

for flags in "" "--xla_gpu_enable_triton_gemm=false"; do
  cap=$(( $(left) - 10 )); [ "$cap" -gt 60 ] && cap=60
  name=fp8_${flags:+cublas}; name=${name%_}
  if [ "$cap" -lt 25 ]; then echo "== $name: not run (budget)" | tee -a "$log"; continue; fi
  echo "== $name (XLA_FLAGS='$flags', cap ${cap} s, $(left) s left)" | tee -a "$log"
  XLA_FLAGS="$flags" timeout "$cap" python3 -m benchmarks.kernels.quant_gemm --layers 8 --batch 16 64 256 \
    --formats bf16-fused fp8-native int8-pallas --out "$work/$name" 2>&1 | quiet | tee -a "$log"
  cp "$work/$name/quant_gemm.json" "$out/quant_gemm_$name.json" 2>/dev/null
done
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
