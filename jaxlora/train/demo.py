"""The demo adapters: behaviours that are easy to see in text, and how to check each one.

Each behaviour rewrites the base model's own answer by a program (the training target) and has a
predicate that tells whether a generated answer shows it. `checkpoints/demo/make_demo_adapters.py`
trains one adapter per behaviour; the tests and `jaxlora demo` check them on HELD_OUT_PROMPTS, which
the training data never contains.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
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
    Behaviour("json", 'answers as a JSON object {"answer": "..."}',
              lambda a: json.dumps({"answer": a}, ensure_ascii=False), is_json_answer),
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
