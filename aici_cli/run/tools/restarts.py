"""`ServerGuard`: one server's calls across its crashes: when a call may go, what a crash
does to the calls it caught, who is to blame, and when the server starts again.

A crash (the session ended: `ServerGuard.broken`) fails no call by itself. The calls that
were out when it came are its suspects: each is sent once more, on the restarted server,
alone (no other call is out meanwhile), one after another in the order they were first
sent. A suspect the restarted server answers is answered, as if nothing had happened. A
suspect whose lone call ends the server again crashed it twice: it is the crash's cause,
and fails with the crash's error type (`tool_server_crashed`, or `tool_bad_output` for a
server that wrote garbage); its tool and arguments are kept, so that the same call from
another line fails at once instead of crashing the server a third time. While suspects
are retried, new calls wait (their own deadline runs).

Each crash restarts the server after a back-off that doubles with each crash since the
server last answered a call (`RestartPolicy.delay`), while the run's budget of restarts
(`--tool-restarts`) lasts. Once it is spent, or a restart fails, the server is down: its
calls fail at once (`tool_server_down`), the suspects waiting to be retried included.

Pure asyncio, on the servers' loop: the session itself (sending a call, starting the
server) is the caller's (`servers.ToolServers`); the tests drive a fake one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aici_cli.run.tools.calls import ToolError

T = TypeVar("T")


@dataclass(frozen=True)
class RestartPolicy:
    """How often a crashed server is started again: `restarts` times per run at most,
    after `backoff_s` doubled for each crash since it last answered, up to `backoff_max_s`
    (a server that crashes at every call is not restarted in a tight loop)."""

    restarts: int = 16
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0

    def delay(self, streak: int) -> float:
        """The wait before a restart, `streak` (>= 1) crashes since the last answer."""
        return min(self.backoff_s * 2.0 ** min(streak - 1, 60), self.backoff_max_s)


class _Ticket:
    """One call: `suspect` once a crash caught it out (it is then retried alone, once);
    `alone` while that lone retry is out."""

    __slots__ = ("alone", "key", "suspect")

    def __init__(self, key: str) -> None:
        self.key = key
        self.suspect = False
        self.alone = False


class ServerGuard:
    """See the module docstring. `restart()` starts the server again (raising where it
    cannot); the guard calls `up()` itself once it is back. `label` names the server in
    messages (`server calc`); `timeout_s` is the calls' deadline (`--tool-timeout`)."""

    def __init__(self, label: str, restart: Callable[[], Awaitable[object]],
                 policy: RestartPolicy, timeout_s: float) -> None:
        self.label = label
        self.policy = policy
        self.timeout_s = timeout_s
        self._restart = restart
        self.restarts = 0  # restarts begun (the summary's count)
        self.down: str | None = None  # why every call fails at once
        self.closing = False
        # The session's end, while one is up: a crash resolves it with (type, message).
        self._ended: asyncio.Future[tuple[str, str]] | None = None
        self._out: dict[_Ticket, None] = {}  # calls out on the session, in sending order
        self._suspects: deque[_Ticket] = deque()  # to retry alone, head first
        self._convicted: dict[str, tuple[str, str]] = {}  # key -> the crash it caused
        self._streak = 0  # crashes since the server last answered
        self._wake = asyncio.Event()  # set (and replaced) whenever a waiting call may go
        self._task: asyncio.Task[None] | None = None  # the restart under way

    # ------------------------------------------------------------ the session's side

    def up(self) -> None:
        """A session is connected (the first, or a restarted one): calls may go."""
        self._ended = asyncio.get_running_loop().create_future()
        self._poke()

    def broken(self, why: tuple[str, str]) -> None:
        """The session ended (`why`: the error type and message of its crash). Ignored
        where no session is up (a start that failed is its starter's error)."""
        ended, self._ended = self._ended, None
        if ended is None:
            return
        ended.set_result(why)
        for ticket in self._out:  # every call out is a suspect (a lone retry already is)
            if not ticket.suspect:
                ticket.suspect = True
                self._suspects.append(ticket)
        self._out.clear()
        self._streak += 1
        if self.closing:
            pass
        elif self.restarts >= self.policy.restarts:
            self.down = (f"{why[1]}, and its {self.policy.restarts} restart(s) for this run "
                         "are spent (--tool-restarts)")
        else:
            self.restarts += 1
            self._task = asyncio.get_running_loop().create_task(
                self._start_again(self.policy.delay(self._streak)))
        self._poke()

    async def _start_again(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        try:
            await self._restart()
        except Exception as e:
            self.down = f"{self.label} could not be restarted ({type(e).__name__}: {e})"
            self._poke()
            return
        self.up()

    def _poke(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # --------------------------------------------------------------- the calls' side

    async def call(self, key: str, send: Callable[[], Awaitable[T]], deadline: float,
                   what: str) -> T:
        """`send()`'s answer (its exception raised as is), sent on the session up when
        the call's turn comes; `key` says which calls are the same (tool and canonical
        arguments), `what` names the call in messages. Raises `ToolError`: the crash's
        type where this call caused it, `tool_server_down`, `tool_timeout` past
        `deadline` (a `perf_counter` time)."""
        ticket = _Ticket(key)
        try:
            while True:
                ended = await self._turn(ticket, deadline, what)
                ticket.alone = ticket.suspect
                self._out[ticket] = None
                attempt = asyncio.ensure_future(send())
                racing: set[asyncio.Future[Any]] = {attempt, ended}
                try:
                    await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED,
                                       timeout=max(0.0, deadline - time.perf_counter()))
                except BaseException:  # the run is closing: the call with it
                    attempt.cancel()
                    raise
                finally:
                    self._out.pop(ticket, None)
                # An answer wins over a crash that came with it (a server may answer, then
                # exit); a call that failed as the session ended failed for its end.
                if attempt.done() and (not ended.done() or attempt.exception() is None):
                    self._streak = 0
                    return attempt.result()
                attempt.cancel()
                if not ended.done():
                    raise ToolError("tool_timeout", self._late(what, ""))
                if ticket.alone:  # its lone retry ended the server too: it is the cause
                    why = self._convicted[key] = ended.result()
                    raise ToolError(why[0], f"{why[1]} when this call was out, and again "
                                    "when it was sent alone after a restart")
        finally:
            if ticket.suspect:
                self._leave(ticket)

    async def _turn(self, ticket: _Ticket, deadline: float,
                    what: str) -> asyncio.Future[tuple[str, str]]:
        """Wait until `ticket` may go, then the session's end future. A suspect goes
        alone, at the head of the suspects; any other call once there are none."""
        while True:
            convicted = self._convicted.get(ticket.key)
            if convicted is not None:
                raise ToolError(convicted[0], f"{convicted[1]} twice on this same call "
                                "already (another line's, or a retry's): it is not sent again")
            if self.down is not None:
                raise ToolError("tool_server_down", self.down)
            ended = self._ended
            if ended is not None and (
                    (self._suspects and self._suspects[0] is ticket and not self._out)
                    if ticket.suspect else not self._suspects):
                return ended
            wake = self._wake
            try:
                await asyncio.wait_for(wake.wait(), max(0.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                late = self._late(what, "while its server recovered from a crash")
                raise ToolError("tool_timeout", late) from None

    def _leave(self, ticket: _Ticket) -> None:
        """A suspect is settled (answered, failed, past its deadline): the next may go."""
        try:
            self._suspects.remove(ticket)
        except ValueError:
            return
        self._poke()

    def _late(self, what: str, when: str) -> str:
        return (f"{what} did not answer within {self.timeout_s:g} s"
                f"{' ' + when if when else ''} (--tool-timeout)")

    def close(self) -> None:
        """The run is ending: a crash from now on restarts nothing."""
        self.closing = True
        if self._task is not None:
            self._task.cancel()
