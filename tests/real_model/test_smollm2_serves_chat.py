"""The colocated server on its default model (no --model-path: SmolLM2-135M-Instruct), driven by the real
``openai`` client: /v1/models lists the served name and its alias, a real question gets a sensible answer that
stops at ``<|im_end|>`` with finish_reason ``stop`` and no stop token in the text (streamed the same), and the
chat prompt the server renders is transformers' ``apply_chat_template``."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import ServerProcess
from tests.real_model.conftest import SERVED_NAME

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_lists_the_default_model_and_its_aliases(smollm2_server: ServerProcess, smollm2) -> None:  # noqa: ANN001
    c = client(smollm2_server)
    assert [m.id for m in c.models.list().data] == [SERVED_NAME, "smollm2"]
    assert c.models.retrieve(SERVED_NAME).id == SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    info = httpx.get(smollm2_server.url + "/get_model_info", timeout=10).json()
    assert info["model_path"] == str(smollm2.gguf) and info["tokenizer_path"] == str(smollm2.folder)
    assert info["architecture"] == "LlamaForCausalLM" and info["vocab_size"] == 49152
    # The alias is accepted in requests; another name gets the 400 naming the model.
    assert c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError, match="not served here"):
        c.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)


def test_a_real_question_gets_a_real_answer_that_stops_at_im_end(smollm2_server: ServerProcess,
                                                                 hf_tokenizer) -> None:  # noqa: ANN001
    c = client(smollm2_server)
    reply = c.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=48, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content and "<|im_start|>" not in choice.message.content
    rendered = hf_tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    rendered = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert reply.usage.prompt_tokens == len(rendered)
    assert reply.usage.completion_tokens < 48
    chunks = list(c.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=48, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == choice.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_generate_renders_the_same_tokens_as_transformers(smollm2_server: ServerProcess,
                                                          hf_tokenizer) -> None:  # noqa: ANN001
    """/generate with text: the server tokenizes as transformers does, and decodes its own output ids."""
    text = "The three primary colors are"
    r = httpx.post(smollm2_server.url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    assert r["meta_info"]["prompt_tokens"] == len(hf_tokenizer.encode(text))
    assert r["text"] == hf_tokenizer.decode(r["output_ids"], skip_special_tokens=True)


def test_logit_bias_bans_the_answer_the_model_would_give(smollm2_server: ServerProcess,
                                                         hf_tokenizer) -> None:  # noqa: ANN001
    c = client(smollm2_server)
    banned = {str(t): -100 for word in ("Paris", " Paris") for t in hf_tokenizer.encode(word)[:1]}
    reply = c.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=48, temperature=0,
                                      logit_bias=banned)
    text = reply.choices[0].message.content
    assert text and "Paris" not in text, text


def test_echo_with_logprobs_scores_the_prompt_like_transformers(smollm2_server: ServerProcess, hf_model,
                                                               hf_tokenizer) -> None:  # noqa: ANN001
    """lm-eval-harness's loglikelihood request: echo, logprobs, max_tokens 0. Each prompt token's logprob equals
    transformers' (the first token has none); asking twice gives the same (nothing comes from the cache)."""
    import torch
    c = client(smollm2_server)
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = hf_tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[i - 1, t].item() for i, t in enumerate(ids) if i]
    for _ in range(2):
        r = c.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        choice = r.choices[0]
        assert choice.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
        assert "".join(lp.tokens) == hf_tokenizer.decode(ids)
        diff = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected))
        assert diff < 1e-3, diff
        assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    more = c.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                temperature=0).choices[0]
    assert more.text.startswith(prompt) and len(more.logprobs.tokens) == len(ids) + 3
    assert more.logprobs.text_offset[len(ids)] == len(prompt)
    plain = c.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text == more.text and plain.choices[0].logprobs is None


def test_a_streamed_completion_sends_a_chunk_for_every_token_even_one_whose_text_is_held(
        smollm2_server: ServerProcess) -> None:
    """A stop string that starts like the answer holds its text back until the answer departs from it: those
    tokens still get their chunks (empty text), as vLLM streams, so a client times every token; the texts join
    into the unstreamed answer."""
    body = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    whole = httpx.post(smollm2_server.url + "/v1/completions", json=body, timeout=120).json()
    text = whole["choices"][0]["text"]
    words = text.split()
    assert len(words) >= 3, text
    stop = text[:text.index(words[2])] + "~never~"  # matches the answer's first two words, then never
    texts, usage = [], None
    with httpx.stream("POST", smollm2_server.url + "/v1/completions", timeout=120, json={
            **body, "stop": [stop], "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                texts += [c["text"] for c in chunk["choices"]]
                usage = chunk.get("usage") or usage
    assert "".join(texts) == text
    assert usage is not None and len(texts) == usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert "" in texts[:-1]  # the held tokens' chunks
