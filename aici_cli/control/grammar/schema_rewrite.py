"""How constraints become llguidance grammars: the JSON options, the relaxations tried
when a schema does not compile as written, and the schema rewrites applied first."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from aici_cli.control.grammar.limits import MAX_EXCLUSIVE_BRANCHES

# Compact, predictable JSON: fixed separators (Python's own `json.dumps` style, which
# models have seen a lot) and no free whitespace. Free whitespace lets small models loop
# on newlines until the token limit; fixed separators also make more tokens forced.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def json_options(whitespace: str | None) -> dict[str, Any]:
    """The JSON options for a constraint's `whitespace`: None, the compact default above;
    "", no whitespace at all; a regex, what the whitespace between tokens must match
    (llguidance lets it match there, in place of the separators' fixed spaces)."""
    if whitespace is None:
        return JSON_OPTIONS
    if whitespace == "":
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": True, "whitespace_pattern": whitespace}

# Tried in order when a schema does not compile as written. The output is still validated
# against the original schema, so a relaxation can cost compliance but never correctness.
RELAXATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("", {}),
    ("oneOf enforced as anyOf", {"coerce_one_of": True}),
    ("unsupported keywords not enforced", {"coerce_one_of": True, "lenient": True}),
)


def choices_grammar(choices: Sequence[str]) -> str:
    """A Lark grammar that matches exactly one of `choices`.

    The alternatives form one terminal (one lexer regex) rather than one rule with an
    alternative each: a rule's cost grows with the square of its alternatives (20,000 took
    0.6 s and 50,000 took 7.5 s, before any limit applied), a terminal's stays linear and is
    bounded by `initial_lexer_fuel`.
    """
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def close_objects(schema: Any) -> Any:
    """Return `schema` with undeclared object keys disallowed where the schema is silent.

    JSON Schema allows any extra key by default; a model given that freedom tends to
    invent keys until the token limit. Objects that list `properties` and say nothing about
    extra keys get `additionalProperties: false` (keys they require without declaring them
    are declared, with any value). Closing must only narrow what validates,
    so some schemas stay open: members of `allOf` and of `anyOf` whose parent declares keys
    itself (closing one would reject the keys declared beside it), members of `oneOf`
    (a closed branch can fail where its open original matched, letting an output match
    another branch alone under the closed schema but two under the original), and anything
    under `not` (narrowing there widens the whole). The same holds through local `$ref`s:
    a definition that some such member (or a `$ref` beside declared keys) refers to stays
    open too, wherever it is written (`allOf: [{$ref: A}, {$ref: B}]` with A and B closed
    could not be satisfied at all).
    """
    merged_refs: set[str] = set()  # local `$ref` targets that must stay open
    # A definition may be written before the `$ref` that merges it is seen: walk again
    # until no new target turns up (each pass only adds targets; a schema has finitely many).
    while True:
        seen = len(merged_refs)
        closed = _closing(schema, False, "", merged_refs)
        if len(merged_refs) == seen:
            return closed


def _closing(node: Any, in_all_of: bool, path: str, merged_refs: set[str]) -> Any:
    """`node` (at JSON pointer `path`) closed as `close_objects` says; `in_all_of`: it is
    merged with what is beside it, so it stays open. Adds to `merged_refs` the local
    `$ref` targets it finds merged."""
    if isinstance(node, list):
        return [_closing(x, in_all_of, f"{path}/{i}", merged_refs) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return node
    in_all_of = in_all_of or path in merged_refs
    parent_keys = "properties" in node or "required" in node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and (in_all_of or parent_keys):
        merged_refs.add(unquote(ref[1:]))  # a URI fragment: percent-encoded
    out = {}
    for key, value in node.items():
        where = f"{path}/{_pointer_token(key)}"
        if key in ("enum", "const", "default", "examples", "not"):
            out[key] = value  # data, or (`not`) a schema that must stay as written
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: _closing(v, False, f"{where}/{_pointer_token(k)}", merged_refs)
                        for k, v in value.items()}
        else:
            # A member of a merged node merges with what is merged beside it, too.
            merged = key in ("allOf", "oneOf") or (
                key == "anyOf" and (parent_keys or in_all_of))
            out[key] = _closing(value, merged, where, merged_refs)
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    combined = any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref"))
    if (
        isinstance(node.get("properties"), dict)
        and not any(k in node for k in open_keys)
        and not in_all_of
        and not combined
    ):
        _close(out, node.get("required"))
    return out


def _close(out: dict[str, Any], required: Any) -> None:
    """Disallows the undeclared keys of the object schema `out` (whose `required` is
    given), in place."""
    out["additionalProperties"] = False
    # A key the object requires but does not declare stays allowed (with any value):
    # closed without it, the object could not be written at all.
    if isinstance(required, list):
        missing = [k for k in required if isinstance(k, str) and k not in out["properties"]]
        if missing:
            out["properties"] = {**out["properties"], **{k: {} for k in missing}}


def _pointer_token(key: str) -> str:
    """`key` as one JSON Pointer reference token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def exclusive_one_of(schema: Any) -> Any:
    """Return `schema` with `oneOf` branches made exclusive where `required` tells them apart.

    llguidance enforces `oneOf` only as `anyOf`, so an output may satisfy two branches and
    fail `oneOf`. A branch j that requires key k fails whenever k is absent; so branch i
    forbids one such key of every other branch (`properties: {k: false}`). This only
    narrows the schema, and it makes the common `oneOf: [{required: [a]}, {required: [b]}]`
    exact. It adds n-1 keys to each of n branches, so a `oneOf` of more than
    `MAX_EXCLUSIVE_BRANCHES` stays as written (llguidance then enforces it as `anyOf`,
    with a warning, unless it can tell the branches apart itself).
    """

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in ("enum", "const", "default", "examples") else walk(v))
               for k, v in node.items()}
        branches = out.get("oneOf")
        if (
            isinstance(branches, list)
            and len(branches) <= MAX_EXCLUSIVE_BRANCHES
            and all(isinstance(b, dict) for b in branches)
        ):
            required = [set(b.get("required", [])) for b in branches]
            if all(isinstance(k, str) for r in required for k in r):
                new = []
                for i, branch in enumerate(branches):
                    forbid = {
                        sorted(r - required[i])[0]
                        for j, r in enumerate(required) if j != i and r - required[i]
                    }
                    if forbid:
                        props = dict(branch.get("properties", {}))
                        props.update({k: False for k in forbid})
                        branch = {**branch, "properties": props}
                    new.append(branch)
                out["oneOf"] = new
        return out

    return walk(schema)


