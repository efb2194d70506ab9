"""What a built-in controller enforces: a JSON schema, a regex, a Lark grammar, a choice, or
tool calls.

Torch-free: the input parser and the CLI build constraints without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# "choice": the value is the list of options (the input field and CLI flag are named
# `choices`; in a result, `choices` are the n samples of a line).
ConstraintKind = Literal["json_schema", "regex", "choice", "lark", "tool_calls"]


@dataclass(frozen=True)
class Constraint:
    """`value`: a schema (dict or bool), a regex, a Lark grammar, a list of options, or for
    tool calls `{"tools": [{"name", "parameters"}, ...], "text": bool, "parallel": bool}`
    (the tools a call may name; whether plain text may answer instead; whether several
    calls may follow one another; see `tool_calls.py`).

    The other two fields apply to JSON schemas only. `whitespace`: a regex that the
    whitespace between JSON tokens must match ("" for none at all); None keeps the compact
    default (", " and ": ", nothing else). `permissive`: whether objects may carry keys
    their schema does not declare (tools' arguments too); None leaves it to the run
    (`--json-permissive`).
    """

    kind: ConstraintKind
    value: Any
    whitespace: str | None = None
    permissive: bool | None = None
