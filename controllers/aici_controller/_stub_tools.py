"""The tools `testing.StubHost` serves: fake tools, answered in plain CPython as the host
answers a controller's `aici:tools` calls, so a controller's tool use is unit-tested
without a server.

    StubHost(tools={"multiply": lambda args: args["a"] * args["b"]})
    StubHost(tools={"lookup": FakeTool(lookup, description="...", input_schema={...})},
             allow_tools=["lookup"])

A fake is a callable of the arguments (a dict) or a `FakeTool` around one. Its return
value is the answer (a `str` as it is, anything else as JSON); raising `tools.ToolError`
answers with that host error (`ToolError("tool_timeout", "...")` plays a hung server),
raising anything else is the tool's own error (`tool_error`). As on the host: a tool not
on `allow_tools` (default: every fake) is `tool_not_allowed`, arguments that are not a
JSON object are `tool_bad_arguments`, a sequence's 33rd call is `tool_quota`, and the
answer's control characters (but tab and newline) are dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolError

# The host's `GuestLimits.max_tool_calls`: calls per sequence.
MAX_TOOL_CALLS = 32
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # what the host drops from an answer


@dataclass(frozen=True)
class FakeTool:
    """A tool the stub serves: `answer(arguments)` gives its answer."""

    answer: Callable[[dict[str, Any]], Any]
    description: str = ""
    input_schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class StubToolCall:
    """A call a controller made under the stub, and what it got."""

    name: str
    arguments: str  # as the controller sent them: JSON text
    ok: bool
    text: str  # the answer, or "TYPE: message"


class StubTools:
    """The stub's tools and the calls made to them (`calls`, in order)."""

    def __init__(self, tools: Mapping[str, FakeTool | Callable[[dict[str, Any]], Any]] | None,
                 allow: Iterable[str] | None) -> None:
        self.tools = {name: tool if isinstance(tool, FakeTool) else FakeTool(tool)
                      for name, tool in (tools or {}).items()}
        self.allowed = set(self.tools) if allow is None else set(allow)
        self.calls: list[StubToolCall] = []

    def list_tools(self) -> list[tuple[str, str, str]]:
        return [(name, tool.description, json.dumps(dict(tool.input_schema)))
                for name, tool in sorted(self.tools.items()) if name in self.allowed]

    def call_tool(self, name: str, arguments: str) -> tuple[bool, str]:
        ok, text = self._answer(name, arguments)
        self.calls.append(StubToolCall(name, arguments, ok, text))
        return ok, text

    def _answer(self, name: str, arguments: str) -> tuple[bool, str]:
        tool = self.tools.get(name)
        if tool is None or name not in self.allowed:
            return False, f"tool_not_allowed: tool {name!r} is not on --allow-tool"
        try:
            args = json.loads(arguments)
        except ValueError as exc:
            return False, f"tool_bad_arguments: the arguments of {name} are not JSON ({exc})"
        if not isinstance(args, dict):
            return False, (f"tool_bad_arguments: the arguments of {name} are JSON "
                           f"{type(args).__name__}, not an object")
        try:
            value = tool.answer(args)
        except ToolError as exc:
            return False, f"{exc.type}: {exc.message}"
        except Exception as exc:  # the tool's own error, as a server reports it
            return False, f"tool_error: {exc}"
        text = value if isinstance(value, str) else json.dumps(value)
        return True, _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
