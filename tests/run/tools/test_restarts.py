"""A server's calls across its crashes (`restarts.ServerGuard`), without a process: a fake
server on the test's loop whose calls take a while and end the session for the keys the
test says crash it. Random interleavings of calls: only the calls that crash the server
fail (`tool_server_crashed`), every other is answered, each caught call is retried once
and alone; the budget of restarts, the back-off, and a restart that fails; the restarts
in the run summary."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.run.tally import outcome_rows
from aici_cli.run.tools.calls import ToolError
from aici_cli.run.tools.host import with_restarts
from aici_cli.run.tools.restarts import RestartPolicy, ServerGuard

CRASHED = ("tool_server_crashed", "server fake closed its connection (it exited or crashed)")


@dataclass
class FakeServer:
    """Answers `answer KEY` after a call's delay; a key of `crashing` ends the session
    instead (every call out with it). Records what was out at once, and its starts."""

    crashing: set[str]
    policy: RestartPolicy = field(default_factory=lambda: RestartPolicy(100, 0.0, 0.0))
    fail_restart: bool = False
    starts: int = 0
    sent: list[tuple[str, int]] = field(default_factory=list)  # (key, calls out with it)
    out: int = 0
    session: int = 0

    def __post_init__(self) -> None:
        self.guard = ServerGuard("server fake", self.restart, self.policy, 60.0)

    async def restart(self) -> None:
        await asyncio.sleep(0.001)
        if self.fail_restart:
            raise OSError("no such file")
        self.starts += 1
        self.session += 1

    def send(self, key: str, delay_s: float) -> Callable[[], Awaitable[str]]:
        async def go() -> str:
            session = self.session
            self.out += 1
            self.sent.append((key, self.out))
            try:
                await asyncio.sleep(delay_s)
                if key in self.crashing and session == self.session:
                    self.session += 1
                    self.guard.broken(CRASHED)
                if session != self.session:
                    await asyncio.Future()  # a call on a dead session is never answered
                return f"answer {key}"
            finally:
                self.out -= 1

        return go

    async def call(self, key: str, start_s: float, delay_s: float) -> str | tuple[str, str]:
        await asyncio.sleep(start_s)
        try:
            return await self.guard.call(key, self.send(key, delay_s), time.perf_counter() + 60,
                                         f"tool t (server fake) {key}")
        except ToolError as e:
            return (e.type, e.message)


def _run(server: FakeServer, calls: list[tuple[str, float, float]]
         ) -> list[str | tuple[str, str]]:
    async def main() -> list[str | tuple[str, str]]:
        server.guard.up()
        try:
            return await asyncio.gather(*(server.call(*c) for c in calls))
        finally:
            server.guard.close()

    return asyncio.run(main())


KEYS = st.sampled_from("abcdef")
CALLS = st.lists(st.tuples(KEYS, st.floats(0, 0.01), st.floats(0, 0.004)),
                 min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(calls=CALLS, crashing=st.sets(KEYS, max_size=2))
def test_only_the_calls_that_crash_the_server_fail(calls: list[tuple[str, float, float]],
                                                   crashing: set[str]) -> None:
    server = FakeServer(crashing)
    outcomes = _run(server, calls)
    for (key, _, _), outcome in zip(calls, outcomes):
        if key in crashing:
            assert isinstance(outcome, tuple) and outcome[0] == "tool_server_crashed", outcome
        else:
            assert outcome == f"answer {key}"
    # A crashing key crashes the server twice at most: once among others, once alone;
    # then its calls fail unsent. Every crash begins a restart (the last may still be
    # under way when the calls are done).
    called = {key for key, _, _ in calls} & crashing
    assert server.starts <= server.guard.restarts <= 2 * len(called)
    assert server.guard.restarts == server.session - server.starts
    assert server.guard.down is None
    # Each call is sent once, or twice where a crash caught it; a crashing key's calls
    # after its second crash are not sent at all.
    assert len(server.sent) <= 2 * len(calls)


@settings(max_examples=40, deadline=None)
@given(calls=CALLS, crashing=st.sets(KEYS, min_size=1, max_size=3),
       budget=st.integers(0, 3))
def test_a_spent_budget_downs_the_server_and_blames_no_one_else(
        calls: list[tuple[str, float, float]], crashing: set[str], budget: int) -> None:
    server = FakeServer(crashing, RestartPolicy(budget, 0.0, 0.0))
    outcomes = _run(server, calls)
    assert server.guard.restarts <= budget
    for (key, _, _), outcome in zip(calls, outcomes):
        if key in crashing:
            assert isinstance(outcome, tuple)
            assert outcome[0] in ("tool_server_crashed", "tool_server_down")
        else:
            assert outcome == f"answer {key}" or outcome[0] == "tool_server_down"
        if isinstance(outcome, tuple) and outcome[0] == "tool_server_down":
            assert "restart(s) for this run are spent (--tool-restarts)" in outcome[1]


def test_a_caught_call_is_retried_alone_and_answered() -> None:
    """Eight calls out together, one crashes the server: the seven others are sent again
    on the restarted server one at a time, and answered; the crashing one, alone, crashes
    it again and fails; a later call with its arguments fails unsent."""
    server = FakeServer({"x"})
    calls = [(k, 0.0, 0.02) for k in "abcdefg"] + [("x", 0.005, 0.0), ("x", 0.2, 0.0),
                                                    ("h", 0.2, 0.0)]
    outcomes = _run(server, calls)
    assert outcomes[:7] == [f"answer {k}" for k in "abcdefg"]
    assert outcomes[9] == "answer h"
    for outcome in outcomes[7:9]:
        assert isinstance(outcome, tuple) and outcome[0] == "tool_server_crashed"
    assert "and again when it was sent alone after a restart" in outcomes[7][1]
    assert "twice on this same call already" in outcomes[8][1]
    assert server.guard.restarts == 2
    first = [key for key, _ in server.sent[:8]]
    assert sorted(first) == sorted("abcdefgx")
    retried = server.sent[8:]
    assert sorted(key for key, _ in retried[:8]) == sorted("abcdefgx")
    assert all(out == 1 for _, out in retried[:8])  # each alone on the server


def test_backoff_doubles_from_the_last_answer() -> None:
    policy = RestartPolicy(10, 0.1, 0.5)
    assert [policy.delay(k) for k in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    asked: list[float] = []

    class Recorded(RestartPolicy):
        def delay(self, streak: int) -> float:
            asked.append(super().delay(streak))
            return 0.0

    # Crash, crash again alone (two in a row), an answer, then a crash: 1, 2, then 1.
    server = FakeServer({"x", "y"}, Recorded(10, 0.1, 5.0))
    outcomes = _run(server, [("x", 0.0, 0.0), ("a", 0.1, 0.0), ("y", 0.2, 0.0)])
    assert outcomes[1] == "answer a"
    assert asked == [0.1, 0.2, 0.1, 0.2]


def test_a_restart_that_fails_downs_the_server() -> None:
    server = FakeServer({"x"}, fail_restart=True)
    outcomes = _run(server, [("x", 0.0, 0.0), ("a", 0.0, 0.01), ("b", 0.05, 0.0)])
    for outcome in outcomes:
        assert isinstance(outcome, tuple) and outcome[0] == "tool_server_down"
        assert outcome[1] == "server fake could not be restarted (OSError: no such file)"


def test_a_call_waiting_out_a_restart_keeps_its_deadline() -> None:
    async def main() -> tuple[str, str]:
        async def slow() -> None:
            await asyncio.sleep(10)

        guard = ServerGuard("server fake", slow, RestartPolicy(5, 0.0, 0.0), 0.05)
        guard.up()
        guard.broken(CRASHED)  # restarting, for longer than the call may wait
        try:
            await guard.call("k", slow, time.perf_counter() + 0.05, "tool t (server fake)")
        except ToolError as e:
            return e.type, e.message
        finally:
            guard.close()
        raise AssertionError("answered")

    assert asyncio.run(main()) == (
        "tool_timeout", "tool t (server fake) did not answer within 0.05 s while its server "
        "recovered from a crash (--tool-timeout)")


@pytest.mark.parametrize("why", [CRASHED, ("tool_bad_output", "server fake wrote garbage")])
def test_the_culprit_gets_the_crash_s_own_type(why: tuple[str, str]) -> None:
    server = FakeServer(set())

    async def main() -> tuple[str, str]:
        server.guard.up()

        async def breaks() -> str:
            server.guard.broken(why)
            await asyncio.Future()
            return ""

        try:
            await server.guard.call("k", breaks, time.perf_counter() + 5, "tool t")
        except ToolError as e:
            return e.type, e.message
        finally:
            server.guard.close()
        raise AssertionError("answered")

    etype, message = asyncio.run(main())
    assert etype == why[0] and message.startswith(why[1])
    assert server.guard.restarts == 2


class _Restarted:
    """A host whose servers restarted as the test says."""

    def __init__(self, restarts: dict[str, int]) -> None:
        self._restarts = restarts

    def restarts(self) -> dict[str, int]:
        return self._restarts


def test_the_summary_counts_each_server_s_restarts() -> None:
    row = {"calls": 3, "failed": 1, "tool_errors": 0, "ms": 12.5}
    summary = {"lines": 3, "tools": {"calc": row}}
    host: Any = _Restarted({"calc": 2, "kv": 0, "guest": 1})
    tools = with_restarts(summary, host)["tools"]
    # Every counted server gets its restarts; a server no line's call reached gets a row
    # only where it restarted (a controller's calls crashed it).
    assert tools == {"calc": {**row, "restarts": 2},
                     "guest": {"calls": 0, "failed": 0, "tool_errors": 0, "ms": 0.0,
                               "restarts": 1}}
    assert summary["tools"] == {"calc": row}  # the summary given is left as it was
    assert with_restarts(summary, None) is summary
    rows = dict(outcome_rows({"lines": 3, "errors": 1, "tools": tools}))
    assert rows["tool calls to calc"] == "3 (1 failed, 0 tool errors), 0.01 s, 2 restarts"
    assert rows["tool calls to guest"] == "0 (0 failed, 0 tool errors), 0.00 s, 1 restart"
