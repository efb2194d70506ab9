"""`--schema-fallback relax`: a schema llguidance refuses, brought step by step to the
closest schema it enforces.

Each step reads llguidance's error and changes only what that error names: it drops the
keywords llguidance does not implement (`not`, `dependencies`, `if`/`then`/`else`, ...),
formats it does not know, and `pattern`s its regex engine refuses (lookarounds,
backreferences); a recursive `$ref` that llguidance would have to merge with other keys is
rewritten exactly where it can be (`ref_merges.py`), else the fewest such references that
stop the error are dropped (`_circular_ref`); for a property that cannot be satisfied it
leaves objects open to undeclared keys, then leaves `oneOf` branches overlapping (both
rewrites only ever narrow the schema, see `schema_rewrite.py`), then drops the property
from `required`. When no rule applies, the deepest subschema whose replacement by `{}`
lets the schema compile is replaced. Every step is recorded as a short string; the output
is still validated against the original schema.

The rules work on the user's schema (a copy); the usual rewrites (`rewrite_conditionals`,
`exclusive_one_of`, `close_objects`) are applied to it afresh before each compile.
Searches compile the schema again and again (`Checks.probe`), so they are bounded
(`MAX_SEARCH_PROBES`), as is the whole (`MAX_RELAX_STEPS`, and the compiler's
`RELAX_SECONDS`). The rules find what to change by walking the schema (`schema_walk.py`).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from aici_cli.control.grammar.conditionals import rewrite_conditionals
from aici_cli.control.grammar.ref_merges import merge_exactly, merged_use
from aici_cli.control.grammar.schema_rewrite import close_objects, exclusive_one_of
from aici_cli.control.grammar.schema_walk import SchemaNode, children, pointer, shown, walk

# Steps before giving up. Of the 4,622 JSONSchemaBench dev schemas, the 45 that need relaxing
# take 3 steps (median), 11 at most (large recursive schemas).
MAX_RELAX_STEPS = 16

# Compiles one search may spend (each 1-100 ms on real schemas).
MAX_SEARCH_PROBES = 64


@dataclass
class Relaxation:
    """The relaxed schema so far, and what was done to it."""

    schema: Any  # the user's schema with the steps applied (a private copy)
    steps: list[str] = field(default_factory=list)
    close: bool = True  # `close_objects` still applies (strict JSON)
    exclusive: bool = True  # `exclusive_one_of` still applies
    circular: Counter[str] = field(default_factory=Counter)  # steps per `$ref` target

    @classmethod
    def of(cls, schema: Any) -> Relaxation:
        return cls(copy.deepcopy(schema))

    def prepared(self, strict_json: bool) -> Any:
        """The schema as compiled: the relaxed one with the usual rewrites applied."""
        schema = rewrite_conditionals(self.schema)[0]
        schema = exclusive_one_of(schema) if self.exclusive else schema
        return close_objects(schema) if strict_json and self.close else schema


# The checks a step may ask for: why a regex is refused (None: accepted), and why the
# relaxed schema as it stands now (`state.schema`, changed in place while a step searches)
# does not compile (None: it compiles).
RegexProblem = Callable[[str], "str | None"]
Probe = Callable[[], "str | None"]


@dataclass(frozen=True)
class Checks:
    regex_problem: RegexProblem
    probe: Probe
    strict_json: bool


def relax_step(state: Relaxation, errors: list[str], checks: Checks) -> bool:
    """Apply the first rule that one of llguidance's `errors` (most exact compile first)
    calls for; record it in `state.steps`. False when no rule changed the schema."""
    for error in errors:
        for rule in (_drop_unimplemented, _drop_unknown_format, _drop_bad_patterns,
                     _circular_ref, _unsatisfiable_required):
            step = rule(state, error, checks)
            if step:
                state.steps.append(step)
                return True
    step = _weaken_smallest(state, errors[-1] if errors else "", checks.probe)
    if step:
        state.steps.append(step)
        return True
    return False


def _drop_keyword(schema: Any, keyword: str,
                  only: Callable[[Any], bool] = lambda _: True) -> list[str]:
    """Remove `keyword` from every subschema (where `only(value)`); returns the paths."""
    paths = []
    for item in walk(schema):
        if isinstance(item.node, dict) and keyword in item.node and only(item.node[keyword]):
            del item.node[keyword]
            paths.append(item.path)
    return paths


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


def _drop_unimplemented(state: Relaxation, error: str, *_: Any) -> str:
    """`not`, `dependencies`, `if`/`then`/`else`, `contains`, ...: llguidance names them."""
    m = _UNIMPLEMENTED.search(error)
    if m is None:
        return ""
    try:
        keywords = [k for k in json.loads(m.group(1)) if isinstance(k, str)]
    except ValueError:
        return ""
    done = []
    for keyword in keywords:
        paths = _drop_keyword(state.schema, keyword)
        if paths:
            done.append(f"dropped {keyword} at {shown(paths)}")
    return "; ".join(done)


_UNKNOWN_FORMAT = re.compile(r"Unknown format: (.+)")


def _drop_unknown_format(state: Relaxation, error: str, *_: Any) -> str:
    m = _UNKNOWN_FORMAT.search(error)
    if m is None:
        return ""
    name = m.group(1).strip().splitlines()[0]
    paths = _drop_keyword(state.schema, "format", lambda v: v == name)
    return f"dropped format {name!r} at {shown(paths)}" if paths else ""


def _drop_bad_patterns(state: Relaxation, error: str, checks: Checks) -> str:
    """Every `pattern` (and `patternProperties` key) llguidance's regex engine refuses."""
    regex_problem = checks.regex_problem
    lowered = error.lower()
    if "regex" not in lowered and "look" not in lowered and "backreference" not in lowered:
        return ""
    done = []
    for item in list(walk(state.schema)):
        node = item.node
        if not isinstance(node, dict):
            continue
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            problem = regex_problem(pattern)
            if problem is not None:
                del node["pattern"]
                done.append(f"dropped pattern at {pointer(item.path)} ({problem})")
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in [k for k in props if regex_problem(k) is not None]:
                del props[key]
                done.append(f"dropped patternProperties {key!r} at {pointer(item.path)} "
                            f"({regex_problem(key)})")
    return "; ".join(done)


