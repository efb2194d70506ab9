"""A JSON Schema as users hand it over: unwrapped from OpenAI's envelope, and refused
when its top level constrains nothing.

OpenAI's structured outputs wrap the schema: `{"name": "person", "strict": true,
"schema": {...}}` (the `json_schema` of a `response_format`, itself
`{"type": "json_schema", "json_schema": {...}}`). Read as a JSON Schema, an envelope's
keys are all unknown keywords, which JSON Schema ignores: it allows any value, so the
output would be unconstrained and every output `valid`. `unwrap` takes the schema out;
`inert_problem` refuses any other object whose top level has no keyword that constrains
a value, saying what was probably meant.

Torch-free; a dictionary walk of the top level only.
"""

from __future__ import annotations

from typing import Any

from aici_cli.core.suggest import did_you_mean

# Keywords that constrain a value, in any draft (2020-12 back to draft 4).
CONSTRAINING = frozenset({
    "type", "enum", "const", "properties", "patternProperties", "additionalProperties",
    "required", "items", "prefixItems", "additionalItems", "contains", "minContains",
    "maxContains", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minProperties", "maxProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "$ref", "$dynamicRef", "$recursiveRef", "unevaluatedProperties",
    "unevaluatedItems",
})
# Keywords that only annotate or hold definitions: valid, but they allow every value.
ANNOTATING = frozenset({
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary",
    "$comment", "$defs", "definitions", "title", "description", "default", "examples",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding",
    "contentSchema",
})
# The keys of OpenAI's `json_schema` envelope.
_ENVELOPE = frozenset({"name", "strict", "description", "schema"})


def unwrap(schema: Any) -> tuple[Any, str | None]:
    """The schema inside an OpenAI envelope, and a note saying it was unwrapped (None:
    `schema` is no envelope, and comes back as it is). Takes both the `json_schema`
    envelope and a whole `response_format` (`{"type": "json_schema", "json_schema":
    {...}}`)."""
    if not isinstance(schema, dict):
        return schema, None
    envelope, outer = schema, None
    if (schema.get("type") == "json_schema" and isinstance(schema.get("json_schema"), dict)
            and set(schema) <= {"type", "json_schema"}):
        envelope, outer = schema["json_schema"], "a response_format"
    inner = envelope.get("schema")
    if not (isinstance(inner, (dict, bool)) and set(envelope) <= _ENVELOPE):
        return schema, None
    name = envelope.get("name")
    named = f" '{name}'" if isinstance(name, str) and name else ""
    what = outer or "an OpenAI json_schema envelope"
    return inner, f"is {what}{named}: using the JSON Schema under its 'schema' key"


def inert_problem(schema: Any) -> str | None:
    """Why `schema` constrains nothing, with what was probably meant, or None. An object
    with keys of which none constrains a value (only unknown words and annotations) is
    refused; `{}` and `true` (any value, on purpose) and booleans pass."""
    if not isinstance(schema, dict) or not schema or set(schema) & CONSTRAINING:
        return None
    unknown = [k for k in schema if k not in ANNOTATING]
    shown = ", ".join(repr(k) for k in list(schema)[:6])
    problem = (f"has no keyword that constrains a value at its top level (it has {shown}), "
               "so it allows any JSON")
    return f"{problem}: {_probably_meant(schema, unknown)}"


def _probably_meant(schema: dict[str, Any], unknown: list[str]) -> str:
    if "schema" in schema or "json_schema" in schema:
        return ("an OpenAI envelope? Give the JSON Schema itself (what is under its "
                "'schema'), or only the keys 'name', 'strict', 'description', 'schema'")
    typos = did_you_mean(unknown, CONSTRAINING)
    if typos:
        return typos
    if unknown and all(isinstance(schema[k], dict) for k in unknown):
        return ('these look like properties: did you mean {"type": "object", '
                '"properties": {...}}?')
    return 'a schema says what a value must be, e.g. {"type": "object", "properties": {...}}'
