"""A sequence constrained by a compiled grammar: masks, fast-forward, validation."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from aici_cli.control import tool_calls
from aici_cli.control.base import ControllerBase, Directive
from aici_cli.control.grammar.compiler import CompiledGrammar
from aici_cli.control.grammar.distinct_keys import DistinctKeys
from aici_cli.control.grammar.early_close import UNCLOSABLE, Closing, EarlyClose, Undo
from aici_cli.control.grammar.keyword_guard import CallKeywordGuard, KeywordGuard, clear_bits
from aici_cli.control.grammar.limits import is_limit_error, tidy_error
from aici_cli.core.errors import ControllerError


class GrammarController(ControllerBase):
    """A sequence constrained by a compiled grammar; see `aici_cli.control.base`."""

    def __init__(self, grammar: CompiledGrammar, fast_forward: bool = True,
                 closing: Closing | None = None, keywords: bool = True) -> None:
        """`keywords`: hold the output to the schema's keywords the grammar cannot express
        (keyword_guard.py), where it has any; its backtracks are the sequence's own, so
        a controller whose tokens are counted by another (a wasm segment) turns it off."""
        self.grammar = grammar
        self._matcher = grammar.template.deep_copy()
        self.fast_forward = fast_forward
        # Every token the matcher consumed and the closing plan (early_close.py): kept only
        # when the line may be closed early, not on every constrained row's step.
        accepts = _accepts(grammar.validator) if (
            grammar.constraint.kind == "json_schema" and grammar.validator is not None) else None
        self._guard = _guard(grammar) if keywords else None
        fault_at = self._guard.first_fault if self._guard is not None else None
        self._early = (EarlyClose(closing, grammar.hints, accepts, fault_at)
                       if closing is not None else None)
        # No key twice in an object, where the schema's objects may hold undeclared keys.
        self._keys = (DistinctKeys(grammar.key_index, grammar.decode)
                      if grammar.key_index is not None and grammar.decode is not None
                      else None)

    @property
    def closed_early(self) -> bool:
        return self._early is not None and self._early.reason is not None

    def _next(self, sampled: Sequence[int] = ()) -> Directive:
        """What follows `sampled` (just consumed): the grammar's forced tokens, a retry of
        a value that breaks a keyword (keyword_guard.py), a close, or a stop."""
        m = self._matcher
        if m.is_error():
            raise self.matcher_fault()
        ff_tokens: list[int] = []
        if self.fast_forward and not m.is_stopped():
            ff_tokens = m.compute_ff_tokens()  # forced by the grammar: no need to sample them
            if m.is_error() or (ff_tokens and not m.consume_tokens(ff_tokens)):
                raise self.matcher_fault()
        early = self._early
        if early is not None:
            early.consumed(ff_tokens)
        if self._keys is not None:
            self._keys.consumed(ff_tokens)
        if self._guard is not None:
            retry = self._retry([*sampled, *ff_tokens], ff_tokens)
            if retry is not None:
                return retry
        if self._keys is not None and self._keys.scanner.repeated_key >= 0:
            mended = self._mend_key(ff_tokens)
            if mended is not None:
                return mended
        if early is None or m.is_stopped():
            return Directive(ff_tokens=tuple(ff_tokens), stop=m.is_stopped())
        close = early.decide(m)
        if close is None:
            return Directive(ff_tokens=tuple(ff_tokens), stop=m.is_stopped())
        if isinstance(close, Undo):  # a loop taken back: the model goes on from there
            if self._guard is not None:
                self._guard.rollback(close.backtrack)
            if self._keys is not None:
                self._keys.rollback(close.backtrack)
            return _back(close.backtrack, ff_tokens)
        finish = "length" if close.reason == UNCLOSABLE else "stop"  # a cut, not a close
        if close.backtrack > len(ff_tokens):  # back into what the engine already holds
            return Directive(backtrack=close.backtrack - len(ff_tokens),
                             ff_tokens=tuple(close.tokens), stop=True, finish=finish)
        kept = ff_tokens[: len(ff_tokens) - close.backtrack]
        return Directive(ff_tokens=tuple(kept + close.tokens), stop=True, finish=finish)

    def _retry(self, tokens: list[int], ff_tokens: list[int]) -> Directive | None:
        """After `tokens` (the last `ff_tokens` of them forced, not yet the engine's): a
        backtrack to the choice point of a value they finish that breaks a keyword, or
        None."""
        guard = self._guard
        assert guard is not None
        fault = guard.consumed(tokens)
        back = guard.mend(self._matcher, fault) if fault is not None else 0
        if not back:
            return None
        if self._early is not None:
            self._early.rollback(back)
        if self._keys is not None:
            self._keys.rollback(back)
        return _back(back, ff_tokens)

    def _mend_key(self, ff_tokens: list[int]) -> Directive | None:
        """A key written twice (the grammar forced its end): back to its last choice,
        barred there (distinct_keys.py); None where it cannot be mended."""
        assert self._keys is not None
        back = self._keys.mend(self._matcher)
        if not back:
            return None
        if self._early is not None:
            self._early.rollback(back)
        if self._guard is not None:
            self._guard.rollback(back)
        return _back(back, ff_tokens)

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
        if self._early is not None:
            self._early.consumed(tokens)
            self._early.sampled = True
        if self._keys is not None:
            self._keys.consumed(tokens)
        return self._next(tokens)

    def stats(self) -> dict[str, float | bool | str]:
        """`closed_early` and `close_reason` ("limit", "loop", or "loop_unclosable": a
        loop the guard cut, its output not a whole value) when it was; `loops_undone`,
        the loops taken back for the model to write again (early_close.py), and
        `undone_tokens`, the tokens the loop guard took back (passes spent on them), and
        `keyword_retries`, the tokens barred to mend a keyword (keyword_guard.py), when
        any was."""
        out: dict[str, float | bool | str] = {}
        if self._early is not None and self._early.reason is not None:
            out.update(closed_early=True, close_reason=self._early.reason)
        if self._early is not None and self._early.loops_undone:
            out["loops_undone"] = self._early.loops_undone
        if self._early is not None and self._early.undone_tokens:
            out["undone_tokens"] = self._early.undone_tokens
        if self._guard is not None and self._guard.barred_count:
            out["keyword_retries"] = self._guard.barred_count
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar accepts from the current state, consuming
        nothing (used to trim draft tokens before they are verified); none when the first
        is barred here."""
        if tokens and (tokens[0] in self._barred() or tokens[0] in self._key_bars()):
            return 0
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

    def matcher(self) -> llguidance.LLMatcher | None:
        """The matcher, which the engine fills with the batch's others; None at a position
        where a token is barred (by the keyword guard, a loop undone, or a key already
        written): then `fill_mask` clears it from the matcher's mask."""
        return None if self._barred() or self._key_bars() else self._matcher

    def fill_mask(self, out: torch.Tensor) -> bool:
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        if self._matcher.is_error():
            raise self.matcher_fault()
        words = out.numpy().view(np.uint32)
        barred = self._barred()
        if barred:
            clear_bits(words, barred)
        repeats = self._key_bars()
        if repeats:  # soft: dropped where only a repeated key is allowed
            kept = words.copy()
            clear_bits(words, repeats)
            if not words.any():
                words[:] = kept
        return True

    def _key_bars(self) -> set[int]:
        """Tokens that would write a key the object holds already (distinct_keys.py)."""
        return self._keys.barred() if self._keys is not None else set()

    def _barred(self) -> set[int]:
        """Tokens barred at this position: by the keyword guard, or by a loop undone."""
        guard = self._guard.barred() if self._guard is not None else set()
        early = self._early.barred() if self._early is not None else set()
        return guard | early if guard and early else guard or early

    def report(self, text: str) -> dict[str, Any]:
        warnings = list(self.grammar.warnings)
        kind = self.grammar.constraint.kind
        fields: dict[str, Any] = {}
        if kind == "json_schema":
            fields = self._report_json(text, warnings)
        elif kind == "tool_calls":
            fields = self._report_calls(text, warnings)
        if warnings:
            fields["warnings"] = warnings
        if self.grammar.relaxed:  # `valid` is still against the original schema
            fields["relaxed"] = list(self.grammar.relaxed)
        return fields

    def _report_json(self, text: str, warnings: list[str]) -> dict[str, Any]:
        """`json` (the output parsed) and `valid` (against the schema as written)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # also output nested past Python's stack
            return {"json": None, "valid": False}
        return {"json": value, "valid": _is_valid(self.grammar.validator, value, warnings)}

    def _report_calls(self, text: str, warnings: list[str]) -> dict[str, Any]:
        """`calls` (the ToolCalls read from the output; the result line gives them ids) and
        `valid` (every call names a tool and its arguments validate against that tool's
        `parameters`), for an output that calls tools; nothing for a text answer. An output
        cut off inside a call (at max_tokens) keeps the calls before it, and says the cut
        one was dropped (`dropped_call`); one with no whole call has none and is not
        valid."""
        if not text.startswith(tool_calls.OPEN):
            return {}
        calls, rest = tool_calls.complete_calls(text)
        if not calls:
            return {"valid": False}
        validators = self.grammar.tools
        valid = all(c.name in validators and _is_valid(validators[c.name],
                                                       json.loads(c.arguments), warnings)
                    for c in calls)
        fields: dict[str, Any] = {"calls": calls, "valid": valid}
        if rest < len(text):
            fields["dropped_call"] = text[rest:].lstrip(tool_calls.SEPARATOR)[:200]
            warnings.append(f"a tool call cut off at max_tokens was dropped; the "
                            f"{len(calls)} whole call(s) before it are kept")
        return fields


def _guard(grammar: CompiledGrammar) -> KeywordGuard | None:
    """The keyword guard of a grammar whose schema (or a tool's `parameters`) has
    keywords it cannot express; None for the rest."""
    if grammar.decode is None:
        return None
    if grammar.keywords is not None:
        return KeywordGuard(grammar.keywords, grammar.validator, grammar.decode)
    if grammar.tool_keywords:
        return CallKeywordGuard(grammar.tool_keywords, grammar.tools, grammar.decode)
    return None


def _back(n: int, ff_tokens: list[int]) -> Directive:
    """Take back the last `n` tokens, of which the last `ff_tokens` are this step's forced
    ones (not yet the engine's), and go on."""
    if n > len(ff_tokens):  # back into what the engine already holds
        return Directive(backtrack=n - len(ff_tokens))
    return Directive(ff_tokens=tuple(ff_tokens[: len(ff_tokens) - n]))


def _accepts(validator: Any) -> Callable[[str], bool]:
    """Whether an output text is a value `validator` accepts, with no key twice in an
    object: what a close checks its completion with (early_close.py)."""

    def accepts(text: str) -> bool:
        try:
            return bool(validator.is_valid(json.loads(text, object_pairs_hook=_distinct)))
        except Exception:  # noqa: BLE001 - not JSON, or not checkable: not known valid
            return False

    return accepts


def _distinct(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict; a key written twice is an error."""
    value = dict(pairs)
    if len(value) < len(pairs):
        raise ValueError("a key written twice")
    return value


def _is_valid(validator: Any, value: Any, warnings: list[str]) -> bool:
    """Whether `value` validates; False, with a warning, when it cannot be validated."""
    try:
        return bool(validator.is_valid(value))
    except Exception as e:  # e.g. a $ref jsonschema cannot resolve: not validated
        warnings.append(f"output could not be validated: {type(e).__name__}: {str(e)[:200]}")
        return False
