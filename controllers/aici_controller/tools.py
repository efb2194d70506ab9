"""The tools the run allows this controller: `aici:tools`, served by the run's MCP servers
(`aici-batch run --mcp NAME=COMMAND --allow-tool TOOL`, docs/tools.md).

    from aici_controller import tools

    names = [tool.name for tool in tools.list_tools()]   # Tool(name, description, input_schema)
    try:
        product = tools.call_tool("multiply", {"a": 17, "b": 23})   # its text: "391.0"
    except tools.ToolError as e:     # e.type: "tool_not_allowed", "tool_timeout", ...
        product = None

`list_tools` gives the tools on `--allow-tool` that a server serves (none without them).
`call_tool` waits for the answer: the host bounds the call (`--tool-timeout`,
`--tool-result-bytes`), traces and records it, and the engine's step waits with it, so
every line of the batch waits for a slow tool. The answer is the server's text: untrusted,
for a prompt or for parsing. A call the host cannot answer raises `ToolError` with the
host's type (wit/deps/tools/tools.wit lists them; a tool's own error is `tool_error`);
uncaught, it ends the sequence as any exception does. A fork's new branches do not call
again: the host answers the calls made before the fork from its journal.

Under `testing.StubHost(tools={...})` the same calls reach fake tools.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import _host

__all__ = ["Tool", "ToolError", "call_tool", "list_tools"]


@dataclass(frozen=True)
class Tool:
    """A tool the controller may call, as its server listed it."""

    name: str
    description: str
    input_schema: dict[str, Any]  # the JSON Schema of its arguments


class ToolError(Exception):
    """A call the host answered with `err`: `type` (`tool_not_allowed`, `tool_error`,
    `tool_timeout`, ...) and `message`."""

    def __init__(self, type: str, message: str) -> None:  # noqa: A002 (the WIT word)
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message

    @classmethod
    def parse(cls, text: str) -> ToolError:
        """The host's `TYPE: message`."""
        type_, sep, message = text.partition(": ")
        if not sep or " " in type_:
            return cls("tool_failed", text)
        return cls(type_, message)


def list_tools() -> list[Tool]:
    """The tools this controller may call, by name."""
    return [Tool(name, description, _schema(schema))
            for name, description, schema in _host.current().list_tools()]


def call_tool(name: str, arguments: Mapping[str, Any] | str | None = None) -> str:
    """Calls tool `name` with `arguments` (a dict, or its JSON text; None: `{}`) and
    returns its answer's text; raises `ToolError` when there is none."""
    if not isinstance(name, str):
        raise TypeError(f"call_tool() takes the tool's name as str, got {type(name).__name__}")
    if arguments is None:
        text = "{}"
    elif isinstance(arguments, str):
        text = arguments
    else:
        text = json.dumps(dict(arguments), ensure_ascii=False)
    ok, answer = _host.current().call_tool(name, text)
    if not ok:
        raise ToolError.parse(answer)
    return answer


def _schema(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
