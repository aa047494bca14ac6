"""The raw bytes one token stands for (the `bytes` of OpenAI's chat logprobs).

Decoding a token alone is not enough: a byte-level BPE token may hold part of a UTF-8 character
(an emoji spans several tokens), and decoding it alone gives U+FFFD, whose bytes are not the token's.
The token's own string, read through its tokenizer's byte mapping, is:
- byte-level BPE (GPT-2, Llama 3, SmolLM2): each character stands for one byte (GPT-2's table);
- SentencePiece with byte fallback (Llama 2): `<0xNN>` is byte NN, `▁` is a space;
- anything else (special tokens, other decoders): the decoded text's UTF-8.
"""

from __future__ import annotations

import functools
import json
import re

from tokenizers import Tokenizer as HFTokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's word-start mark


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> the byte.
    Printable bytes stand for themselves; the others take 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def decoder_types(hf: HFTokenizer) -> frozenset[str]:
    """The types of the tokenizer's decoder (and of a Sequence's parts), e.g. {"ByteLevel"}."""
    decoder = json.loads(hf.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return frozenset(p.get("type") for p in parts if p)


def token_bytes(hf: HFTokenizer, token_id: int, *, types: frozenset[str], added: frozenset[int]) -> bytes:
    """The bytes `token_id` stands for. `types`: `decoder_types(hf)`; `added`: the ids of added and
    special tokens (`hf.get_added_tokens_decoder()`), both computed once by the caller."""
    token = hf.id_to_token(token_id)
    if token is None:
        return b""
    if token_id in added:
        return token.encode()  # a special or added token is its literal text
    if "ByteLevel" in types:
        table = _byte_of_char()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
    if "ByteFallback" in types and (m := _BYTE_TOKEN.fullmatch(token)):
        return bytes([int(m.group(1), 16)])
    if "Metaspace" in types or "Replace" in types:
        return token.replace(_SPACE, " ").encode()
    return hf.decode([token_id], skip_special_tokens=False).encode()
