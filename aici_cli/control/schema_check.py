"""Whether a user's JSON Schema can be used as a constraint, checked without a tokenizer.

`check_json_schema` holds the schema to its dialect's meta-schema; `json_schema_problem`
adds the `$ref` analysis: every reference must resolve inside the schema (nothing is
ever fetched), and no reference may lead back to a schema it is part of without going
into the value, since validating an output would then recurse forever.

Torch-free: input lines are checked with it before any model is loaded.
"""

from __future__ import annotations

import warnings
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from jsonschema_specifications import REGISTRY as META_SCHEMAS
from referencing import Registry, Resource, Specification
from referencing.exceptions import NoSuchAnchor, NoSuchResource, PointerToNowhere, Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

from aici_cli.core.json_text import field_path, show


def check_json_schema(schema: dict[str, Any]) -> str | None:
    """Return a description of why `schema` is not a usable JSON Schema, or None.

    Checks the dialect (`$schema`) and the schema against its dialect's meta-schema;
    references are not followed (see `json_schema_problem`). An unknown `$schema` only
    warns in jsonschema today (and will raise later), so it is turned into an error here
    rather than leaking a DeprecationWarning per line. Raises RecursionError for a schema
    nested past the interpreter's stack: bound its depth first, or catch it.
    """
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        return f"'$schema' must be a string, got {show(dialect)}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls = validator_for(schema)  # no $schema -> latest draft (2020-12)
    if any(issubclass(w.category, DeprecationWarning) for w in caught):
        return f"unknown '$schema' {show(dialect)}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # from `pattern`s, as for `regex`
            cls.check_schema(schema)
    except SchemaError as exc:
        where = field_path(list(exc.path))
        return f"at '{where}': {exc.message}" if where else exc.message
    except OverflowError as exc:
        # jsonschema compiles each `pattern` with `re` and expects only re.error; a
        # repetition like `a{4294967295}` raises OverflowError instead.
        return f"a 'pattern' in it is not a valid regular expression: {exc}"
    return None


_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords that apply a subschema to the value itself rather than to a part of it: a
# path through only these and references never gets closer to the end of the value.
_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_LIST = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas", "dependencies")
# Drafts in which `$ref` makes every keyword beside it ignored.
_REF_ALONE_DRAFTS = {"draft-03", "draft-04", "draft-06", "draft-07"}
_LOOKUP_ERRORS = (Unresolvable, LookupError, TypeError, ValueError)

# A subschema and the resolver for the references in it (referencing does not export the
# Resolver type).
SchemaNode = tuple[Any, Resource[Any]]


def _ref_problem(ref: str, exc: Exception) -> str:
    """Why `ref` does not resolve, without the resource's text the exception carries."""
    if isinstance(exc, NoSuchAnchor):
        reason = "the schema has no such anchor"
    elif isinstance(exc, NoSuchResource) or not ref.startswith("#"):
        reason = "it is not part of this schema, and schemas are never fetched"
    elif isinstance(exc, (PointerToNowhere, LookupError, TypeError, ValueError)):
        # referencing raises TypeError for a pointer through a boolean schema, and
        # ValueError for a non-numeric array index.
        reason = "the schema has no such location"
    else:
        reason = type(exc).__name__
    return f"'{ref}' cannot be resolved: {reason}"


def _schema_nodes(schema: dict[str, Any]) -> tuple[Specification[Any], list[SchemaNode]]:
    """Every subschema of `schema`, each with the resolver for references inside it.

    References resolve the way jsonschema resolves them when it validates an output,
    but with no retrieval: jsonschema would otherwise fetch a remote `$ref` over the
    network (which can hang). Only meta-schemas are known besides the schema itself.
    """
    dialect = schema.get("$schema", "")
    spec = specification_with(dialect, default=DRAFT202012) if dialect else DRAFT202012
    root: Resource[Any] = spec.create_resource(schema)
    nodes = [(META_SCHEMAS.combine(Registry()).resolver_with_root(root), root)]
    for resolver, resource in nodes:  # grows while it is walked
        nodes.extend((resolver.in_subresource(sub), sub) for sub in resource.subresources())
    return spec, nodes


def _unresolvable_ref(nodes: list[SchemaNode]) -> str | None:
    """Describe the first reference that does not resolve, or None."""
    for resolver, resource in nodes:
        contents = resource.contents
        if not isinstance(contents, dict):
            continue
        for keyword in _REF_KEYWORDS:
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except _LOOKUP_ERRORS as exc:
                return f"{keyword} {_ref_problem(ref, exc)}"
    return None


