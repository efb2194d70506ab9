"""Which of a schema's checked keywords apply at a JSON path: through properties, items,
`$ref` and `allOf`, and an `anyOf` branch only where it alone admits the value."""

from __future__ import annotations

from typing import Any

from aici_cli.control.grammar.keyword_schema import KeywordSchema, checked

UNIQUE = {"type": "array", "uniqueItems": True}
SCHEMA: dict[str, Any] = {
    "$defs": {"Tags": UNIQUE, "Named": {"type": "object", "maxProperties": 2}},
    "type": "object",
    "properties": {
        "tags": {"$ref": "#/$defs/Tags"},
        "maybe": {"anyOf": [{"$ref": "#/$defs/Named"}, {"type": "null"}]},
        "either": {"anyOf": [{"type": "object", "minProperties": 1},
                             {"type": "object", "maxProperties": 0}]},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, UNIQUE],
                 "items": {"not": {"type": "null"}}},
    },
    "patternProperties": {"^x-": {"type": "object", "minProperties": 1}},
    "additionalProperties": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "allOf": [{"minProperties": 1}],
}


def test_checks_by_path() -> None:
    ks = KeywordSchema.of(SCHEMA)
    assert ks is not None
    assert ks.checks((), "object") == [{"minProperties": 1}]
    assert ks.checks(("tags",), "array") == [{"uniqueItems": True}]
    assert ks.checks(("maybe",), "object") == [{"maxProperties": 2}]
    assert ks.checks(("maybe",), "null") == []
    assert ks.checks(("either",), "object") == []  # two branches may apply: neither held
    assert ks.checks(("pair", 1), "array") == [{"uniqueItems": True}]
    assert ks.checks(("pair", 0), "string") == []
    assert ks.checks(("pair", 5), "number") == [{"not": {"type": "null"}}]
    assert ks.checks(("x-1",), "object") == [{"minProperties": 1}]
    assert ks.checks(("other",), "object") == [{"dependentRequired": {"a": ["b"]}}]


def test_only_schemas_with_such_keywords_get_one() -> None:
    assert KeywordSchema.of({"type": "array", "items": {"type": "string"}}) is None
    assert KeywordSchema.of({"uniqueItems": False}) is None
    assert KeywordSchema.of(True) is None
    assert checked({"if": {"type": "string"}}) == {}  # no then, no else: nothing to hold
    assert checked({"dependencies": {"a": ["b"], "c": {"required": ["d"]}}}) == {
        "dependencies": {"a": ["b"]}}
    recursive = {"$defs": {"N": {"type": "array", "items": {"$ref": "#/$defs/N"},
                                 "uniqueItems": True}}, "$ref": "#/$defs/N"}
    ks = KeywordSchema.of(recursive)
    assert ks is not None and ks.checks((0, 0, 0), "array") == [{"uniqueItems": True}]
