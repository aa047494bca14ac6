"""Tokenizer and chat template: `tokenizers` for BPE, jinja2 for the checkpoint's chat template.

Two sources: a Hugging Face `tokenizer.json` (+ `tokenizer_config.json` for the template and special
tokens), read here, or the byte-level BPE stored in GGUF metadata (jaxlora.loading.gguf_tokenizer).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from jaxlora.errors import ModelLoadError
from jaxlora.token_bytes import decoder_types, token_bytes


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> token ids, plus the chat template and the ids that end generation."""

    hf: HFTokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos: bool = False

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for (special tokens included): a text of
        more than `n * max_token_bytes` bytes cannot tokenize to `n` tokens or fewer."""
        return max(len(self.hf.decode([i], skip_special_tokens=False).encode()) for i in range(self.vocab_size))

    @functools.cached_property
    def chat_overhead(self) -> ChatOverhead:
        """What each message adds to a chat prompt beyond its own text, at least (see ChatOverhead)."""
        return ChatOverhead.measure(self)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch runs the Rust tokenizer with the GIL released (encode holds it: one long prompt
        # stalled every other Python thread, the engine loop included).
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    @functools.cached_property
    def _byte_decoding(self) -> tuple[frozenset[str], frozenset[int]]:
        return decoder_types(self.hf), frozenset(self.hf.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for, also when that is part of a UTF-8 character
        (jaxlora.token_bytes)."""
        types, added = self._byte_decoding
        return token_bytes(self.hf, token_id, types=types, added=added)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Renders messages ([{"role", "content"}]) with the checkpoint's template (sandboxed jinja2)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be an object with string 'role' and 'content'")
        return _compile_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            eos_token=self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        # The template already writes any BOS it wants.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatOverhead:
    """Lower bounds on what one more message adds to a rendered chat, beyond its own strings: the
    template's markup around it, in bytes and in tokens. With them a chat is refused by its size
    before the template runs (a million empty messages render and tokenize for seconds).

    Measured once, as the difference between one and two messages with empty role and content.
    Token merges across the markup's two edges can join a markup token with the text beside it,
    so two tokens are taken off the measured count.
    """

    bytes_per_message: int = 0
    tokens_per_message: int = 0

    @classmethod
    def measure(cls, tokenizer: Tokenizer) -> ChatOverhead:
        empty = {"role": "", "content": ""}
        try:
            one, two = (tokenizer.apply_chat_template([empty] * n, add_generation_prompt=False) for n in (1, 2))
        except (ValueError, jinja2.exceptions.TemplateError):  # no template, or it refuses empty roles
            return cls()
        num_tokens = [len(tokenizer.encode(t, add_special_tokens=False)) for t in (one, two)]
        return cls(
            bytes_per_message=max(0, len(two.encode()) - len(one.encode())),
            tokens_per_message=max(0, num_tokens[1] - num_tokens[0] - 2),
        )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment settings as Hugging Face's chat templating, sandboxed.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def tokenizer_from_folder(folder: Path, *, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """`tokenizer.json` + optional `tokenizer_config.json` (template, BOS/EOS) of an HF folder."""
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    try:
        hf = HFTokenizer.from_file(str(tj))
    except Exception as e:
        raise ModelLoadError(f"{tj}: cannot read tokenizer ({e})") from None
    tc_path = folder / "tokenizer_config.json"
    tc: dict[str, Any] = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    template = tc.get("chat_template")
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_id(key: str) -> int | None:
        tok = tc.get(key)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        return None if tok is None else hf.token_to_id(tok)

    eos = tuple(eos_token_ids) or tuple(i for i in [token_id("eos_token")] if i is not None)
    return Tokenizer(
        hf=hf,
        chat_template=template,
        eos_token_ids=eos,
        bos_token_id=token_id("bos_token"),
        add_bos=bool(tc.get("add_bos_token", False)),
    )


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    """Writes tokenizer.json + tokenizer_config.json so the folder loads with `tokenizer_from_folder`
    (and with Hugging Face's AutoTokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(folder / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok.add_bos,
        "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template is not None:
        cfg["chat_template"] = tok.chat_template
    if tok.eos_token_ids:
        cfg["eos_token"] = tok.hf.id_to_token(tok.eos_token_ids[0])
    if tok.bos_token_id is not None:
        cfg["bos_token"] = tok.hf.id_to_token(tok.bos_token_id)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
