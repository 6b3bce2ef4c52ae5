"""Conformance: the real ``openai`` client, through the router, against prefill + decode workers on the real
model. Every parameter of chat and completions is either honoured (each test checks what it does) or refused with
a 400 naming it; harmless bookkeeping fields change nothing."""
from __future__ import annotations

import openai
import pytest

QUESTION = [{"role": "user", "content": "Write two sentences about the sea."}]


def chat(client: openai.OpenAI, model: str, stream: bool = False, **kw: object):  # noqa: ANN201
    """The answer's text per choice, finish reasons, and usage (assembled from chunks when streamed)."""
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    if not stream:
        r = client.chat.completions.create(model=model, messages=kw.pop("messages", QUESTION), **kw)
        return [c.message.content for c in r.choices], [c.finish_reason for c in r.choices], r.usage, r
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    chunks = list(client.chat.completions.create(model=model, messages=kw.pop("messages", QUESTION), stream=True,
                                                 **kw))
    for ch in chunks:
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)], usage, chunks


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_and_max_completion_tokens_bound_the_answer(client, model, stream) -> None:  # noqa: ANN001
    for field in ("max_tokens", "max_completion_tokens"):
        texts, reasons, _, _ = chat(client, model, stream, **{"max_tokens": None, field: 5})
        plain, _, usage, _ = chat(client, model, False, max_tokens=5)
        assert texts == plain and reasons == ["length"]
        assert usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_is_repeatable_and_seeds_reproduce_samples(client, model, stream) -> None:  # noqa: ANN001
    greedy = chat(client, model, stream)[0]
    assert greedy == chat(client, model, stream)[0] and greedy[0]
    a = chat(client, model, stream, temperature=1.0, seed=7)[0]
    assert a == chat(client, model, not stream, temperature=1.0, seed=7)[0]
    others = {chat(client, model, stream, temperature=1.0, seed=s)[0][0] for s in (8, 9, 10)}
    assert len(others | {a[0]}) > 1  # different seeds, different samples
    # a nucleus holding only the top token, or top-k 1, or min-p 1: sampling becomes greedy
    assert chat(client, model, stream, temperature=1.0, top_p=1e-9)[0] == greedy
    assert chat(client, model, stream, temperature=1.0, extra_body={"top_k": 1})[0] == greedy
    assert chat(client, model, stream, temperature=1.0, extra_body={"min_p": 1.0})[0] == greedy


@pytest.mark.parametrize("stream", [False, True])
def test_n_gives_that_many_choices(client, model, stream) -> None:  # noqa: ANN001
    texts, reasons, _, _ = chat(client, model, stream, n=3)
    assert len(texts) == 3 and len(set(texts)) == 1 and reasons == ["length"] * 3  # greedy: all alike
    sampled = chat(client, model, stream, n=4, temperature=1.0, seed=3)[0]
    assert len(sampled) == 4 and len(set(sampled)) > 1


def test_stream_options_include_usage(client, model) -> None:  # noqa: ANN001
    _, _, usage, chunks = chat(client, model, True, stream_options={"include_usage": True})
    assert usage is not None and usage.completion_tokens == 24 and chunks[-1].usage is not None
    _, _, none, _ = chat(client, model, True)
    assert none is None


