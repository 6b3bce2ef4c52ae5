"""A failure that belongs to one request fails that request alone: sampling with penalties runs on the engine's
real path (inference-mode logits, batches mixing penalised and plain rows), a request whose sampling or
detokenization raises ends with a 500 naming the stage while the rest of its batch finishes with the tokens it
would have had without it, and the page pool stays consistent."""
from __future__ import annotations

import random
from pathlib import Path

import httpx

from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core
from tests.helpers import ServerProcess

PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=-1.0), dict(repetition_penalty=1.3),
             dict(logit_bias={7: 5.0, 11: -100.0})]


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def run(core: EngineCore, specs: list[dict], rid: str, sabotage: dict[int, str] | None = None) -> list:
    reqs = []
    for i, (p, spec) in enumerate(zip(prompts(len(specs)), specs)):
        reqs.append(core.make_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True, **spec),
                                      rid=f"{rid}-{i}"))
    for i, stage in (sabotage or {}).items():
        sabotage_request(reqs[i], stage)
    core.run_to_completion(reqs)
    return reqs


def sabotage_request(req, stage: str) -> None:  # noqa: ANN001
    """Make one request fail in ``stage`` on its fourth token (instrumentation of the real objects)."""
    if stage == "sampling":  # a bias on a token id past the vocabulary: what validation would have refused
        req.sampling.logit_bias = {10**9: 1.0}
        return
    detok, calls = req.detok, [0]
    add = detok.add

    def failing_add(ids):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add(ids)
    detok.add = failing_add


def test_penalised_rows_do_not_change_their_neighbours(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    plain = [dict(temperature=0.0)] * 4
    alone = [r.output_ids for r in run(core, plain, "alone")]
    mixed_specs = [dict(temperature=0.0), {**PENALTIES[0], "temperature": 0.0}, dict(temperature=0.0),
                   {**PENALTIES[1], "temperature": 0.7, "seed": 5}] + [dict(temperature=0.0, **p) for p in PENALTIES]
    mixed = run(core, plain[:1] + mixed_specs[1:2] + plain[2:3] + mixed_specs[3:], "mixed")
    assert all(len(r.output_ids) == 12 and r.finish_reason == "length" for r in mixed)
    assert [mixed[0].output_ids, mixed[2].output_ids] == [alone[0], alone[2]]
    banned = next(r for r in mixed if r.sampling.logit_bias)
    assert 11 not in banned.output_ids
    core.check_integrity()


def test_a_request_failing_in_sampling_or_detokenization_fails_alone(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    specs = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=0.0, presence_penalty=0.5),
             dict(temperature=0.0), dict(temperature=0.0)]
    clean = [r.output_ids for r in run(core, specs, "clean")]
    core.flush_cache()
    hurt = run(core, specs, "hurt", sabotage={1: "sampling", 3: "detokenization"})
    for i in (0, 2, 4):
        assert hurt[i].finish_reason == "length" and hurt[i].output_ids == clean[i]
    for i, stage in ((1, "sampling"), (3, "detokenization")):
        assert hurt[i].finish_reason == "abort"
        assert hurt[i].finish_detail.status == 500 and f"failed in {stage}" in hurt[i].finish_detail.message
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.used == 0  # every page came back


def test_penalties_and_logit_bias_through_the_server(server: ServerProcess) -> None:
    for extra in PENALTIES:
        body = {"model": None, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, **extra}
        body.pop("model")
        if "logit_bias" in extra:
            body["logit_bias"] = {str(k): v for k, v in extra["logit_bias"].items()}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(server.url + "/generate", timeout=60, json={
            "text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, **body_sampling(extra)}})
        assert r.status_code == 200, r.text


def body_sampling(extra: dict) -> dict:
    if "logit_bias" in extra:
        return {"logit_bias": {str(k): v for k, v in extra["logit_bias"].items()}}
    return extra
