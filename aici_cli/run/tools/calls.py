"""What every source of tool answers speaks: a served tool (`ServedTool`), the outcome of
one call (`CallOutcome`), the `ToolHost` protocol that the servers, a replay and a recording
implement, and how an answer becomes text a prompt may hold.

An outcome is either an answer (`content`, possibly a tool's own error: `is_error`, which
the model is told, as it would be told any answer) or a host error (`error`: the server
crashed, hung, answered garbage or too much, or a replay lacks the call), which ends the
line that made the call. Torch-free and mcp-free.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ServedTool:
    """A tool as its server listed it."""

    server: str
    name: str
    description: str | None
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class CallOutcome:
    """How one call ended; `t0`, `t1`: when it was sent and answered (`perf_counter`),
    `ms` the time it took (a replay's: the recorded time, so that a replayed transcript
    is the recorded one)."""

    server: str
    content: str | None = None
    is_error: bool = False
    error: tuple[str, str] | None = None  # (type, message): the line's error
    ms: float = 0.0
    t0: float = 0.0
    t1: float = 0.0


class ToolHost(Protocol):
    """Where a run's tool calls go: the MCP servers (`servers.ToolServers`), a replay
    (`record.ReplayedTools`) or either behind a recording (`record.Recorder`)."""

    tools: dict[str, ServedTool]

    def call(self, index: int, name: str, arguments: str) -> Future[CallOutcome]:
        """Call `name` with `arguments` (the JSON text of an object) for input line
        `index`; the future never fails, a failure is its outcome's `error`."""
        ...

    def restarts(self) -> dict[str, int]:
        """How many times each server was started again after a crash, by name."""
        ...

    def close(self) -> None: ...


class ToolError(Exception):
    """A call that cost its line: `type` names the failure in the line's error."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


def canonical(arguments: str) -> str:
    """Arguments as one text whatever their spacing and key order (a record's key)."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False)
    except (ValueError, RecursionError):
        return arguments


# Control characters other than tab and newline: a result is text for a prompt, and a
# server has no business sending the terminal or the tokenizer anything else.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# The call format's tags (control/tool_calls.py) and the tool-response wrapper of a
# template without tools (models/tokenizer/tool_prompt.py): a result that held them could
# pass for a call the model made, or end its own response early. Their `<` is escaped.
_TAGS = re.compile(r"<(/?)(tool_call|tool_response)>")


def untrusted_text(text: str) -> str:
    """A server's text as a prompt may hold it (see `_CONTROL` and `_TAGS`)."""
    text = _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return _TAGS.sub(r"&lt;\1\2>", text)


def result_text(result: dict[str, Any]) -> str:
    """The text of an MCP `CallToolResult` (as JSON, camelCase keys): its text parts in
    order, a placeholder for what is not text, its structured content where it has no
    parts. Not yet made safe: see `untrusted_text`."""
    parts: list[str] = []
    for item in result.get("content") or []:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            parts.append(str(item.get("text", "")))
        elif kind == "resource":
            resource = item.get("resource") or {}
            text = resource.get("text")
            parts.append(str(text) if text is not None
                         else f"[resource {resource.get('uri', '')}]")
        elif kind == "resource_link":
            parts.append(f"[resource {item.get('uri', '')}]")
        else:  # image, audio: nothing a text model can read
            parts.append(f"[{kind} {item.get('mimeType', '')}]".replace(" ]", "]"))
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"], ensure_ascii=False))
    return "\n".join(parts)
