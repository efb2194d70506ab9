"""Built-in controllers: JSON schema, regex and choice, enforced by llguidance.

Costs: wrapping a tokenizer for llguidance takes about 0.3 s at a 49k vocabulary and 4 s
at 262k, so `GrammarCompiler` builds it once per model. Compiling a grammar takes 0.1-100
ms; each distinct grammar is compiled once per run into a template matcher, and each
sequence gets a `deep_copy` of it. A mask costs about 50-90 us per row; the engine fills
all rows' masks in parallel (`LLExecutor`) while the forward pass runs.

Bounds: every grammar is compiled and run under `GRAMMAR_LIMITS`, and JSON schemas are
first held to `MAX_SCHEMA_DEPTH`, `MAX_SCHEMA_NODES` and `MAX_OBJECT_PROPERTIES`, so no
constraint makes compiling take more than about 4 s (real ones: milliseconds), nor a mask
more than about 40 ms step after step (a 0.2 s mask happens once, as the step that ends
its sequence). A constraint past a limit is that line's error (`grammar_too_large` when
compiling, `grammar_too_complex` at a step), never a hang.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import referencing
import torch

from aici_cli.control.base import ControllerBase, Directive
from aici_cli.control.constraint import Constraint
from aici_cli.errors import ControllerError, GrammarError

# Compact, predictable JSON: fixed separators (Python's own `json.dumps` style, which
# models have seen a lot) and no free whitespace. Free whitespace lets small models loop
# on newlines until the token limit; fixed separators also make more tokens forced.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# Tried in order when a schema does not compile as written. The output is still validated
# against the original schema, so a relaxation can cost compliance but never correctness.
RELAXATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("", {}),
    ("oneOf enforced as anyOf", {"coerce_one_of": True}),
    ("unsupported keywords not enforced", {"coerce_one_of": True, "lenient": True}),
)


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
    extra keys get `additionalProperties: false`. Closing must only narrow what validates,
    so some schemas stay open: members of `allOf` and of `anyOf` whose parent declares keys
    itself (closing one would reject the keys declared beside it), members of `oneOf`
    (a closed branch can fail where its open original matched, letting an output match
    another branch alone under the closed schema but two under the original), and anything
    under `not` (narrowing there widens the whole).
    """

    def walk(node: Any, in_all_of: bool) -> Any:
        if isinstance(node, list):
            return [walk(x, in_all_of) for x in node]
        if not isinstance(node, dict):
            return node
        parent_keys = "properties" in node or "required" in node
        out = {}
        for key, value in node.items():
            if key in ("enum", "const", "default", "examples", "not"):
                out[key] = value  # data, or (`not`) a schema that must stay as written
            elif key == "properties" and isinstance(value, dict):
                out[key] = {k: walk(v, False) for k, v in value.items()}
            else:
                merged = key in ("allOf", "oneOf") or (key == "anyOf" and parent_keys)
                out[key] = walk(value, merged)
        open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
        combined = any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref"))
        if (
            isinstance(node.get("properties"), dict)
            and not any(k in node for k in open_keys)
            and not in_all_of
            and not combined
        ):
            out["additionalProperties"] = False
        return out

    return walk(schema, False)


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


