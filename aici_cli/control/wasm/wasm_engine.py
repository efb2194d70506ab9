"""The process-wide wasmtime engine and the thread that advances its epoch.

Engines are thread-safe and compiled components are tied to the engine's config, so one
engine serves every component: one ticker thread and one compile-cache key space. Fuel
and epoch interruption are on: fuel bounds a call's CPU work deterministically, the epoch
deadline bounds the CPU time its thread spends in it.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import wasmtime


class EpochTicker:
    """Advances a wasm engine's epoch once per millisecond of CPU time that the threads
    inside guest calls spend, while such calls run.

    A deadline of N ticks is then about N ms of the guest thread's own CPU time. Wall time
    would charge a guest for what is not its doing: a loaded machine that deschedules the
    process, or another thread holding the GIL while the guest waits in a host function's
    trampoline (a 50 ms deadline then fails a guest that ran 4 ms). Fuel bounds the work
    itself; the epoch bounds its cost. With several threads inside calls at once (one per
    engine in practice), the one that spent the most since its call began sets the ticks.
    Where a thread's CPU clock cannot be read (no `time.pthread_getcpuclockid`), the
    monotonic clock counts instead.

    The thread blocks while no call is active so that it does not compete for the GIL
    with the decode loop. Daemon: it never keeps the process alive. Reading a thread's
    CPU clock costs ~1.3 us, once a millisecond per active call.
    """

    def __init__(
        self,
        increment: Callable[[], None],
        clock: Callable[[int], float] | None = None,
        name: str = "aici-wasm-epoch",
    ) -> None:
        self._increment = increment
        self._name = name
        self._clock = clock or thread_cpu_clock
        self._lock = threading.Lock()  # guards _active and the increments
        self._active: dict[int, _Call] = {}  # thread ident -> its call in progress
        self._wake = threading.Event()
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        thread.start()
        return thread

    def enter(self) -> None:
        """Call before setting a deadline: time from before it never counts against it."""
        ident = threading.get_ident()
        with self._lock:
            if not self._thread.is_alive():  # a forked child inherits no threads
                self._thread = self._start()
            call = self._active.get(ident)
            if call is None:
                self._active[ident] = _Call(self._clock(ident))
            else:  # re-entered on the same thread (a nested instantiation): one clock
                call.depth += 1
            self._wake.set()

    def leave(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            call = self._active[ident]
            call.depth -= 1
            if call.depth == 0:
                del self._active[ident]
            if not self._active:
                self._wake.clear()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(0.001)
            with self._lock:
                ticks = 0
                for ident, call in self._active.items():
                    spent_ms = int((self._clock(ident) - call.start) * 1000)
                    ticks = max(ticks, spent_ms - call.ticked)
                for call in self._active.values():
                    call.ticked += ticks
                for _ in range(ticks):
                    self._increment()


@dataclass
class _Call:
    """A thread inside a guest call: its clock reading at entry and the ticks counted."""

    start: float
    ticked: int = 0
    depth: int = 1


def thread_cpu_clock(ident: int) -> float:
    """Seconds of CPU time thread `ident` has used (monotonic seconds where unsupported)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):  # no per-thread CPU clocks here (Windows, macOS)
        return time.monotonic()


@dataclass(frozen=True)
class SharedWasmEngine:
    """The one wasmtime engine of the process, with its epoch ticker."""

    wasm_engine: wasmtime.Engine
    ticker: EpochTicker
    fingerprint: str  # everything besides the wasm bytes that a compiled artifact depends on


_shared_lock = threading.Lock()
_shared: SharedWasmEngine | None = None


def shared_wasm_engine() -> SharedWasmEngine:
    """The process-wide wasm engine (fuel + epochs on) and its ticker, created once."""
    global _shared
    with _shared_lock:
        if _shared is None:
            config = wasmtime.Config()
            config.consume_fuel = True
            config.epoch_interruption = True
            wasm_engine = wasmtime.Engine(config)
            fingerprint = (
                f"wasmtime={_wasmtime_version()};fuel=1;epoch=1;"
                f"arch={platform.machine()};os={platform.system()}"
            )
            ticker = EpochTicker(wasm_engine.increment_epoch)
            _shared = SharedWasmEngine(wasm_engine, ticker, fingerprint)
        return _shared


def _wasmtime_version() -> str:
    try:
        from importlib.metadata import version

        return version("wasmtime")
    except Exception:  # metadata missing (vendored install): the artifact check still guards
        return "unknown"
