"""Requests shared by the structured-output tests on the real model (colocated and PD): the seeded schemas, a
request per schema through the real ``openai`` client, and the checks every answer must pass."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema

from tests.pd.test_pd_matches_colocated import client
from tests.real_model.conftest import SERVED_NAME
from tests.schemas import random_schema

SCHEMA_SEEDS = range(100, 120)  # 20 schemas
MAX_TOKENS = 512


def schema_request(seed: int, sampled: bool) -> dict:
    schema = random_schema(seed)
    return {"model": SERVED_NAME, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "Fill in this record about a shop as JSON: "
                                                     f"{', '.join(schema['properties'])}."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": f"record_{seed}", "schema": schema,
                                                                        "strict": True}},
            **({"temperature": 0.9, "seed": seed} if sampled else {"temperature": 0})}


def ask_all(url: str, bodies: list[dict], threads: int = 8) -> list:
    """The chat completions of ``bodies``, sent concurrently (they share decode batches)."""
    c = client(url)
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda b: c.chat.completions.create(**b), bodies))


def assert_valid(answer, schema: dict) -> dict:  # noqa: ANN001 - an openai ChatCompletion
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    doc = json.loads(choice.message.content)
    jsonschema.validate(doc, schema)
    return doc
