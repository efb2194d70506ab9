"""Ask a tool, then write its answer: a controller that calls a tool the run serves.

    aici-batch run prompts.jsonl --controller calculator.wasm \\
        --mcp calc="python examples/tools/calc_server.py" --allow-tool multiply

It lists the tools it may call (logged, and the "tools" output), calls one, and forces
" Answer: <the tool's answer>" into the text; the model writes nothing: the tool decides.
A call the host refuses or cannot answer (a tool not on --allow-tool, a server that hangs
past --tool-timeout) is handled: " Answer: unknown (<error type>)".

Arg (JSON, optional): {"tool": "multiply", "arguments": {"a": 17, "b": 23}} (the default).
Outputs: "tools" (the names it may call), then "answer" (the tool's text) or "error" (the
host's error type, e.g. "tool_not_allowed") and "message".
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, fixed, log, set_output, tools


@controller
def calculator(ctx: Context) -> Generator[Any, Any, None]:
    arg = ctx.arg_json()
    name = arg.get("tool", "multiply")
    arguments = arg.get("arguments", {"a": 17, "b": 23})
    listed = tools.list_tools()
    set_output("tools", [tool.name for tool in listed])
    for tool in listed:
        log(f"tool {tool.name}: {tool.description}")
    try:
        answer = tools.call_tool(name, arguments)  # waits for the answer
    except tools.ToolError as e:
        set_output("error", e.type)
        set_output("message", e.message)
        yield fixed(f" Answer: unknown ({e.type})\n")
        return
    set_output("answer", answer)
    yield fixed(f" Answer: {answer}\n")  # the tool's text, forced: no token is sampled
