"""The byte-level BPE tokenizer stored in GGUF metadata, rebuilt with the `tokenizers` library."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxlora.errors import ModelLoadError
from jaxlora.loading.gguf_file import field_array
from jaxlora.tokenizer import Tokenizer

# llama.cpp pre-tokenizer names -> pre-tokenizer builders (the regexes llama.cpp uses for them).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_PRE_TOKENIZERS = {
    "gpt2": _byte_level,
    "default": _byte_level,
    # SmolLM: every digit on its own, then the GPT-2 regex.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_PATTERN),
}


def tokenizer_from_gguf(reader: Any, meta: dict[str, Any], *, source: str) -> Tokenizer:
    """Rebuilds the byte-level BPE tokenizer stored in GGUF metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"{source}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE "
            "'gpt2'); convert the model to a Hugging Face folder with tokenizer.json"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    tokens = field_array(reader, "tokenizer.ggml.tokens") or []
    merges = field_array(reader, "tokenizer.ggml.merges") or []
    types = field_array(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    hf.decoder = decoders.ByteLevel()
    # CONTROL (3) and USER_DEFINED (4) tokens are matched whole, before BPE.
    hf.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (3, 4)]
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        hf=hf,
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