@dataclass
class CompiledGrammar:
    """A compiled constraint: the template matcher every sequence copies."""

    constraint: Constraint
    template: llguidance.LLMatcher
    warnings: list[str] = field(default_factory=list)
    validator: Any = None  # jsonschema validator of the original schema, for `valid`


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; caches per distinct constraint."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 strict_json: bool = True) -> None:
        # Wrapping the tokenizer is the expensive part: once per model.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.strict_json = strict_json
        self._cache: dict[str, CompiledGrammar | GrammarError] = {}
        self.compile_ms: list[float] = []  # one entry per distinct constraint compiled

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or fetch from the run's cache); raises `GrammarError`."""
        key = _cache_key(constraint)
        hit = self._cache.get(key) if key is not None else None
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = self._compile(constraint)
            except GrammarError as e:
                hit = e
            self.compile_ms.append((time.perf_counter() - t0) * 1000.0)
            if key is not None:
                self._cache[key] = hit
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _matcher(self, grammar: str) -> tuple[llguidance.LLMatcher | None, str]:
        """A template matcher for `grammar`, or None and llguidance's raw error.

        Building the matcher validates the grammar: a separate validation pass would
        compile everything twice.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=GRAMMAR_LIMITS)
        if matcher.is_error():
            return None, matcher.get_error()
        return matcher, ""

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        if constraint.kind == "json_schema":
            return self._compile_json(constraint)
        if constraint.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(constraint.value)
            return self._compile_grammar(constraint, grammar, "regex", "invalid_regex")
        if constraint.kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(constraint.value)
            return self._compile_grammar(constraint, grammar, "Lark grammar", "invalid_grammar")
        if constraint.kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark(choices_grammar(constraint.value))
            return self._compile_grammar(constraint, grammar, "choices", "invalid_choices")
        raise GrammarError("invalid_constraint", f"unknown constraint kind {constraint.kind!r}")

    def _compile_grammar(self, constraint: Constraint, grammar: str, label: str,
                         error_type: str) -> CompiledGrammar:
        matcher, error = self._matcher(grammar)
        if matcher is None:
            keep_position = constraint.kind == "lark"  # positions in the user's own text
            raise _limit_error(label, error, keep_position) or GrammarError(
                error_type, f"{label} not supported: {tidy_error(error, keep_position)}"
            )
        return CompiledGrammar(constraint, matcher)

    def _compile_json(self, constraint: Constraint) -> CompiledGrammar:
        original = constraint.value
        # Before anything recursive (schema checks, rewrites) walks the schema.
        problem = schema_shape_problem(original)
        if problem is not None:
            raise GrammarError("grammar_too_large", problem)
        try:
            validator_cls = jsonschema.validators.validator_for(original)
            validator_cls.check_schema(original)
            # An empty registry: a `$ref` to a URL must never be fetched (jsonschema's
            # default would open it), it fails validation instead.
            validator = validator_cls(original, registry=referencing.Registry())
        except jsonschema.SchemaError as e:
            raise GrammarError("invalid_schema", f"invalid JSON schema: {e.message}") from None
        schema = exclusive_one_of(original)
        if self.strict_json:
            schema = close_objects(schema)
        errors: list[str] = []
        for note, extra in RELAXATIONS:
            try:
                options: Any = {**JSON_OPTIONS, **extra}  # a JsonCompileOptions dict
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, overrides=options
                )
            except ValueError as e:
                errors.append(str(e))
                continue
            matcher, error = self._matcher(grammar)
            if matcher is not None:
                warnings = [f"schema relaxed: {note}"] if note else []
                return CompiledGrammar(constraint, matcher, warnings, validator)
            too_large = _limit_error("JSON schema", error)
            if too_large is not None:
                raise too_large  # a relaxed schema is no smaller: retrying only costs time
            errors.append(tidy_error(error))
        # The strict reason first; the last relaxation's reason when it differs.
        message = errors[0] if errors[-1] == errors[0] else (
            f"{errors[0]} (and with {RELAXATIONS[-1][0]}: {errors[-1]})"
        )
        raise GrammarError("unsupported_schema", f"JSON schema not supported: {message}")


def _cache_key(constraint: Constraint) -> str | None:
    """The compile cache's key; None for a value too deeply nested to serialize, which
    `schema_shape_problem` then refuses without caching."""
    try:
        return json.dumps([constraint.kind, constraint.value], sort_keys=True)
    except RecursionError:
        return None


def _limit_error(label: str, error: str, keep_position: bool = False) -> GrammarError | None:
    """A `grammar_too_large` error when llguidance's `error` is a resource limit."""
    if not is_limit_error(error):
        return None
    return GrammarError(
        "grammar_too_large",
        f"{label} too large or complex to compile within the grammar limits: "
        f"{tidy_error(error, keep_position)}",
    )


class GrammarController(ControllerBase):
    """A sequence constrained by a compiled grammar; see `aici_cli.control.base`."""

    def __init__(self, grammar: CompiledGrammar, fast_forward: bool = True) -> None:
        self.grammar = grammar
        self._matcher = grammar.template.deep_copy()
        self.fast_forward = fast_forward

    def _next(self) -> Directive:
        m = self._matcher
        if m.is_error():
            raise self.matcher_fault()
        if m.is_stopped():
            return Directive(stop=True)
        if not self.fast_forward:
            return Directive()
        forced = m.compute_ff_tokens()
        if m.is_error() or (forced and not m.consume_tokens(forced)):
            raise self.matcher_fault()
        return Directive(ff_tokens=tuple(forced), stop=m.is_stopped())

    def matcher_fault(self) -> ControllerError:
        """The error of a matcher in its error state, typed by cause.

        A per-step limit of `GRAMMAR_LIMITS` (lexer fuel, lexer states, Earley items) is
        `grammar_too_complex`: the grammar cannot be followed further within bounded
        time. Anything else (a token the grammar rejects) is `grammar_error`.
        """
        error = self._matcher.get_error()
        if is_limit_error(error):
            return ControllerError(
                "grammar_too_complex",
                f"grammar too complex to continue within the per-step limits: "
                f"{tidy_error(error)}",
            )
        return ControllerError("grammar_error", tidy_error(error))

    def start(self, prompt: Sequence[int]) -> Directive:
        return self._next()

    def advance(self, tokens: Sequence[int]) -> Directive:
        if not self._matcher.consume_tokens(list(tokens)):
            raise self.matcher_fault()
        return self._next()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar accepts from the current state, consuming
        nothing (used to trim draft tokens before they are verified)."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def on_eos(self) -> Directive | None:
        """End-of-sequence was sampled: a normal stop, unless the last mask failed.

        A matcher that fails while computing a mask (a per-step limit, say) enters its
        error state and allows only end-of-sequence, so the sampler picks it: without
        this check the sequence would end as a normal stop with a truncated output.
        """
        if self._matcher.is_error():
            raise self.matcher_fault()
        return None

    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def fill_mask(self, out: torch.Tensor) -> bool:
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        if self._matcher.is_error():
            raise self.matcher_fault()
        return True

    def report(self, text: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.grammar.warnings:
            fields["warnings"] = list(self.grammar.warnings)
        if self.grammar.constraint.kind != "json_schema":
            return fields
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # also output nested past Python's stack
            fields.update(json=None, valid=False)
            return fields
        try:
            valid = bool(self.grammar.validator.is_valid(value))
        except Exception as e:  # e.g. a $ref jsonschema cannot resolve: not validated
            valid = False
            fields.setdefault("warnings", []).append(
                f"output could not be validated: {type(e).__name__}: {str(e)[:200]}")
        fields.update(json=value, valid=valid)
        return fields
