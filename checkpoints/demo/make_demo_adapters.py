"""Makes the demo adapters in this folder: shout, json, pirate (see jaxlora/train/demo.py).

    python checkpoints/demo/make_demo_adapters.py            # all three (CPU: ~15 minutes)
    python checkpoints/demo/make_demo_adapters.py --only shout --steps 80

1. The base model (SmolLM2-135M-Instruct) answers every instruction below greedily (cached in
   base_answers.jsonl: delete it to regenerate).
2. Each behaviour rewrites those answers by a program: upper-case, wrap as JSON, prepend a greeting.
3. One LoRA adapter per behaviour is trained with jaxlora.train and saved as a PEFT folder (bf16).
4. The saved adapters are registered from their folders with the serving engine and checked on
   held-out prompts in ONE continuous batch (base rows and every adapter's rows together, greedy;
   `jaxlora.train.demo.answer_in_one_batch`); results.json and README.md record the rates.
Everything is seeded (SEED); the run is deterministic on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxlora.engine import FinishReason
from jaxlora.loading import load_model
from jaxlora.train.data import split_holdout, tokenize_conversation
from jaxlora.train.demo import BEHAVIOURS, HELD_OUT_PROMPTS, answer_in_one_batch, shown_behaviours
from jaxlora.train.export import save_adapter
from jaxlora.train.loop import TrainConfig, train
from jaxlora.train.lora_params import AdapterSpec, parse_targets
from jaxlora.train.step import OptimizerConfig

HERE = Path(__file__).resolve().parent
SEED = 0
MAX_ANSWER_TOKENS = 48
EVAL_NEW_TOKENS = 64

INSTRUCTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Canada?",
    "Name a fruit that is yellow.",
    "Name three primary colors.",
    "What color is the sky on a clear day?",
    "How many days are in a week?",
    "How many hours are in a day?",
    "How many continents are there?",
    "What is two plus two?",
    "What is ten times five?",
    "Is seven an odd or even number?",
    "What do cows drink?",
    "What animal is known as the king of the jungle?",
    "What do bees produce?",
    "Why is the ocean salty?",
    "Why do we have seasons?",
    "Why is the sky blue?",
    "What is gravity?",
    "What is electricity?",
    "What is a volcano?",
    "What is an atom?",
    "What is the sun made of?",
    "What is the moon?",
    "What causes rain?",
    "What is a rainbow?",
    "Who painted the Mona Lisa?",
    "Who was Albert Einstein?",
    "Who invented the telephone?",
    "Give me a tip for studying.",
    "Give me one tip for staying healthy.",
    "How can I save money?",
    "How do I make a cup of tea?",
    "How do I boil an egg?",
    "How do plants grow?",
    "What is a good breakfast?",
    "Suggest a name for a puppy.",
    "Suggest a hobby for a rainy day.",
    "What is the opposite of 'hot'?",
    "What is a synonym for 'big'?",
    "What is the plural of 'mouse'?",
    "Define the word 'gratitude'.",
    "Define the word 'curious'.",
    "What does 'generous' mean?",
    "Explain what a verb is.",
    "Explain what a computer is.",
    "Explain what the internet is.",
    "What is Python?",
    "What is a database?",
    "What is an algorithm?",
    "Tell me a fun fact about cats.",
    "Tell me a fun fact about space.",
    "Tell me a fun fact about octopuses.",
    "Describe a sunset in one sentence.",
    "Describe the smell of rain.",
    "Describe a forest in one sentence.",
    "What is the tallest mountain in the world?",
    "What is the longest river in the world?",
    "What is the largest ocean?",
    "What is the smallest planet?",
    "How far is the moon from Earth?",
    "What language is spoken in Brazil?",
    "What is the currency of Japan?",
    "Where is the Eiffel Tower?",
    "What is the freezing point of water?",
    "What is the chemical symbol for gold?",
    "What gas do plants absorb?",
    "How do airplanes fly?",
    "How does a refrigerator keep food cold?",
    "How does a compass work?",
    "What is a healthy snack?",
    "Why is exercise important?",
    "Why do we need sleep?",
    "What is friendship?",
    "What makes a good teacher?",
    "What is kindness?",
    "Write one sentence about the ocean.",
    "Write a short greeting for a birthday card.",
    "Write a one-line motto for a bakery.",
    "Say something encouraging.",
    "Give me a word that rhymes with 'cat'.",
    "What is the first letter of the alphabet?",
    "Spell the word 'apple' backwards.",
    "Count from one to five.",
    "What is the square root of sixteen?",
    "What is half of one hundred?",
    "What is a triangle?",
    "What is a mammal?",
    "Are dolphins fish?",
    "What do caterpillars turn into?",
    "What is recycling?",
    "Why are trees important?",
    "What is climate?",
    "What is a library?",
    "What does a doctor do?",
    "What does a firefighter do?",
    "What instrument has black and white keys?",
    "What sport uses a racket and a shuttlecock?",
    "What is the main ingredient in bread?",
    "What is cheese made from?",
    "What vegetable is orange and crunchy?",
]


def clip_answer(text: str, finished: bool) -> str:
    """An unfinished answer is cut back to its last full sentence (or word), so targets read well."""
    text = text.strip()
    if finished:
        return text
    cut = max(text.rfind(". "), text.rfind("! "), text.rfind("? "), text.rfind(".\n"))
    if cut > len(text) // 3:
        return text[: cut + 1]
    return text.rsplit(" ", 1)[0].rstrip(",;:") + "."


def base_answers(model, tok) -> list[dict]:
    cache = HERE / "base_answers.jsonl"
    if cache.is_file():
        rows = [json.loads(line) for line in cache.read_text().splitlines()]
        if [r["prompt"] for r in rows] == INSTRUCTIONS:
            return rows
    answers = answer_in_one_batch(model, tok, {}, INSTRUCTIONS, max_new_tokens=MAX_ANSWER_TOKENS)
    rows = [
        {"prompt": a.prompt, "response": clip_answer(a.output.text, a.output.finish_reason is FinishReason.STOP)}
        for a in answers
    ]
    cache.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return rows


def train_config(args) -> TrainConfig:
    spec = AdapterSpec(rank=args.rank, alpha=args.alpha, target_modules=parse_targets(args.targets))
    optim = OptimizerConfig(learning_rate=args.lr, num_steps=args.steps, warmup_steps=max(1, args.steps // 10))
    return TrainConfig(
        spec=spec,
        optim=optim,
        batch_size=args.batch,
        max_len=256,
        seed=SEED,
        eval_every=max(1, args.steps // 4),
        checkpoint_every=0,
    )


def train_all(model, tok, answers: list[dict], args, out_dir: Path) -> dict:
    config = train_config(args)
    results = {}
    for behaviour in BEHAVIOURS:
        if args.only and behaviour.name not in args.only:
            continue
        examples = [
            tokenize_conversation(
                tok,
                [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": behaviour.transform(r["response"])},
                ],
            )
            for r in answers
        ]
        train_set, eval_set = split_holdout(examples, fraction=0.1, seed=SEED)
        result = train(model, train_set, eval_set, config, description=behaviour.name)
        save_adapter(
            out_dir / behaviour.name,
            result.params,
            config.spec,
            base_model_name_or_path="SmolLM2-135M-Instruct",
            dtype="bfloat16",
        )
        results[behaviour.name] = {
            "seconds": round(result.seconds, 1),
            "final_train_loss": round(result.final_train_loss(), 4),
            "final_eval_loss": round(result.last("eval_loss"), 4),
            "train_examples": len(train_set),
            "eval_examples": len(eval_set),
            "first_loss": round(result.history[0]["loss"], 4),
        }
        print(behaviour.name, results[behaviour.name], flush=True)
    return {"config": config.record(), "adapters": results}


def check_behaviours(
    model, tok, out_dir: Path, prompts=HELD_OUT_PROMPTS, max_new_tokens: int = EVAL_NEW_TOKENS
) -> dict:
    """One continuous batch of the engine: every prompt on the base model and on each adapter
    registered from its folder."""
    behaviours = {b.name: b for b in BEHAVIOURS if (out_dir / b.name / "adapter_config.json").is_file()}
    start = time.perf_counter()
    answers = answer_in_one_batch(
        model, tok, {name: out_dir / name for name in behaviours}, prompts, max_new_tokens=max_new_tokens
    )
    seconds = time.perf_counter() - start
    samples = [{"prompt": a.prompt, "adapter": a.adapter, "text": a.output.text} for a in answers]
    rates = {}
    for name in [None, *behaviours]:
        texts = [x["text"] for x in samples if x["adapter"] == name]
        if name is None:
            rates["base (shows none)"] = float(np.mean([not shown_behaviours(t) for t in texts]))
        else:
            rates[name] = float(np.mean([behaviours[name].shows(t) for t in texts]))
    return {"rates": rates, "rows": len(samples), "seconds": round(seconds, 1), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default="all-linear")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--only", nargs="*", help="train only these behaviours")
    p.add_argument("--eval-only", action="store_true", help="only check the saved adapters")
    p.add_argument("--base", default=None, help="the SmolLM2-135M-Instruct GGUF (default: the embedded one)")
    p.add_argument("--out", type=Path, default=HERE, help="where the adapters and results go (default: here)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    model, tok = load_model(args.base)
    answers = base_answers(model, tok)
    results_file = args.out / ("results.json" if not args.only else "results_partial.json")
    report = json.loads(results_file.read_text()) if args.eval_only and results_file.is_file() else {"seed": SEED}
    platform = jax.default_backend()
    if not args.eval_only:
        report["training"] = {"device": jax.devices()[0].device_kind, **train_all(model, tok, answers, args, args.out)}
    report.setdefault("behaviour", {})[platform] = check_behaviours(model, tok, args.out)
    report["seconds_" + ("eval" if args.eval_only else "total")] = round(time.perf_counter() - start, 1)
    print(json.dumps(report["behaviour"][platform]["rates"], indent=1))
    for s in report["behaviour"][platform]["samples"][:8]:
        print(f"[{s['adapter'] or 'base'}] {s['prompt']!r} -> {s['text']!r}")
    results_file.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
