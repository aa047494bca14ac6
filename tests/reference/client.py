"""Run the Hugging Face reference (``hf_ref.py``) from the test process, with an on-disk cache.

The reference needs torch, which installs here only for Python 3.11, while jaxlora runs on 3.12;
so it lives in its own venv (``scripts/setup_ref_env.sh``) and runs as a subprocess. Stdlib and
numpy only.

    from tests.reference.client import run_reference
    result = run_reference({
        "kind": "generate",
        "model": {"gguf": "/path/SmolLM2-135M-Instruct.Q4_1.gguf"},
        "prompts": [[1, 9690, 198], [1, 4093]],
        "n_new": 8,
        "adapters": {"a": {"r": 8, "target_modules": "all-linear", "seed": 1}},  # or a folder
        "rows": [{"prompt": 0, "adapter": None}, {"prompt": 1, "adapter": "a"}],
    })
    result["rows"][1]["tokens"]       # list[int], exactly n_new greedy ids
    result["rows"][1]["logits"]       # np.ndarray [len(prompt), vocab] float32
    result["adapters"]["a"]           # Path of the PEFT folder that was made (read-only: copy it
                                      # before changing it)

Results are cached under ``<repo>/.cache/reference/<key>``; the key hashes the job, the source of
``hf_ref.py`` and what every path in the job points at (contents for files up to 64 MiB, else
size and mtime; not the path's name), so a rerun is instant and any change reruns the reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REFERENCE_DIR = Path(__file__).resolve().parent
REPO_ROOT = REFERENCE_DIR.parents[1]
HF_REF = REFERENCE_DIR / "hf_ref.py"
SETUP_COMMAND = "bash scripts/setup_ref_env.sh"
DEFAULT_TIMEOUT_S = 1200.0
_HASH_CONTENT_MAX_BYTES = 64 << 20
_CACHE_FORMAT = 1
_EXIT_BAD_JOB = 3  # hf_ref.py's exit code for a job it rejects; deterministic, so cached too.
BAD_JOB_FILE = "bad_job.txt"


class ReferenceError(RuntimeError):
    """The reference subprocess failed; the message carries the tail of its stderr."""


def ref_python() -> Path | None:
    """The reference venv's interpreter: ``$JAXLORA_REF_PYTHON``, else ``<repo>/.venv-ref``."""
    configured = os.environ.get("JAXLORA_REF_PYTHON")
    path = Path(configured) if configured else REPO_ROOT / ".venv-ref" / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def cache_root() -> Path:
    return Path(os.environ.get("JAXLORA_REF_CACHE", REPO_ROOT / ".cache" / "reference"))


def run_reference(job: dict, *, timeout: float = DEFAULT_TIMEOUT_S, use_cache: bool = True) -> dict[str, Any]:
    """Runs one reference job (or returns its cached result).

    Args:
      job: JSON-able dict with a ``kind`` (generate, tokenize, make_adapters, make_tiny_model,
        merge, batch); ``pathlib.Path`` values are allowed.
      timeout: seconds before the subprocess is killed.
      use_cache: False always reruns (and refreshes the cache entry).

    Returns:
      The job's result with ``{"__npy__": f}`` replaced by ``np.ndarray`` and ``{"__path__": d}``
      by an absolute ``Path`` inside the cache entry. ``result["meta"]`` has versions and seconds.
    """
    python = ref_python()
    if python is None:
        raise ReferenceError(f"no reference environment; create it with: {SETUP_COMMAND}")
    job = _normalize(job)
    entry = cache_root() / job_key(job)
    if use_cache and _is_complete(entry):
        os.utime(entry)  # Marks it used, for pruning.
    else:
        _run_fresh(python, job, entry, timeout)
        _prune(entry.parent, keep=entry)
    if (entry / BAD_JOB_FILE).is_file():
        raise ReferenceError((entry / BAD_JOB_FILE).read_text())
    return _load_result(entry)


