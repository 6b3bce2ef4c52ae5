"""Compiled grammars, cached by their text and compiled off the engine thread.

xgrammar compiles a grammar against the tokenizer's vocabulary once (a JSON schema in ~5-10 ms here, a large
EBNF in far more); the result is immutable and shared by every request that asks for the same text, each with
its own matcher. The cache is an LRU bounded by entry count (texts that did not compile are remembered too, so a
client repeating one costs nothing); a text being compiled is compiled once however
many requests ask for it at the same moment (they share one future). Compilation runs on a small thread pool:
callers (the HTTP layer) wait on the future with a deadline, so a slow grammar delays only its own requests and
never the running batch. A grammar that does not compile is an InvalidRequestError naming the request field."""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.grammar.spec import GrammarSpec
from engine.sampling_params import InvalidRequestError

JSON_SEPARATORS = (", ", ": ")  # compact JSON, the way json.dumps writes it: no free-form whitespace to loop in


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, and for JSON the tokens allowed anywhere (``allowed``, a packed bitmask row): none
    holding a raw control byte. Compact JSON never contains one, but xgrammar 0.2.9 lets a string with
    ``maxLength`` hold them (its rule is ``[^"\\\r\n]``), which makes the output unparseable."""

    compiled: Any  # xgrammar.CompiledGrammar
    allowed: Any = None  # torch.Tensor [bitmask words] int32, or None: every token the grammar allows


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar and what it cost (``seconds`` 0 and ``hit`` true when it came from the cache)."""

    grammar: Grammar
    seconds: float
    hit: bool


class GrammarCache:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], capacity: int,
                 threads: int = 2) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.capacity = capacity
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the cache and the pending futures
        self._build_lock = threading.Lock()  # building the compiler, once
        self._done: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._failed: OrderedDict[GrammarSpec, InvalidRequestError] = OrderedDict()  # refused again without work
        self._pending: dict[GrammarSpec, Future[Compiled]] = {}
        self._compiler: Any = None  # built on first use: the vocabulary scan takes ~0.1 s
        self._json_tokens: Any = None  # the bitmask row of tokens without control bytes

    def submit(self, spec: GrammarSpec) -> Future[Compiled]:
        """The compiled grammar of ``spec``, now if cached, else from the pool."""
        with self._lock:
            grammar = self._done.get(spec)
            if grammar is not None:
                self._done.move_to_end(spec)
                fut: Future[Compiled] = Future()
                fut.set_result(Compiled(grammar, 0.0, True))
                return fut
            error = self._failed.get(spec)
            if error is not None:
                fut = Future()
                fut.set_exception(InvalidRequestError(str(error), param=error.param, code=error.code))
                return fut
            fut = self._pending.get(spec)
            if fut is None:
                fut = self._pool.submit(self._compile, spec)
                self._pending[spec] = fut
            return fut

    def compile(self, spec: GrammarSpec) -> Compiled:
        """Blocking: for callers off the event loop (tests, offline use)."""
        return self.submit(spec).result()

    def __len__(self) -> int:
        return len(self._done)

    def _compile(self, spec: GrammarSpec) -> Compiled:
        start = time.perf_counter()
        try:
            try:
                grammar = self._build(spec)
            except InvalidRequestError:
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar reports bad grammars with RuntimeError and others
                raise InvalidRequestError(f"{spec.param} does not compile: {_first_line(e)}", param=spec.param,
                                          code="invalid_grammar") from None
        except BaseException as e:
            with self._lock:
                if isinstance(e, InvalidRequestError):
                    self._failed[spec] = e
                    while len(self._failed) > self.capacity:
                        self._failed.popitem(last=False)
                self._pending.pop(spec, None)
            raise
        seconds = time.perf_counter() - start
        with self._lock:  # cached before it stops being pending: a request arriving now finds one or the other
            self._done[spec] = grammar
            while len(self._done) > self.capacity:
                self._done.popitem(last=False)
            self._pending.pop(spec, None)
        return Compiled(grammar, seconds, False)

    def _build(self, spec: GrammarSpec) -> Grammar:
        compiler = self._xgrammar_compiler()
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
            return Grammar(compiler.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS),
                           self._json_tokens)
        if spec.kind == "regex":
            return Grammar(compiler.compile_regex(spec.text))
        if spec.kind == "ebnf":
            return Grammar(compiler.compile_grammar(spec.text))
        return Grammar(compiler.compile_structural_tag(json.loads(spec.text)))

    def _xgrammar_compiler(self) -> Any:
        with self._build_lock:  # not self._lock: submit() takes that one on the event loop
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._json_tokens = _without_control_bytes(info.decoded_vocab, self.vocab_size)
            return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _without_control_bytes(vocab: list[bytes], vocab_size: int) -> Any:
    """A packed bitmask row (xgrammar's layout: bit j of word i is token 32 i + j) of the tokens whose text holds
    no byte below 0x20."""
    import numpy as np
    import torch
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint8)
    for token, piece in enumerate(vocab[:vocab_size]):
        bits[token] = not any(b < 0x20 for b in piece)
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:123: "


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    line = next((ln for ln in lines if _SOURCE_PREFIX.match(ln)), lines[0] if lines else type(e).__name__)
    return _SOURCE_PREFIX.sub("", line)[:500]