_CIRCULAR = re.compile(r"circular references with sibling keys are not supported: (\S+)")


def _circular_ref(state: Relaxation, error: str, checks: Checks) -> str:
    """A recursive `$ref` that llguidance must merge with other keys (the keys beside it,
    the other members of its allOf, the keys beside its anyOf/oneOf) while it is still
    compiling the target: llguidance merges eagerly, so a loop of merges never ends.

    Each time a target is named the uses that merge it are changed further: first only
    exactly (a `type` beside anyOf/oneOf that every branch declares is dropped, keys
    beside `$ref` that the draft ignores are dropped, other uses get a copy of the target
    in place of the reference). Merges llguidance makes that are not visible here (two
    schemas for one property, from `properties` and `patternProperties`, are merged too)
    and a target named again: the fewest references to it whose removal ends the error
    are found by compiling, and removed.
    """
    m = _CIRCULAR.search(error)
    if m is None or "#" not in m.group(1):
        return ""
    target = "#" + unquote(m.group(1).split("#", 1)[1])
    first = state.circular[target] == 0
    state.circular[target] += 1
    if first:
        uses = [item for item in walk(state.schema) if merged_use(item, target)]
        step = merge_exactly(state.schema, target, uses)
        if step:
            return step
    refs = [item.node for item in walk(state.schema) if isinstance(item.node, dict)
            and isinstance(item.node.get("$ref"), str) and unquote(item.node["$ref"]) == target
            and item.owner is not None]
    paths = {id(item.node): item.path for item in walk(state.schema)}

    def gone(nodes: list[dict[str, Any]]) -> bool:
        saved = [node.pop("$ref") for node in nodes]
        error = checks.probe()
        for node, ref in zip(nodes, saved):
            node["$ref"] = ref
        named = _CIRCULAR.search(error or "")
        return named is None or named.group(1) != m.group(1)

    culprits = _fewest(refs, gone)
    if not culprits:
        return ""
    for node in culprits:
        del node["$ref"]
    return (f"dropped circular $ref {target!r} at "
            f"{shown([paths[id(node)] for node in culprits])}")


