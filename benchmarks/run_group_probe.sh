#!/usr/bin/env bash
# One device call for issue 18's LoRA group launches: benchmarks.kernels.lora_groups (the four module
# groups of a 7B layer, 8 layers: the split launches with the per-row or the tile expand, the
# one-launch candidates, XLA), under a total wall clock; the JSON is rewritten after every case, so
# a cut call keeps its rows. Arguments after TOTAL_S replace the default selection.
#   bash benchmarks/run_group_probe.sh OUT_DIR TOTAL_S [group_kernels args...]
set -o pipefail
out="${1:?OUT_DIR}"; total="${2:-540}"; shift 2 || true
sel=("$@")
[ ${#sel[@]} -eq 0 ] && sel=(--tokens 64 256 16 512 --ranks 16 64 --check-ranks 8 32)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"
log="$out/log.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation\|return rule(ctx"; }
cmd="python3 -m benchmarks.kernels.lora_groups --layers 8 ${sel[*]} --budget-s $(( total - 60 )) --out $out"
echo "== $cmd" | tee -a "$log"
timeout $(( total - 10 )) $cmd 2>&1 | quiet | tee -a "$log"
