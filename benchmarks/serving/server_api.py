"""The server side of `benchmarks/serving/trace.py --api http|grpc`: `jaxlora serve` started exactly as a
user starts it, on files written to disk.

  - the model: a Hugging Face folder (config.json, model.safetensors, tokenizer.json) with random
    weights of the benchmark's shape, and the benchmark's word tokenizer (no end-of-sequence id, so
    every request runs to its max_tokens);
  - the adapters: PEFT folders given with `--adapter NAME=PATH`; a few real weight sets, the other
    names folders of symbolic links to them (a 2,000-adapter setting would otherwise write tens of
    GB), registered as separate adapters all the same;
  - the engine: a preset YAML given with `--config`, the in-process engine's `EngineConfig`.

The process that starts servers never initializes JAX on the GPU (`benchmarks/serving/trace.py` pins its
own JAX to the CPU for these apis): a process that touched the GPU holds most of its memory, and the
server would find little left for its KV cache.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import ml_dtypes
import numpy as np
import yaml

from jaxlora.cli.startup import parse_line
from jaxlora.config import ModelConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.loading.names import flat_to_hf
from jaxlora.lora.peft_format import save_peft_adapter
from jaxlora.model.params import abstract_model
from jaxlora.tokenizer import Tokenizer, save_tokenizer
from jaxlora.weights_file import save_safetensors

_STAMP = ".benchmark-model.json"
_POOL_VALUES = 1 << 20  # random values tiled into every weight: writing a 7B model takes seconds


def write_model_folder(config: ModelConfig, dtype: str, tokenizer: Tokenizer, out: Path, *, seed: int = 0) -> Path:
    """A Hugging Face folder of `config` with random weights (N(0, 0.02) matrices, norm scales near
    1) in `dtype`, and `tokenizer`. Values repeat with a period of `_POOL_VALUES`: the benchmark
    times the server, and the weights' values do not change its work. A folder this wrote before
    for the same config, dtype and seed is kept (two benchmark runs in one device call share it)."""
    hf = config.to_hf_dict()
    hf["torch_dtype"] = dtype
    stamp = json.dumps({"config": hf, "seed": seed, "pool": _POOL_VALUES}, sort_keys=True)
    if (out / _STAMP).is_file() and (out / _STAMP).read_text() == stamp:
        return out
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    normal = np.random.default_rng(seed).standard_normal(_POOL_VALUES, np.float32)
    # Tiled in the stored dtype: no float32 copy of a 7B model is ever made.
    matrices, scales = (0.02 * normal).astype(np_dtype), (1.0 + 0.1 * normal).astype(np_dtype)
    flat = {
        name: np.resize(scales if name.endswith(".scale") else matrices, spec.shape)
        for name, spec in abstract_model(config, np.float32)[1].items()
    }
    out.mkdir(parents=True, exist_ok=True)
    tensors = flat_to_hf(flat, config)
    del flat
    save_safetensors(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_tokenizer(tokenizer, out)
    (out / _STAMP).write_text(stamp)  # last: a folder cut short by a crash is written again
    return out


def write_adapter_folders(pool: list[dict], *, ranks: tuple[int, ...], n: int, out: Path) -> dict[str, Path]:
    """PEFT folders a0..a{n-1}: a{i} holds the weight set pool[i % len(pool)] (module -> (A, B) as
    `benchmarks.paging.weight_pool` draws them), of rank ranks[i % len(pool)]. The first len(pool)
    are written; the others are folders of links to their files."""
    out.mkdir(parents=True, exist_ok=True)
    folders: dict[str, Path] = {}
    for i in range(n):
        folder = out / f"a{i}"
        if i < len(pool):
            save_peft_adapter(folder, weights=pool[i], rank=ranks[i], alpha=float(ranks[i]), dtype="bfloat16")
        else:
            folder.mkdir(exist_ok=True)
            for f in folders[f"a{i % len(pool)}"].iterdir():
                link = folder / f.name
                if not link.is_symlink():
                    link.symlink_to(f.resolve())
        folders[f"a{i}"] = folder
    return folders


def write_preset(config: EngineConfig, out: Path) -> Path:
    """`config` as a preset YAML that `jaxlora serve --config` reads back into an equal config."""
    data = _plain(dataclasses.asdict(config))
    out.write_text(yaml.safe_dump({"engine": data}, sort_keys=False))
    if EngineConfig.from_yaml(out) != config:
        raise RuntimeError(f"{out} does not read back as the engine config it was written from")
    return out


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    """A `jaxlora serve` subprocess with HTTP and gRPC on loopback ports."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path
    started: float
    ready_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def startup(self) -> dict[str, float] | None:
        """The server's own start-up line (import, load, register, compile, warm-up run)."""
        return parse_line(self.log.read_text(errors="replace"))

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve_command(model: Path, preset: Path, adapters: dict[str, Path], *, http_port: int, grpc_port: int) -> list[str]:
    """The `jaxlora serve` command line (the console script beside this interpreter if installed)."""
    script = Path(sys.executable).with_name("jaxlora")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "jaxlora.cli.main"]
    command += ["serve", "--model", str(model.resolve()), "--config", str(preset.resolve()), "--host", "127.0.0.1"]
    command += ["--http-port", str(http_port), _grpc_flag(), str(grpc_port)]
    command += ["--max-concurrent-streams", "4096", "--max-connections", "4096"]
    for name, folder in adapters.items():
        command += ["--adapter", f"{name}={folder.resolve()}"]
    return command


def _grpc_flag() -> str:
    """`--grpc-port` where `--port` is the HTTP port (as in vLLM), else `--port`."""
    import argparse

    from serving.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    return "--grpc-port" if "--grpc-port" in parser._option_string_actions else "--port"


def start_server(
    model: Path,
    preset: Path,
    adapters: dict[str, Path],
    *,
    log: Path,
    cache: Path | None,
    timeout_s: float,
    code: Path | None = None,
) -> Server:
    """Starts `jaxlora serve` and waits for /health to answer 200; raises RuntimeError with the end
    of its log if it exits or is not ready within `timeout_s`. `code`: a source tree whose jaxlora
    and serving the server runs (first on its PYTHONPATH), e.g. an export of an older commit."""
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ)
    if cache is not None:
        env["JAXLORA_COMPILATION_CACHE"] = str(cache.resolve())
    command = serve_command(model, preset, adapters, http_port=http_port, grpc_port=grpc_port)
    cwd = None
    if code is not None:
        # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: run in `code`.
        cwd = code.resolve()
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(cwd), env.get("PYTHONPATH")) if x)
        command = [sys.executable, "-m", "jaxlora.cli.main", *command[command.index("serve") :]]
    out = open(log, "w")
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    server = Server(process, http_port, grpc_port, log, started)
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jaxlora serve exited {process.returncode}:\n{_tail(log)}")
        if _health(http_port) == 200:
            server.ready_s = time.perf_counter() - started
            return server
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"jaxlora serve was not ready within {timeout_s} s:\n{_tail(log)}")


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def gpu_name() -> str | None:
    """The first NVIDIA GPU's name from nvidia-smi (None without one), read without touching it from
    this process."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None
