#!/usr/bin/env bash
# One device call for issue 18 (where a decode step's time goes on the ragged step) and issue 20
# (does XLA fuse the int8 / FP8 convert into the GEMM with Triton forced), each part under its own
# timeout inside a total wall clock; results are merged into OUT after every part, so a cut call
# keeps what it measured.
#   bash benchmarks/run_floor_probe.sh OUT_DIR TOTAL_S
# Parts (8 of the 32 layers where a model is built: per-layer costs are what is compared):
#   gemm_<flags>   benchmarks.kernels.quant_gemm --layers 8 under several XLA_FLAGS sets -> quant_gemm_flags.json
#   steps          benchmarks.step.profile, decode mixes d64 / d256, no adapters and 64 rank-16
#                  all-module adapters, pallas and xla -> step_profile.json
#   ops            the same d64 cases op by op (command buffers off) -> step_profile_ops.json
#   host           benchmarks.engine.host_loop --layers 8, 64:64 and 256:256 -> host_loop.json
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-540}"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
work=/tmp/floor_probe; mkdir -p "$work" "$out"
log="$out/log.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }

merge_gemm() {
  python3 - "$work" "$out/quant_gemm_flags.json" <<'EOF'
import json, pathlib, sys
runs = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("gemm_*/quant_gemm.json")):
    runs[f.parent.name] = json.loads(f.read_text())
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
EOF
}

gemm() {  # gemm NAME MAX_S "XLA_FLAGS" quant_gemm args...
  local name="$1" max_s="$2" flags="$3"; shift 3
  local cap=$(( $(left) - 20 )); [ "$cap" -gt "$max_s" ] && cap="$max_s"
  if [ "$cap" -lt 30 ]; then echo "== $name: not run (budget)" | tee -a "$log"; return; fi
  echo "== $name (XLA_FLAGS='$flags', cap ${cap} s, $(left) s left)" | tee -a "$log"
  XLA_FLAGS="$flags" timeout "$cap" python3 -m benchmarks.kernels.quant_gemm --layers 8 --out "$work/gemm_$name" "$@" 2>&1 | quiet | tee -a "$log"
  merge_gemm
}

gemm default 120 "" --batch 16 64 256 --formats bf16 bf16-fused int8 fp8
gemm cublas 60 "--xla_gpu_enable_triton_gemm=false" --batch 64 256 --formats bf16 bf16-fused
gemm triton_any 70 "--xla_gpu_triton_gemm_any=true" --batch 64 --formats bf16 int8 fp8
gemm cublaslt 50 "--xla_gpu_enable_cublaslt=true" --batch 64 --formats bf16 bf16-fused

cap=$(( $(left) - 200 )); [ "$cap" -gt 130 ] && cap=130
echo "== steps (cap ${cap} s, $(left) s left)" | tee -a "$log"
timeout "$cap" python3 -m benchmarks.step.profile --layers 8 --settings none all --backends pallas xla \
  --mixes d64 d256 --reps 20 --out "$work/steps" 2>&1 | quiet | tee -a "$log"
cp "$work/steps/step_profile.json" "$out/step_profile.json" 2>/dev/null

cap=$(( $(left) - 140 )); [ "$cap" -gt 70 ] && cap=70
echo "== ops (cap ${cap} s, $(left) s left)" | tee -a "$log"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$cap" python3 -m benchmarks.step.profile --layers 8 \
  --settings none all --backends pallas --mixes d64 --profile d64 --reps 10 --out "$work/ops" 2>&1 | quiet | tee -a "$log"
cp "$work/ops/step_profile.json" "$out/step_profile_ops.json" 2>/dev/null

cap=$(( $(left) - 10 ))
echo "== host (cap ${cap} s, $(left) s left)" | tee -a "$log"
if [ "$cap" -gt 40 ]; then
  timeout "$cap" python3 -m benchmarks.engine.host_loop --layers 8 --cases 64:64 256:256 --steps 60 --warmup-steps 20 \
    --profile-steps 0 --out "$out" 2>&1 | quiet | tee -a "$log"
fi
echo "== done at $(( $(date +%s) - t0 )) s" | tee -a "$log"
