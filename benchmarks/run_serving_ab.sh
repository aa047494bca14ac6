#!/usr/bin/env bash
# One device call part: an A/B of the LoRA group rule on S-LoRA's trace, one process per arm
# (--lora-groups split, then tuned), each under its own timeout; OUT_DIR/<arm>/serving.json.
# SETUP_S is the set-up time the benchmark budgets for (it starts no setting that would not fit).
#   bash benchmarks/run_serving_ab.sh OUT_DIR SECONDS_EACH SETTING RATE ENGINE_COMMIT SETUP_S
set -o pipefail
out="${1:?OUT_DIR}"; each="${2:?SECONDS_EACH}"; setting="${3:?SETTING}"; rate="${4:?RATE}"; commit="${5:?COMMIT}"; setup="${6:?SETUP_S}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$out"
quiet() { grep -v "hlo_rematerialization\|cuda_timer\|^WARNING\|Deprecation"; }
for arm in split tuned; do
  echo "== serving $setting @ $rate, --lora-groups $arm" | tee -a "$out/ab_log.txt"
  timeout "$each" python3 -m benchmarks.serving.trace --settings "$setting" --rates "$rate" --duration 25 \
    --max-drain-s 20 --probe-steps 0 --budget-s $(( each - 8 )) --setup-s "$setup" --lora-groups "$arm" \
    --engine-commit "$commit" --out "$out/$arm" 2>&1 | quiet | tail -12 | tee -a "$out/ab_log.txt"
done
