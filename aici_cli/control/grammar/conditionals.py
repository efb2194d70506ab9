"""`if`/`then`/`else` as branches llguidance enforces: the rewrite of a conditional whose
`if` tests properties against constants.

llguidance does not implement `if`/`then`/`else` (nor `not`): compiled leniently, a
conditional is dropped, and `{"country": "CA", "postal": "*"}` passes a schema whose
branches set the postal code's `pattern` by country. But `{if: A, then: B, else: C}` is
`anyOf: [A and B, (not A) and C]`, and where A only tests properties against constants
(`properties: {k: {const: v}}` or `{enum: [...]}`, with or without `required`), `not A`
can be written positively: A fails when a key it requires is absent, or when a key is
present with another value (another member of the property's own `enum`; a string not
among A's, as a pattern with no lookaround; the other boolean; an integer above or below).
So each conditional becomes `anyOf` of whole object schemas, one for `then` and one for
each way A can fail, each the node's own keywords merged with A's part and the branch's
(`properties` merged key by key through `allOf`, `required` joined): flat objects that
`close_objects` still closes.

Exact, not narrowed: a conditional this cannot write exactly (an `if` with other keywords,
a constant of another kind) stays as written, and compiling it leniently drops it; its
path and why are returned for the warning (`rewrite_conditionals`).

Cost: a walk of the schema, once per distinct schema; `then` and `else` are copied per
branch (at most `MAX_BRANCHES` a conditional).
"""

from __future__ import annotations

from typing import Any

# Branches one conditional may become (1 for `then`, one per way its `if` fails).
MAX_BRANCHES = 8
# Keywords that say nothing about a value: kept on the node, not copied into branches.
_NOTES = ("title", "description", "$comment", "examples", "default")
# Keywords that stay on the node (definitions that `$ref`s name from the root).
_STAYS = ("$schema", "$id", "id", "definitions", "$defs", *_NOTES)
# What an `if` may hold to be negated exactly.
_IF_WORDS = frozenset(("properties", "required", "type", *_NOTES))
_TEST_WORDS = frozenset(("const", "enum", "type", *_NOTES))


def rewrite_conditionals(schema: Any) -> tuple[Any, list[str]]:
    """`schema` with each conditional it can write exactly rewritten as branches (a
    copy where any is), and a note for each one left as written: its JSON pointer and
    why."""
    notes: list[str] = []
    return _rewrite(schema, "", notes), notes


def _rewrite(node: Any, path: str, notes: list[str]) -> Any:
    if isinstance(node, list):
        return [_rewrite(x, f"{path}/{i}", notes) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else
               _rewrite(v, f"{path}/{k}", notes)) for k, v in node.items()}
    if "if" not in out or ("then" not in out and "else" not in out):
        return out
    branches, why = _branches(out)
    if branches is None:
        notes.append(f"if/then/else at {path or '/'} not enforced while decoding ({why})")
        return out
    kept = {k: out[k] for k in _STAYS if k in out}
    return {**kept, "anyOf": branches}


def _branches(node: dict[str, Any]) -> tuple[list[Any] | None, str]:
    """The branches `node`'s conditional becomes, or None and why not."""
    test, then, other = node["if"], node.get("then", True), node.get("else", True)
    rest = {k: v for k, v in node.items() if k not in ("if", "then", "else", *_STAYS)}
    if not isinstance(test, dict) or not set(test) <= _IF_WORDS:
        return None, "its `if` tests more than properties against constants"
    props = test.get("properties", {})
    required = test.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return None, "its `if` is not a test of properties"
    fails: list[dict[str, Any]] = [{"properties": {k: False}} for k in required]
    own = rest.get("properties", {}) if isinstance(rest.get("properties"), dict) else {}
    for key, check in props.items():
        other_values = _negated(check, own.get(key))
        if other_values is None:
            return None, f"its test of {key!r} is not a constant or enum it can negate"
        fails.append({"properties": {key: other_values}, "required": [key]})
    if 1 + len(fails) > MAX_BRANCHES:
        return None, f"more than {MAX_BRANCHES} branches"
    holds = {"properties": {k: _bare(v) for k, v in props.items()}, "required": required}
    branches = [b for b in [_merged(rest, holds, then), *(_merged(rest, f, other)
                                                          for f in fails)]
                if not _unsatisfiable(b)]
    return (branches, "") if branches else (None, "no branch can be satisfied")


