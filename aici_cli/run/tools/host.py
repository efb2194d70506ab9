"""`open_tool_host`: the run's tools as its options ask for them, before the model loads:
the `--mcp` servers started (or the `--tool-replay` file read), `--allow-tool` checked
against them, behind a `--tool-record` recording; `guest_tool_host`, those tools as the
run's controllers may call them; `served`, their list as the run's start shows it; and
`run_lines`, a backend's run with the tool rounds around it where there are tools;
`with_restarts`, the servers' restarts in the run summary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aici_cli.core.config import ToolOptions
from aici_cli.core.job import BadLine, Job
from aici_cli.run.tools.calls import ToolHost
from aici_cli.run.tools.guest import GuestToolHost, allowed_tools
from aici_cli.run.tools.loop import ToolLoop
from aici_cli.run.tools.record import Recorder, ReplayedTools

if TYPE_CHECKING:
    from aici_cli.engine import Emit
    from aici_cli.run.backends.protocol import Backend
    from aici_cli.run.live_input import LiveInput


def open_tool_host(options: ToolOptions, resume: bool) -> ToolHost | None:
    """The run's `ToolHost`, None without tools; raises `UsageError` where a server does
    not start, two serve one name, or a file cannot be read or written."""
    if not options.active:
        return None
    host: ToolHost
    if options.replay is not None:
        host = ReplayedTools(options.replay)
    else:
        from aici_cli.run.tools.restarts import RestartPolicy
        from aici_cli.run.tools.servers import ToolServers  # mcp, on first use

        host = ToolServers(options.servers, options.call_timeout_s, options.result_bytes,
                           RestartPolicy(restarts=options.restarts))
    try:
        listed = allowed_tools(host.tools, options.allowed, replay=options.replay is not None)
        if options.record is not None:
            host = Recorder(host, options.record, append=resume, listed=listed)
    except BaseException:
        host.close()
        raise
    return host


def guest_tool_host(host: ToolHost | None, options: ToolOptions) -> GuestToolHost | None:
    """The tools the run's controllers may call (`--allow-tool`); None where it allows
    none (a controller's calls are then refused, its list empty)."""
    if host is None or not options.allowed:
        return None
    return GuestToolHost(host, options.allowed, options.call_timeout_s)


def served(host: ToolHost) -> str:
    """The run's tools by server, for its start: `calc: add, lookup; kv: get`."""
    by_server: dict[str, list[str]] = {}
    for tool in host.tools.values():
        by_server.setdefault(tool.server, []).append(tool.name)
    return "; ".join(f"{server}: {', '.join(sorted(names))}"
                     for server, names in sorted(by_server.items()))


def with_restarts(summary: dict[str, Any], host: ToolHost | None) -> dict[str, Any]:
    """The run summary with each server's restarts after crashes under `tools`: on every
    server's row, and a row for a server that restarted though no line's call to it is
    counted (a controller's calls are not)."""
    restarts = host.restarts() if host is not None else {}
    if not restarts:
        return summary
    tools = dict(summary.get("tools") or {})
    for server, count in restarts.items():
        if server in tools or count:
            row = tools.get(server) or {"calls": 0, "failed": 0, "tool_errors": 0, "ms": 0.0}
            tools[server] = {**row, "restarts": count}
    return {**summary, "tools": tools} if tools else summary


def run_lines(backend: Backend, items: Iterator[Job | BadLine], emit: Emit,
              should_admit: Callable[[], bool], note: Callable[[str], None],
              live: LiveInput[Job | BadLine] | None, host: ToolHost | None,
              max_rounds: int) -> None:
    """The backend's run, with the tool rounds of `ToolLoop` between it and the input and
    results where the run has tools. The loop reads a live input itself (on the live
    reader's thread), so that a line's next round never waits for the next input line."""
    if host is None:
        backend.run(items, emit, should_admit, note, live)
        return
    tracer: Any = getattr(backend, "tracing", None)  # a traced run's (backends/local.py)
    loop = ToolLoop(host, max_rounds, emit, tracer.tool_call if tracer is not None else None)
    source: Iterator[Job | BadLine | None] = items
    if live is not None:
        live.start(items)
        source = live.items(loop.idle)
    backend.run(loop.items(source), loop.emit, loop.should_admit(should_admit), note)  # type: ignore[arg-type]
