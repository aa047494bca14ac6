#!/usr/bin/env bash
# One device call for issue 18's one-launch LoRA groups: benchmarks.group_kernels (the four module
# groups of a 7B layer, 8 layers, fused candidates vs the split launches vs XLA, ranks 16 / 8 / 64),
# under a total wall clock; the JSON is rewritten after every case, so a cut call keeps its rows.
#   bash benchmarks/run_group_probe.sh OUT_DIR TOTAL_S
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-540}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"
log="$out/log.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation\|return rule(ctx"; }
cmd="python3 -m benchmarks.group_kernels --layers 8 --tokens 64 256 16 512 --ranks 16 64 --check-ranks 8 32 --budget-s $(( total - 60 )) --out $out"
echo "== $cmd" | tee -a "$log"
timeout $(( total - 10 )) $cmd 2>&1 | quiet | tee -a "$log"
