"""`ToolServers`: the run's MCP servers, each a client session of the `mcp` package, on an
asyncio loop of their own thread, so that the engine (synchronous, between steps) sends a
call and gets a future, and a line waiting on a call holds no row.

A server is a command spoken to over stdio, or a streamable-HTTP URL. At start every
server is connected and its tools listed, together; one that does not start, or a tool
name two servers serve, is a `UsageError` before the model loads. Then each call is
checked against the tool's input schema, sent, and bounded: a deadline, a size limit, and
a watch on what the server writes (a line that is not JSON-RPC breaks the session). A
server whose connection ends (it crashed) is started again, its calls that were out are
retried, and only the call that crashed it twice fails (`restarts.ServerGuard`, within
the run's `--tool-restarts`). Every failure is the calling line's error
(`CallOutcome.error`), never the run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aici_cli.core.config import ToolServer
from aici_cli.core.errors import UsageError
from aici_cli.run.tools.calls import (
    CallOutcome,
    ServedTool,
    ToolError,
    canonical,
    result_text,
    untrusted_text,
)
from aici_cli.run.tools.restarts import RestartPolicy, ServerGuard

T = TypeVar("T")

START_TIMEOUT_S = 30.0  # a server's start and its tool list
STOP_TIMEOUT_S = 5.0  # closing a session (the package then kills the process)
CONNECTION_CLOSED = -32000  # the JSON-RPC code the package gives a call on a closed connection


@dataclass
class _Link:
    """One server's session: `alive` from its start until its connection ends (or it
    writes garbage); `guard`, its calls across crashes and restarts."""

    spec: ToolServer
    guard: ServerGuard
    session: Any = None
    alive: bool = False
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class ToolServers:
    """The servers of `--mcp` (see the module docstring): `tools` by name, `call`."""

    def __init__(self, servers: Sequence[ToolServer], timeout_s: float,
                 result_bytes: int, policy: RestartPolicy | None = None) -> None:
        try:
            import mcp  # noqa: F401  (an extra: `pip install 'aici-batch[tools]'`)
        except ImportError:
            raise UsageError("--mcp needs the `mcp` package: pip install "
                             "'aici-batch[tools]'") from None
        self.timeout_s = timeout_s
        self.result_bytes = result_bytes
        self.policy = policy or RestartPolicy()
        self.tools: dict[str, ServedTool] = {}
        self.closing = False
        # The package logs what a server does wrong; here that is the calling line's error.
        logging.getLogger("mcp").setLevel(logging.CRITICAL)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aici-tools",
                                        daemon=True)
        self._thread.start()
        self._links: dict[str, _Link] = {}
        try:
            listed = self._wait(self._start_all(servers), START_TIMEOUT_S + STOP_TIMEOUT_S)
            self._index(listed)
        except BaseException:
            self.close()
            raise

    def _wait(self, coroutine: Awaitable[T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)  # type: ignore[arg-type]

    async def _start_all(self, servers: Sequence[ToolServer]
                         ) -> list[tuple[str, list[dict[str, Any]]]]:
        """Every server connected and listed, together; the first that failed raises."""
        for spec in servers:
            self._links[spec.name] = _Link(spec, ServerGuard(
                f"server {spec.name}", self._restarter(spec.name), self.policy, self.timeout_s))
        lists = await asyncio.gather(*(self._connect(link) for link in self._links.values()),
                                     return_exceptions=True)
        for link, listed in zip(self._links.values(), lists):
            if isinstance(listed, BaseException):
                raise UsageError(f"--mcp {link.spec.name}: the server did not start "
                                 f"({_why(listed)})")
        for link in self._links.values():
            link.guard.up()
        return [(name, listed) for name, listed in zip(self._links, lists)]  # type: ignore[misc]

    def _index(self, listed: list[tuple[str, list[dict[str, Any]]]]) -> None:
        for server, tools in listed:
            for tool in tools:
                name = str(tool["name"])
                other = self.tools.get(name)
                if other is not None:
                    raise UsageError(f"--mcp: servers {other.server} and {server} both serve "
                                     f"a tool named {name!r}; a name must say which server runs it")
                self.tools[name] = ServedTool(server, name, tool.get("description"),
                                              tool.get("inputSchema") or {"type": "object"})

    # ----------------------------------------------------------- one server's session

    async def _connect(self, link: _Link) -> list[dict[str, Any]]:
        """Start `link`'s session (its task lives until its `stop` is set); its tools."""
        link.stop = asyncio.Event()
        link.alive = True
        ready: asyncio.Future[list[dict[str, Any]]] = self.loop.create_future()
        link.task = self.loop.create_task(self._serve(link, ready))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
        except BaseException:
            link.stop.set()
            link.task.cancel()
            raise

    def _restarter(self, name: str) -> Callable[[], Awaitable[None]]:
        """How server `name`'s guard starts it again: the old session closed, a new one
        up."""
        async def restart() -> None:
            link = self._links[name]
            if link.task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(link.task, STOP_TIMEOUT_S)
            await self._connect(link)
            if not link.alive:  # it ended before the guard heard it was up
                raise RuntimeError("it closed its connection as it started")

        return restart

    async def _serve(self, link: _Link, ready: asyncio.Future[list[dict[str, Any]]]) -> None:
        """The session: open the transport, watch what comes back (`_watch`), initialize,
        list the tools, then wait for the end of the run."""
        import anyio
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await _transport(stack, link.spec)
                send, watched = anyio.create_memory_object_stream[Any](0)
                group = await stack.enter_async_context(anyio.create_task_group())
                group.start_soon(self._watch, link, read, send)
                session = await stack.enter_async_context(ClientSession(watched, write))
                await session.initialize()
                listed = await _list_tools(session)
                link.session = session
                ready.set_result(listed)
                await link.stop.wait()
                group.cancel_scope.cancel()
        except BaseException as e:  # a start that failed; or the end of a broken session
            if not ready.done():
                ready.set_exception(e)
        finally:
            link.session = None

    async def _watch(self, link: _Link, read: Any, send: Any) -> None:
        """Pass the server's messages on to the session; what is not a message, or the
        end of the stream, breaks the session for the calls it holds."""
        why = ("tool_server_crashed", f"server {link.spec.name} closed its connection "
               "(it exited or crashed)")
        async with send:
            async for item in read:
                if isinstance(item, Exception):
                    why = ("tool_bad_output", f"server {link.spec.name} wrote what is not "
                           f"JSON-RPC ({_why(item)})")
                    break
                await send.send(item)
            # Before the session hears of the end: its calls then fail for this reason.
            self._broken(link, why)

    def _broken(self, link: _Link, why: tuple[str, str]) -> None:
        """`link`'s session is over: its guard restarts it (see `restarts.ServerGuard`)."""
        link.alive = False
        link.stop.set()
        link.guard.broken(why)

    # ------------------------------------------------------------------------- calls

    def call(self, index: int, name: str, arguments: str) -> Future[CallOutcome]:
        """Send a call from any thread; see `ToolHost.call`."""
        tool = self.tools[name]
        return asyncio.run_coroutine_threadsafe(self._call(tool, arguments), self.loop)

    async def _call(self, tool: ServedTool, arguments: str) -> CallOutcome:
        t0 = time.perf_counter()
        try:
            content, is_error = await self._answer(self._links[tool.server], tool, arguments,
                                                   t0 + self.timeout_s)
            error = None
        except ToolError as e:
            content, is_error, error = None, False, (e.type, e.message)
        except Exception as e:  # the future never fails (`ToolHost.call`): the line's error
            content, is_error, error = None, False, (
                "tool_failed", f"tool {tool.name} (server {tool.server}): {_why(e)}")
        t1 = time.perf_counter()
        return CallOutcome(tool.server, content, is_error, error, round((t1 - t0) * 1e3, 3),
                           t0, t1)

    async def _answer(self, link: _Link, tool: ServedTool, arguments: str,
                      deadline: float) -> tuple[str, bool]:
        """The answer's text, and whether it is the tool's own error; raises `ToolError`
        where the call costs its line."""
        import json

        args = json.loads(arguments)
        problem = _schema_problem(tool.input_schema, args)
        if problem is not None:  # the line's tool was not the server's: tell the model
            return f"invalid arguments for {tool.name}: {problem}", True

        async def send() -> Any:
            if link.session is None:  # the guard let it go: it never does without a session
                raise ToolError("tool_server_down", f"server {tool.server} is down")
            return await link.session.call_tool(tool.name, args)

        try:
            result = await link.guard.call(f"{tool.name} {canonical(arguments)}", send,
                                           deadline, f"tool {tool.name} (server {tool.server})")
        except ToolError:
            raise
        except Exception as e:
            return self._refused(tool, e)
        return self._text(tool, result)

    def _refused(self, tool: ServedTool, e: Exception) -> tuple[str, bool]:
        """A call the server answered with an error, not a result: a JSON-RPC error is
        the tool's (told to the model); anything else costs the line."""
        code = getattr(getattr(e, "error", None), "code", None)
        if code == CONNECTION_CLOSED:
            raise ToolError("tool_server_crashed", f"server {tool.server} closed its "
                            f"connection during the call (it exited or crashed)") from None
        if code is not None:  # a JSON-RPC error: the server refused the call
            return f"error: {_why(e)}", True
        raise ToolError("tool_bad_output", f"server {tool.server} answered "
                        f"{tool.name} with what is not a tool result ({_why(e)})") from None

    def _text(self, tool: ServedTool, answer: Any) -> tuple[str, bool]:
        try:
            result = answer.model_dump(by_alias=True, mode="json")
        except Exception as e:
            return self._refused(tool, e)
        text = result_text(result)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.result_bytes:
            raise ToolError("tool_result_too_large", f"tool {tool.name} (server {tool.server}) "
                            f"answered {size:,} bytes, over the limit of {self.result_bytes:,} "
                            "(--tool-result-bytes)")
        return untrusted_text(text), bool(result.get("isError"))

    def restarts(self) -> dict[str, int]:
        """How many times each server was started again this run, by name."""
        return {name: link.guard.restarts for name, link in self._links.items()}

    def close(self) -> None:
        """End every session (each server process with it) and the loop's thread."""
        self.closing = True

        async def stop_all() -> None:
            for link in self._links.values():
                link.guard.close()
                link.stop.set()
            tasks = [link.task for link in self._links.values() if link.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:  # restarts under way, calls nobody waits for now
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=1.0)

        with contextlib.suppress(BaseException):
            self._wait(stop_all(), STOP_TIMEOUT_S + 1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(STOP_TIMEOUT_S)


async def _transport(stack: contextlib.AsyncExitStack, spec: ToolServer) -> tuple[Any, Any]:
    """The read and write streams of `spec`'s transport, open until `stack` closes."""
    if spec.url:
        from mcp.client.streamable_http import streamable_http_client

        streams = await stack.enter_async_context(streamable_http_client(spec.target))
        return streams[0], streams[1]
    from mcp import StdioServerParameters, stdio_client

    words = shlex.split(spec.target)
    if not words:
        raise ValueError("no command")
    # The run's whole environment, as any command it started would have (the package's
    # default passes a few variables only: a server's keys and settings would be lost).
    params = StdioServerParameters(command=words[0], args=words[1:], env=dict(os.environ))
    # The server's own stderr is the process's (a stream that replaced sys.stderr, as a
    # test's, may have no file descriptor to give a child).
    errlog = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
    return read, write


async def _list_tools(session: Any) -> list[dict[str, Any]]:
    """Every tool the server lists, page after page, as JSON (camelCase keys)."""
    from mcp.types import PaginatedRequestParams

    tools: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = await session.list_tools(
            params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += [t.model_dump(by_alias=True, mode="json") for t in page.tools]
        cursor = page.next_cursor
        if not cursor:
            return tools


def _schema_problem(schema: dict[str, Any], value: Any) -> str | None:
    import jsonschema

    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except jsonschema.exceptions.SchemaError:
        return None  # the server's own schema is broken: it checks its arguments itself
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where + ': ' if where else ''}{error.message}"


def _why(e: BaseException) -> str:
    """An exception in a few words (a task group's: its first)."""
    while getattr(e, "exceptions", None):  # an exception group
        e = e.exceptions[0]  # type: ignore[attr-defined]
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__
