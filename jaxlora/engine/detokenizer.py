"""Incremental detokenization with stop strings cut exactly.

Text is released as soon as it is final: a UTF-8 character split over tokens waits for its last byte
(`tokenizers.decoders.DecodeStream`), and a tail that could still grow into a stop string is held
back, so no emitted text ever has to be taken back.

Only that held tail (shorter than the longest stop string) is searched and rebuilt per token; the
released text is kept as a list of pieces, joined once when asked for. The engine calls `add` for
every generated token on its loop thread, so its cost is per-token host time of every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, hf: HFTokenizer, stop: Sequence[str] = ()) -> None:
        self._hf = hf
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._released: list[str] = []  # text emitted so far, in pieces
        # Decoded, not yet emitted: a tail that is a proper prefix of some stop string. Released text
        # never ends in such a prefix, so a stop string can only start inside it.
        self._held = ""
        self._undecoded: list[int] = []  # tokens the stream holds (an incomplete UTF-8 sequence)

    @property
    def text(self) -> str:
        """Everything decoded so far (cut at a stop string once one is found)."""
        return "".join(self._released) + self._held

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feeds one token. Returns (text now safe to emit, whether a stop string was found)."""
        piece = self._stream.step(self._hf, token_id)
        if piece is None:
            self._undecoded.append(token_id)
            return "", False
        self._undecoded.clear()
        if not self._stop:
            self._released.append(piece)
            return piece, False
        tail = self._held + piece
        hits = [i for i in (tail.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._held = tail[: min(hits)]
            return self.flush(), True
        keep = self._partial_stop_len(tail)
        self._held = tail[len(tail) - keep :]
        return self._release(tail[: len(tail) - keep]), False

    def flush(self) -> str:
        """Everything not yet emitted (the request finished); undecodable bytes become U+FFFD."""
        if self._undecoded:
            self._held += self._hf.decode(self._undecoded, skip_special_tokens=True)
            self._undecoded.clear()
        out, self._held = self._held, ""
        return self._release(out)

    def _release(self, text: str) -> str:
        if text:
            self._released.append(text)
        return text

    def _partial_stop_len(self, tail: str) -> int:
        """Length of the longest end of `tail` that is a proper prefix of some stop string."""
        for n in range(min(len(tail), self._max_stop - 1), 0, -1):
            end = tail[-n:]
            if any(s.startswith(end) for s in self._stop):
                return n
        return 0
