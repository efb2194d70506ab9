"""A JSON schema's subschemas, each with where it sits and its JSON pointer (`walk`,
`children`), and pointers as a relaxation step shows them (`pointer`, `shown`).

A relaxation rule finds what to change by walking the schema and changes it in place
through `SchemaNode.owner[key]`; the pointers are only for the step's text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Paths listed per step; the rest are counted.
_MAX_PATHS_SHOWN = 4

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not",
        "if", "then", "else", "unevaluatedProperties", "unevaluatedItems", "items")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
        "dependencies")
# Keywords whose value is data, never a schema.
_DATA = ("enum", "const", "default", "examples", "required", "type", "format", "pattern",
         "$ref", "$schema", "$id", "id", "title", "description", "$comment")

Owner = dict[str, Any] | list[Any]


@dataclass
class SchemaNode:
    """A subschema, where it sits (`owner[key]`) and its JSON pointer."""

    node: Any
    owner: Owner | None
    key: str | int
    path: str
    keyword: str = ""  # the keyword it sits under in its parent schema
    parent: dict[str, Any] | None = None  # that parent schema


def pointer(path: str) -> str:
    """A JSON pointer as shown in a step: the root is "/"."""
    return path or "/"


def walk(schema: Any) -> Iterator[SchemaNode]:
    """Every subschema of `schema`, depth first, the root first. Keys that are not
    keywords of JSON Schema are walked too when they hold objects (real schemas keep
    definitions under names like `definations` and reach them by `$ref`)."""
    stack = [SchemaNode(schema, None, "", "")]
    while stack:
        item = stack.pop()
        yield item
        stack.extend(reversed(list(children(item.node, item.path))))


def children(node: Any, path: str) -> Iterator[SchemaNode]:
    """The direct subschemas of a (dict) schema node."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        here = f"{path}/{_escape(key)}"
        if key in _DATA:
            continue
        if isinstance(value, list) and (key in _LIST or key not in _ONE + _MAP):
            for i, member in enumerate(value):
                if isinstance(member, dict):
                    yield SchemaNode(member, value, i, f"{here}/{i}", key, node)
        elif isinstance(value, dict) and (key in _MAP or (
                key not in _ONE and value and all(isinstance(v, dict) for v in value.values()))):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield SchemaNode(sub, value, name, f"{here}/{_escape(name)}", key, node)
        elif isinstance(value, dict):
            yield SchemaNode(value, node, key, here, key, node)


def _escape(key: Any) -> str:
    """`key` as one JSON Pointer reference token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def shown(paths: list[str]) -> str:
    """Paths as a step lists them: the first few pointers, then how many more."""
    listed = ", ".join(pointer(p) for p in paths[:_MAX_PATHS_SHOWN])
    more = len(paths) - _MAX_PATHS_SHOWN
    return f"{listed} and {more} more" if more > 0 else listed
