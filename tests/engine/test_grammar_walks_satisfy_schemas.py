"""The JSON-schema keywords we accept are the ones the compiled grammar enforces: random paths through each
compiled grammar (over the real SmolLM2 vocabulary, no model needed) always satisfy the schema under
``jsonschema``, for seeded random schemas and for one schema per accepted keyword; the keywords xgrammar would
compile without enforcing are refused with a 400 that names them."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from engine.grammar.compiler import GrammarCache
from engine.grammar.spec import GrammarSpec
from engine.sampling_params import InvalidRequestError
from tests.schemas import ascii_tokens, random_schema, random_walk

STOP = 2  # <|im_end|>


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    from transformers import AutoTokenizer

    from engine.models.source import resolve_model_path
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(None).folder))
    return GrammarCache(tok, len(tok), (STOP,), capacity=64)


@pytest.fixture(scope="module")
def ascii_only(grammars: GrammarCache) -> np.ndarray:
    return ascii_tokens(grammars._hf, grammars.vocab_size)


def assert_walks_valid(grammars: GrammarCache, schema: dict, walks: int = 12, seed: int = 0,
                       only: np.ndarray | None = None) -> None:
    grammar = grammars.compile(GrammarSpec.from_json_schema(schema, "json_schema")).grammar
    rng = np.random.default_rng(seed)
    finished = 0
    for _ in range(walks):
        tokens = random_walk(grammar, grammars.vocab_size, STOP, rng, limit=1000, only=only)
        if tokens is None:
            continue
        finished += 1
        text = grammars._hf.decode(tokens)
        jsonschema.validate(json.loads(text), schema)
    assert finished >= 1, f"none of {walks} walks ended within the limit"


@pytest.mark.parametrize("seed", range(30))
def test_random_schemas_admit_only_valid_documents(grammars: GrammarCache, ascii_only: np.ndarray,
                                                   seed: int) -> None:
    assert_walks_valid(grammars, random_schema(seed, depth=1 + seed % 2), seed=seed, only=ascii_only)


KEYWORD_SCHEMAS = {
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "minLength/maxLength": {"type": "string", "minLength": 3, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$"},
    "integer bounds": {"type": "integer", "minimum": -5, "maximum": 17},
    "exclusive bounds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "number bounds": {"type": "number", "minimum": 1.5, "maximum": 9.25},
    "exclusive number bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf (integer)": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    "enum": {"enum": ["a", 1, None, {"x": 1}]},
    "const": {"const": "hello"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "single allOf": {"allOf": [{"type": "integer", "minimum": 3, "maximum": 4}]},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
                   "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2},
    "additionalProperties false": {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                          "additionalProperties": False},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
                      "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 2}, {"type": "integer"}],
                    "items": False},
    "type list": {"type": ["integer", "null"]},
    "required nested": {"type": "object", "required": ["p"], "properties": {"p": {
        "type": "object", "required": ["q"], "properties": {"q": {"type": "boolean"}, "r": {"enum": ["x", "y"]}}}}},
    "format uuid": {"type": "string", "format": "uuid"},
    "format date-time": {"type": "string", "format": "date-time"},
}


@pytest.mark.parametrize("name", list(KEYWORD_SCHEMAS))
def test_each_accepted_keyword_is_enforced(grammars: GrammarCache, name: str) -> None:
    assert_walks_valid(grammars, KEYWORD_SCHEMAS[name])


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "oneOf"),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "allOf"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "contains": {"const": 7}}, "contains"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
     "unevaluatedProperties"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "format": "phone"}, "phone"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"oneOf": [{"type": "null"}]}}}},
     "oneOf"),
])
def test_keywords_the_grammar_would_not_enforce_are_refused(schema: dict, keyword: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        GrammarSpec.from_json_schema(schema, "response_format")
    assert e.value.param == "response_format" and keyword in str(e.value), str(e.value)


def test_a_schema_that_does_not_compile_is_a_client_error(grammars: GrammarCache) -> None:
    for spec in (GrammarSpec.from_json_schema({"type": "array", "items": [{"type": "integer"}]}, "json_schema"),
                 GrammarSpec.of_text("regex", "a(b", "regex"), GrammarSpec.of_text("ebnf", "root ::= ", "ebnf")):
        with pytest.raises(InvalidRequestError) as e:
            grammars.compile(spec)
        assert e.value.param == spec.param and "does not compile" in str(e.value) and ".cc:" not in str(e.value)
        fut = grammars.submit(spec)  # remembered: refused again at once, with the same message
        assert fut.done() and str(fut.exception()) == str(e.value)


def test_compiled_grammars_are_cached_by_text_and_bounded(grammars: GrammarCache) -> None:
    small = GrammarCache(grammars._hf, grammars.vocab_size, (STOP,), capacity=2)
    specs = [GrammarSpec.of_text("regex", f"[a-z]{{{i}}}", "regex") for i in range(1, 4)]
    first = small.compile(specs[0])
    assert not first.hit and small.compile(specs[0]).hit
    small.compile(specs[1])
    small.compile(specs[2])  # evicts specs[0], the least recently used
    assert len(small) == 2 and not small.compile(specs[0]).hit and small.compile(specs[2]).hit
    small.close()
