"""Training data: JSONL conversations -> chat-templated token ids with a loss mask, then batches.

A line is `{"prompt": str, "response": str}` or `{"messages": [{"role", "content"}, ...]}`. The loss
covers every assistant turn's tokens, its end-of-turn token included (so the adapter learns to stop),
and nothing else: not the system prompt, not the user turns, not the template's role headers.

Prompt tokens are exactly what inference feeds the model (`Tokenizer.encode_chat` of the messages
before the turn), so what the adapter is trained on is what it is served with.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxlora.tokenizer import Tokenizer

# Padded lengths: multiples of 16 up to 128, then powers of two and 1.5x powers of two, so short
# chat turns waste little and long ones compile the step for only a handful of shapes.
_FINE_STEP = 16
_FINE_LIMIT = 128


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized conversation. ids [n] int32; loss_mask [n] bool, True where ids[i] is a target."""

    ids: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Next-token training batch (numpy, padded on the right).

    tokens: [b, t] int32 inputs; targets: [b, t] int32 the next token of each input;
    weights: [b, t] float32, 1 where the target is a response token, 0 elsewhere (padding too).
    """

    tokens: np.ndarray
    targets: np.ndarray
    weights: np.ndarray


def read_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """Reads conversations; raises ValueError naming the line of a malformed record."""
    conversations = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                conversations.append(record_messages(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not conversations:
        raise ValueError(f"{path}: no training records")
    return conversations


def record_messages(record: object) -> list[dict[str, str]]:
    """A JSONL record -> chat messages ending with an assistant turn."""
    if not isinstance(record, dict):
        raise ValueError("a record must be a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        raise ValueError('a record needs "prompt" and "response" strings, or "messages"')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must have string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages[1:]):
        raise ValueError("the conversation has no assistant turn after the first message to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def tokenize_conversation(tok: Tokenizer, messages: Sequence[dict[str, str]]) -> Example:
    """Chat-templates `messages`; the mask covers each assistant turn up to its end-of-turn token."""
    ids: list[int] = []
    mask: list[bool] = []
    done = ""  # template text already tokenized
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prefix = tok.apply_chat_template(messages[:i], add_generation_prompt=True)
        full = tok.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not (prefix.startswith(done) and full.startswith(prefix)):
            raise ValueError("the chat template does not render conversations incrementally; cannot mask turns")
        context = tok.encode(prefix[len(done) :], add_special_tokens=not done)
        turn = tok.encode(full[len(prefix) :], add_special_tokens=False)
        ids += context + turn
        mask += [False] * len(context) + _turn_mask(turn, tok.eos_token_ids)
        done = full
    return Example(ids=np.asarray(ids, np.int32), loss_mask=np.asarray(mask, bool))


def _turn_mask(turn: list[int], eos_ids: Sequence[int]) -> list[bool]:
    """True up to and including the first end-of-turn token; the template's trailing text is not learned."""
    end = next((i for i, t in enumerate(turn) if t in eos_ids), len(turn) - 1)
    return [i <= end for i in range(len(turn))]


def bucket_length(n: int, max_len: int) -> int:
    """Smallest bucket (16, 32, ..., 128, 192, 256, 384, 512, ...) >= n, capped at max_len."""
    if n <= _FINE_LIMIT:
        return min(-(-max(n, 1) // _FINE_STEP) * _FINE_STEP, max_len)
    size = _FINE_LIMIT
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, max_len)


# Fewer examples than this are all trained on: holding one out of a handful would cost the adapter
# a real share of its data for a held-out loss too noisy to read.
MIN_EXAMPLES_FOR_HOLDOUT = 10


def split_holdout(examples: Sequence[Example], *, fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Deterministic (train, held-out) split; held-out is empty for fraction 0 or fewer than
    MIN_EXAMPLES_FOR_HOLDOUT examples."""
    if not 0 <= fraction < 1:
        raise ValueError(f"eval fraction={fraction} must be in [0, 1)")
    order = np.random.default_rng(seed).permutation(len(examples))
    enough = len(examples) >= MIN_EXAMPLES_FOR_HOLDOUT
    num_eval = min(math.ceil(fraction * len(examples)), len(examples) - 1) if enough else 0
    held = {int(i) for i in order[:num_eval]}
    return ([e for i, e in enumerate(examples) if i not in held], [examples[int(i)] for i in order[:num_eval]])


def make_batch(examples: Sequence[Example], *, max_len: int, pad_id: int = 0, rows: int | None = None) -> Batch:
    """Pads `examples` (truncated to max_len + 1 tokens) to [rows, bucket]; missing rows are all padding."""
    rows = rows or len(examples)
    longest = max(min(len(e), max_len + 1) for e in examples) - 1
    t = bucket_length(max(longest, 1), max_len)
    tokens = np.full((rows, t), pad_id, np.int32)
    targets = np.full((rows, t), pad_id, np.int32)
    weights = np.zeros((rows, t), np.float32)
    for r, e in enumerate(examples):
        n = min(len(e), t + 1)
        tokens[r, : n - 1] = e.ids[: n - 1]
        targets[r, : n - 1] = e.ids[1:n]
        weights[r, : n - 1] = e.loss_mask[1:n]
    return Batch(tokens=tokens, targets=targets, weights=weights)


def train_batch(examples: Sequence[Example], step: int, *, batch_size: int, seed: int, max_len: int) -> Batch:
    """The batch of training step `step`: a pure function of (step, seed), so a resumed run sees the
    same batches. Examples are shuffled once per epoch."""
    n = len(examples)
    orders: dict[int, np.ndarray] = {}
    picks = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng((seed, epoch)).permutation(n)
        picks.append(examples[int(orders[epoch][index])])
    return make_batch(picks, max_len=max_len)


def eval_batches(examples: Sequence[Example], *, batch_size: int, max_len: int) -> Iterator[Batch]:
    """Held-out examples in order, sorted by length so padding stays small; the last batch is padded."""
    ordered = sorted(examples, key=len)
    for start in range(0, len(ordered), batch_size):
        yield make_batch(ordered[start : start + batch_size], max_len=max_len, rows=batch_size)
