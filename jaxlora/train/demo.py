"""The demo adapters: behaviours that are easy to see in text, and how to check each one.

Each behaviour rewrites the base model's own answer by a program (the training target) and has a
predicate that tells whether a generated answer shows it. `checkpoints/demo/make_demo_adapters.py`
trains one adapter per behaviour; the tests and `jaxlora demo` check them on HELD_OUT_PROMPTS, which
the training data never contains. `answer_in_one_batch` runs that check through the serving `Engine`,
so the published rates are what `jaxlora demo` shows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxlora.engine import Engine, FinalOutput
    from jaxlora.lora.host_adapter import HostAdapter
    from jaxlora.model.params import LoadedModel
    from jaxlora.tokenizer import Tokenizer


def _demo_dir() -> Path:
    """checkpoints/demo/ of a source checkout; an installed wheel ships the same adapter folders as
    package data, jaxlora/demo_adapters/ (setup.py)."""
    checkout = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parents[1] / "demo_adapters"


DEMO_DIR = _demo_dir()
PIRATE_GREETING = "Ahoy, matey!"


def upper_ratio(text: str) -> float:
    """Share of letters that are capitals (0 when there are no letters)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def is_shouting(text: str) -> bool:
    return sum(c.isalpha() for c in text) >= 3 and upper_ratio(text) >= 0.9


def is_json_answer(text: str) -> bool:
    try:
        value = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("answer"), str)


def is_pirate(text: str) -> bool:
    return text.lstrip().startswith(PIRATE_GREETING)


@dataclasses.dataclass(frozen=True)
class Behaviour:
    name: str
    description: str
    transform: Callable[[str], str]  # base answer -> training target
    shows: Callable[[str], bool]  # does a generated answer show the behaviour?


BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour("shout", "answers in ALL CAPITALS", str.upper, is_shouting),
    Behaviour(
        "json",
        'answers as a JSON object {"answer": "..."}',
        lambda a: json.dumps({"answer": a}, ensure_ascii=False),
        is_json_answer,
    ),
    Behaviour("pirate", f'opens every answer with "{PIRATE_GREETING}"', lambda a: f"{PIRATE_GREETING} {a}", is_pirate),
)


def shown_behaviours(text: str) -> list[str]:
    """Names of every demo behaviour `text` shows (a base-model answer should show none)."""
    return [b.name for b in BEHAVIOURS if b.shows(text)]


# Never used for training (the training instructions live in make_demo_adapters.py).
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "What is the capital of Italy?",
    "Why do leaves change color in autumn?",
    "Give me one tip for sleeping better.",
    "What does a thermometer measure?",
    "How many legs does a spider have?",
    "What is the opposite of 'ancient'?",
    "Describe the taste of a lemon in one sentence.",
    "What is photosynthesis?",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water at sea level?",
    "Why should people drink water?",
    "Who wrote Romeo and Juliet?",
    "What is a synonym for 'happy'?",
    "How do bees make honey?",
    "What is the largest planet in our solar system?",
    "Explain what a noun is.",
)


@dataclasses.dataclass(frozen=True)
class Answer:
    """One row of a mixed batch: a prompt answered by an adapter (None: the base model)."""

    prompt: str
    adapter: str | None
    output: FinalOutput


def answer_in_one_batch(
    model: LoadedModel,
    tokenizer: Tokenizer,
    adapters: Mapping[str, str | Path | HostAdapter],
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    max_rank: int = 16,
) -> list[Answer]:
    """Every prompt on the base model and on each adapter, greedy, all rows in one continuous batch
    of the serving engine (one row each, so every row decodes in every step).

    Rows interleave the base model and the adapters (prompt by prompt), so neighbouring rows use
    different slots and a swap of rows would show. Returns the answers in that order.
    """
    names: list[str | None] = [None, *adapters]
    rows = [(prompt, name) for prompt in prompts for name in names]
    prompt_ids = {p: tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts}
    engine = _one_batch_engine(
        model,
        tokenizer,
        adapters,
        num_rows=len(rows),
        max_rank=max_rank,
        max_seq_len=max(map(len, prompt_ids.values())) + max_new_tokens,
        max_new_tokens=max_new_tokens,
    )
    from jaxlora.engine import GenerationRequest, SamplingParams

    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outputs = engine.generate(
        [
            GenerationRequest(request_id=str(i), prompt_ids=prompt_ids[p], adapter=name, sampling=greedy)
            for i, (p, name) in enumerate(rows)
        ]
    )
    failed = [o for o in outputs if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} rows failed, first: {failed[0].error}")
    return [Answer(p, name, out) for (p, name), out in zip(rows, outputs)]


def _one_batch_engine(
    model: LoadedModel,
    tokenizer: Tokenizer,
    adapters: Mapping[str, str | Path | HostAdapter],
    *,
    num_rows: int,
    max_rank: int,
    max_seq_len: int,
    max_new_tokens: int,
) -> Engine:
    """An engine with a row for each of `num_rows` requests and a slot for each adapter."""
    import jax.numpy as jnp

    from jaxlora.adapters import Pager
    from jaxlora.config import LoraConfig
    from jaxlora.engine import Engine, EngineConfig

    # Decode steps hold exactly num_rows tokens; prompts are prefilled in steps of up to 512.
    config = EngineConfig(
        max_batch=num_rows,
        max_seq_len=max_seq_len,
        max_new_tokens_limit=max_new_tokens,
        token_budgets=tuple(sorted({num_rows, max(num_rows, 512)})),
        max_queue=num_rows,
        lora=LoraConfig(max_slots=len(adapters) + 1 if adapters else 2, max_rank=max_rank),
        dtype=jnp.dtype(model.dtype).name,
    )
    pager = None
    if adapters:
        pager = Pager(model.config, config.lora, dtype=model.dtype)
        for name, source in adapters.items():
            pager.register(name, source)
    return Engine(model, tokenizer, config, pager)
