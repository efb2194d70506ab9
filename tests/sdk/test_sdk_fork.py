"""`fork`, `storage` and `set_line_output` in the guest SDK, under the stub host.

The stub runs forks as the host does (new branches replayed to the fork point, each branch
told its index in branch order, faults ending the line), so these tests pin the SDK's
behaviour in milliseconds; `test_controllers.py` runs the same code as a component.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from aici_controller import (
    ALL,
    Action,
    Context,
    Fork,
    TokenController,
    backtrack,
    controller,
    fixed,
    fork,
    gen,
    log,
    sample,
    set_line_output,
    set_output,
    stop,
    storage,
)
from aici_controller.testing import LineFault, StubHost, StubHostError
from sdk_examples import load_example


def test_vote_example_reports_the_majority_once() -> None:
    run = StubHost(respond=["Paris", "Rome", "Paris", "Lyon", "Paris"]).run(load_example("vote"))
    assert run.error is None
    assert [b.branch for b in run.branches] == [(k,) for k in range(5)]
    assert [b.outputs["answer"] for b in run.branches] == ["Paris", "Rome", "Paris", "Lyon",
                                                           "Paris"]
    assert run.line_outputs == {"answer": "Paris", "votes": {"Paris": 3, "Rome": 1, "Lyon": 1}}
    assert run.storage == {"answers": b"Paris\nRome\nParis\nLyon\nParis\n"}
    # Each branch's text is its own answer: nothing came before the fork.
    assert [b.text for b in run.branches] == ["Paris", "Rome", "Paris", "Lyon", "Paris"]


def test_vote_example_takes_its_branch_count_from_the_arg() -> None:
    run = StubHost(respond=["a", "b", "b"]).run(load_example("vote"), arg='{"branches": 3}')
    assert run.line_outputs == {"answer": "b", "votes": {"a": 1, "b": 2}}


def test_generator_fork_resumes_in_each_branch_with_its_index() -> None:
    @controller
    def three(ctx: Context):  # type: ignore[no-untyped-def]
        yield fixed("ab")
        branch = yield fork(3)
        set_output("seen", [branch, ctx.branch, list(ctx.branch_path), list(ctx.tokens)])
        yield fixed("xyz"[branch])

    host = StubHost()
    a, b = host.tokenize("ab")
    run = host.run(three)
    assert run.error is None and len(run.branches) == 3
    assert [r.text for r in run.branches] == ["abx", "aby", "abz"]
    assert [r.outputs["seen"] for r in run.branches] == [
        [k, k, [k], [a, b]] for k in range(3)]
    # Each branch's actions: the shared ones, the fork, then its own.
    assert run.branches[2].trace == ["fixed('ab')", "fork(3)", "fixed('z')", "stop()"]
    assert run.text == "abx" and run.branch == (0,)  # the line mirrors its first branch


def test_nested_forks_in_tree_order_and_logs_before_the_fork_in_every_branch() -> None:
    @controller
    def tree(ctx: Context):  # type: ignore[no-untyped-def]
        log("before")
        first = yield fork(2)
        if first == 1:
            yield fork(2)
        log(f"path {ctx.branch_path}")

    run = StubHost().run(tree)
    assert [r.branch for r in run.branches] == [(0,), (1, 0), (1, 1)]
    assert [r.logs for r in run.branches] == [
        ["before", "path (0,)"], ["before", "path (1, 0)"], ["before", "path (1, 1)"]]


def test_token_controller_forks_through_on_fork() -> None:
    @controller
    class Split(TokenController):
        def start(self, ctx: Context) -> None:
            self.steps = 0

        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            self.steps += 1
            if self.steps == 2 and ctx.branch is None:
                return fork(2)
            if len(ctx.tokens) >= 3:
                set_output("steps", self.steps)
                return stop()
            return sample(ALL)

        def on_fork(self, ctx: Context, branch: int) -> Action:
            set_output("branch", branch)
            return fixed("AB"[branch])

    run = StubHost(sampler=lambda allowed: allowed[5]).run(Split)
    assert [r.outputs for r in run.branches] == [{"branch": 0, "steps": 4},
                                                 {"branch": 1, "steps": 4}]
    assert [r.text[1] for r in run.branches] == ["A", "B"]
    assert run.branches[0].text[0] == run.branches[1].text[0]  # the token before the fork


def test_on_fork_defaults_to_a_step_without_new_tokens() -> None:
    @controller
    class Plain(TokenController):
        def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
            if ctx.branch is None:
                return fork(2)
            set_output("entry", [ctx.branch, list(new_tokens)])
            return stop()

    run = StubHost().run(Plain)
    assert [r.outputs for r in run.branches] == [{"entry": [0, []]}, {"entry": [1, []]}]


def test_storage_writes_are_seen_by_later_steps_of_every_branch() -> None:
    @controller
    def count(ctx: Context):  # type: ignore[no-untyped-def]
        branch = yield fork(3)
        length = storage.append("log", f"{branch};")
        set_output("length", length)
        yield sample(ALL)  # one round later every branch has appended
        set_output("all", (storage.get("log") or b"").decode())
        storage.set("last", b"x")

    run = StubHost().run(count)
    # Branches are entered in branch order at the fork: each append sees the ones before.
    assert [r.outputs["length"] for r in run.branches] == [2, 4, 6]
    assert all(r.outputs["all"] == "0;1;2;" for r in run.branches)
    assert run.storage == {"log": b"0;1;2;", "last": b"x"}


def test_storage_values_and_calls_outside_a_controller() -> None:
    with pytest.raises(RuntimeError, match="no running controller"):
        storage.get("k")
    with pytest.raises(RuntimeError, match="no running controller"):
        set_line_output("k", 1)

    @controller
    def types(ctx: Context):  # type: ignore[no-untyped-def]
        storage.set("s", "é")
        set_output("s", list(storage.get("s") or b""))
        set_output("none", storage.get("missing"))
        storage.set("k", 5)  # type: ignore[arg-type]
        yield stop()

    run = StubHost().run(types)
    assert run.outputs == {"s": [0xC3, 0xA9], "none": None}
    assert run.error == "TypeError: storage.set() takes bytes or str, got int"


def test_storage_over_quota_ends_the_line_and_cannot_be_caught() -> None:
    @controller
    def greedy(ctx: Context):  # type: ignore[no-untyped-def]
        yield fork(2)
        try:
            storage.append("k", "x" * 700_000)
        except Exception:  # a host fault is not a controller exception
            set_output("caught", True)
        yield sample(ALL)

    run = StubHost().run(greedy)
    assert run.error is not None and run.error.startswith(
        "storage_quota: storage append 'k': the line's storage would hold 1,400,001 bytes")
    assert [r.outputs for r in run.branches] == [{}, {}]
    assert issubclass(LineFault, BaseException) and not issubclass(LineFault, Exception)


def test_fork_past_max_branches_and_backtrack_past_the_fork_end_the_line() -> None:
    @controller
    def wide(ctx: Context):  # type: ignore[no-untyped-def]
        yield fork(3)
        yield fork(3)

    run = StubHost(max_branches=6).run(wide)
    assert run.error == ("bad_action: fork(3) would make 7 branches for the line, more "
                         "than max_branches 6")
    assert [r.branch for r in run.branches][:3] == [(0, 0), (0, 1), (0, 2)]

    @controller
    def rewind(ctx: Context):  # type: ignore[no-untyped-def]
        yield fixed("abc")
        yield fork(2)
        yield fixed("d")
        yield backtrack(2)

    run = StubHost().run(rewind)
    assert run.error == ("bad_action: splice backtracks 2 tokens past the fork point: only 1 "
                         "were generated since the fork")


def test_a_controller_that_acts_otherwise_on_replay_is_refused() -> None:
    calls = [0]

    @controller
    def moody(ctx: Context):  # type: ignore[no-untyped-def]
        calls[0] += 1  # state outside the controller: a replay sees another value
        yield fixed("a" if calls[0] == 1 else "b")
        yield fork(2)

    with pytest.raises(StubHostError, match="answered fixed\\('b'\\) where it had answered "
                                            "fixed\\('a'\\)"):
        StubHost().run(moody)


def test_line_outputs_last_write_wins_and_segments_answer_in_branch_order() -> None:
    @controller
    def report(ctx: Context):  # type: ignore[no-untyped-def]
        branch = yield fork(2)
        text = yield gen(choices=["x", "y"])
        set_line_output("last", [branch, text])

    run = StubHost(respond=["y", "x"]).run(report)
    assert [r.text for r in run.branches] == ["y", "x"]
    assert run.line_outputs == {"last": [1, "x"]}


def test_fork_checks_its_argument_and_the_session_checks_the_host() -> None:
    with pytest.raises(ValueError, match="at least 2 branches"):
        fork(1)
    with pytest.raises(TypeError, match="takes an int"):
        fork("2")  # type: ignore[arg-type]
    assert fork(2) == Fork(2) and str(fork(4)) == "fork(4)"

    @controller
    def once(ctx: Context):  # type: ignore[no-untyped-def]
        yield fork(2)

    session = StubHost().start(once)
    assert session.step(0, []) == Fork(2)
    with pytest.raises(Exception, match="without a branch index"):
        session.step(0, [])

    fresh: Any = StubHost().start(once)
    with pytest.raises(Exception, match="branch index 1 without a fork"):
        fresh.step(0, [], None, 1)
