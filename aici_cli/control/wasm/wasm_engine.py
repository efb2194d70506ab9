"""The process-wide wasmtime engine and the thread that advances its epoch.

Engines are thread-safe and compiled components are tied to the engine's config, so one
engine serves every component: one ticker thread and one compile-cache key space. Fuel
and epoch interruption are on: fuel bounds a call's CPU work deterministically, the epoch
deadline bounds its wall time.
"""

from __future__ import annotations

import platform
import threading
import time
from dataclasses import dataclass

import wasmtime


class EpochTicker:
    """Advances a wasm engine's epoch once per elapsed millisecond while guest calls run.

    A deadline of N ticks is then about N ms. The tick count follows the monotonic clock
    (not the number of sleeps, which overshoot by ~0.1-0.3 ms each), and the thread
    blocks while no call is active so that it does not compete for the GIL with the
    decode loop. Daemon: it never keeps the process alive.
    """

    def __init__(self, wasm_engine: wasmtime.Engine) -> None:
        self._wasm_engine = wasm_engine
        self._lock = threading.Lock()  # guards _active, _resume and the increments
        self._active = 0
        self._resume = time.monotonic()  # when _active last went from 0 to 1
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aici-wasm-epoch", daemon=True)
        self._thread.start()

    def enter(self) -> None:
        """Call before setting a deadline: ticks from before it never count against it."""
        with self._lock:
            if not self._thread.is_alive():  # a forked child inherits no threads
                self._thread = threading.Thread(
                    target=self._run, name="aici-wasm-epoch", daemon=True
                )
                self._thread.start()
            if self._active == 0:
                self._resume = time.monotonic()
            self._active += 1
            self._wake.set()

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._wake.clear()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            self._wake.wait()
            time.sleep(0.001)
            with self._lock:
                if self._active == 0:
                    continue  # went idle meanwhile: idle time is nobody's deadline
                last = max(last, self._resume)
                elapsed = int((time.monotonic() - last) * 1000)
                for _ in range(elapsed):
                    self._wasm_engine.increment_epoch()
                last += elapsed / 1000


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
            _shared = SharedWasmEngine(wasm_engine, EpochTicker(wasm_engine), fingerprint)
        return _shared


def _wasmtime_version() -> str:
    try:
        from importlib.metadata import version

        return version("wasmtime")
    except Exception:  # metadata missing (vendored install): the artifact check still guards
        return "unknown"
