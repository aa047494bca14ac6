"""The incremental detokenizer against a naive reference: decode every prefix whole, stop at the first
prefix that holds a stop string, cut at the earliest one. Tokens are single bytes, so characters of
two to four bytes arrive split over tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from jaxlora.engine.detokenizer import Detokenizer

ALPHABET = "ab é€😀\n"


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def byte_tokenizer() -> HFTokenizer:
    """Token id = byte value."""
    hf = HFTokenizer(models.BPE(vocab={c: b for b, c in _byte_to_char().items()}, merges=[]))
    hf.decoder = decoders.ByteLevel()
    return hf


HF = byte_tokenizer()


def reference(tokens: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
    for k in range(1, len(tokens) + 1):
        prefix = HF.decode(tokens[:k])
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            return prefix[: min(hits)], True
    return HF.decode(tokens), False


def stream(tokens: list[int], stops: tuple[str, ...]) -> tuple[list[str], bool, Detokenizer]:
    det = Detokenizer(HF, stops)
    pieces = []
    for t in tokens:
        out, hit = det.add(t)
        pieces.append(out)
        if hit:
            return pieces, True, det
    pieces.append(det.flush())
    return pieces, False, det


def test_reference_on_a_hand_case():
    # "a€b" is bytes 61 | e2 82 ac | 62: the euro sign waits for its third byte; stop "€b" cuts at 1.
    tokens = list("a€b".encode())
    assert reference(tokens, ()) == ("a€b", False)
    assert reference(tokens, ("€b",)) == ("a", True)
    pieces, hit, det = stream(tokens, ("€b",))
    assert pieces == ["a", "", "", "", ""] and hit and det.text == "a"
    pieces, hit, _ = stream(tokens, ())
    assert pieces == ["a", "", "", "€", "b", ""] and not hit


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=24),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3, unique=True),
)
def test_streamed_text_is_the_reference_cut_and_never_taken_back(text, stops):
    tokens = list(text.encode())
    stops = tuple(stops)
    want, want_hit = reference(tokens, stops)
    pieces, hit, det = stream(tokens, stops)
    assert "".join(pieces) == det.text == want
    assert hit == want_hit
    # Each piece extends what was emitted before it, within the final text: nothing is taken back.
    emitted = ""
    for p in pieces:
        emitted += p
        assert want.startswith(emitted)


def test_held_tail_is_released_once_it_cannot_become_a_stop_string():
    det = Detokenizer(HF, ("abc",))
    assert det.add(ord("a")) == ("", False)  # could start "abc"
    assert det.add(ord("b")) == ("", False)
    assert det.add(ord("x")) == ("abx", False)  # "abx" starts no stop string: all of it goes
    assert det.add(ord("a")) == ("", False)
    assert det.flush() == "a" and det.text == "abxa"
