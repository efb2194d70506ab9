"""How tools and past tool calls reach the model through a chat template.

A template that reads `tools` gets them, and the messages' `tool_calls` and `tool` messages
as they are (with each call's `arguments` as an object, as vLLM passes them). A template
that does not (the default model's) gets plain messages instead, written in the same form
the tool-call grammar makes the model use (Hermes's, see `control/tool_calls.py`):

- the tools, in a system message (after the line's own system message, if it starts with
  one), as JSON within `<tools></tools>`, with how to call them;
- an assistant message's calls as its content (`<tool_call>` blocks, after any text);
- `tool` messages as a user message holding each result within `<tool_response></tool_response>`
  (consecutive ones together).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jinja2
import jinja2.meta

from aici_cli.control.tool_calls import ToolCall, call_arguments, calls_text

_TOOLS_INTRO = ("You may call one or more functions to answer. The functions are given as JSON "
                "within <tools></tools>:")
_CALL_HOWTO = ("To call a function, answer with a JSON object of its name and arguments "
               "within <tool_call></tool_call> tags, one object per call:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')


@functools.lru_cache(maxsize=16)
def template_takes_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (so it shows tools itself)."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:  # tags of transformers' own (`generation`): read the text
        return re.search(r"\btools\b", template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as a template gets them: without the keys given as null."""
    return [{**tool, "function": {k: v for k, v in tool["function"].items() if v is not None}}
            for tool in tools]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that reads tool calls: each call's `arguments` an object."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls is not None:
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": call_arguments(c)}}
                for c in calls]}
        out.append(message)
    return out


def plain_messages(messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` for a template that knows nothing of tools (see the module docstring)."""
    out: list[dict[str, Any]] = []
    responses = False  # whether out[-1] is a user message made of tool responses
    for message in messages:
        role, content = message["role"], message.get("content")
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            responses = True
            continue
        responses = False
        calls = message.get("tool_calls")
        if calls is not None:
            made = [ToolCall(c["function"]["name"],
                             json.dumps(call_arguments(c), ensure_ascii=False)) for c in calls]
            content = (content + "\n" if content else "") + calls_text(made)
        out.append({"role": role, "content": content})
    if tools:
        text = "\n".join([_TOOLS_INTRO, "<tools>",
                          *(json.dumps(t, ensure_ascii=False) for t in template_tools(tools)),
                          "</tools>", _CALL_HOWTO])
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether rendering these messages involves tools at all."""
    return tools is not None or any(
        m["role"] == "tool" or "tool_calls" in m for m in messages)
