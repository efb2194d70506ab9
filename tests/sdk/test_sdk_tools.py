"""`aici_controller.tools` (aici:tools) under the stub host's fake tools: the calculator
example, refusals, the host's errors as `ToolError`, answers as untrusted text, the quota,
and a fork that does not call a tool again. `tests/run/tools/test_controller_tools.py`
runs the same code as a component against a real MCP server."""

from __future__ import annotations

from typing import Any

import pytest
from aici_controller import Context, controller, fixed, fork, set_output, tools
from aici_controller.testing import FakeTool, StubHost, StubToolCall
from sdk_examples import load_example

MULTIPLY = FakeTool(lambda a: a["a"] * a["b"], "Multiply two numbers.",
                    {"type": "object", "properties": {"a": {"type": "number"}}})
TOOLS: dict[str, Any] = {"multiply": MULTIPLY, "add": lambda a: a["a"] + a["b"]}


def test_the_calculator_lists_calls_and_forces_the_answer() -> None:
    run = StubHost(tools=TOOLS, allow_tools=["multiply"]).run(load_example("calculator"))
    assert run.error is None
    assert run.text == " Answer: 391\n"
    assert run.outputs == {"tools": ["multiply"], "answer": "391"}
    assert run.logs == ["tool multiply: Multiply two numbers."]
    assert run.tool_calls == [StubToolCall("multiply", '{"a": 17, "b": 23}', True, "391")]


def test_a_tool_not_allowed_is_refused_and_handled() -> None:
    run = StubHost(tools=TOOLS, allow_tools=["multiply"]).run(
        load_example("calculator"), arg='{"tool": "add", "arguments": {"a": 1, "b": 2}}')
    assert run.error is None
    assert run.text == " Answer: unknown (tool_not_allowed)\n"
    assert run.outputs["message"] == "tool 'add' is not on --allow-tool"
    # Without tools at all (a run with no --mcp): an empty list, every call refused.
    bare = StubHost().run(load_example("calculator"))
    assert bare.outputs == {"tools": [], "error": "tool_not_allowed",
                            "message": "tool 'multiply' is not on --allow-tool"}


def test_tools_are_listed_with_their_schemas() -> None:
    seen: list[Any] = []

    @controller
    def lists(ctx: Context):  # type: ignore[no-untyped-def]
        seen.extend(tools.list_tools())
        yield fixed("x")

    StubHost(tools=TOOLS).run(lists)
    assert [(t.name, t.description) for t in seen] == [("add", ""),
                                                        ("multiply", "Multiply two numbers.")]
    assert seen[1].input_schema == {"type": "object", "properties": {"a": {"type": "number"}}}


def test_host_errors_tool_errors_and_untrusted_text() -> None:
    def hung(_: dict[str, Any]) -> str:
        raise tools.ToolError("tool_timeout", "tool hung did not answer within 1 s")

    def raises(_: dict[str, Any]) -> str:
        raise ZeroDivisionError("division by zero")

    stub = StubHost(tools={"hung": hung, "raises": raises, "noisy": lambda _: "a\x07b\r\nc",
                           "json": lambda _: {"x": 1}})
    seen: list[tuple[str, str]] = []

    @controller
    def probe(ctx: Context):  # type: ignore[no-untyped-def]
        for name, args in (("hung", {}), ("raises", None), ("noisy", {}), ("json", "{}"),
                           ("json", "[1]"), ("json", "{oops"), ("gone", {})):
            try:
                seen.append(("ok", tools.call_tool(name, args)))
            except tools.ToolError as e:
                seen.append((e.type, e.message))
        yield fixed("x")

    assert stub.run(probe).error is None
    assert seen[:5] == [
        ("tool_timeout", "tool hung did not answer within 1 s"),
        ("tool_error", "division by zero"),
        ("ok", "ab\nc"),  # control characters dropped, as the host drops them
        ("ok", '{"x": 1}'),
        ("tool_bad_arguments", "the arguments of json are JSON list, not an object"),
    ]
    assert seen[5][0] == "tool_bad_arguments"
    assert seen[6] == ("tool_not_allowed", "tool 'gone' is not on --allow-tool")


def test_an_uncaught_tool_error_ends_the_sequence_with_its_type() -> None:
    @controller
    def careless(ctx: Context):  # type: ignore[no-untyped-def]
        tools.call_tool("missing")
        yield fixed("never")

    run = StubHost().run(careless)
    assert run.error is not None
    assert run.error.startswith(
        "ToolError: tool_not_allowed: tool 'missing' is not on --allow-tool")


def test_a_sequence_may_make_32_calls() -> None:
    answers: list[str] = []

    @controller
    def many(ctx: Context):  # type: ignore[no-untyped-def]
        for _ in range(33):
            try:
                answers.append(tools.call_tool("add", {"a": 1, "b": 1}))
            except tools.ToolError as e:
                answers.append(e.type)
        yield fixed("x")

    run = StubHost(tools=TOOLS).run(many)
    assert answers == ["2"] * 32 + ["tool_quota"]
    assert len(run.tool_calls) == 32  # the 33rd never reached the tool


def test_a_fork_replays_the_calls_before_it_without_calling_again() -> None:
    calls: list[dict[str, Any]] = []

    def count(args: dict[str, Any]) -> int:
        calls.append(args)
        return len(calls)

    @controller
    def forks(ctx: Context):  # type: ignore[no-untyped-def]
        first = tools.call_tool("count", {"at": "start"})
        branch = yield fork(3)
        after = tools.call_tool("count", {"branch": branch})
        set_output("seen", [first, after])
        yield fixed("x")

    run = StubHost(tools={"count": count}).run(forks)
    assert run.error is None
    # One call before the fork (its answer replayed into branches 1 and 2), one per branch.
    assert calls == [{"at": "start"}, {"branch": 0}, {"branch": 1}, {"branch": 2}]
    assert [b.outputs["seen"] for b in run.branches] == [["1", "2"], ["1", "3"], ["1", "4"]]
    assert len(run.tool_calls) == 4


def test_tools_need_a_running_controller() -> None:
    with pytest.raises(RuntimeError, match="no running controller"):
        tools.list_tools()
    with pytest.raises(RuntimeError, match="no running controller"):
        tools.call_tool("x", {})


def test_a_tool_error_reads_the_hosts_type_and_message() -> None:
    e = tools.ToolError.parse("tool_timeout: tool x did not answer: within 1 s")
    assert (e.type, e.message) == ("tool_timeout", "tool x did not answer: within 1 s")
    odd = tools.ToolError.parse("something went wrong: badly")
    assert (odd.type, odd.message) == ("tool_failed", "something went wrong: badly")
