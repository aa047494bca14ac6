"""The Hugging Face peer of `jaxlora bench`: transformers + PEFT on the same GPU, in its own process.

Llama-2-7B shape `LlamaForCausalLM` with random bf16 weights built on the device, greedy `generate`
of `--batch` random prompts of `--prompt-len` tokens:
  - base model only, `--gen-len` new tokens;
  - a mixed batch: `--adapters` distinct rank-`--rank` LoRA adapters on all seven projections, row i on
    adapter i % adapters through PEFT's `adapter_names=` (PEFT loops over the adapters of the batch in
    every LoRA layer, so a step costs seconds: `--mixed-gen-len` new tokens, fewer, by default).
Per case: tokens/s of the timed `generate` (prefill included, as jaxlora's end-to-end figure), the
time to first token (a 1-token `generate` of the whole batch) and the mean decode step
((t(N) - t(1)) / (N - 1)). Also the device-to-device copy bandwidth through torch, for reference.

    python -m benchmarks.engine.hf_peer --out hf_peer.json               # H200 (torch, transformers, peft)
    python -m benchmarks.engine.hf_peer --tiny --device cpu --out x.json  # smoke run on a toy shape

Runs under the image's torch python, never imports jax or jaxlora.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# This folder holds kernels.py, which would shadow the `kernels` package transformers probes for.
import torch

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA2_7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_gbps(device: str) -> float | None:
    """Device-to-device copy, bytes read + written, median of 10 (CUDA events)."""
    if device != "cuda":
        return None
    x = torch.empty(1 << 31, dtype=torch.uint8, device=device)  # 2 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * x.numel() / times[len(times) // 2] / 1e9


def timed_generate(model, ids, mask, new_tokens: int, device: str, **kw) -> float:
    sync(device)
    t0 = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    sync(device)
    return time.perf_counter() - t0


def measure(model, ids, mask, gen_len: int, device: str, **kw) -> dict:
    ttft = timed_generate(model, ids, mask, 1, device, **kw)
    total = timed_generate(model, ids, mask, gen_len, device, **kw)
    batch = ids.shape[0]
    return {
        "tokens_per_s": batch * gen_len / total,
        "ttft_ms": ttft * 1e3,
        "step_ms": (total - ttft) / max(gen_len - 1, 1) * 1e3,
        "gen_len": gen_len,
        "seconds": total,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--mixed-gen-len", type=int, default=8)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--skip-base", action="store_true", help="only the mixed-adapter batch")
    args = p.parse_args()

    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = args.device
    result = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "rank": args.rank,
        "rows": [],
    }
    result["copy_GBps"] = copy_gbps(dev)

    def save():
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)

    t = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if args.tiny else LLAMA2_7B))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    result["build_s"] = time.perf_counter() - t
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, config.vocab_size, (args.batch, args.prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        timed_generate(model, ids[:, :8], mask[:, :8], 2, dev)  # warm-up (cuBLAS handles, kernels)
        if not args.skip_base:
            result["rows"].append({"distinct_adapters": 0, **measure(model, ids, mask, args.gen_len, dev)})
            save()

    t = time.perf_counter()
    cfg = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=MODULES, lora_dropout=0.0, init_lora_weights=False
    )
    names = [f"a{i}" for i in range(args.adapters)]
    with torch.device(dev):
        peft_model = get_peft_model(model, cfg, adapter_name=names[0])
        for name in names[1:]:
            peft_model.add_adapter(name, cfg)
    peft_model = peft_model.to(torch.bfloat16).eval()
    result["adapters_build_s"] = time.perf_counter() - t
    print(f"built {len(names)} adapters in {result['adapters_build_s']:.1f} s", flush=True)
    row_names = [names[i % len(names)] for i in range(args.batch)]
    with torch.inference_mode():
        row = measure(peft_model, ids, mask, args.mixed_gen_len, dev, adapter_names=row_names)
    result["rows"].append({"distinct_adapters": len(set(row_names)), **row})
    save()


if __name__ == "__main__":
    main()
