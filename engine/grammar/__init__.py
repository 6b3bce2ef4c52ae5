"""Constrained decoding: what a request asks its output to match (GrammarSpec), compiled by xgrammar into a
grammar cached by its text (GrammarCache), and followed token by token by one matcher per request
(GrammarState), whose allowed tokens become a bitmask over the step's logits (masks)."""
from engine.grammar.spec import GrammarSpec
from engine.grammar.state import GrammarState

__all__ = ["GrammarSpec", "GrammarState"]
