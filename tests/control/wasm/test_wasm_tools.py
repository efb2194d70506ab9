"""`aici:tools` in the wasm host, against hand-written WAT guests (tests/support/wat.py) and
fake tools: a guest lists and calls tools through `GuestTools`, gets `err` as a value it
handles, is linked the interface only when it imports it, waits for a slow tool without
being charged for it, is held to its call quota, and a fork's new branch gets the calls
made before the fork from the journal, without calling the tool again."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from fake_services import FakeServices
from wat import Guest, component, save

from aici_cli.control.actions import Fork, StepInput, Stop
from aici_cli.control.guest_tools import NO_TOOLS, ToolAnswer, ToolInfo, not_allowed
from aici_cli.control.line_scope import LineScope
from aici_cli.control.wasm import ComponentError, ControllerComponent, GuestLimits
from aici_cli.control.wasm.signatures import TOOLS_INTERFACE

INFOS = [ToolInfo("multiply", "Multiply two numbers.", '{"type": "object"}'),
         ToolInfo("lookup", "", "{}")]


class FakeTools:
    """`GuestTools` that answers `multiply` with "391.0" (after `delay_s`), refuses the rest,
    and counts the calls."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.delay_s = delay_s

    def list_tools(self) -> list[ToolInfo]:
        return list(INFOS)

    def call_tool(self, name: str, arguments: str) -> ToolAnswer:
        self.calls.append((name, arguments))
        time.sleep(self.delay_s)
        return ToolAnswer(True, "391.0") if name == "multiply" else not_allowed(name)


# Lists the tools: "count" is how many, the log holds the first one's name and schema.
LIST = Guest(
    """
    (call $list-tools (global.get $out))
    (local.set $p (i32.load (global.get $out)))
    (local.set $n (i32.load offset=4 (global.get $out)))
    (call $set-output {count} (call $utoa (local.get $n)))
    (if (local.get $n) (then
      (call $log (i32.load (local.get $p)) (i32.load offset=4 (local.get $p)))
      (call $log (i32.load offset=16 (local.get $p)) (i32.load offset=20 (local.get $p)))))
    (call $stop)
    """,
    data={"count": "count"},
)


