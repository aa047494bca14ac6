"""A token's raw bytes (chat logprobs' `bytes`), also for tokens that hold part of a UTF-8 character."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from jaxlora.tokenizer import Tokenizer

TEXTS = ["héllo wörld", "naïve café 🙂🚀", "鿰龘𠀋 ꧁꧂", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ascii"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_to_the_texts_utf8(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(smollm2_tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_a_token_holding_part_of_a_character_gives_its_bytes_not_the_replacement(smollm2_tokenizer):
    ids = [i for text in TEXTS for i in smollm2_tokenizer.encode(text, add_special_tokens=False)]
    partial = []
    for i in ids:
        raw = smollm2_tokenizer.token_bytes(i)
        try:
            raw.decode()
        except UnicodeDecodeError:
            partial.append(i)
    assert partial, "no token of TEXTS splits a character: pick rarer characters"
    for i in partial:
        assert "\ufffd" in smollm2_tokenizer.decode([i])  # what decoding it alone gives
        assert b"\xef\xbf\xbd" not in smollm2_tokenizer.token_bytes(i)


def test_special_tokens_are_their_text(smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_ids[0]
    assert smollm2_tokenizer.token_bytes(eos) == smollm2_tokenizer.token_text(eos).encode()


def test_sentencepiece_byte_fallback_and_word_marks():
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581h": 3, "i": 4}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(hf=hf, chat_template=None, eos_token_ids=(), bos_token_id=None)
    assert [tok.token_bytes(i) for i in (3, 4, 1, 2)] == [b" h", b"i", b"\xc3", b"\xa9"]
    assert tok.decode([1]) != "\xc3"  # alone, the byte is not a character