def test_stream_options_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk(client, model) -> None:  # noqa: ANN001
    """vLLM's extension (aiperf's --per-chunk-usage sends it): a chunk's usage is its choice's prompt and the
    tokens streamed for that choice up to and with the chunk; the last chunk of a choice counts all of them."""
    prompt = chat(client, model)[2].prompt_tokens
    opts = {"include_usage": True, "continuous_usage_stats": True}
    _, _, total, chunks = chat(client, model, True, n=2, stream_options=opts)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for ch in chunks[:-1]:
        (c,) = ch.choices
        assert ch.usage.prompt_tokens == prompt and ch.usage.total_tokens == prompt + ch.usage.completion_tokens
        seen[c.index].append(ch.usage.completion_tokens)
    for counts in seen.values():  # the role chunk (0), then at least one more token a chunk, up to max_tokens
        assert counts[0] == 0 and counts[-1] == 24 and all(b > a for a, b in zip(counts[1:], counts[2:]))
    assert chunks[-1].choices == [] and total.completion_tokens == 48 and total.prompt_tokens == prompt
    base = dict(model=model, prompt="The sea is", max_tokens=8, temperature=0)
    legacy = [c for c in client.completions.create(**base, stream=True, stream_options=opts)]
    counts = [c.usage.completion_tokens for c in legacy if c.choices]
    assert counts[-1] == 8 == legacy[-1].usage.completion_tokens and counts == sorted(counts) and counts[0] >= 1


@pytest.mark.parametrize("body, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # not streamed: OpenAI and vLLM refuse it
    ({"stream": True, "stream_options": {"include_usage": True, "per_chunk": True}}, "stream_options.per_chunk"),
])
def test_stream_options_that_cannot_be_honoured_are_refused_by_name(client, model, body, param) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, **body)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_stop_ends_the_text_before_the_stop_string(client, model, stream) -> None:  # noqa: ANN001
    full = chat(client, model, False, max_tokens=40)[0][0]
    word = full.split()[3]
    texts, reasons, _, _ = chat(client, model, stream, max_tokens=40, stop=[word, "zzzz"])
    assert full.startswith(texts[0]) and word not in texts[0] and reasons == ["stop"]
    texts, reasons, _, _ = chat(client, model, stream, max_tokens=40, extra_body={"stop_token_ids": [13]})
    assert reasons[0] in ("stop", "length")


def test_penalties_change_a_repetitive_answer(client, model) -> None:  # noqa: ANN001
    base = dict(model=model, prompt="sea, sea, sea, sea, sea, sea,", max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**base).choices[0].text
    assert plain.count("sea") >= 5  # greedy keeps repeating
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0,
                                                                                     "ignore_eos": True}}):
        changed = client.completions.create(**{**base, **kw}).choices[0].text
        assert changed.count("sea") < plain.count("sea"), (kw, changed, plain)


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_bans_and_forces_tokens(pd, client, model, stream) -> None:  # noqa: ANN001
    import httpx
    ids = httpx.post(pd.router.url + "/tokenize", json={"prompt": chat(client, model)[0][0]}, timeout=30).json()
    first = ids["tokens"][0]
    banned = chat(client, model, stream, logit_bias={str(first): -100})[0][0]
    assert banned and not banned.startswith(chat(client, model)[0][0][:3])
    word = httpx.post(pd.router.url + "/tokenize", json={"prompt": " ocean", "add_special_tokens": False},
                      timeout=30).json()["tokens"][0]
    forced = chat(client, model, stream, max_tokens=3, logit_bias={str(word): 100})[0][0]
    assert forced == " ocean" * 3 or forced == "ocean ocean ocean", forced


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_report_the_chosen_tokens(client, model, stream) -> None:  # noqa: ANN001
    kw = dict(logprobs=True, top_logprobs=3, max_tokens=8)
    if stream:
        chunks = chat(client, model, True, **kw)[3]
        content = [lp for ch in chunks for c in ch.choices if c.logprobs for lp in c.logprobs.content]
    else:
        content = chat(client, model, False, **kw)[3].choices[0].logprobs.content
    assert len(content) == 8
    for lp in content:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.logprob >= max(t.logprob for t in lp.top_logprobs) - 1e-4  # greedy picks the top token


