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
