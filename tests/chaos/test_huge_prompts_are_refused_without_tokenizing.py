"""A prompt that cannot fit the context is refused from its length alone, before it is tokenized (a 5 MB prompt
used to hold a worker's event loop for seconds while it was tokenized, stalling every other stream and /health);
long texts that may fit are tokenized on a worker thread, never on the event loop. The timing itself is
benchmarks/bench_event_loop.py's job; here: what is refused, by what, and on which thread the work runs."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from engine.server import text_pool
from engine.server.serving import INLINE_TEXT_CHARS, ServingContext, prompt_from_chat, prompt_from_text
from engine.tokenizer import Tokenizer
from tests.pd.conftest import Cluster, wait_pool_idle

HUGE = "word " * (1 << 20)  # 5 MiB


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", HUGE], "max_tokens": 1}, "prompt.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}, "messages"),
    ("/generate", {"text": HUGE, "sampling_params": {"max_new_tokens": 1}}, "text"),
], ids=["completion", "batch", "chat", "generate"])
def test_a_prompt_over_the_context_is_refused_from_its_length(cluster: Cluster, path: str, body: dict,
                                                              param: str) -> None:
    for srv in (cluster.router, cluster.decode, cluster.colocated):
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 400, (srv.url, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        assert "characters, which is at least" in err["message"], err  # the bound, not a full tokenization
    wait_pool_idle(cluster.prefill), wait_pool_idle(cluster.decode)


class ThreadRecorder:
    """The model's real tokenizer, noting the thread each call runs on."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.threads = tok, []

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self.tok, name)
        if name not in ("encode", "apply_chat_template"):
            return attr

        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            self.threads.append(threading.current_thread())
            return attr(*a, **k)
        return call


def test_long_texts_are_tokenized_off_the_event_loop(tiny_model_dir) -> None:  # noqa: ANN001
    tok = ThreadRecorder(Tokenizer(tiny_model_dir))
    # the serving functions read only the tokenizer and the context length from the engine
    ctx = ServingContext(engine=SimpleNamespace(core=SimpleNamespace(tokenizer=tok, context_length=1 << 30)),
                         metrics=None)  # type: ignore[arg-type]
    loop_thread = threading.main_thread()

    async def run() -> None:
        short, long = "hello there", "hello there " * (INLINE_TEXT_CHARS // 4)
        assert await prompt_from_text(ctx, short) == tok.tok.encode(short)
        assert await prompt_from_text(ctx, long) == tok.tok.encode(long)
        chat = [{"role": "user", "content": long}]
        assert await prompt_from_chat(ctx, chat, True) == tok.tok.apply_chat_template(chat, True)
    asyncio.run(run())
    assert tok.threads[0] is loop_thread  # short: inline, a thread hop would cost more
    assert all(t is not loop_thread for t in tok.threads[1:3]) and len(tok.threads) == 3


class HeldTokenizer:
    """The model's real tokenizer, except that encoding a huge text waits until released; notes how many huge
    encodes ran at once."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.release = tok, threading.Event()
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.tok, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > text_pool.HUGE_TEXT_CHARS:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            self.release.wait(30)
            with self.lock:
                self.running -= 1
        return self.tok.encode(text, add_special_tokens)


def test_huge_texts_take_one_thread_and_long_ones_do_not_wait_behind_them(tiny_model_dir) -> None:  # noqa: ANN001
    tok = HeldTokenizer(Tokenizer(tiny_model_dir))
    context = text_pool.HUGE_TEXT_CHARS // text_pool.HUGE_CHARS_PER_TOKEN  # huge: over HUGE_TEXT_CHARS characters
    ctx = ServingContext(engine=SimpleNamespace(core=SimpleNamespace(tokenizer=tok, context_length=context)),
                         metrics=None)  # type: ignore[arg-type]
    huge, long = "hello there " * (text_pool.HUGE_TEXT_CHARS // 8), "hello there " * (INLINE_TEXT_CHARS // 4)
    assert tok.fewest_tokens(len(huge)) <= context  # not refused from its length: it is tokenized

    async def run() -> None:
        held = [asyncio.ensure_future(prompt_from_text(ctx, huge)) for _ in range(4)]
        try:  # a long prompt that is not huge is tokenized while all four huge ones are still waiting
            assert await asyncio.wait_for(prompt_from_text(ctx, long), 10) == tok.tok.encode(long)
            assert not any(h.done() for h in held)
        finally:
            tok.release.set()  # never leave the shared huge-text thread blocked for later tests
        assert all(ids == tok.tok.encode(huge) for ids in await asyncio.gather(*held))
    asyncio.run(run())
    assert tok.most == 1  # however many arrive, huge texts take one core
