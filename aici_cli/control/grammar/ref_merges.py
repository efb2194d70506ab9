"""Where llguidance merges a `$ref` with other keys (the keys beside it, the other members
of its allOf, the keys beside its anyOf/oneOf), and the rewrites that end such a merge
without changing what validates: keys the draft ignores dropped, a `type` every branch
declares dropped, the target inlined in place of the reference.

llguidance merges eagerly, so a recursive `$ref` merged this way never finishes compiling;
`relax._circular_ref` tries these exact rewrites first and drops references only after."""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import unquote

from aici_cli.control.grammar.schema_walk import SchemaNode, shown

_COMBINERS = ("allOf", "anyOf", "oneOf")
# Keys that assert nothing (llguidance's list): never merged with a `$ref` beside them.
_ANNOTATIONS = {"$anchor", "$defs", "definitions", "$schema", "$id", "id", "$comment", "title",
                "description", "default", "readOnly", "writeOnly", "examples",
                "contentMediaType", "contentEncoding"}
# Drafts in which every keyword beside `$ref` is ignored.
_REF_ALONE = re.compile(r"draft-0[3-7]/")


def merged_use(item: SchemaNode, target: str) -> bool:
    node = item.node
    if not isinstance(node, dict) or item.owner is None:
        return False
    ref = node.get("$ref")
    if not isinstance(ref, str) or unquote(ref) != target:
        return False
    return bool(_beside_ref(node)) or bool(_merged_with(item))


def _beside_ref(node: dict[str, Any]) -> list[str]:
    """The asserting keys beside a node's `$ref`."""
    return [k for k in node if k != "$ref" and k not in _ANNOTATIONS]


def _merged_with(item: SchemaNode) -> list[str]:
    """For a member of allOf/anyOf/oneOf: the keys of its parent schema that llguidance
    merges into it (allOf: the other members too, named "allOf")."""
    parent = item.parent
    if parent is None or item.keyword not in _COMBINERS:
        return []
    keys = [k for k in parent if k not in _ANNOTATIONS and k not in _COMBINERS]
    if item.keyword == "allOf" and len(parent["allOf"]) > 1:
        keys.append("allOf")
    return keys


def merge_exactly(schema: Any, target: str, uses: list[SchemaNode]) -> str:
    """Rewrites, in place in `schema`, the `uses` of `target` that llguidance would
    merge, where an exact rewrite exists (see `_circular_ref` in relax.py); returns the
    step's text, "" when nothing changed."""
    ref_alone = _REF_ALONE.search(str(_dialect(schema))) is not None
    resolved = _resolve(schema, target)
    inline = isinstance(resolved, dict) and not any(k in resolved for k in ("$id", "id"))
    ignored, implied, inlined = [], [], []
    for item in uses:
        node, parent = item.node, item.parent
        beside = _beside_ref(node)
        if beside and ref_alone:
            for k in beside:
                del node[k]
            ignored.append(item.path)
            if not _merged_with(item):
                continue
        merged = _merged_with(item)
        if merged == ["type"] and parent is not None and _branches_imply_type(schema,
                                                                               parent):
            del parent["type"]
            implied.append(item.path.rsplit("/", 2)[0])
            continue
        if inline and (merged or _beside_ref(node)):
            assert item.owner is not None
            replacement = copy.deepcopy(resolved)
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            if siblings:  # 2019-09 on: the keys beside `$ref` apply too
                replacement = {**siblings, "allOf": [*siblings.get("allOf", []), replacement]}
            item.owner[item.key] = replacement  # type: ignore[index]
            inlined.append(item.path)
    done = []
    if ignored:
        done.append(f"dropped keys beside $ref {target!r} at {shown(ignored)} (ignored "
                    "by the draft)")
    if implied:
        done.append(f"dropped type beside anyOf/oneOf at {shown(sorted(set(implied)))} "
                    "(every branch declares it)")
    if inlined:
        done.append(f"inlined $ref {target!r} at {shown(inlined)}")
    return "; ".join(done)


def _branches_imply_type(schema: Any, parent: dict[str, Any]) -> bool:
    """Whether every anyOf/oneOf branch of `parent` declares `parent`'s `type` itself."""
    kind = parent.get("type")
    for keyword in ("anyOf", "oneOf"):
        for branch in parent.get(keyword, []) if isinstance(parent.get(keyword), list) else []:
            if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                branch = _resolve(schema, unquote(branch["$ref"])) or branch
            if not isinstance(branch, dict) or branch.get("type") != kind:
                return False
    return True


def _dialect(schema: Any) -> Any:
    return schema.get("$schema", "") if isinstance(schema, dict) else ""


def _resolve(schema: Any, ref: str) -> Any:
    """The subschema at a local JSON pointer `#/a/b`, or None."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