def calling(name: str, arguments: str) -> Guest:
    """Calls `name`; sets output "answer" to the ok text or "error" to the err text."""
    return Guest(
        """
        (call $call-tool {name} {arguments} (global.get $out))
        (if (i32.load8_u (global.get $out))
          (then (call $set-output {error} (i32.load offset=4 (global.get $out))
                                          (i32.load offset=8 (global.get $out))))
          (else (call $set-output {answer} (i32.load offset=4 (global.get $out))
                                           (i32.load offset=8 (global.get $out)))))
        (call $stop)
        """,
        data={"name": name, "arguments": arguments, "answer": "answer", "error": "error"},
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wasm-tools")


def load(folder: Path, guests: Guest | Mapping[str, Guest], version: str = "0.1.0",
         limits: GuestLimits | None = None) -> ControllerComponent:
    path = save(folder, component(guests, version))
    return ControllerComponent.load(path, limits or GuestLimits(), cache_dir=folder)


def test_a_guest_lists_and_calls_tools(folder: Path) -> None:
    comp = load(folder, {"l": LIST, "c": calling("multiply", '{"a": 17, "b": 23}'),
                         "r": calling("add", "{}")})
    assert comp.lowering.tools and comp.lowering.call_tool
    tools = FakeTools()
    lister = comp.instantiate("l", [1], FakeServices(), tools=tools)
    assert lister.mid_process(StepInput()) == Stop()
    assert lister.outputs == {"count": 2}
    assert lister.logs == ["multiply", '{"type": "object"}']
    caller = comp.instantiate("c", [1], FakeServices(), tools=tools)
    assert caller.mid_process(StepInput()) == Stop()
    assert caller.outputs == {"answer": 391.0}  # "391.0" parses as JSON
    # A refusal is the guest's `err`, a value it handles: the guest goes on.
    refused = comp.instantiate("r", [1], FakeServices(), tools=tools)
    assert refused.mid_process(StepInput()) == Stop() and not refused.dead
    assert refused.outputs == {"error": "tool_not_allowed: tool 'add' is not on --allow-tool"}
    assert tools.calls == [("multiply", '{"a": 17, "b": 23}'), ("add", "{}")]


def test_without_tools_the_list_is_empty_and_every_call_refused(folder: Path) -> None:
    comp = load(folder, {"l": LIST, "c": calling("multiply", "{}")})
    lister = comp.instantiate("l", [1], FakeServices())  # NO_TOOLS, the default
    lister.mid_process(StepInput())
    assert lister.outputs == {"count": 0} and lister.logs == []
    caller = comp.instantiate("c", [1], FakeServices(), tools=NO_TOOLS)
    caller.mid_process(StepInput())
    assert caller.outputs["error"].startswith(
        "tool_not_allowed: tool 'multiply' is not on --allow-tool")


def test_only_a_component_that_imports_tools_is_linked_to_them(folder: Path) -> None:
    older = load(folder, Guest("(call $stop)"), version="0.2.0")
    assert not older.lowering.tools
    assert TOOLS_INTERFACE not in older.interfaces()[1]
    assert older.instantiate("", [1], FakeServices(), tools=FakeTools()).mid_process(
        StepInput()) == Stop()
    newer = load(folder, calling("multiply", "{}"), version="0.2.0")
    assert TOOLS_INTERFACE in newer.interfaces()[1]


def test_a_tools_import_of_another_shape_is_refused_at_load(folder: Path) -> None:
    text = component(calling("multiply", "{}")).replace(
        '(param "arguments" string) (result (result string (error string))))',
        '(param "arguments" string) (result string))')
    path = folder / "odd-tools.wat"
    path.write_text(text)
    with pytest.raises(ComponentError, match="import aici:tools/tools@0.1.0#call-tool has"):
        ControllerComponent.load(path, cache_dir=folder)


def test_a_slow_tool_is_not_charged_to_the_guests_deadline(folder: Path) -> None:
    comp = load(folder, calling("multiply", "{}"), limits=GuestLimits(call_ms=20))
    guest = comp.instantiate("", [1], FakeServices(), tools=FakeTools(delay_s=0.3))
    t0 = time.perf_counter()
    assert guest.mid_process(StepInput()) == Stop()
    assert time.perf_counter() - t0 >= 0.3
    assert guest.outputs == {"answer": 391.0} and guest.host_ms >= 300


def test_a_sequence_is_held_to_its_tool_calls(folder: Path) -> None:
    twice = Guest(
        """
        (call $call-tool {name} {arguments} (global.get $out))
        (call $call-tool {name} {arguments} (global.get $out))
        (call $set-output {result} (i32.load offset=4 (global.get $out))
                                   (i32.load offset=8 (global.get $out)))
        (call $stop)
        """,
        data={"name": "multiply", "arguments": "{}", "result": "result"},
    )
    comp = load(folder, twice, limits=GuestLimits(max_tool_calls=1))
    tools = FakeTools()
    guest = comp.instantiate("", [1], FakeServices(), tools=tools)
    guest.mid_process(StepInput())
    assert guest.outputs == {"result": "tool_quota: more than 1 tool calls per sequence"}
    assert len(tools.calls) == 1


def test_a_forks_new_branch_gets_the_calls_before_it_from_the_journal(folder: Path) -> None:
    # Call 1: a tool call, then fork(2). Call 2 (each branch): another call, its answer out.
    forking = Guest(
        """
        (call $call-tool {name} {arguments} (global.get $out))
        (if (i32.eq (global.get $calls) (i32.const 1))
          (then (return (call $fork (i32.const 2)))))
        (call $set-output {answer} (i32.load offset=4 (global.get $out))
                                   (i32.load offset=8 (global.get $out)))
        (call $stop)
        """,
        data={"name": "multiply", "arguments": "{}", "answer": "answer"},
    )
    comp = load(folder, forking, version="0.2.0")
    tools = FakeTools()
    first = comp.instantiate("", [1], FakeServices(), LineScope(), tools)
    assert first.mid_process(StepInput()) == Fork(2)
    second = first.replica()
    assert len(tools.calls) == 1  # the replay was answered from the journal
    for branch, guest in enumerate((first, second)):
        assert guest.mid_process(StepInput(branch=branch)) == Stop()
        assert guest.outputs == {"answer": 391.0}
    assert len(tools.calls) == 3
    assert second.tool_calls == 2
