#!/usr/bin/env bash
# One device call: the Mosaic GPU int8 GEMM checked and timed (benchmarks/kernels/quant_mgpu.py), then, in
# what time is left and with HOST_AB=1 set, the one-row CONCURRENT scheduling A/B of the engine's
# host loop (the 7B shape at full depth); with E2E_S=seconds, `benchmarks.engine.e2e` on bf16 / int8 / fp8
# bases (E2E_FORMATS, default "bf16 int8 fp8") for the plan groups E2E_GROUPS (default "0 2 4":
# B=64, 16, 128) first.
#   bash benchmarks/run_mgpu_probe.sh OUT_DIR TOTAL_S [quant_mgpu args...]
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-540}"; shift 2
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"
log="$out/log.txt"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee -a "$log"
echo "== quant_mgpu ($(left) s left)" | tee -a "$log"
timeout $(( $(left) - 20 )) python3 -m benchmarks.kernels.quant_mgpu --out "$out" "$@" 2>&1 | quiet | tee -a "$log" | grep -v "^gemm\|^check" | tail -40
grep "^check" "$log" | cut -c 1-300
if [ -n "$E2E_S" ] && [ "$(left)" -gt $(( E2E_S + 30 )) ]; then
  echo "== e2e ${E2E_GROUPS:-0 2 4}, ${E2E_FORMATS:-bf16 int8 fp8}, budget $E2E_S s ($(left) s left)" | tee -a "$log"
  timeout $(( E2E_S + 60 )) python3 -m benchmarks.engine.e2e --backend pallas --quantize ${E2E_FORMATS:-bf16 int8 fp8} \
    --groups ${E2E_GROUPS:-0 2 4} --budget-s "$E2E_S" --no-plots --out "$out/e2e" 2>&1 | quiet | grep -v '^  {' | tee -a "$log"
fi
if [ -n "$HOST_AB" ] && [ "$(left)" -gt 150 ]; then
  for cmt in 1 100000; do
    echo "== host_loop 1:1 16:16 --concurrent-min-tokens $cmt ($(left) s left)" | tee -a "$log"
    timeout $(( $(left) / 2 - 5 )) python3 -m benchmarks.engine.host_loop --cases 1:1 16:16 --steps 40 --warmup-steps 10 \
      --profile-steps 0 --probe-reps 0 --concurrent-min-tokens $cmt --out "$out/hl_cmt$cmt" 2>&1 | quiet | tail -6 | tee -a "$log"
  done
fi
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
