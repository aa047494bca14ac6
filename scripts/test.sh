#!/usr/bin/env bash
# Installs jaxlora with its test dependencies (.venv, Python 3.12) and the Hugging Face reference
# environment (.venv-ref, Python 3.11 + torch CPU), then runs the whole test suite.
source "$(dirname "$0")/_venv.sh"
make_venv test
bash "$ROOT/scripts/setup_ref_env.sh" "$ROOT/.venv-ref"
cd "$ROOT"
export JAXLORA_REF_PYTHON="$ROOT/.venv-ref/bin/python"
# Two workers (the CI machine has two cores); tests/conftest.py's scheduler sends each module, and each
# directory whose modules share a session fixture, whole to one worker. `-n 0` after it runs serially.
# --durations: the slowest tests in every run's log, to keep the suite's time in view.
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadscope --durations=25 "$@"
