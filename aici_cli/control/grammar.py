"""Built-in controllers: JSON schema, regex and choice, enforced by llguidance.

Costs: wrapping a tokenizer for llguidance takes about 0.3 s at a 49k vocabulary and 4 s
at 262k, so `GrammarCompiler` builds it once per model. Compiling a grammar takes 0.1-100
ms; each distinct grammar is compiled once per run into a template matcher, and each
sequence gets a `deep_copy` of it. A mask costs about 50-90 us per row; the engine fills
all rows' masks in parallel (`LLExecutor`) while the forward pass runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import torch

from aici_cli.control.base import ControllerError, Directive
from aici_cli.jobs import Constraint

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


class GrammarError(Exception):
    """A constraint that cannot be compiled; `type` is the result line's error type."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type
        self.message = message


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
    exact.
    """

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in ("enum", "const", "default", "examples") else walk(v))
               for k, v in node.items()}
        branches = out.get("oneOf")
        if isinstance(branches, list) and all(isinstance(b, dict) for b in branches):
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
        key = json.dumps([constraint.kind, constraint.value], sort_keys=True)
        hit = self._cache.get(key)
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = self._compile(constraint)
            except GrammarError as e:
                hit = e
            self.compile_ms.append((time.perf_counter() - t0) * 1000.0)
            self._cache[key] = hit
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _matcher(self, grammar: str) -> tuple[llguidance.LLMatcher | None, str]:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            return None, messages[0] if messages else "grammar rejected"
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return None, matcher.get_error()
        return matcher, ""

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        if constraint.kind == "json_schema":
            return self._compile_json(constraint)
        if constraint.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(constraint.value)
            matcher, error = self._matcher(grammar)
            if matcher is None:
                raise GrammarError("invalid_regex", f"regex not supported: {error}")
            return CompiledGrammar(constraint, matcher)
        if constraint.kind == "lark":
            matcher, error = self._matcher(llguidance.LLMatcher.grammar_from_lark(constraint.value))
            if matcher is None:
                raise GrammarError("invalid_grammar", f"Lark grammar not supported: {error}")
            return CompiledGrammar(constraint, matcher)
        if constraint.kind == "choices":
            lark = "start: " + " | ".join(json.dumps(c) for c in constraint.value)
            matcher, error = self._matcher(llguidance.LLMatcher.grammar_from_lark(lark))
            if matcher is None:
                raise GrammarError("invalid_choices", f"choices not supported: {error}")
            return CompiledGrammar(constraint, matcher)
        raise GrammarError("invalid_constraint", f"unknown constraint kind {constraint.kind!r}")

    def _compile_json(self, constraint: Constraint) -> CompiledGrammar:
        original = constraint.value
        try:
            validator_cls = jsonschema.validators.validator_for(original)
            validator_cls.check_schema(original)
            validator = validator_cls(original)
        except jsonschema.SchemaError as e:
            raise GrammarError("invalid_schema", f"invalid JSON schema: {e.message}") from None
        schema = exclusive_one_of(original)
        if self.strict_json:
            schema = close_objects(schema)
        errors: list[str] = []
        for note, extra in RELAXATIONS:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, overrides={**JSON_OPTIONS, **extra}
                )
            except ValueError as e:
                errors.append(str(e))
                continue
            matcher, error = self._matcher(grammar)
            if matcher is not None:
                warnings = [f"schema relaxed: {note}"] if note else []
                return CompiledGrammar(constraint, matcher, warnings, validator)
            errors.append(error)
        # The strict reason first; the last relaxation's reason when it differs.
        message = errors[0] if errors[-1] == errors[0] else (
            f"{errors[0]} (and with {RELAXATIONS[-1][0]}: {errors[-1]})"
        )
        raise GrammarError("unsupported_schema", f"JSON schema not supported: {message}")


class GrammarController:
    """A sequence constrained by a compiled grammar; see `aici_cli.control.base`."""

    def __init__(self, grammar: CompiledGrammar, fast_forward: bool = True) -> None:
        self.grammar = grammar
        self.matcher = grammar.template.deep_copy()
        self.fast_forward = fast_forward

    def _next(self) -> Directive:
        m = self.matcher
        if m.is_error():
            raise ControllerError("grammar_error", m.get_error())
        if m.is_stopped():
            return Directive(stop=True)
        if not self.fast_forward:
            return Directive()
        forced = m.compute_ff_tokens()
        if forced and not m.consume_tokens(forced):
            raise ControllerError("grammar_error", m.get_error())
        return Directive(forced=tuple(forced), stop=m.is_stopped())

    def start(self, prompt: Sequence[int]) -> Directive:
        return self._next()

    def advance(self, tokens: Sequence[int]) -> Directive:
        if not self.matcher.consume_tokens(list(tokens)):
            raise ControllerError("grammar_error", self.matcher.get_error())
        return self._next()

    def fill_mask(self, out: torch.Tensor) -> bool:
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        return True

    def report(self, text: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.grammar.warnings:
            fields["warnings"] = list(self.grammar.warnings)
        if self.grammar.constraint.kind != "json_schema":
            return fields
        try:
            value = json.loads(text)
        except ValueError:
            fields.update(json=None, valid=False)
            return fields
        fields.update(json=value, valid=self.grammar.validator.is_valid(value))
        return fields