def _unsatisfiable(branch: Any) -> bool:
    """A branch that requires a key it forbids (llguidance refuses such a schema)."""
    if branch is False:
        return True
    props = branch.get("properties") or {}
    return any(props.get(k) is False for k in branch.get("required") or ())


def _bare(check: Any) -> Any:
    """A property test without its notes."""
    return {k: v for k, v in check.items() if k not in _NOTES} if isinstance(
        check, dict) else check


def _negated(check: Any, own: Any) -> Any:
    """A schema of the values `check` (a const or enum test) rejects, of the kind its
    values are (`own`: the node's own schema of the property, whose `enum` narrows it);
    None where it cannot be written exactly."""
    if not isinstance(check, dict) or not set(check) <= _TEST_WORDS:
        return None
    if "const" in check:
        values = [check["const"]]
    elif isinstance(check.get("enum"), list) and check["enum"]:
        values = check["enum"]
    else:
        return None
    if isinstance(own, dict) and isinstance(own.get("enum"), list):
        others = [v for v in own["enum"] if v not in values]
        return {"enum": others} if others else False
    kinds = {type(v) for v in values}
    if kinds == {str}:
        return {"type": "string", "pattern": f"^{_none_of(sorted(set(values)))}$"}
    if kinds == {bool}:
        others = [b for b in (False, True) if b not in values]
        return {"enum": others} if others else False
    if kinds == {int} and len(values) == 1:
        v = values[0]
        return {"type": "integer", "anyOf": [{"maximum": v - 1}, {"minimum": v + 1}]}
    return None


def _none_of(words: list[str]) -> str:
    """A regex (no lookaround) of every string but `words`."""
    anything = r"[\s\S]*"
    alts = [] if "" in words else [""]
    firsts = sorted({w[0] for w in words if w})
    if firsts:
        alts.append("[^" + "".join(_char(c) for c in firsts) + "]" + anything)
        for c in firsts:
            alts.append(_char(c) + _none_of([w[1:] for w in words if w[:1] == c]))
    else:
        alts.append(r"[\s\S]" + anything)
    return "(" + "|".join(alts) + ")"


def _char(c: str) -> str:
    return c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):x}}}"


def _merged(rest: dict[str, Any], part: dict[str, Any], branch: Any) -> Any:
    """The node's own keywords `rest` with `part` (a test's) and `branch` (`then` or
    `else`): properties merged key by key, `required` joined; a branch with other
    keywords is kept whole beside them (`allOf`)."""
    if branch is False:
        return False
    out = dict(rest)
    extra: list[Any] = []
    for piece in (part, branch):
        if not isinstance(piece, dict):
            continue
        simple = {k: v for k, v in piece.items() if k in ("properties", "required")}
        other = {k: v for k, v in piece.items() if k not in simple and k not in _NOTES}
        if other:
            extra.append(other)
        props = dict(out.get("properties") or {})
        for key, sub in (simple.get("properties") or {}).items():
            props[key] = sub if key not in props else (
                False if sub is False or props[key] is False else {"allOf": [props[key], sub]})
        if props:
            out["properties"] = props
        joined = list(out.get("required") or [])
        joined += [k for k in simple.get("required") or [] if k not in joined]
        if joined:
            out["required"] = joined
    if out.get("additionalProperties") is False:  # keys the node does not declare: absent
        own = rest.get("properties") or {}
        out["properties"] = {k: (v if k in own else False)
                             for k, v in out.get("properties", {}).items()}
    if extra:
        out["allOf"] = [*out.get("allOf", []), *extra]
    return out
