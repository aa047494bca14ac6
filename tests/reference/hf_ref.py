"""Hugging Face transformers + PEFT reference runner (runs in the Python 3.11 reference venv).

    python hf_ref.py JOB.json OUT_DIR

Reads one job (JSON), writes ``OUT_DIR/result.json`` plus ``.npy`` files for arrays and folders for
saved models/adapters. In ``result.json`` an array is ``{"__npy__": "rel.npy"}`` and a saved
artifact is ``{"__path__": "rel/dir"}``; ``client.py`` turns both back into arrays and absolute
paths. This file imports only torch/transformers/peft/numpy and shares no code with jaxlora.

Job kinds (see ``client.py`` for examples): ``generate``, ``tokenize``, ``make_adapters``,
``make_tiny_model``, ``merge``, and ``batch`` (several jobs in one process, sharing model loads).

A model source is ``{"gguf": "/path/model.gguf"}`` or ``{"hf_dir": "/path/folder"}``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# Spinning OpenMP workers collapse throughput when the machine is busy (seen: 20x slower decode).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class JobError(ValueError):
    """A job the runner cannot do; the message says which field is wrong."""


# ---------------------------------------------------------------------------------------------
# Output helpers


class Output:
    """Writes arrays and artifact folders under one result directory."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._counter = 0

    def array(self, name: str, value) -> dict:
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float32).cpu().numpy()
        self._counter += 1
        rel = f"{self._counter:04d}_{_safe(name)}.npy"
        np.save(self.root / rel, np.ascontiguousarray(value))
        return {"__npy__": rel}

    def folder(self, name: str) -> tuple[Path, dict]:
        rel = f"artifacts/{_safe(name)}"
        suffix = 1
        while (self.root / rel).exists():  # Batch jobs may make two of the same name.
            suffix += 1
            rel = f"artifacts/{_safe(name)}_{suffix}"
        (self.root / rel).mkdir(parents=True)
        return self.root / rel, {"__path__": rel}


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(name))[:80] or "x"


# ---------------------------------------------------------------------------------------------
# Loading (memoized per process so a batch job loads a GGUF once)

_MODELS: dict[str, torch.nn.Module] = {}
_TOKENIZERS: dict[str, object] = {}


def _source_args(source: dict) -> tuple[str, dict]:
    if not isinstance(source, dict) or len(source) != 1:
        raise JobError(f'model source must be {{"gguf": path}} or {{"hf_dir": path}}, got {source!r}')
    if "gguf" in source:
        path = Path(source["gguf"])
        if not path.is_file():
            raise JobError(f"GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if "hf_dir" in source:
        path = Path(source["hf_dir"])
        if not path.is_dir():
            raise JobError(f"model folder not found: {path}")
        return str(path), {}
    raise JobError(f"unknown model source {source!r}")


def load_model(source: dict, dtype: str = "float32") -> torch.nn.Module:
    """The base model, memoized. Callers that wrap it with PEFT must deep-copy it first."""
    key = json.dumps([source, dtype], sort_keys=True)
    if key not in _MODELS:
        folder, kwargs = _source_args(source)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype], **kwargs)
        model.eval()
        _MODELS[key] = model
    return _MODELS[key]


def load_tokenizer(source: dict):
    key = json.dumps(source, sort_keys=True)
    if key not in _TOKENIZERS:
        folder, kwargs = _source_args(source)
        _TOKENIZERS[key] = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
    return _TOKENIZERS[key]


# ---------------------------------------------------------------------------------------------
# make_adapters


DEFAULT_STRENGTH = 0.15  # Changes SmolLM2 greedy text clearly, still readable.