def _prune(root: Path, keep: Path, max_age_s: float = 7 * 86400) -> None:
    """Drops entries unused for a week: every edit of hf_ref.py orphans the old ones."""
    cutoff = time.time() - max_age_s
    for entry in root.iterdir():
        try:
            if entry != keep and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass  # Another process removed it.


def _is_complete(entry: Path) -> bool:
    return (entry / "result.json").is_file() or (entry / BAD_JOB_FILE).is_file()


def job_key(job: dict) -> str:
    """The cache key: the job, hf_ref.py's source, and the contents of the files it points at.

    A string naming an existing file or folder is keyed by what is there, not by its name, so a
    model written to a fresh ``tmp_path`` on every run still hits the cache.
    """
    digest = hashlib.sha256()
    digest.update(f"format={_CACHE_FORMAT}\n".encode())
    digest.update(HF_REF.read_bytes())
    digest.update(json.dumps(_key_view(_normalize(job)), sort_keys=True).encode())
    return digest.hexdigest()[:24]


def _key_view(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _key_view(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_key_view(v) for v in value]
    if isinstance(value, str) and ("/" in value or os.sep in value) and os.path.exists(value):
        return f"<contents {_path_fingerprint(Path(value))}>"
    return value


def _path_fingerprint(root: Path) -> str:
    digest = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        stat = file.stat()
        name = file.name if file == root else file.relative_to(root).as_posix()
        digest.update(f"{name}:{stat.st_size}:".encode())
        if stat.st_size > _HASH_CONTENT_MAX_BYTES:  # Big models: size and mtime only.
            digest.update(str(stat.st_mtime_ns).encode())
        else:
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _normalize(job: dict) -> dict:
    return json.loads(json.dumps(job, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"job value of type {type(value).__name__} is not JSON-able: {value!r}")


def _run_fresh(python: Path, job: dict, entry: Path, timeout: float) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        job_file = work / "job.json"
        job_file.write_text(json.dumps(job, indent=1))
        out = work / "out"
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [str(python), str(HF_REF), str(job_file), str(out)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=_subprocess_env(),
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as error:
            raise ReferenceError(
                f"reference job {job.get('kind')!r} timed out after {timeout:.0f}s\n{_tail(error.stderr)}"
            ) from None
        if proc.returncode == _EXIT_BAD_JOB:
            out.mkdir(parents=True, exist_ok=True)
            (out / BAD_JOB_FILE).write_text(f"reference job {job.get('kind')!r} rejected:\n{_tail(proc.stderr)}")
        elif proc.returncode != 0:
            raise ReferenceError(
                f"reference job {job.get('kind')!r} failed (exit {proc.returncode}, "
                f"{time.perf_counter() - start:.1f}s) running {python}\n{_tail(proc.stderr)}"
            )
        shutil.copy(job_file, out / "job.json")
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)
        try:
            out.rename(entry)
        except OSError:
            if not _is_complete(entry):  # Not a concurrent writer of the same key.
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TQDM_DISABLE="1",
        PYTHONNOUSERSITE="1",
    )
    # The 3.12 test process's path must not leak into the 3.11 interpreter.
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def _load_result(entry: Path) -> dict[str, Any]:
    raw = json.loads((entry / "result.json").read_text())
    return _resolve(raw, entry)


def _resolve(value: Any, entry: Path) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__npy__"}:
            return np.load(entry / value["__npy__"])
        if set(value) == {"__path__"}:
            return entry / value["__path__"]
        return {k: _resolve(v, entry) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, entry) for v in value]
    return value


def main(argv: list[str]) -> int:
    """``python tests/reference/client.py JOB.json``: run a job, print its result summary."""
    job = json.loads(Path(argv[0]).read_text())
    result = run_reference(job, use_cache="--no-cache" not in argv)
    print(
        json.dumps(
            result, default=lambda v: f"<array {v.shape} {v.dtype}>" if isinstance(v, np.ndarray) else str(v), indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
