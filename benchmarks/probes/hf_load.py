"""Loading a dense Hugging Face folder in the serving layout: the one-pass loader that
`load_model` runs (jaxlora.loading.hf_placement) against the older host path (read every tensor,
transpose and stack on the host, fuse, then place: `load_hf_arrays` + `build_model`), alternating,
on a random-weight folder of the 7B shape with `--layers` layers (written once, then read from the
page cache as a restart reads it). Checks that both give the same parameters ("same_params":
the first 64 columns of every parameter, all layers and rows; whole copies of two 7B models do not
fit the host comfortably).

`--adapters N` then times what a server start does next, on the preset's engine
(configs/llama2-7b-h200.yaml: rank 16 on all seven modules): N PEFT folders registered alone
(`register_many` into the pager `make_pager` builds, pinned host memory on a GPU), then
`load_engine` (the model loading on one thread while the adapters register on others), with its
"load" and "register" laps.

    python -m benchmarks.probes.hf_load --layers 32 --repeats 2 --out results.json   # GPU
    python -m benchmarks.probes.hf_load --layers 32 --adapters 64 --out results.json
    python -m benchmarks.probes.hf_load --layers 2 --repeats 2 --out /tmp/l.json     # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, word_tokenizer
from benchmarks.serving.server_api import write_model_folder
from jaxlora.loading import load_model
from jaxlora.loading.hf_folder import load_hf_arrays
from jaxlora.model.params import build_model


def one_pass(folder: Path):
    return load_model(folder, dtype=jnp.bfloat16, fused=True)[0]


def host_path(folder: Path):
    config, arrays = load_hf_arrays(folder)
    return build_model(config, arrays, dtype=jnp.bfloat16, fused=True, source=str(folder))


def timed(fn, folder: Path) -> tuple[float, object]:
    start = time.perf_counter()
    model = fn(folder)
    jax.block_until_ready(model.params)
    return time.perf_counter() - start, model


def time_adapters(folder: Path, n: int, result: dict) -> None:
    """The `--adapters` rows (see the module docstring), added to `result`."""
    from benchmarks.engine.paging import weight_pool
    from benchmarks.serving.server_api import write_adapter_folders
    from jaxlora.adapters.register_many import register_many
    from jaxlora.cli.startup import StartupClock
    from jaxlora.engine.build import make_pager
    from jaxlora.engine.config import EngineConfig
    from jaxlora.engine.load import EngineSpec, load_engine
    from jaxlora.loading import read_model_config

    preset = Path(__file__).resolve().parents[2] / "configs" / "llama2-7b-h200.yaml"
    config = EngineConfig.from_yaml(preset)
    model_config = read_model_config(folder)
    pool = weight_pool(model_config, config.lora.max_rank, config.lora.target_modules, 4)
    adapters = write_adapter_folders(
        pool, ranks=(config.lora.max_rank,) * 4, n=n, out=folder.parent / "hf_load_adapters"
    )
    del pool
    start = time.perf_counter()
    pager, _ = make_pager(config, model_config, config.jnp_dtype)
    made = time.perf_counter()
    register_many(pager, adapters)
    done = time.perf_counter()
    result["register_alone"] = {
        "adapters": n,
        "make_pager_s": round(made - start, 2),
        "register_s": round(done - made, 2),
    }
    print(json.dumps(result["register_alone"]), flush=True)
    del pager
    clock = StartupClock()
    engine = load_engine(
        EngineSpec(model=str(folder), config=config, adapters={k: str(v) for k, v in adapters.items()}), clock=clock
    )
    result["load_engine"] = {k: round(v, 2) for k, v in clock.seconds.items()}
    print(json.dumps(result["load_engine"]), flush=True)
    del engine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--folder", type=Path, default=Path("/tmp/hf_load_model"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    config = dataclasses.replace(LLAMA2_7B, num_layers=args.layers)
    start = time.perf_counter()
    write_model_folder(config, "bfloat16", word_tokenizer(config.vocab_size), args.folder)
    nbytes = sum(f.stat().st_size for f in args.folder.glob("*.safetensors"))
    result = {
        "device": str(jax.devices()[0].device_kind),
        "layers": args.layers,
        "gb": round(nbytes / 1e9, 2),
        "write_s": round(time.perf_counter() - start, 1),
        "runs": [],
    }
    print(json.dumps(result), flush=True)
    for i in range(args.repeats):
        for name, fn in (("host_path", host_path), ("one_pass", one_pass)):
            seconds, model = timed(fn, args.folder)
            if i == 0:
                result.setdefault("models", {})[name] = {
                    k: np.asarray(v[..., :64]) for k, v in model.flat_params().items()
                }
            del model
            row = {"loader": name, "repeat": i, "s": round(seconds, 2), "gb_per_s": round(nbytes / 1e9 / seconds, 2)}
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    a, b = result.pop("models").values()
    result["same_params"] = all(np.array_equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    print("same params:", result["same_params"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.adapters:
        time_adapters(args.folder, args.adapters, result)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
