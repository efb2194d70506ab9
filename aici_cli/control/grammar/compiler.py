"""Compiling constraints into template matchers, once per distinct constraint a run."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import referencing

from aici_cli.control import tool_calls
from aici_cli.control.constraint import Constraint
from aici_cli.control.grammar.limits import (
    GRAMMAR_LIMITS,
    is_limit_error,
    schema_shape_problem,
    tidy_error,
)
from aici_cli.control.grammar.schema_rewrite import (
    RELAXATIONS,
    choices_grammar,
    close_objects,
    exclusive_one_of,
    json_options,
)
from aici_cli.control.schema_check import check_json_schema
from aici_cli.errors import GrammarError


@dataclass
class CompiledGrammar:
    """A compiled constraint: the template matcher every sequence copies."""

    constraint: Constraint
    template: llguidance.LLMatcher
    warnings: list[str] = field(default_factory=list)
    validator: Any = None  # jsonschema validator of the original schema, for `valid`
    # With tool calls: the validator of each tool's `parameters`, by tool name.
    tools: dict[str, Any] = field(default_factory=dict)


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
        if constraint.kind == "tool_calls":
            return self._compile_tools(constraint)
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
        prepared = self._prepare_json(constraint.value, constraint.whitespace,
                                      constraint.permissive)
        return CompiledGrammar(constraint, prepared.matcher, prepared.warnings,
                               prepared.validator)

    def _prepare_json(self, original: Any, whitespace: str | None, permissive: bool | None,
                      where: str = "") -> _PreparedJson:
        """`original` checked, rewritten (exclusive `oneOf`, closed objects unless
        permissive) and compiled, relaxed as far as needed; raises `GrammarError`, whose
        message starts with `where` (which schema it is, when there are several)."""
        # Before anything recursive (schema checks, rewrites) walks the schema.
        problem = schema_shape_problem(original)
        if problem is not None:
            raise GrammarError("grammar_too_large", problem)
        # The same check as input lines get (a schema given any other way: `--json-schema`,
        # a wasm segment, has not had it); a boolean schema needs none.
        problem = check_json_schema(original) if isinstance(original, dict) else None
        if problem is not None:
            raise GrammarError("invalid_schema", f"{where}invalid JSON schema: {problem}")
        # An empty registry: a `$ref` to a URL must never be fetched (jsonschema's default
        # would open it), it fails validation instead.
        validator = jsonschema.validators.validator_for(original)(
            original, registry=referencing.Registry())
        schema = exclusive_one_of(original)
        strict = self.strict_json if permissive is None else not permissive
        if strict:
            schema = close_objects(schema)
        errors: list[str] = []
        for note, extra in RELAXATIONS:
            # A JsonCompileOptions dict.
            options: Any = {**json_options(whitespace), **extra}
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, overrides=options
                )
            except ValueError as e:
                errors.append(str(e))
                continue
            matcher, error = self._matcher(grammar)
            if matcher is not None:
                warnings = [f"schema relaxed: {note}"] if note else []
                return _PreparedJson(schema, options, matcher, warnings, validator)
            too_large = _limit_error(f"{where}JSON schema", error)
            if too_large is not None:
                raise too_large  # a relaxed schema is no smaller: retrying only costs time
            errors.append(tidy_error(error))
        # The strict reason first; the last relaxation's reason when it differs.
        message = errors[0] if errors[-1] == errors[0] else (
            f"{errors[0]} (and with {RELAXATIONS[-1][0]}: {errors[-1]})"
        )
        raise GrammarError("unsupported_schema", f"{where}JSON schema not supported: {message}")

    def _compile_tools(self, constraint: Constraint) -> CompiledGrammar:
        """The grammar of an output that calls the constraint's tools (`tool_calls.py`):
        each tool's `parameters` prepared as a JSON schema of its own, then one grammar."""
        spec = constraint.value
        arguments: list[tuple[str, dict[str, Any]]] = []
        validators: dict[str, Any] = {}
        warnings: list[str] = []
        for tool in spec["tools"]:
            name = tool["name"]
            prepared = self._prepare_json(tool["parameters"], None, constraint.permissive,
                                          f"parameters of tool {name!r}: ")
            # `parameters` is always an object (the input line's schema says so).
            arguments.append((name, {**prepared.schema, "x-guidance": prepared.options}))
            validators[name] = prepared.validator
            warnings += [f"tool {name!r}: {w}" for w in prepared.warnings]
        lark = tool_calls.lark_grammar(arguments, text=spec["text"], parallel=spec["parallel"])
        compiled = self._compile_grammar(constraint, llguidance.LLMatcher.grammar_from_lark(lark),
                                         "tool call grammar", "unsupported_schema")
        compiled.warnings = warnings
        compiled.tools = validators
        return compiled


@dataclass
class _PreparedJson:
    """A JSON schema ready for llguidance: as rewritten, the options it compiled with, its
    template matcher, what was relaxed, and the validator of the schema as written."""

    schema: Any
    options: dict[str, Any]
    matcher: llguidance.LLMatcher
    warnings: list[str]
    validator: Any


def _cache_key(constraint: Constraint) -> str | None:
    """The compile cache's key; None for a value too deeply nested to serialize, which
    `schema_shape_problem` then refuses without caching."""
    try:
        return json.dumps([constraint.kind, constraint.value, constraint.whitespace,
                           constraint.permissive], sort_keys=True)
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


