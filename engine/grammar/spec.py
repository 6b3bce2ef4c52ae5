"""What a request's output must match, as the client said it: one of a JSON schema, any JSON object, a regular
expression, an EBNF grammar, or an xgrammar structural tag (what tool calling compiles to). The text is the
cache key: two requests with the same schema share one compiled grammar.

``from_json_schema`` refuses, with a 400 naming the keyword and where it is, every schema keyword that the
grammar could not enforce. The list was measured, not assumed: xgrammar 0.2.9 compiles ``uniqueItems``,
``oneOf`` (as anyOf), ``allOf``, ``not``, ``contains``, ``if``/``then``/``else``, ``dependentRequired`` and
``multipleOf`` on numbers without enforcing them (random walks through the compiled grammar produced output that
``jsonschema`` rejects), and ignores ``unevaluated*``, ``dependentSchemas`` and ``$dynamicRef`` outright."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.sampling_params import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 1 << 20  # a schema or grammar longer than this is refused before it is compiled

# Keywords the compiled grammar enforces (checked by tests/engine/test_grammar_walks_satisfy_schemas.py).
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Annotations: they describe, never constrain, so honouring them means nothing to do.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor", "deprecated",
    "readOnly", "writeOnly", "discriminator", "strict", "contentMediaType", "contentEncoding",
})
FORMATS = frozenset({"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference"})
_HINTS = {
    "oneOf": "use anyOf (a grammar cannot check that exactly one branch matches)",
    "allOf": "merge the branches into one schema",
    "nullable": "use \"type\": [..., \"null\"]",
    "uniqueItems": "drop it, or use an enum per position",
}
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str  # the schema as canonical JSON, the regex, the EBNF, the structural tag as JSON; "" for json_object
    param: str = field(default="response_format", compare=False)  # the request field it came from

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @classmethod
    def from_json_schema(cls, schema: object, param: str) -> GrammarSpec:
        """A schema given as a dict or as JSON text, checked for keywords the grammar cannot enforce."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}",
                                      param=param)
        check_schema(schema, param)
        # key order is kept: it is the order the output's keys come in
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def of_text(cls, kind: str, text: object, param: str) -> GrammarSpec:
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"{param} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are "
                                      "compiled", param=param)
        return cls(kind, text, param)


def check_schema(schema: object, param: str, where: str | None = None) -> None:
    """Refuse keywords the grammar would not enforce (InvalidRequestError for the request field ``param``,
    naming the keyword and its path from ``where``, which defaults to ``param``)."""
    label = where or param
    stack: list[tuple[object, str]] = [(schema, "")]
    seen = 0
    while stack:
        node, path = stack.pop()
        seen += 1
        if seen > 100_000:
            raise InvalidRequestError(f"{label} has more than 100000 subschemas", param=param)
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise InvalidRequestError(f"{label}{path} must be a schema (an object or a boolean)", param=param)
        for key, value in node.items():
            at = f"{label}{path}.{key}"
            if key in ANNOTATIONS:
                continue
            if key not in ENFORCED:
                if key == "uniqueItems" and value is False:
                    continue
                if key == "allOf" and isinstance(value, list) and len(value) == 1:
                    stack.append((value[0], f"{path}.allOf.0"))
                    continue
                hint = _HINTS.get(key, "remove it (the grammar would not enforce it)")
                raise InvalidRequestError(f"{at}: the JSON-schema keyword {key!r} is not supported for structured "
                                          f"output; {hint}", param=param, code="unsupported_schema")
            if key == "format" and value not in FORMATS:
                raise InvalidRequestError(f"{at}: format {value!r} is not supported; supported formats: "
                                          f"{', '.join(sorted(FORMATS))}", param=param, code="unsupported_schema")
            if key == "multipleOf" and node.get("type") != "integer":
                raise InvalidRequestError(f"{at}: multipleOf is enforced only with \"type\": \"integer\"",
                                          param=param, code="unsupported_schema")
            if key in _SUBSCHEMA and isinstance(value, (dict, bool)):
                stack.append((value, f"{path}.{key}"))
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                stack.extend((v, f"{path}.{key}.{i}") for i, v in enumerate(value))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, f"{path}.{key}.{k}") for k, v in value.items())
