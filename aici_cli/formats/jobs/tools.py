"""A line's `tools`, `tool_choice` and `parallel_tool_calls`, and the tool calls in its
`messages`: what the input-line schema cannot say about them, and the constraint they make.

The choice defaults and edge cases are vLLM's (its OpenAI server's request checks): with
tools the choice defaults to "auto", without them to "none"; a choice other than "none"
needs `tools`; "required" (or "auto") over an empty list of tools calls nothing.
"""

from __future__ import annotations

import json
from typing import Any

from aici_cli.control.schema_check import json_schema_problem
from aici_cli.control.tool_calls import call_arguments
from aici_cli.core.constraint import Constraint

# The arguments schema of a tool given without `parameters` (vLLM's: an empty object).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_constraint(obj: dict[str, Any],
                    max_depth: int) -> Constraint | tuple[str, str] | None:
    """The tool-call constraint of a line already valid under the input-line schema; None
    when it calls no tool; (error type, problem) when its tool fields cannot be used."""
    tools: list[dict[str, Any]] | None = obj.get("tools")
    choice = obj.get("tool_choice", "auto" if tools else "none")
    if tools is not None and "messages" not in obj:
        return "invalid_line", ("field 'tools' needs 'messages': tools are shown to the model "
                                "through the chat template")
    if tools is None:
        if choice != "none":
            return "invalid_line", "field 'tool_choice' needs 'tools' (the functions to call)"
        return None
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            return "invalid_line", (f"field 'tools[{i}].function.name' repeats {json.dumps(name)},"
                                    f" the name of tools[{seen[name]}]")
        seen[name] = i
        unusable = json_schema_problem(_parameters(tool), max_depth)
        if unusable is not None:
            return unusable[0], f"field 'tools[{i}].function.parameters' {unusable[1]}"
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in seen:
            return "invalid_line", (f"field 'tool_choice.function.name' names {json.dumps(name)},"
                                    " which is not one of 'tools'")
        called = [tools[seen[name]]]
    elif choice == "none" or not tools:
        return None
    else:
        called = tools
    spec = {"tools": [{"name": t["function"]["name"], "parameters": _parameters(t)}
                      for t in called],
            "text": choice == "auto",
            "parallel": bool(obj.get("parallel_tool_calls", True))}
    return Constraint("tool_calls", spec)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if parameters is not None else NO_PARAMETERS


def messages_problem(messages: list[dict[str, Any]]) -> str | None:
    """What the input-line schema cannot say about `messages`: `tool_calls` belong to
    assistant messages, and each call's `arguments` is the JSON text of an object."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if message["role"] != "assistant":
            return (f"field 'messages[{i}].tool_calls' belongs to an assistant message, not to a "
                    f"{json.dumps(message['role'])} one")
        for j, call in enumerate(calls):
            if call_arguments(call) is None:
                return (f"field 'messages[{i}].tool_calls[{j}].function.arguments' must be the "
                        "JSON text of an object")
    return None
