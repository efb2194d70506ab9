"""The keywords of a JSON schema its grammar cannot express, by where they apply in a value.

llguidance compiles no `uniqueItems`, `minProperties`/`maxProperties`,
`dependentRequired` (nor `dependencies`' array form), `if`/`then`/`else`, exclusive
`oneOf` or `not`: an output can break them, and is reported `valid: false`. The keyword
guard (keyword_guard.py) checks them while the value is written; `KeywordSchema` says
which of them apply to the value at a JSON path (`checks`).

Which subschemas apply at a path: from the root through `properties`,
`patternProperties`, `additionalProperties`, `prefixItems`, `items`, `additionalItems`,
local `$ref`s and `allOf`; through an `anyOf` or `oneOf` only where one branch alone
admits the value's JSON type (an optional object, `anyOf: [{object}, {null}]`). Branches
that may each apply are not followed: the guard never holds a value to a subschema that
may not apply to it (it checks less, never wrongly).

Cost: built once per distinct schema (`of`: a walk of the schema); `checks` is cached per
(path, type).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from aici_cli.control.grammar.json_scan import Step
from aici_cli.control.grammar.schema_walk import walk

# The keywords checked (each as jsonschema reads it). `uniqueItems` and `maxProperties`
# are also checked on a container's items so far (`PREFIX`); the rest on whole values.
CHECKED = ("uniqueItems", "minProperties", "maxProperties", "dependentRequired",
           "dependencies", "if", "then", "else", "oneOf", "not")
# How deep `$ref`, `allOf` and branches are followed at one path (a recursive `$ref`).
_MAX_EXPAND = 32
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def checked(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`'s checked keywords, as a schema of their own (`dependencies`: only its
    array form; its schema form is a subschema the grammar compiles)."""
    out = {k: schema[k] for k in CHECKED if k in schema and k != "dependencies"}
    deps = schema.get("dependencies")
    if isinstance(deps, dict):
        listed = {k: v for k, v in deps.items() if isinstance(v, list)}
        if listed:
            out["dependencies"] = listed
    if out.get("uniqueItems") is not True:
        out.pop("uniqueItems", None)
    if "if" in out and "then" not in out and "else" not in out:
        del out["if"]
    return out


def json_type(value: Any) -> str:
    """A JSON value's type as `type` names it ("integer" counts as "number")."""
    if value is None:
        return "null"
    for name, kind in _TYPES.items():
        if isinstance(value, kind):
            return name
    return "number"


def first_byte_type(b: int) -> str:
    """The JSON type of a value that begins with byte `b`."""
    return {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean",
            ord("f"): "boolean", ord("n"): "null"}.get(b, "number")


class KeywordSchema:
    """A schema (as written) with some checked keyword; see the module docstring."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._cache: dict[tuple[tuple[Step, ...], str], list[dict[str, Any]]] = {}

    @classmethod
    def of(cls, schema: Any) -> KeywordSchema | None:
        """None when no subschema of `schema` has a checked keyword (the guard then costs
        nothing)."""
        for node in walk(schema):
            if isinstance(node.node, dict) and checked(node.node):
                return cls(schema)
        return None

    def checks(self, path: tuple[Step, ...], kind: str) -> list[dict[str, Any]]:
        """The checked keywords (one schema each) that apply to a value of type `kind` at
        `path`; empty when none does."""
        key = (path, kind)
        hit = self._cache.get(key)
        if hit is None:
            found = [checked(s) for s in self.applying(path, kind)]
            hit = self._cache[key] = [c for c in found if c]
        return hit

    def applying(self, path: tuple[Step, ...], kind: str) -> list[dict[str, Any]]:
        """Every subschema that applies to a value of type `kind` at `path`."""
        here = [self.root]
        for step in path:
            parent = "object" if isinstance(step, str) else "array"
            here = [c for s in self._expand(here, parent) for c in _children(s, step)]
        return list(self._expand(here, kind))

    def _expand(self, schemas: list[Any], kind: str) -> Iterator[dict[str, Any]]:
        """`schemas` and what applies with them: their `$ref`s and `allOf`s, and the one
        branch of an `anyOf`/`oneOf` that admits `kind`, if only one does."""
        seen: set[int] = set()
        todo = [(s, 0) for s in schemas]
        while todo:
            s, depth = todo.pop()
            if not isinstance(s, dict) or id(s) in seen or depth > _MAX_EXPAND:
                continue
            seen.add(id(s))
            yield s
            ref = self._ref(s)
            if ref is not None:
                todo.append((ref, depth + 1))
            todo += [(sub, depth + 1) for sub in s.get("allOf", ()) if isinstance(sub, dict)]
            for name in ("anyOf", "oneOf"):
                branches = [b for b in s.get(name, ()) if self._admits(b, kind)]
                if len(branches) == 1:
                    todo.append((branches[0], depth + 1))

    def _ref(self, s: dict[str, Any]) -> Any:
        """The target of `s`'s local `$ref` ("#/..."); None for none or another kind."""
        ref = s.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node: Any = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _admits(self, branch: Any, kind: str, depth: int = 0) -> bool:
        """Whether `branch` may accept a value of type `kind` (True when unsure)."""
        if branch is False:
            return False
        if not isinstance(branch, dict) or depth > _MAX_EXPAND:
            return True
        ref = self._ref(branch)
        if ref is not None and not self._admits(ref, kind, depth + 1):
            return False
        types = branch.get("type")
        if isinstance(types, str):
            types = [types]
        if isinstance(types, list):
            names = {"number" if t == "integer" else t for t in types}
            if kind not in names:
                return False
        if "const" in branch and json_type(branch["const"]) != kind:
            return False
        enum = branch.get("enum")
        return not isinstance(enum, list) or any(json_type(v) == kind for v in enum)


def _children(s: dict[str, Any], step: Step) -> list[Any]:
    """The subschemas of `s` that apply to its member `step` (a key or an index)."""
    if isinstance(step, str):
        props = s.get("properties")
        found = [props[step]] if isinstance(props, dict) and step in props else []
        for pattern, sub in (s.get("patternProperties") or {}).items():
            try:
                if re.search(pattern, step):
                    found.append(sub)
            except re.error:  # an ECMA pattern Python cannot read: not followed
                continue
        extra = s.get("additionalProperties")
        if not found and isinstance(extra, dict):
            found.append(extra)
        return found
    prefix = s.get("prefixItems")
    items = s.get("items")
    if isinstance(prefix, list):
        return [prefix[step]] if step < len(prefix) else [items]
    if isinstance(items, list):
        return [items[step]] if step < len(items) else [s.get("additionalItems")]
    return [items]