def _fewest(items: list[Any], enough: Callable[[list[Any]], bool]) -> list[Any]:
    """A small subset of `items` that is `enough` (by halves, as QuickXplain: about
    k log n checks for k needed of n), or [] when all of them are not."""
    budget = [MAX_SEARCH_PROBES]

    def check(subset: list[Any]) -> bool:
        budget[0] -= 1
        return budget[0] >= 0 and enough(subset)

    def shrink(kept: list[Any], candidates: list[Any]) -> list[Any]:
        # `kept + candidates` is enough: the part of `candidates` needed with `kept`.
        if kept and check(kept):
            return []
        if len(candidates) <= 1:
            return candidates
        half = len(candidates) // 2
        a, b = candidates[:half], candidates[half:]
        if check(kept + a):
            return shrink(kept, a)
        if check(kept + b):
            return shrink(kept, b)
        need_a = shrink(kept + b, a)
        return need_a + shrink(kept + need_a, b)

    if not items or not check(items):
        return []
    found = shrink([], items)
    return found if budget[0] >= 0 else items


_UNSATISFIABLE_REQUIRED = re.compile(r"required property '(.*?)' is unsatisfiable")


def _unsatisfiable_required(state: Relaxation, error: str, checks: Checks) -> str:
    """A property the schema requires but llguidance finds no value for. Closing objects
    and making `oneOf` branches exclusive narrow the schema and can cause it; without
    them it is the user's own, and the property is no longer required."""
    m = _UNSATISFIABLE_REQUIRED.search(error)
    if m is None:
        return ""
    if state.close and checks.strict_json:
        state.close = False
        return "objects left open to keys they do not declare"
    if state.exclusive:
        state.exclusive = False
        return "oneOf branches not made exclusive"
    name = m.group(1)
    paths = []
    for item in walk(state.schema):
        required = item.node.get("required") if isinstance(item.node, dict) else None
        if isinstance(required, list) and name in required:
            item.node["required"] = [k for k in required if k != name]
            paths.append(item.path)
    return f"dropped required {name!r} at {shown(paths)}" if paths else ""


def _weaken_smallest(state: Relaxation, error: str, probe: Probe) -> str:
    """Replace by `{}` the deepest subschema whose replacement alone lets the schema
    compile (found top down, at most `MAX_SEARCH_PROBES` compiles); "" when none does."""
    probes = 0
    found: SchemaNode | None = None
    node, path = state.schema, ""
    while probes < MAX_SEARCH_PROBES:
        hit = None
        for child in children(node, path):
            if probes >= MAX_SEARCH_PROBES:
                break
            owner, key = child.owner, child.key
            assert owner is not None
            saved = owner[key]  # type: ignore[index]
            owner[key] = {}  # type: ignore[index]
            probes += 1
            ok = probe() is None
            owner[key] = saved  # type: ignore[index]
            if ok:
                hit = child
                break
        if hit is None:
            break  # no child of `node` suffices alone: `node` is the smallest
        found, node, path = hit, hit.node, hit.path
    if found is None or found.owner is None:
        return ""
    found.owner[found.key] = {}  # type: ignore[index]
    reason = error.strip().splitlines()[0][:80] if error.strip() else "refused"
    return f"replaced schema at {pointer(found.path)} with {{}} ({reason})"
