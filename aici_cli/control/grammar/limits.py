"""The bounds of every grammar: llguidance's parser limits, schema shape checks, and
how llguidance's errors are told apart (a resource limit or a rejected grammar) and
shortened to one line."""

from __future__ import annotations

import re
from typing import Any

import llguidance

# Resource limits of every grammar. llguidance checks them while it compiles a grammar and
# while it computes each mask; a grammar past one gets an error state instead of running
# long or growing without bound. Figures below are from a shared 2-core x86 CPU, with the
# tests' tiny tokenizer and SmolLM2's 49k one.
GRAMMAR_LIMITS = llguidance.LLParserLimits(
    # Symbols of the compiled grammar (llguidance's default: 500k). The largest of 4,600
    # real-world schemas (JSONSchemaBench) needs 1.6k. llguidance compiles the slowest
    # grammars built to reach 50k (thousands of nested objects, Lark rules) in about 0.6 s.
    max_grammar_size=50_000,
    # Work to build the lexer's regexes (default 1M). Real schemas need at most 11k; at the
    # default a 100k-value enum took 0.5 s only to be refused.
    initial_lexer_fuel=200_000,
    # Lexer states are built lazily at 1-2 kB each: 50k bounds a grammar's lexer to about
    # 100 MB (the default, 250k, allows 500 MB).
    max_lexer_states=50_000,
    # Per mask: lexer work (about 15 ms at most) and Earley items. llguidance's defaults;
    # random walks through all 4,600 schemas above stayed under 5 ms a mask.
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    # Earley items in one parser row (default 2000). A mask's cost grows about with the
    # cube of it: an ambiguous Lark grammar took 290 ms a mask at 2000 and 38 ms at 1000.
    # Real schemas reach about 520; an `anyOf` of over 1000 schemas exceeds it.
    max_items_in_row=1000,
    # One-line errors, without the parser state and the grammar text in them.
    verbose_errors=False,
)

# JSON nesting levels of a schema. llguidance refuses past 124 with a bare "recursion limit
# exceeded", and the schema rewrites below recurse in Python. Input lines are held to 100
# levels already; this covers schemas given any other way (`--json-schema`, controllers).
MAX_SCHEMA_DEPTH = 100

# Objects and arrays in a schema, all counted. Checking a schema against its meta-schema
# (jsonschema) costs 150-350 us per node and llguidance's JSON compiler is slower still on
# some shapes (a 5,000-branch anyOf: 5 s), both before any llguidance limit applies. The
# largest of the 4,600 real-world schemas above has 917 nodes; at 10,000 the slowest
# schema built to reach the limit compiles in about 4 s.
MAX_SCHEMA_NODES = 10_000

# Properties declared by one object schema. Compile time grows with their square and is
# spent before any llguidance limit is checked: 1,000 optional properties take 0.3 s,
# 6,000 take 5 s. Real schemas declare up to 131.
MAX_OBJECT_PROPERTIES = 1000

# Largest `oneOf` that `exclusive_one_of` rewrites: the rewrite grows with the square of
# the branches (1,000 branches would add a million keys and take seconds to be refused).
MAX_EXCLUSIVE_BRANCHES = 64

# Time `--schema-fallback relax` may spend relaxing one schema (each step compiles it again,
# and a step may search by compiling, see relax.py). Of the 4,622 JSONSchemaBench schemas
# the slowest to relax (large, recursive) takes about 4 s here; most take milliseconds.
# A schema not relaxed in time stays unsupported.
RELAX_SECONDS = 10.0

# Longest llguidance message kept in an error: some quote the whole grammar or regex.
_MAX_MESSAGE_CHARS = 300

# Phrases of llguidance errors that mean a resource limit was reached: the constraint
# itself may be fine, just too large or complex to enforce within `GRAMMAR_LIMITS`.
_LIMIT_PHRASES = (
    "too big (limit",  # max_grammar_size, initial_lexer_fuel
    "fuel exhausted",  # initial_lexer_fuel, while checking lexemes
    "schema too large",  # the JSON schema compiler's own size limit
    "recursion limit exceeded",  # nesting, past MAX_SCHEMA_DEPTH's reach
    "maximum number of nested",  # regex nesting
    "too many states",  # max_lexer_states
    "too many expressions",  # step_lexer_fuel
    "too many items",  # step_max_items
    "items; max is",  # max_items_in_row
)


def is_limit_error(message: str) -> bool:
    """Whether an llguidance error says a resource limit was reached.

    Only llguidance's own words count: the first line, without quoted text, and any
    `error: ...` line. The other lines echo the user's regex or grammar, which could
    spell out one of the phrases.
    """
    lines = message.splitlines() or [""]
    own = [re.sub(r'"(?:[^"\\]|\\.)*"', '""', lines[0])]
    own += [line for line in lines[1:] if line.lstrip().startswith("error:")]
    lowered = "\n".join(own).lower()
    return any(phrase in lowered for phrase in _LIMIT_PHRASES)


def tidy_error(message: str, keep_position: bool = False) -> str:
    """One short line from an llguidance error.

    Its messages can run to several lines (a caret under the source, a trailing
    `<non-verbose/>` marker) and quote the whole grammar. The first line says what failed;
    an `error: ...` line, when there is one, says why. `at L(C): ` points into the grammar
    text, which is the user's own only for Lark; for the others it points into a grammar
    built here and is dropped.
    """
    lines = [line.strip() for line in message.splitlines()]
    lines = [line for line in lines if line and not line.startswith("<")]
    if not lines:
        return "grammar rejected"
    text = lines[0] if keep_position else re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    if len(text) > _MAX_MESSAGE_CHARS // 2:
        text = text[: _MAX_MESSAGE_CHARS // 2 - 3] + "..."
    reason = next((line[len("error:"):].strip() for line in lines[1:]
                   if line.startswith("error:")), None)
    if reason:
        text = f"{text.rstrip(':')}: {reason}"
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


def schema_shape_problem(schema: Any) -> str | None:
    """Why `schema` is too deep or too wide to compile within bounded time, or None.

    Iterative, so that a schema nested thousands of levels deep is measured, not a
    RecursionError; one pass over the schema, stopping at the first problem.
    """
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return (
                f"JSON schema has more than {MAX_SCHEMA_NODES:,} objects and arrays, "
                "too many to compile in bounded time"
            )
        if depth > MAX_SCHEMA_DEPTH:
            return f"JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep"
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > MAX_OBJECT_PROPERTIES:
                return (
                    f"JSON schema declares {len(props):,} properties in one object, over "
                    f"the limit of {MAX_OBJECT_PROPERTIES:,}"
                )
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return None


