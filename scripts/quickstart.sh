#!/usr/bin/env bash
# Installs jaxlora (Python 3.12 venv in .venv) and runs the main job on the embedded default model:
# one mixed batch where the base model and every demo adapter answer side by side.
source "$(dirname "$0")/_venv.sh"
make_venv bench
cd "$ROOT"
exec "$VENV/bin/jaxlora" demo "$@"
