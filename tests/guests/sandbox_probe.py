"""A controller that tries to reach the host: files, directories, environment, network.

Arg: the probes to run, comma-separated, in order ("none": no probe). Each probe's
outcome lands in `outputs[<probe>]`: "error: <Type>: <message>" when it raised, otherwise
the repr of what it got (cut at 200 characters). A probe that reaches a WASI function
stubbed out at build time traps instead, which ends the sequence; what earlier probes
reported stays in the result line. Then it forces " done" and stops.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from typing import Any

from aici_controller import Context, controller, fixed, set_output

try:  # a CPython built for WASI may lack _socket: then importing it is the answer
    import socket
except Exception as exc:
    socket = None  # type: ignore[assignment]
    SOCKET_IMPORT = f"error: {type(exc).__name__}: {exc}"
else:
    SOCKET_IMPORT = "ok"


def read_file() -> Any:
    with open("/etc/hostname", encoding="utf-8") as f:
        return f.read()


def list_root() -> Any:
    return os.listdir("/")


def environ() -> Any:
    return dict(os.environ)


def getenv() -> Any:
    return [os.getenv(name) for name in ("HOME", "PATH", "USER", "AICI_PROBE_MARKER")]


def connect() -> Any:
    if socket is None:
        return SOCKET_IMPORT
    with socket.create_connection(("127.0.0.1", 22), timeout=0.1) as s:
        return s.recv(16)


def resolve() -> Any:
    if socket is None:
        return SOCKET_IMPORT
    return socket.gethostbyname("localhost")


def recurse(n: int) -> int:
    return recurse(n + 1) + 1


def recursion() -> Any:
    return recurse(0)  # Python's own limit stops it: RecursionError, not a crash


PROBES: dict[str, Callable[[], Any]] = {
    "file": read_file,
    "listdir": list_root,
    "environ": environ,
    "getenv": getenv,
    "connect": connect,
    "resolve": resolve,
    "recursion": recursion,
}


def outcome(probe: Callable[[], Any]) -> str:
    try:
        return repr(probe())[:200]
    except BaseException as exc:  # the point is to report whatever it was
        return f"error: {type(exc).__name__}: {exc}"[:200]


@controller
def sandbox_probe(ctx: Context) -> Generator[Any, Any, None]:
    for name in ctx.arg.split(","):
        if name != "none":
            set_output(name, outcome(PROBES[name]))
    yield fixed(" done")
