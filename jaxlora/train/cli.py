"""`jaxlora train`: LoRA fine-tuning of a base model on a JSONL file, saved as a PEFT folder.

    jaxlora train --data train.jsonl --out adapters/mine --steps 200

OUT receives adapter_config.json + adapter_model.safetensors (Hugging Face PEFT loads it as is),
train_log.json (settings, loss history, time) and train_state/ (orbax checkpoints for --resume).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxlora.errors import JaxloraError
from jaxlora.train.data import MIN_EXAMPLES_FOR_HOLDOUT, read_jsonl, split_holdout, tokenize_conversation
from jaxlora.train.lora_params import ALL_LINEAR, AdapterSpec, parse_targets
from jaxlora.train.step import OptimizerConfig

STATE_DIR = "train_state"
LOG_FILE = "train_log.json"


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help='JSONL: {"prompt", "response"} or {"messages"} per line')
    p.add_argument("--out", required=True, help="folder for the PEFT adapter (created)")
    p.add_argument(
        "--base",
        default=None,
        help="base model: GGUF file, Hugging Face folder or converted "
        "checkpoint (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale = alpha / r)")
    p.add_argument("--rslora", action="store_true", help="scale alpha / sqrt(r) instead of alpha / r")
    p.add_argument(
        "--targets",
        default="q_proj,v_proj",
        help=f"comma-separated projections, or {ALL_LINEAR} (default: q_proj,v_proj)",
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--batch", type=int, default=8, help="conversations per step")
    p.add_argument("--max-len", type=int, default=512, help="truncate conversations to this many tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help=f"share of the data held out for eval loss (none with fewer than {MIN_EXAMPLES_FOR_HOLDOUT} examples)",
    )
    p.add_argument("--eval-every", type=int, default=50, help="held-out loss every N steps (0: only at the end)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint the training state every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state if it exists")
    p.add_argument(
        "--save-dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the saved adapter tensors",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace):
    """The run's TrainConfig (raises ValueError on bad values)."""
    from jaxlora.train.loop import TrainConfig

    spec = AdapterSpec(
        rank=args.rank, alpha=args.alpha, target_modules=parse_targets(args.targets), use_rslora=args.rslora
    )
    warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    optim = OptimizerConfig(
        learning_rate=args.lr,
        num_steps=args.steps,
        warmup_steps=warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.clip,
    )
    return TrainConfig(
        spec=spec,
        optim=optim,
        batch_size=args.batch,
        max_len=args.max_len,
        seed=args.seed,
        eval_every=args.eval_every,
        checkpoint_every=args.save_every,
    )


def run_train(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        conversations = read_jsonl(args.data)
    except (OSError, ValueError) as e:
        print(f"jaxlora train: {e}", file=sys.stderr)
        return 2
    from jaxlora.loading import load_model
    from jaxlora.train.export import save_adapter
    from jaxlora.train.loop import train

    out = Path(args.out)
    try:
        model, tok = load_model(args.base)
        examples = [tokenize_conversation(tok, c) for c in conversations]
        train_set, eval_set = split_holdout(examples, fraction=args.eval_fraction, seed=args.seed)
        if args.eval_fraction > 0 and len(examples) < MIN_EXAMPLES_FOR_HOLDOUT:
            print(
                f"warning: {len(examples)} examples, fewer than {MIN_EXAMPLES_FOR_HOLDOUT}: all are trained on, "
                "none is held out for an eval loss",
                file=sys.stderr,
            )
        print(
            f"{len(train_set)} training / {len(eval_set)} held-out conversations; adapter: rank {config.spec.rank}, "
            f"{', '.join(config.spec.target_modules)} ({count_params_of(model, config.spec):,} parameters)",
            file=sys.stderr,
        )
        result = train(
            model,
            train_set,
            eval_set,
            config,
            checkpoint_dir=out / STATE_DIR,
            resume=args.resume,
            progress=not args.no_progress,
            on_estimate=lambda line: print(line, file=sys.stderr, flush=True),
        )
        save_adapter(
            out,
            result.params,
            config.spec,
            base_model_name_or_path=str(args.base or "SmolLM2-135M-Instruct"),
            dtype=args.save_dtype,
        )
    except (JaxloraError, ValueError, OSError) as e:
        print(f"jaxlora train: {e}", file=sys.stderr)
        return 1
    log = {
        "config": config.record(),
        "train_examples": len(train_set),
        "eval_examples": len(eval_set),
        "seconds": result.seconds,
        "final_train_loss": result.final_train_loss(),
        "final_eval_loss": result.last("eval_loss"),
        "history": result.history,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (out / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    eval_text = "" if log["final_eval_loss"] is None else f", held-out loss {log['final_eval_loss']:.4f}"
    print(
        f"saved {out} after {config.optim.num_steps} steps in {result.seconds:.1f}s: train loss "
        f"{log['final_train_loss']:.4f} (moving average, as the progress bar shows){eval_text}"
    )
    return 0


def count_params_of(model, spec: AdapterSpec) -> int:
    return sum(model.config.num_layers * spec.rank * sum(model.config.module_shape(m)) for m in spec.target_modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="jaxlora train", description=__doc__.splitlines()[0])
    add_train_args(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
