"""What a guest's failure reads as: wasmtime errors classified into `ControllerError`s.

wasmtime reports traps, exhausted fuel, expired deadlines and refused memory or table
growth as one `WasmtimeError` whose text holds the cause and a wasm backtrace; the type
and the one-line message of the result's error are read from that text.
"""

from __future__ import annotations

import re

from aici_cli.control.wasm.limits import GuestLimits
from aici_cli.core.errors import ControllerError
from aici_cli.core.units import byte_size


class Fault(Exception):
    """Raised inside a host function to end the call with this ControllerError."""

    def __init__(self, error: ControllerError) -> None:
        super().__init__(error.message)
        self.error = error


class Overrun(Fault):
    """A call that returned but overran its deadline outside wasm (in conversions)."""


_FRAME = re.compile(r"^\s*\d+:\s+0x[0-9a-f]+ - (?P<name>.+)$", re.MULTILINE)
# Frames that mean "an allocation failed": Rust's OOM hooks, C's, CPython's.
_OOM_FRAME = re.compile(r"alloc_error|rust_oom|__rg_oom|out_of_memory|PyErr_NoMemory|\boom\b")
# Frames of WASI functions that componentize-py's --stub-wasi turned into traps.
_WASI_FRAME = re.compile(
    r"preopens|get_directories|get_stdout|get_stderr|get_stdin|get_environment|"
    r"wall_clock|monotonic_clock|get_random|wasi"
)


def classify(message: str, phase: str, budget_ms: int, limits: GuestLimits) -> ControllerError:
    """The error of a call (`phase`: instantiation, constructor, mid-process) that ended
    with the wasmtime error `message`."""
    cause = root_cause(message)
    frames = [m.group("name").strip() for m in _FRAME.finditer(message)]
    if "all fuel consumed" in message:
        return ControllerError(
            "controller_fuel",
            f"{phase} ran out of fuel ({limits.fuel_per_call:,} units per call)",
        )
    if "wasm trap: interrupt" in message:
        return ControllerError(
            "controller_timeout", f"{phase} exceeded its {budget_ms} ms deadline"
        )
    cap = byte_size(limits.memory_bytes)
    named = [f for f in frames if "<wasm function" not in f]
    where = f" in {named[0]}" if named else ""
    if "call stack exhausted" in message:
        return ControllerError(
            "controller_trap",
            f"{phase} trapped: stack overflow (recursion too deep?): {cause}{where}",
        )
    if "exceeds table limits" in message:
        return ControllerError(
            "controller_memory",
            f"{phase} needs a table larger than the cap of {limits.table_elements:,} "
            f"elements: {cause}",
        )
    if "exceeds memory limits" in message:
        return ControllerError(
            "controller_memory", f"{phase} needs more than the {cap} cap: {cause}"
        )
    if any(_OOM_FRAME.search(f) for f in frames) or "memory allocation of" in message:
        return ControllerError(
            "controller_memory",
            f"{phase} ran out of memory (cap {cap}): {cause} (tables are capped too, at "
            f"{limits.table_elements:,} elements)",
        )
    text = f"{phase} trapped: {cause}{where}"
    if any(_WASI_FRAME.search(f) for f in named):
        text += (
            " (a WASI function stubbed out at build time: controllers get no filesystem, "
            "stdio, environment, clock or network; an uncaught Python exception ends here "
            "too, because printing its traceback needs them)"
        )
    return ControllerError("controller_trap", text)


def root_cause(message: str) -> str:
    """The innermost reason in a wasmtime error ("wasm trap: ..."), one line."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if "Caused by:" in lines:
        after = lines[lines.index("Caused by:") + 1 :]
        causes = [re.sub(r"^\d+: ", "", ln) for ln in after if not _FRAME.match(ln)]
        if causes:
            return "; ".join(causes)
    return lines[0] if lines else "unknown error"


def is_trap(message: str) -> bool:
    return "wasm trap" in message or "wasm backtrace" in message


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, with a note saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters cut]"
