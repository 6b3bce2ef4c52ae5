"""One request's progress through its grammar: an xgrammar matcher that has accepted exactly the request's
output tokens so far, so retraction (which keeps the output) needs nothing restored, and a decode worker that
receives the first token from a prefill worker accepts it and goes on.

Jump-forward: where the grammar allows exactly one continuation (a fixed key, punctuation), its text is turned
into tokens without running the model for each. The text is tokenized together with the last output token's
text and used only if that tokenization keeps the last token as it is, so the jumped tokens are what the
tokenizer itself writes after it; the final jumped token is left for the model to sample (it may merge with
what follows). A jump that would hold a special token is not taken."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class GrammarRejected(RuntimeError):
    """The grammar does not allow a token that was produced (a failure of this request alone)."""


class GrammarState:
    def __init__(self, grammar: Any, stop_token_ids: tuple[int, ...]) -> None:
        """``grammar``: a compiler.Grammar (the compiled grammar and the tokens allowed anywhere)."""
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=list(stop_token_ids))
        self.allowed = grammar.allowed

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise GrammarRejected(f"token {token} does not continue the requested grammar")

    def accept_run(self, tokens: list[int]) -> int:
        """Accept ``tokens`` in order up to and including one that completes the grammar; returns how many."""
        for i, token in enumerate(tokens):
            self.accept(token)
            if self.matcher.is_terminated():
                return i + 1
        return len(tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def rollback(self, tokens: int) -> None:
        """Forget the last ``tokens`` accepted tokens (a jump the scheduler could not make room for)."""
        self.matcher.rollback(tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row from here, short of one that completes it (nothing
        can be masked after that); the state is left as it was."""
        n = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            n += 1
            if self.matcher.is_terminated():
                n -= 1
                self.matcher.rollback(1)
                break
        if n:
            self.matcher.rollback(n)
        return n

    def fill(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed

    def jump_forward(self, encode: Callable[[str], list[int]], token_text: Callable[[int], str],
                     last: int | None, special: frozenset[int], limit: int) -> list[int]:
        """Accept and return the tokens of the grammar's only continuation (at most ``limit``); [] if none."""
        if limit < 1 or self.matcher.is_terminated():
            return []
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return []
        if last is None:
            ids = encode(forced)
        else:
            before = token_text(last)
            if "\ufffd" in before:  # the last token ends mid-character: no clean boundary to tokenize at
                return []
            ids = encode(before + forced)
            if not ids or ids[0] != last:
                return []
            ids = ids[1:]
        ids = ids[:-1][:limit]
        if not ids or any(t in special for t in ids):
            return []
        for i, token in enumerate(ids):
            if not self.matcher.accept_token(token):
                self.matcher.rollback(i)
                return []
        return ids
