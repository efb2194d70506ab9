"""Compiling constraints into template matchers, once per distinct constraint a run."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema
import llguidance
import referencing

from aici_cli.control import tool_calls
from aici_cli.control.grammar.conditionals import rewrite_conditionals
from aici_cli.control.grammar.distinct_keys import TokenIndex, may_repeat_keys
from aici_cli.control.grammar.hints import NO_HINTS, Hints, hints_for
from aici_cli.control.grammar.keyword_schema import KeywordSchema
from aici_cli.control.grammar.limits import (
    GRAMMAR_LIMITS,
    RELAX_SECONDS,
    is_limit_error,
    schema_shape_problem,
    tidy_error,
)
from aici_cli.control.grammar.relax import MAX_RELAX_STEPS, Checks, Relaxation, relax_step
from aici_cli.control.grammar.schema_rewrite import (
    JSON_OPTIONS,
    RELAXATIONS,
    choices_grammar,
    close_objects,
    exclusive_one_of,
    json_options,
)
from aici_cli.control.schema_check import check_json_schema
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import GrammarError


@dataclass
class CompiledGrammar:
    """A compiled constraint: the template matcher every sequence copies."""

    constraint: Constraint
    template: llguidance.LLMatcher
    warnings: list[str] = field(default_factory=list)
    validator: Any = None  # jsonschema validator of the original schema, for `valid`
    # With tool calls: the validator of each tool's `parameters`, by tool name.
    tools: dict[str, Any] = field(default_factory=dict)
    relaxed: list[str] = field(default_factory=list)  # what `relax` changed (relax.py)
    hints: Hints = NO_HINTS  # what the closer tries where its tokens cannot close (hints.py)
    # A JSON schema's keywords the grammar cannot express (keyword_schema.py), None when it
    # has none; and tokens to their exact bytes, for the guard that checks them.
    keywords: KeywordSchema | None = None
    decode: Callable[[list[int]], bytes] | None = None
    # With tool calls: those keywords of each tool's `parameters` that has any, by name.
    tool_keywords: dict[str, KeywordSchema] = field(default_factory=dict)
    # Where the schema's objects may hold undeclared keys: the vocabulary by bytes, for
    # the bar on a key written twice (distinct_keys.py); None elsewhere.
    key_index: TokenIndex | None = None


def ll_tokenizer(tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's token table for a fast tokenizer (transformers' or a `HubTokenizer`),
    built as `llguidance.hf.from_tokenizer` builds it but without its `import
    transformers` (~0.45 s): the `tokenizers` file, added tokens included, with padding
    and truncation off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("Only fast tokenizers are supported")
    backend = copy.copy(backend)  # the caller's keeps its padding and truncation
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                  eos_token=sorted(eos_token_ids))


def special_tags(tokenizer: Any, ll: llguidance.LLTokenizer) -> dict[str, int]:
    """The tool-call tags (`tool_calls.OPEN`, `CLOSE`) that are a token of their own in
    `tokenizer`'s vocabulary which llguidance treats as special, by id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    found = {}
    for tag in (tool_calls.OPEN, tool_calls.CLOSE):
        token = backend.token_to_id(tag) if backend is not None else None
        if token is not None and token < ll.vocab_size and ll.is_special_token(token):
            found[tag] = token
    return found


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; caches per distinct constraint."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 strict_json: bool = True) -> None:
        # Wrapping the tokenizer is the expensive part: once per model.
        self.tokenizer = ll_tokenizer(hf_tokenizer, vocab_size, eos_token_ids)
        # The tool-call tags that are one special token here, by id (`tool_calls.lark_grammar`)
        self.special_tags = special_tags(hf_tokenizer, self.tokenizer)
        self.vocab_size = vocab_size
        self.strict_json = strict_json
        self._cache: dict[str, CompiledGrammar | GrammarError] = {}
        self.compile_ms: list[float] = []  # one entry per distinct constraint compiled
        self._regex_problems: dict[str, str | None] = {}
        self._token_index: TokenIndex | None = None  # built the first time one is needed

    def compile(self, constraint: Constraint, relax: bool = False) -> CompiledGrammar:
        """Compile (or fetch from the run's cache); raises `GrammarError`. With `relax`, a
        JSON schema that does not compile is relaxed until it does (`relax.py`)."""
        key = _cache_key(constraint, relax)
        hit = self._cache.get(key) if key is not None else None
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = self._compile(constraint, relax)
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

    def _compile(self, constraint: Constraint, relax: bool) -> CompiledGrammar:
        if constraint.kind == "json_schema":
            return self._compile_json(constraint, relax)
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

    def _compile_json(self, constraint: Constraint, relax: bool) -> CompiledGrammar:
        prepared = self._prepare_json(constraint.value, constraint.whitespace,
                                      constraint.permissive, relax=relax)
        index = self.token_index() if may_repeat_keys(prepared.schema) else None
        return CompiledGrammar(constraint, prepared.matcher, prepared.warnings,
                               prepared.validator, relaxed=prepared.relaxed,
                               hints=replace(hints_for(prepared.schema), distinct_keys=index),
                               keywords=KeywordSchema.of(constraint.value),
                               decode=self.tokenizer.decode_bytes, key_index=index)

    def token_index(self) -> TokenIndex:
        """The vocabulary sorted by bytes (distinct_keys.py), built once per model."""
        if self._token_index is None:
            self._token_index = TokenIndex(self.tokenizer.decode_bytes, self.vocab_size)
        return self._token_index

    def _prepare_json(self, original: Any, whitespace: str | None, permissive: bool | None,
                      where: str = "", relax: bool = False) -> _PreparedJson:
        """`original` checked, rewritten (exclusive `oneOf`, closed objects unless
        permissive) and compiled, relaxed as far as needed (with `relax`, step by step as
        `relax.py` says, after the lenient options); raises `GrammarError`, whose message
        starts with `where` (which schema it is, when there are several)."""
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
        rewritten, kept = rewrite_conditionals(original)
        strict = self.strict_json if permissive is None else not permissive

        def shaped(value: Any) -> Any:
            value = exclusive_one_of(value)
            return close_objects(value) if strict else value

        schema = shaped(rewritten)
        found, errors = self._json_matcher(schema, whitespace, where)
        if found is None and rewritten != original:
            # A conditional's branches brought in what the grammar refuses (a dangling
            # `$ref` under `then`): the schema as written, its conditionals not held, as a
            # lenient compile leaves them; named among the warnings.
            refused = _reason(errors)
            schema = shaped(original)
            found, errors = self._json_matcher(schema, whitespace, where)
            kept = [*kept, f"if/then/else not enforced while decoding (its branches do "
                           f"not compile: {refused})"]
        if found is not None:
            matcher, note, options = found
            # Conditionals left as written are what a lenient compile dropped: named.
            warnings = [f"schema relaxed: {note}", *kept] if note else []
            return _PreparedJson(schema, options, matcher, warnings, validator)
        if relax and isinstance(original, dict):
            return self._relaxed(original, validator, errors, strict, whitespace, where)
        raise GrammarError("unsupported_schema",
                           f"{where}JSON schema not supported: {_reason(errors)}")

    def _json_matcher(
        self, schema: Any, whitespace: str | None, where: str = "",
        relaxations: Sequence[tuple[str, dict[str, Any]]] = RELAXATIONS,
    ) -> tuple[tuple[llguidance.LLMatcher, str, dict[str, Any]] | None, list[str]]:
        """The template matcher of the first of `relaxations` under which `schema`
        compiles, with that relaxation's note and the options it compiled with; else None
        and each one's error. Raises `grammar_too_large` at a resource limit."""
        errors: list[str] = []
        for note, extra in relaxations:
            options: Any = {**json_options(whitespace), **extra}  # a JsonCompileOptions dict
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, overrides=options
                )
            except ValueError as e:
                errors.append(str(e))
                continue
            matcher, error = self._matcher(grammar)
            if matcher is not None:
                return (matcher, note, options), errors
            too_large = _limit_error(f"{where}JSON schema", error)
            if too_large is not None:
                raise too_large  # a relaxed schema is no smaller: retrying only costs time
            errors.append(error)
        return None, errors

    def _relaxed(self, original: dict[str, Any], validator: Any, errors: list[str],
                 strict: bool, whitespace: str | None, where: str) -> _PreparedJson:
        """`--schema-fallback relax`: the closest schema that compiles, step by step
        (`relax.py`), within `MAX_RELAX_STEPS` steps and `RELAX_SECONDS`."""
        state = Relaxation.of(original)
        deadline = time.perf_counter() + RELAX_SECONDS

        def probe() -> str | None:
            """Why `state.schema` as it stands does not compile under the most lenient
            options; None when it does."""
            if time.perf_counter() > deadline:
                return "out of time"
            try:
                found, errs = self._json_matcher(state.prepared(strict), whitespace, where,
                                                 RELAXATIONS[-1:])
            except GrammarError as e:
                return str(e)
            return None if found is not None else errs[-1]

        checks = Checks(self._regex_problem, probe, strict)
        while len(state.steps) < MAX_RELAX_STEPS and time.perf_counter() < deadline:
            if not relax_step(state, errors, checks):
                break
            schema = state.prepared(strict)
            found, errors = self._json_matcher(schema, whitespace, where)
            if found is not None:
                matcher, note, options = found
                relaxed = [*state.steps, note] if note else list(state.steps)
                return _PreparedJson(schema, options, matcher, [], validator, relaxed)
        raise GrammarError(
            "unsupported_schema",
            f"{where}JSON schema not supported, even relaxed ({len(state.steps)} steps): "
            f"{_reason(errors)}",
        )

    def _regex_problem(self, pattern: str) -> str | None:
        """Why llguidance refuses `pattern` as a JSON Schema `pattern`, in a few words;
        None when it accepts it. Cached: a schema may repeat a pattern many times."""
        if pattern not in self._regex_problems:
            try:
                options: Any = dict(JSON_OPTIONS)  # a JsonCompileOptions dict
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "string", "pattern": pattern}, overrides=options)
                _, error = self._matcher(grammar)
            except ValueError as e:
                error = str(e)
            lowered = error.lower()
            problem = None
            if "look" in lowered:
                problem = "lookaround"
            elif "backreference" in lowered:
                problem = "backreference"
            elif error:
                problem = tidy_error(error)[:80]
            self._regex_problems[pattern] = problem
        return self._regex_problems[pattern]

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
        lark = tool_calls.lark_grammar(arguments, text=spec["text"], parallel=spec["parallel"],
                                       special=self.special_tags)
        compiled = self._compile_grammar(constraint, llguidance.LLMatcher.grammar_from_lark(lark),
                                         "tool call grammar", "unsupported_schema")
        compiled.warnings = warnings
        compiled.tools = validators
        for tool in spec["tools"]:
            keywords = KeywordSchema.of(tool["parameters"])
            if keywords is not None:
                compiled.tool_keywords[tool["name"]] = keywords
        if compiled.tool_keywords:
            compiled.decode = self.tokenizer.decode_bytes
        compiled.hints = hints_for({"anyOf": [schema for _, schema in arguments]})
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
    relaxed: list[str] = field(default_factory=list)  # `relax` steps taken (relax.py)


def _reason(errors: list[str]) -> str:
    """llguidance's reason a schema did not compile: the strict one first, and the last
    relaxation's when it differs."""
    tidy = [tidy_error(e) for e in errors] or ["grammar rejected"]
    if tidy[-1] == tidy[0]:
        return tidy[0]
    return f"{tidy[0]} (and with {RELAXATIONS[-1][0]}: {tidy[-1]})"


def _cache_key(constraint: Constraint, relax: bool) -> str | None:
    """The compile cache's key; None for a value too deeply nested to serialize, which
    `schema_shape_problem` then refuses without caching."""
    try:
        return json.dumps([constraint.kind, constraint.value, constraint.whitespace,
                           constraint.permissive, relax], sort_keys=True)
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


