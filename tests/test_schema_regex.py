"""JSON Schema -> regular expression (pdserve.schema_regex): integer ranges against brute force;
documents drawn at random from the compiled automaton (outlines-core, a one-character-per-token
vocabulary) always validate under their schema (jsonschema) and always end; keywords that cannot
be enforced are refused by name."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from outlines_core import Guide, Index, Vocabulary

from pdserve.grammar import json_object_regex, regex_for_schema
from pdserve.schema_regex import (
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    UnsupportedSchemaError,
    integer_range,
    schema_regex,
)

EOS = 0
CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["é", "\n", "\u2028"]
VOCAB = Vocabulary(EOS, {c.encode(): [i + 1] for i, c in enumerate(CHARS)})


@pytest.mark.parametrize(("lo", "hi"), [(0, 100), (-5, 5), (23, 71), (-100, -3), (7, 7), (0, 0),
                                        (-1, 1), (95, 1234), (-999, 1000), (1, 9), (10, 10),
                                        (3, 99_999), (-99_999, 12), (100, 999_999)])
def test_integer_range_is_exact(lo: int, hi: int) -> None:
    r = re.compile(integer_range(lo, hi))
    rng = random.Random(lo * 7 + hi)
    values = [*range(-3000, 3000), *(rng.randrange(-2 * 10**6, 2 * 10**6) for _ in range(3000)),
              *(s * 10**k + d for s in (1, -1) for k in range(7) for d in (-1, 0, 1))]
    got = {n for n in values if r.fullmatch(str(n))}
    assert got == {n for n in values if lo <= n <= hi}
    assert not r.fullmatch("-0") and not r.fullmatch("007") and not r.fullmatch("+1")


def draw(regex: str, rng: random.Random, stop: float) -> str:
    """A random document of ``regex``: a walk over allowed tokens that ends with probability
    ``stop`` whenever EOS is allowed (``stop=0``: never ends by choice)."""
    guide = Guide(Index(regex, VOCAB))
    out: list[str] = []
    for _ in range(5000):
        allowed = list(guide.get_tokens())
        if EOS in allowed and (len(allowed) == 1 or rng.random() < stop):
            return "".join(out)
        t = rng.choice([a for a in allowed if a != EOS])
        out.append(CHARS[t - 1])
        guide.advance(t, return_tokens=False)
    raise AssertionError(f"no end after 5000 characters: {''.join(out)[:200]!r}")


SCHEMAS = [
    {"type": "integer"},
    {"type": "object", "properties": {"population_millions": {"type": "integer",
                                                              "minimum": 0, "maximum": 100}},
     "required": ["population_millions"]},
    {"type": "integer", "exclusiveMinimum": -7, "exclusiveMaximum": 12},
    {"type": "number", "minimum": -2.0, "maximum": 3},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "number"},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "maxLength": 0},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", 1, None, [1, 2], {"k": "v"}]}, "maxItems": 3},
    {"enum": ["cat", "dog", 3, True]},
    {"type": "string", "enum": ["x", 1, "y\"q"]},
    {"const": {"a": [1, "é"]}},
    {"type": ["string", "null"], "maxLength": 3},
    {"anyOf": [{"type": "integer", "maximum": -10}, {"type": "string", "maxLength": 2}]},
    {"oneOf": [{"type": "boolean"}, {"type": "string", "maxLength": 2}]},
    {"type": "string", "pattern": "^[a-c]{2}-[0-9]+$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 5}},
    {"type": "object", "required": ["x"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                         "y": {"type": "integer"}},
                      "required": ["x", "y"]}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2},
    {"definitions": {"n": {"type": "number", "maximum": 0}},
     "allOf": [{"$ref": "#/definitions/n"}]},
    {"type": "object", "properties": {"any": {}, "t": True}, "required": ["any", "t"]},
    {},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:40] for s in SCHEMAS])
def test_every_document_validates_and_ends(schema: dict) -> None:
    regex = regex_for_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(0)
    for stop in (0.0, 0.05, 0.5):
        for _ in range(15):
            doc = draw(regex, rng, stop)
            value = json.loads(doc)
            errors = [e.message for e in validator.iter_errors(value)]
            assert not errors, (doc, errors)


def test_numbers_are_bounded() -> None:
    """The issue's endless ``1111…``: an integer ends after MAX_INTEGER_DIGITS digits and a
    number after its fraction digits, whatever the model prefers."""
    rng = random.Random(1)
    for _ in range(20):
        doc = draw(schema_regex({"type": "integer"}), rng, 0.0)
        assert len(doc.lstrip("-")) <= MAX_INTEGER_DIGITS
        doc = draw(schema_regex({"type": "number"}), rng, 0.0)
        assert len(doc.lstrip("-")) <= MAX_INTEGER_DIGITS + 1 + MAX_FRACTION_DIGITS
        doc = draw(json_object_regex(), rng, 0.02)
        assert isinstance(json.loads(doc), dict)


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "prefixItems"),
    ({"type": "string", "format": "email"}, "email"),
    ({"type": "string", "pattern": "^.+$"}, "pattern"),
    ({"type": "number", "maximum": 2.5}, "maximum"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
     "recursive"),
    ({"type": "nonsense"}, "type"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "bounds"),
    (False, "false"),
])
def test_unenforceable_keywords_are_refused_by_name(schema: object, keyword: str) -> None:
    with pytest.raises(UnsupportedSchemaError, match=re.escape(keyword)):
        schema_regex(schema)
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        regex_for_schema(schema)


def test_annotations_are_not_constraints() -> None:
    plain = schema_regex({"type": "integer", "maximum": 3})
    annotated = schema_regex({"type": "integer", "maximum": 3, "title": "t", "description": "d",
                              "default": 1, "examples": [2], "$schema": "x", "$comment": "c"})
    assert plain == annotated