def _in_place(
    contents: dict[str, Any], resolver: Any, spec: Specification[Any]
) -> list[tuple[dict[str, Any], Any, str]]:
    """The object subschemas that `contents` applies to the value itself, each with the
    resolver to use inside it and the keyword that leads there."""
    out: list[tuple[dict[str, Any], Any, str]] = []
    for keyword in _REF_KEYWORDS:
        ref = contents.get(keyword)
        if isinstance(ref, str):
            try:
                resolved = resolver.lookup(ref)
            except _LOOKUP_ERRORS:
                continue  # reported by _unresolvable_ref
            if isinstance(resolved.contents, dict):
                out.append((resolved.contents, resolved.resolver, f"{keyword} '{ref}'"))
    if spec.name in _REF_ALONE_DRAFTS and "$ref" in contents:
        return out
    children: list[tuple[Any, str]] = [(contents.get(k), k) for k in _IN_PLACE_ONE]
    for keyword in _IN_PLACE_LIST:
        members = contents.get(keyword)
        if isinstance(members, list):
            children += [(member, f"{keyword}[{i}]") for i, member in enumerate(members)]
    for keyword in _IN_PLACE_MAP:
        members = contents.get(keyword)
        if isinstance(members, dict):
            children += [(member, f"{keyword}.{name}") for name, member in members.items()]
    for child, label in children:
        if isinstance(child, dict):
            inner = resolver.in_subresource(spec.create_resource(child))
            out.append((child, inner, label))
    return out


def _reference_loop(
    spec: Specification[Any], nodes: list[SchemaNode], limit: int
) -> tuple[str, str] | None:
    """(type, problem) when references make a schema apply to the same value forever
    (`{"$ref": "#"}`), or through a chain longer than `limit`.

    JSON Schema leaves such a loop undefined. jsonschema follows it by recursion when
    it checks an output, so it ends in RecursionError however small the output, and so
    does a long enough chain; llguidance may accept either. A path that goes into a
    property or an item is fine: the output is finite. Depth-first over the in-place
    edges, without recursion.
    """
    on_path, done = 1, 2
    state: dict[int, int] = {}
    longest: dict[int, int] = {}  # schemas in the longest in-place path from a schema
    for resolver, resource in nodes:
        start = resource.contents
        if not isinstance(start, dict) or id(start) in state:
            continue
        state[id(start)] = on_path
        frames = [(start, _in_place(start, resolver, spec), 0)]
        while frames:
            node, edges, next_edge = frames[-1]
            if next_edge < len(edges):
                frames[-1] = (node, edges, next_edge + 1)
                child, child_resolver, label = edges[next_edge]
                seen = state.get(id(child))
                if seen == on_path:
                    problem = (f"is not a valid JSON Schema: {label} loops back to a schema "
                               "it is part of without going into the value (endless recursion)")
                    return "invalid_schema", problem
                if seen is None:
                    state[id(child)] = on_path
                    frames.append((child, _in_place(child, child_resolver, spec), 0))
                continue
            frames.pop()
            state[id(node)] = done
            longest[id(node)] = 1 + max((longest[id(child)] for child, _, _ in edges), default=0)
    chain = max(longest.values(), default=0)
    if chain <= limit:
        return None
    problem = (f"chains {chain:,} schemas through references and allOf/anyOf/oneOf/not/if "
               f"without going into the value, over the limit of {limit}")
    return "too_deep", problem


def json_schema_problem(schema: dict[str, Any], max_depth: int) -> tuple[str, str] | None:
    """(type, problem) for a `json_schema` that cannot be used as it is, or None.

    `type` is "invalid_schema" (not a valid JSON Schema, or a reference that does not
    resolve or loops back without going into the value) or "too_deep" (a reference chain
    longer than `max_depth`, or nesting too deep to check). `problem` reads after the
    name of the field that holds the schema: "is not a valid JSON Schema: ...".
    """
    try:
        invalid = check_json_schema(schema)
        if invalid is not None:
            return "invalid_schema", f"is not a valid JSON Schema: {invalid}"
        spec, nodes = _schema_nodes(schema)
        unresolvable = _unresolvable_ref(nodes)
        if unresolvable is not None:
            return "invalid_schema", f"is not a valid JSON Schema: {unresolvable}"
        return _reference_loop(spec, nodes, max_depth)
    except RecursionError:
        return "too_deep", "is nested too deeply to check"