def _lora_config(spec: dict):
    import peft

    known = {
        "r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
        "layers_to_transform", "layers_pattern", "lora_dropout", "bias", "fan_in_fan_out",
    }  # fmt: skip
    kwargs = {k: spec[k] for k in known if k in spec}
    kwargs.setdefault("r", 8)
    kwargs.setdefault("lora_alpha", 2 * kwargs["r"])
    kwargs.setdefault("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])
    kwargs.setdefault("lora_dropout", 0.0)
    kwargs.update(spec.get("config_extra", {}))
    try:
        return peft.LoraConfig(task_type="CAUSAL_LM", **kwargs)
    except (TypeError, ValueError) as error:
        raise JobError(f"adapter {spec.get('name')!r}: PEFT rejects the config: {error}") from None


def _randomize_lora(model: torch.nn.Module, seed: int, init_std: float | None, strength: float) -> int:
    """Fill every LoRA A and B with random normal values; returns how many tensors were set.

    With ``init_std`` both are N(0, init_std). Otherwise the size follows the base layer:
    A ~ N(0, 1/in) and B ~ N(0, (strength * rms(W) * sqrt(in) / (scale * sqrt(r)))^2), so the
    delta ``scale * B @ A`` has elementwise rms ``strength * rms(W)`` whatever the rank, alpha or
    rslora (those still matter: a wrong scale gives a different output).
    """
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed)
    count = 0
    for _, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if not isinstance(module, LoraLayer):
            continue
        weight = module.get_base_layer().weight.detach().to(torch.float32)
        weight_rms = float(weight.pow(2).mean().sqrt())
        for adapter in sorted(module.lora_A):
            a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            rank, fan_in = a.shape
            if init_std is not None:
                std_a = std_b = init_std
            else:
                std_a = fan_in**-0.5
                std_b = strength * weight_rms * fan_in**0.5 / (module.scaling[adapter] * rank**0.5)
            with torch.no_grad():
                for param, std in ((a, std_a), (b, std_b)):
                    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                    param.copy_((noise * std).to(param.dtype))
            count += 2
    return count


def make_adapter(base: torch.nn.Module, spec: dict, out_dir: Path) -> dict:
    """Build one random PEFT LoRA adapter on a copy of ``base`` and save it (safetensors)."""
    import peft

    if "name" not in spec:
        raise JobError(f"adapter spec needs a name: {spec!r}")
    config = _lora_config(spec)
    peft_model = peft.get_peft_model(copy.deepcopy(base), config)
    init_std = spec.get("init_std")
    num_tensors = _randomize_lora(
        peft_model,
        seed=int(spec.get("seed", 0)),
        init_std=None if init_std is None else float(init_std),
        strength=float(spec.get("strength", DEFAULT_STRENGTH)),
    )
    if num_tensors == 0:
        raise JobError(f"adapter {spec['name']!r}: no LoRA module matched {config.target_modules!r}")
    save_dtype = spec.get("save_dtype", "float32")
    if save_dtype != "float32":
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(DTYPES[save_dtype])
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    return {"num_lora_tensors": num_tensors, "save_dtype": save_dtype}


def job_make_adapters(job: dict, out: Output) -> dict:
    base = load_model(job["model"], job.get("dtype", "float32"))
    paths, details = {}, {}
    for spec in job["adapters"]:
        path, ref = out.folder(f"adapter_{spec.get('name', 'x')}")
        details[spec["name"]] = make_adapter(base, spec, path)
        paths[spec["name"]] = ref
    return {"adapters": paths, "details": details}


# ---------------------------------------------------------------------------------------------
# generate


def _prepare_adapters(job: dict, out: Output) -> tuple[dict[str, str], dict]:
    """Adapter name -> folder. A value may be a folder path or an inline make_adapters spec."""
    paths, made = {}, {}
    for name, value in (job.get("adapters") or {}).items():
        if isinstance(value, dict):
            base = load_model(job["model"], job.get("dtype", "float32"))
            path, ref = out.folder(f"adapter_{name}")
            make_adapter(base, {**value, "name": name}, path)
            paths[name], made[name] = str(path), ref
        else:
            if not Path(value, "adapter_config.json").is_file():
                raise JobError(f"adapter {name!r}: no adapter_config.json in {value}")
            paths[name] = str(value)
    return paths, made


@torch.no_grad()
def _greedy(model, prompt: list[int], n_new: int, eos_ids: list[int]) -> tuple[list[int], list]:
    """Greedy continuation through HF generate; returns ids and the raw logits of each step."""
    input_ids = torch.tensor([prompt], dtype=torch.long)
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=n_new,
        min_new_tokens=0,
        eos_token_id=eos_ids or None,
        pad_token_id=eos_ids[0] if eos_ids else 0,
        num_beams=1,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    # generate() fills unset fields from the model's own generation config (SmolLM2's has
    # eos_token_id=2), so clear them there for the call: exactly n_new tokens, no suppression.
    defaults = model.generation_config
    saved = (defaults.eos_token_id, defaults.forced_eos_token_id)
    defaults.eos_token_id = defaults.forced_eos_token_id = None
    try:
        generated = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    finally:
        defaults.eos_token_id, defaults.forced_eos_token_id = saved
    tokens = generated.sequences[0, len(prompt) :].tolist()
    logits = [step[0].to(torch.float32) for step in generated.logits]
    return tokens, logits


