"""Whether a line's grammar or JSON whitespace pattern can be used, checked without a
tokenizer (the siblings of `schema_check` for the other constraint fields).

A grammar is Lark as llguidance reads it, or GBNF as llama.cpp writes it (`root ::= ...`),
converted to Lark here as llguidance's own `grammar_from("grammar", ...)` does. llguidance
is imported on first use only: the CLI imports the input parser at startup.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

from aici_cli.core.constraint import Constraint

# Distinct grammars whose answer is kept: a batch repeats one grammar on every line, and
# checking one costs about 1 ms (5 ms when it is refused).
_CACHED_GRAMMARS = 64


@functools.lru_cache(maxsize=_CACHED_GRAMMARS)
def lark_grammar(text: str) -> tuple[str, str | None]:
    """(the grammar as Lark, None), or ("", why it cannot be used)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    from aici_cli.control.grammar.limits import GRAMMAR_LIMITS, tidy_error

    try:
        lark = any_to_lark(text)
    except Exception as e:  # GbnfToLarkError, and plain Exception for "no root rule"
        return "", f"not Lark, and not GBNF either: {e}"
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark), limits=GRAMMAR_LIMITS)
    if error:
        return "", tidy_error(error, keep_position=lark == text)
    return lark, None


# What a whitespace pattern may be made of: JSON's four whitespace characters (as themselves
# or escaped), character classes, groups, alternation and repetition. Anything else could let
# the model write something other than whitespace between JSON tokens (`\s` takes in
# non-breaking spaces, which JSON does not), and llguidance uses the pattern as it is.
_WHITESPACE_PIECES = re.compile(
    r"(?:[ \t\n\r]|\\[ tnr]|\\x(?:20|09|0[aAdD])|\\u00(?:20|09|0[aAdD])|\(\?:|[\[\]()|*+?])*"
)
# {m}, {m,}, {m,n} after something to repeat: read the same by Rust and by re ({,n} is
# re's only).
_COUNTED = re.compile(r"(?<=[^\[(|{}?*+])\{\d+(?:,\d*)?\}")
_REPEATED_TWICE = re.compile(r"[*+?}][*+]")  # possessive `*+`: Python only, Rust refuses it


def whitespace_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be the whitespace between JSON tokens, or None ("" is fine:
    no whitespace at all)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return f"is not a valid regular expression: {e}"
    bare = _COUNTED.sub("", pattern)
    if not _WHITESPACE_PIECES.fullmatch(bare) or _REPEATED_TWICE.search(pattern):
        return ("may match only JSON whitespace: spaces, \\t, \\n and \\r (as characters or "
                "escapes) with [], (), |, ?, *, + and {m,n}")
    return None


def support_problem(constraint: Constraint, strict_json: bool) -> str | None:
    """Why llguidance cannot enforce `constraint` (a JSON schema, regex or choices) under
    any tokenizer, or None: the grammar the compiler would build, validated without one.
    For JSON schemas it tries the compiler's relaxations in turn, as the compiler does
    (`--schema-fallback relax` goes further and is not judged here).

    For a run-level constraint (`--json-schema`, `--regex`, `--choices`), which every line
    would otherwise fail with alike after the model loaded. Tokenizer-free validation
    agreed with a compile for a model's tokenizer on all of 1,540 JSONSchemaBench dev
    schemas (16 refused by both). Bound a schema's size first (`schema_shape_problem`), as
    the compiler does. Imports llguidance and the grammar package (torch).
    """
    from llguidance import LLMatcher

    from aici_cli.control.grammar.limits import GRAMMAR_LIMITS, is_limit_error, tidy_error
    from aici_cli.control.grammar.schema_rewrite import (
        RELAXATIONS,
        choices_grammar,
        close_objects,
        exclusive_one_of,
        json_options,
    )

    grammars: list[str] = []
    errors: list[str] = []
    if constraint.kind == "regex":
        label, grammars = "regex", [LLMatcher.grammar_from_regex(constraint.value)]
    elif constraint.kind == "choice":
        label = "choices"
        grammars = [LLMatcher.grammar_from_lark(choices_grammar(constraint.value))]
    elif constraint.kind == "json_schema":
        label, schema = "JSON schema", exclusive_one_of(constraint.value)
        if strict_json if constraint.permissive is None else not constraint.permissive:
            schema = close_objects(schema)
        for _, extra in RELAXATIONS:
            options: Any = {**json_options(constraint.whitespace), **extra}
            try:
                grammars.append(LLMatcher.grammar_from_json_schema(schema, overrides=options))
            except ValueError as e:
                errors.append(str(e))
    else:
        return None
    for grammar in grammars:
        error = LLMatcher.validate_grammar(grammar, limits=GRAMMAR_LIMITS)
        if not error:
            return None
        if is_limit_error(error):  # a relaxed grammar is no smaller
            return (f"{label} too large or complex to compile within the grammar limits: "
                    f"{tidy_error(error)}")
        errors.append(error)
    return f"{label} not supported: {tidy_error(errors[-1]) if errors else 'grammar rejected'}"
