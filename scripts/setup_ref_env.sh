#!/usr/bin/env bash
# Create the Hugging Face reference environment used by the tests (tests/reference/).
#
#   bash scripts/setup_ref_env.sh [DIR]        DIR defaults to <repo>/.venv-ref
#
# A Python 3.11 venv with torch 2.13.0 (CPU) + transformers + PEFT + gguf: torch installs from local
# disk only for 3.11, while jaxlora needs 3.12, so the reference runs as a subprocess
# (tests/reference/client.py). Idempotent: a stamp of the requirement list makes a rerun instant.
# Python 3.11 is found as $JAXLORA_REF_BASE_PYTHON, python3.11 on PATH, pyenv's 3.11.x, or python3.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo/.venv-ref}"
requirements="$repo/tests/reference/requirements.txt"
stamp="$dir/.jaxlora-ref-stamp"

is_python311() {
  [ -n "$1" ] && "$1" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null
}

find_python311() {
  local candidates=("${JAXLORA_REF_BASE_PYTHON:-}")
  candidates+=("$(command -v python3.11 || true)")
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.11*/bin/python3.11)
  fi
  candidates+=(/usr/bin/python3.11 /usr/local/bin/python3.11 "$(command -v python3 || true)")
  for candidate in "${candidates[@]}"; do
    if is_python311 "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

want="$(cat "$requirements"; echo "setup-script-version=1")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && is_python311 "$dir/bin/python"; then
  echo "reference env up to date: $dir"
  exit 0
fi

start=$SECONDS
if ! is_python311 "$dir/bin/python"; then
  if ! base="$(find_python311)"; then
    echo "error: the reference environment needs Python 3.11 (torch 2.13.0 CPU installs only" >&2
    echo "for 3.11 here) and none was found. Install it (e.g. 'pyenv install 3.11') or point" >&2
    echo "JAXLORA_REF_BASE_PYTHON at a python3.11 binary." >&2
    exit 1
  fi
  echo "creating $dir with $base"
  rm -rf "$dir"
  "$base" -m venv "$dir"
fi
rm -f "$stamp"
# pip (not uv): only pip looks in the local wheel folder that holds torch 2.13.0+cpu.
echo "installing $(grep -c '==' "$requirements") pinned packages (a few minutes the first time)"
"$dir/bin/python" -m pip install -qq --disable-pip-version-check -r "$requirements"
"$dir/bin/python" -c 'import torch, transformers, peft, gguf, safetensors, numpy
assert torch.version.cuda is None, f"expected a CPU torch, got CUDA {torch.version.cuda}"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")'
printf '%s' "$want" > "$stamp"
echo "reference env ready in $((SECONDS - start))s: $dir"