def job_generate(job: dict, out: Output) -> dict:
    import peft

    dtype = job.get("dtype", "float32")
    prompts = [list(map(int, p)) for p in job["prompts"]]
    n_new = int(job["n_new"])
    rows = job.get("rows") or [{"prompt": i, "adapter": None} for i in range(len(prompts))]
    stop_at_eos = bool(job.get("stop_at_eos", False))
    logits_mode = job.get("logits", "prompt")  # "prompt" | "sequence" | "none"
    save_step_logits = bool(job.get("save_step_logits", False))
    if logits_mode not in ("prompt", "sequence", "none"):
        raise JobError(f"logits must be prompt, sequence or none, got {logits_mode!r}")

    options = {"logits": logits_mode, "save_step_logits": save_step_logits}
    adapter_paths, made = _prepare_adapters(job, out)
    base = load_model(job["model"], dtype)
    eos_ids = _eos_ids(base) if stop_at_eos else []
    model = base
    if adapter_paths:
        names = list(adapter_paths)
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_paths[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapter_paths[name], adapter_name=name)
        model.eval()

    results = []
    for index, row in enumerate(rows):
        adapter = row.get("adapter")
        prompt = prompts[int(row["prompt"])]
        if adapter is not None and adapter not in adapter_paths:
            raise JobError(f"row {index}: unknown adapter {adapter!r}")
        if adapter is None and adapter_paths:
            with model.disable_adapter():
                results.append(_run_row(model, prompt, n_new, eos_ids, options, out, index))
        else:
            if adapter is not None:
                model.set_adapter(adapter)
            results.append(_run_row(model, prompt, n_new, eos_ids, options, out, index))
        results[-1].update(prompt=int(row["prompt"]), adapter=adapter)
    return {"rows": results, "adapters": made, "eos_ids": eos_ids}


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []


@torch.no_grad()
def _run_row(model, prompt, n_new, eos_ids, options: dict, out: Output, index: int) -> dict:
    tokens, step_logits = _greedy(model, prompt, n_new, eos_ids)
    row: dict = {"tokens": tokens}
    # Top-1 minus top-2 raw logit per step: a near tie (< ~1e-3) explains a legitimate mismatch.
    margins = []
    for step in step_logits:
        top2 = torch.topk(step, 2).values
        margins.append(float(top2[0] - top2[1]))
    row["step_margins"] = margins
    if options["save_step_logits"]:
        row["step_logits"] = out.array(f"row{index}_step_logits", torch.stack(step_logits))
    if options["logits"] != "none":
        ids = prompt + (tokens if options["logits"] == "sequence" else [])
        logits = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False).logits
        row["logits"] = out.array(f"row{index}_logits", logits[0])
    return row


# ---------------------------------------------------------------------------------------------
# tokenize


def job_tokenize(job: dict, out: Output) -> dict:
    tok = load_tokenizer(job.get("tokenizer") or job["model"])
    encode = []
    for text in job.get("texts", []):
        ids = tok(text, add_special_tokens=True)["input_ids"]
        ids_plain = tok(text, add_special_tokens=False)["input_ids"]
        encode.append(
            {
                "text": text,
                "ids": ids,
                "ids_no_special": ids_plain,
                "tokens": tok.convert_ids_to_tokens(ids_plain),
                "decoded": tok.decode(ids_plain),
            }
        )
    decode = [
        {
            "ids": list(ids),
            "text": tok.decode(list(ids), skip_special_tokens=False),
            "text_skip_special": tok.decode(list(ids), skip_special_tokens=True),
            "pieces": [tok.decode([i]) for i in ids],
        }
        for ids in job.get("decode", [])
    ]
    chat = []
    for messages in job.get("chat", []):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat.append(
            {
                "messages": messages,
                "text": text,
                "ids": tok(text, add_special_tokens=False)["input_ids"],
            }
        )
    info = {
        "vocab_size": len(tok),
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens},
        "chat_template": tok.chat_template,
        "class": type(tok).__name__,
    }
    return {"encode": encode, "decode": decode, "chat": chat, "info": info}


# ---------------------------------------------------------------------------------------------
# make_tiny_model


TINY_DEFAULTS = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def job_make_tiny_model(job: dict, out: Output) -> dict:
    arch = job.get("arch", "llama")
    if arch not in ARCHS:
        raise JobError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    config = config_cls(**{**TINY_DEFAULTS, **job.get("config", {})})
    torch.manual_seed(int(job.get("seed", 0)))
    model = model_cls(config).to(torch.float32)
    _randomize_all(model, int(job.get("seed", 0)), float(job.get("init_std", 0.1)))
    dtype = job.get("dtype", "float32")
    model = model.to(DTYPES[dtype])
    path, ref = out.folder(job.get("name", f"tiny_{arch}"))
    save_kwargs = {}
    if job.get("max_shard_size"):
        save_kwargs["max_shard_size"] = job["max_shard_size"]
    model.save_pretrained(str(path), **save_kwargs)
    if job.get("tokenizer_from"):
        load_tokenizer(job["tokenizer_from"]).save_pretrained(str(path))
    files = sorted(p.name for p in path.iterdir())
    return {"path": ref, "files": files, "config": json.loads(config.to_json_string())}


