"""Tool calls by constraint: the one text form a call takes, its grammar, and reading it back.

A call is written as Hermes and Qwen chat templates write one, with compact JSON:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and several calls follow one another, separated by a newline. The grammar (`lark_grammar`)
allows exactly that (`required`, a named function) or either that or plain text that never
contains `<tool_call>` (`auto`), so a finished output is recognised as calls by its first
characters alone: no model-specific parser, whatever the model. The tool names and keys are
forced, so fast-forward writes them.

Torch-free and llguidance-free: the input reader and the chat rendering use it too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# A call is _HEAD, its name as a JSON string, _ARGUMENTS, its arguments, _TAIL.
_HEAD = OPEN + '\n{"name": '
_ARGUMENTS = ', "arguments": '
_TAIL = "}\n" + CLOSE
SEPARATOR = "\n"  # between calls


@dataclass(frozen=True)
class ToolCall:
    """One call read from the output: the tool's name and its arguments as the model
    wrote them (JSON text of an object, as the format's `arguments` is)."""

    name: str
    arguments: str


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments (all of it forced once the name is)."""
    return _HEAD + json.dumps(name, ensure_ascii=False) + _ARGUMENTS


def call_text(name: str, arguments: str) -> str:
    """One call in its text form; `arguments` is JSON text."""
    return call_prefix(name) + arguments + _TAIL


def calls_text(calls: Sequence[ToolCall]) -> str:
    return SEPARATOR.join(call_text(c.name, c.arguments) for c in calls)


def lark_grammar(arguments: Sequence[tuple[str, dict[str, Any]]], text: bool,
                 parallel: bool, special: Mapping[str, int] | None = None) -> str:
    """The grammar of an output that calls the tools: for each tool, its name and the JSON
    schema of its arguments (with llguidance's JSON options under `x-guidance`). `text`:
    plain text is allowed instead (`auto`); `parallel`: one call or more, else exactly one.
    `special`: the tags (`OPEN`, `CLOSE`) that are one special token of the model's
    vocabulary, by token id (Qwen 2.5's `<tool_call>` is 151657): written as that token
    (`<[id]>`), since llguidance never matches a special token as text, where the tag as
    text would refuse the very token the model writes it with. Decoded, the token is the
    tag's text, so the output reads back the same (`parse_calls`).

    Each tool's arguments are their own `%json` root, so a `$ref` in them resolves in the
    tool's own `parameters`, as its author wrote it. (Lark string literals are JSON
    strings, hence `json.dumps`.)
    """
    special = special or {}

    def tag(text: str) -> str:
        return f"<[{special[text]}]>" if text in special else json.dumps(text)

    calls = "call (SEP call)*" if parallel else "call"
    lines = ["%llguidance {}", f"start: TEXT | {calls}" if text else f"start: {calls}"]
    if text:
        # Anything without the opening tag: the complement (`~`) of every string holding
        # it, intersected with valid UTF-8.
        lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex_literal(OPEN)}(?s:.*)/")
    lines.append(f"SEP: {json.dumps(SEPARATOR)}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(arguments))))
    for i, (name, schema) in enumerate(arguments):
        head = call_prefix(name)[len(OPEN):]
        lines.append(f"call_{i}: {tag(OPEN)} {json.dumps(head, ensure_ascii=False)} args_{i} "
                     f"{json.dumps(_TAIL[:-len(CLOSE)])} {tag(CLOSE)}")
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark `/regex/` (which ends at an unescaped /)."""
    return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$/" else ch for ch in text)


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls an output makes, or None when it is not calls (plain text, or calls cut
    off before their end). Reads exactly the form `lark_grammar` allows."""
    calls, rest = complete_calls(text)
    return calls if calls and rest == len(text) else None


def complete_calls(text: str) -> tuple[list[ToolCall], int]:
    """The whole calls an output starts with, and where the text after them begins (at
    its end when every call is whole; else at what follows the last whole call: a call cut
    off, or what is no call)."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    done = pos = 0  # `done`: the end of the last whole call
    while True:
        if not text.startswith(_HEAD, pos):
            return calls, done
        try:
            name, pos = decoder.raw_decode(text, pos + len(_HEAD))
            if not isinstance(name, str) or not text.startswith(_ARGUMENTS, pos):
                return calls, done
            start = pos + len(_ARGUMENTS)
            arguments, pos = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            return calls, done
        if not isinstance(arguments, dict) or not text.startswith(_TAIL, pos):
            return calls, done
        calls.append(ToolCall(name, text[start:pos]))
        done = pos = pos + len(_TAIL)
        if pos == len(text) or not text.startswith(SEPARATOR, pos):
            return calls, done
        pos += len(SEPARATOR)


def call_id(index: int, line_id: str | int, sample: int, k: int) -> str:
    """The id of a line's k-th call (in sample `sample`): derived from the line, so a
    rerun or `--resume` writes the same ids."""
    key = f"{index}\0{line_id}\0{sample}\0{k}".encode("utf-8", "surrogatepass")
    return "call_" + hashlib.sha256(key).hexdigest()[:24]


def tool_calls_field(calls: Sequence[ToolCall], index: int, line_id: str | int,
                     sample: int) -> list[dict[str, Any]]:
    """The result's `tool_calls`, in the OpenAI format's shape."""
    return [{"id": call_id(index, line_id, sample, k), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for k, c in enumerate(calls)]


def call_arguments(call: dict[str, Any]) -> dict[str, Any] | None:
    """A past call's arguments as an object ("" is none, as vLLM reads it), or None when
    they are not the JSON text of one."""
    text = call["function"]["arguments"]
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
