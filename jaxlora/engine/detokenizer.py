"""Incremental detokenization with stop strings cut exactly.

Text is released as soon as it is final: a UTF-8 character split over tokens waits for its last byte
(`tokenizers.decoders.DecodeStream`), and a tail that could still grow into a stop string is held
back, so no emitted text ever has to be taken back.
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
        self.text = ""  # everything decoded so far (cut at a stop string once one is found)
        self._num_emitted = 0
        self._undecoded: list[int] = []  # tokens the stream holds (an incomplete UTF-8 sequence)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feeds one token. Returns (text now safe to emit, whether a stop string was found)."""
        before = len(self.text)
        piece = self._stream.step(self._hf, token_id)
        self._undecoded.append(token_id)
        if piece is not None:
            self.text += piece
            self._undecoded.clear()
        if self._stop and len(self.text) > before:
            # A match must end inside the new text; it may start up to max_stop - 1 chars earlier.
            search_from = max(0, before - self._max_stop + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self.flush(), True
        return self._take(len(self.text) - self._partial_stop_len()), False

    def flush(self) -> str:
        """Everything not yet emitted (the request finished); undecodable bytes become U+FFFD."""
        if self._undecoded:
            self.text += self._hf.decode(self._undecoded, skip_special_tokens=True)
            self._undecoded.clear()
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self._num_emitted)
        out = self.text[self._num_emitted : end]
        self._num_emitted = end
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest unemitted tail that is a proper prefix of some stop string."""
        tail = self.text[self._num_emitted :]
        for n in range(min(len(tail), self._max_stop - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0