def _randomize_all(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Every weight and bias N(0, init_std); norm weights 1 + N(0, 0.1). Nothing zero, nothing tied
    by accident (tied embeddings appear once in named_parameters)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(init_std * noise)


# ---------------------------------------------------------------------------------------------
# merge


def job_merge(job: dict, out: Output) -> dict:
    import peft

    dtype = job.get("dtype", "float32")
    base = copy.deepcopy(load_model(job["model"], dtype))
    adapter = job["adapter"]
    if isinstance(adapter, dict):
        path, made = out.folder("adapter")
        make_adapter(load_model(job["model"], dtype), {"name": "adapter", **adapter}, path)
        adapter = str(path)
    else:
        made = None
    merged = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload()
    if getattr(merged, "hf_quantizer", None) is not None:
        # Loaded from GGUF, the weights are already plain dequantized tensors, but transformers
        # refuses to save a "gguf-quantized" model until the quantizer is dropped.
        merged.hf_quantizer = None
        merged.is_quantized = False
        if hasattr(merged.config, "quantization_config"):
            del merged.config.quantization_config
    path, ref = out.folder("merged")
    merged.save_pretrained(str(path))
    if job.get("save_tokenizer", True):
        try:
            load_tokenizer(job["model"]).save_pretrained(str(path))
        except (OSError, ValueError):
            pass  # Tiny random models have no tokenizer.
    return {"path": ref, "adapter": made, "files": sorted(p.name for p in path.iterdir())}


# ---------------------------------------------------------------------------------------------
# entry point

JOBS = {
    "generate": job_generate,
    "tokenize": job_tokenize,
    "make_adapters": job_make_adapters,
    "make_tiny_model": job_make_tiny_model,
    "merge": job_merge,
}


def run_job(job: dict, out: Output) -> dict:
    kind = job.get("kind")
    if kind == "batch":
        results: list[dict] = []
        for sub in job["jobs"]:
            results.append(run_job(_resolve_refs(sub, results, out), out))
        return {"results": results}
    if kind not in JOBS:
        raise JobError(f"unknown job kind {kind!r}; known: batch, {', '.join(sorted(JOBS))}")
    return JOBS[kind](job, out)


def _resolve_refs(value, results: list[dict], out: Output):
    """In a batch, ``{"__result__": [i, key, ...]}`` is a value from the i-th earlier result
    (an artifact becomes its absolute path), e.g. ``[0, "path"]`` or ``[1, "adapters", "a"]``."""
    if isinstance(value, dict) and set(value) == {"__result__"}:
        index, *keys = value["__result__"]
        if not 0 <= index < len(results):
            raise JobError(f"__result__ {value['__result__']!r} points at no earlier batch job")
        found = results[index]
        try:
            for key in keys:
                found = found[key]
        except (KeyError, IndexError, TypeError):
            raise JobError(f"__result__ {value['__result__']!r} names nothing") from None
        if isinstance(found, dict) and set(found) == {"__path__"}:
            return str(out.root / found["__path__"])
        return found
    if isinstance(value, dict):
        return {k: _resolve_refs(v, results, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_refs(v, results, out) for v in value]
    return value


def _set_threads() -> int:
    # One thread: batch-1 decode of small models is overhead-bound, and more threads only help
    # on an idle machine (CI has 2 cores, and pytest or other jobs may want them).
    threads = int(os.environ.get("JAXLORA_REF_THREADS", "1"))
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return threads


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: hf_ref.py JOB.json OUT_DIR", file=sys.stderr)
        return 2
    start = time.perf_counter()
    job = json.loads(Path(argv[0]).read_text())
    out = Output(Path(argv[1]))
    threads = _set_threads()
    transformers.logging.set_verbosity_error()
    try:
        result = run_job(job, out)
    except (JobError, ValueError) as error:  # PEFT and transformers reject bad input this way.
        traceback.print_exc()
        print(f"hf_ref: bad job: {type(error).__name__}: {error}", file=sys.stderr)
        return 3
    import peft

    result["meta"] = {
        "seconds": round(time.perf_counter() - start, 3),
        "threads": threads,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    (out.root / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