def test_harmless_fields_change_nothing(client, model) -> None:  # noqa: ANN001
    plain = chat(client, model)[0]
    assert chat(client, model, user="u1", metadata={"team": "a"}, store=False, service_tier="auto")[0] == plain
    assert chat(client, model, response_format={"type": "text"}, tool_choice="none")[0] == plain
    assert chat(client, model, extra_body={"ignore_eos": True, "skip_special_tokens": True})[0] == plain


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"extra_body": {"min_tokens": 4}}, "min_tokens"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
])
def test_unsupported_chat_parameters_are_refused_by_name(client, model, kw, param) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_completions_parameters(client, model) -> None:  # noqa: ANN001
    base = dict(model=model, prompt="The sea is", max_tokens=8, temperature=0)
    one = client.completions.create(**base)
    assert one.choices[0].text and one.usage.completion_tokens <= 8
    batch = client.completions.create(**{**base, "prompt": ["The sea is", "Mountains are"]})
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == one.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stream=True) if c.choices)
    assert streamed == one.choices[0].text
    lp = client.completions.create(**base, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert client.completions.create(**base, best_of=1).choices[0].text == one.choices[0].text
    sampled = dict(base, temperature=1.0, seed=5)
    every = client.completions.create(**sampled, n=3, logprobs=0).choices
    best = client.completions.create(**sampled, best_of=3).choices
    assert len(best) == 1 and best[0].text == max(every, key=lambda c: sum(c.logprobs.token_logprobs)).text
    echoed = client.completions.create(**base, echo=True).choices[0]
    assert echoed.text == "The sea is" + one.choices[0].text
    for kw, param in (({"best_of": 3, "n": 4}, "best_of"), ({"suffix": "!"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**base, **kw)
        assert e.value.body["param"] == param


def completion(client: openai.OpenAI, stream: bool, **kw: object) -> tuple[str, dict | None, object]:
    """One completion's text, legacy logprobs (as plain lists) and usage, assembled from chunks when streamed."""
    if not stream:
        r = client.completions.create(**kw)
        lp = r.choices[0].logprobs
        return r.choices[0].text, lp.model_dump() if lp else None, r.usage
    text, lps, usage = "", None, None
    for ch in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for c in ch.choices:
            text += c.text
            if c.logprobs is not None:
                part = c.logprobs.model_dump()
                lps = part if lps is None else {k: lps[k] + part[k] for k in lps}
    return text, lps, usage


@pytest.mark.parametrize("stream", [False, True])
def test_echo_and_prompt_logprobs_through_pd_match_the_colocated_server(pd, client, model, stream) -> None:  # noqa: ANN001
    """The prefill worker computes the prompt's logprobs and sends them with the room's Success; the decode worker
    answers with them, streamed (the prompt first) or not, as the colocated server does (lm-eval's loglikelihood
    request is the max_tokens 0 case)."""
    local = openai.OpenAI(base_url=pd.colocated.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "The capital of France is Paris, and the capital of Italy is"
    for kw in ({"max_tokens": 0, "logprobs": 2}, {"max_tokens": 4, "logprobs": 1}, {"max_tokens": 4}):
        args = dict(model=model, prompt=prompt, echo=True, temperature=0, **kw)
        text, lps, usage = completion(client, stream, **args)
        ref_text, ref_lps, ref_usage = completion(local, False, **args)
        assert text == ref_text and text.startswith(prompt), (text, ref_text)
        assert (usage.prompt_tokens, usage.completion_tokens) == (ref_usage.prompt_tokens, ref_usage.completion_tokens)
        if ref_lps is None:
            assert lps is None
            continue
        n_prompt = ref_usage.prompt_tokens
        assert len(ref_lps["tokens"]) == n_prompt + kw["max_tokens"]
        assert lps["tokens"] == ref_lps["tokens"] and lps["text_offset"] == ref_lps["text_offset"]
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        diffs = [abs(a - b) for a, b in zip(lps["token_logprobs"][1:], ref_lps["token_logprobs"][1:])]
        assert max(diffs) < 1e-3, diffs
        for got, want in zip(lps["top_logprobs"][1:], ref_lps["top_logprobs"][1:]):
            assert len(got) == kw["logprobs"] and all(abs(got[t] - want[t]) < 1e-3 for t in got.keys() & want)
