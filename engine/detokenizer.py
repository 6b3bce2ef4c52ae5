"""Incremental detokenization and stop strings.

Text is produced by decoding a small window of recent ids and emitting only what grew, and never while the
window ends in an incomplete UTF-8 sequence (U+FFFD). Stop strings are matched on the text across token
boundaries: a tail that could still become a stop string is held back, and the stop string itself is never
emitted."""
from __future__ import annotations

from engine.tokenizer import Tokenizer

_CONTEXT = 5  # prompt tokens decoded as context, for tokenizers whose pieces depend on their left neighbour


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # emitted so far
        self._held = ""

    def _decode_new(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]

    def add(self, new_ids: list[int]) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched or None)."""
        buf = self._held + self._decode_new(new_ids)
        self._held = ""
        if self.stop:
            hits = [(buf.find(s), s) for s in self.stop if s in buf]
            if hits:
                idx, s = min(hits)
                self.text += buf[:idx]
                return buf[:idx], s
            hold = self._stop_prefix_len(buf)
            if hold:
                self._held = buf[-hold:]
                buf = buf[:-hold]
        self.text += buf
        return buf, None

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self.max_stop - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """At the end (length, stop token): text held back for a stop string that never came, and tokens
        still waiting to complete a UTF-8 sequence (decoded as they are)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        out, self._held = self._held + full[len(prefix):], ""
        self.text += out
        return out
