"""MCP servers for the tests and bench/agent_tools.py, written with the `mcp` package and
started as processes (`python tests/support/mcp_servers.py KIND ...`; `command(KIND, ...)`
is that command line for `--mcp NAME=COMMAND`):

    calc [--delay S] [--port P] [--crash-on KEY]
                                  a calculator (add, multiply, divide) and `lookup`, a
                                  key-value table of made-up facts; every call takes S
                                  seconds; with P, streamable HTTP on 127.0.0.1:P; with
                                  KEY, `lookup` of KEY exits the server (os._exit) at once
    bad --mode MODE [--name N]    one tool, `probe` (or N), that misbehaves once the server
                                  has started properly (its tool list works): `crash` exits
                                  in the call, `hang` never answers, `big` answers 10 MB,
                                  `garbage` writes a line that is not JSON-RPC, `ok`
                                  answers "fine"
    dup                           a tool named `add`, as calc serves: two servers, one name
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

# Facts a small model cannot know, so that a right answer needs the tool.
TABLE = {
    "zorblax": "42", "quibble": "17", "fennimore": "305", "gallivant": "8",
    "capital of Veltria": "Ostrand", "color of Mirel": "teal",
}
MODES = ("crash", "hang", "big", "garbage", "ok")


def command(kind: str, *args: str) -> str:
    """The command line that starts server `kind` with `args` (this interpreter)."""
    return shlex.join([sys.executable, str(Path(__file__).resolve()), kind, *args])


def _calc(server: object, delay: float, crash_on: str | None = None) -> None:
    from mcp.server.mcpserver.exceptions import ToolError

    tool = server.tool  # type: ignore[attr-defined]

    @tool()
    async def add(a: float, b: float) -> float:
        """Add two numbers."""
        await asyncio.sleep(delay)
        return a + b

    @tool()
    async def multiply(a: float, b: float) -> float:
        """Multiply two numbers."""
        await asyncio.sleep(delay)
        return a * b

    @tool()
    async def divide(a: float, b: float) -> float:
        """Divide a by b."""
        await asyncio.sleep(delay)
        if b == 0:
            raise ToolError("division by zero")  # the tool's own error, told to the model
        return a / b

    @tool()
    async def lookup(key: str) -> str:
        """The value stored under a key in the local table."""
        if key == crash_on:
            os._exit(3)
        await asyncio.sleep(delay)
        if key not in TABLE:
            raise ToolError(f"no entry {key!r}")
        return TABLE[key]


def _bad(server: object, mode: str, name: str) -> None:
    # The protocol's own stdout, kept before the server points fd 1 elsewhere while it
    # serves, so that the garbage goes where the client reads its answers.
    protocol_out = os.dup(1)

    async def probe(x: bool) -> str:
        if mode == "crash":
            os._exit(3)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "big":
            return "x" * (10 * 1024 * 1024)
        if mode == "garbage":
            os.write(protocol_out, b"this is not JSON\n")
            await asyncio.sleep(3600)
        return "fine"

    probe.__doc__ = "Probe the server."
    server.tool(name=name)(probe)  # type: ignore[attr-defined]


def main() -> None:
    from mcp.server.mcpserver import MCPServer

    parser = argparse.ArgumentParser()
    kinds = parser.add_subparsers(dest="kind", required=True)
    calc = kinds.add_parser("calc")
    calc.add_argument("--delay", type=float, default=0.0)
    calc.add_argument("--port", type=int, default=None)
    calc.add_argument("--crash-on", default=None)
    bad = kinds.add_parser("bad")
    bad.add_argument("--mode", required=True, choices=MODES)
    bad.add_argument("--name", default="probe")
    kinds.add_parser("dup")
    args = parser.parse_args()
    server: MCPServer = MCPServer(args.kind, log_level="CRITICAL")
    if args.kind == "calc":
        _calc(server, args.delay, args.crash_on)
    elif args.kind == "bad":
        _bad(server, args.mode, args.name)
    else:
        @server.tool()
        def add(a: float, b: float) -> float:
            """Add two numbers."""
            return a + b
    if getattr(args, "port", None) is not None:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
