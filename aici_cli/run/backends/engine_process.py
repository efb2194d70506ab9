"""`EngineProcess`: one life of a local run's engine process, seen from the run.

Started as `python -m aici_cli.run.backends.engine_child` (a fresh interpreter, as
multiprocessing's "spawn" would be, without re-importing the run's main module) with one
end of a socket pair; messages are pickled with `multiprocessing.connection`'s framing
(`child_messages.py`). Its stdin is /dev/null (the run's input may be stdin), its stdout
the run's stderr (the run's results may go to stdout).

Costs: a fresh interpreter imports torch and loads the model (the model's files are in
the page cache after the first life); the run's process imports neither.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aici_cli.control.guest_tools import ToolInfo
from aici_cli.core.config import RunConfig
from aici_cli.core.errors import ModelError, UsageError
from aici_cli.run.backends.child_messages import LoadFailed, Ready, Start
from aici_cli.run.backends.progress_relay import ProgressReplay

CHILD_MODULE = "aici_cli.run.backends.engine_child"
# The directory aici_cli is imported from, first on the engine process's path, so that it
# runs this very code (a checkout, an editable install) whatever its working directory.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
EXIT_GRACE_S = 5.0  # for the process to exit after its socket closes, before SIGKILL
LOAD_HINT = ("a native crash (torch's kernels, a driver, the OOM killer); `aici-batch doctor` "
             "shows which modes run here; try --dtype float32, --quantize none or --device "
             "cpu")


class EngineProcess:
    """One engine process: `send`, `receive`, `wait_ready`, and how it ended."""

    def __init__(self, config: RunConfig, life: int,
                 tools: tuple[ToolInfo, ...] | None = None) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=_stderr_fd(),
                env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.gone = False  # the process has exited (its last messages received)
        self.info: dict[str, Any] = {}  # `Ready.info`
        # Sends come from the run's thread and from the tools' (`tool_relay.serve_call`).
        self._send_lock = threading.Lock()
        self.send(Start(config, life, tools))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: object) -> None:
        """Send `message` (from any thread); a process already gone is found by
        `receive`."""
        with self._send_lock:
            if self.gone:
                return
            with contextlib.suppress(OSError):
                self.conn.send(message)

    def receive(self, timeout: float) -> list[object]:
        """The messages that arrived, waiting up to `timeout` s for the first; sets
        `gone` once the process has ended and everything it sent is read."""
        if self.gone:
            return []
        messages: list[object] = []
        if not self.conn.poll(timeout):
            # No end-of-file can mean a process of its own (a compiler worker) holds the
            # socket open: the exit status says.
            self.gone = self.proc.poll() is not None
            return messages
        while True:
            try:
                messages.append(self.conn.recv())
            except (EOFError, OSError, pickle.UnpicklingError):  # a message cut off too
                self.gone = True
                return messages
            if not self.conn.poll(0):
                return messages

    def wait_ready(self, replay: ProgressReplay,
                   go_on: Callable[[], bool] = lambda: True) -> bool:
        """Wait for the model to load, showing its progress on `replay`; False when
        `go_on()` turned False first (the process is then stopped). Raises what loading
        raised (`UsageError`, `ModelError`), and a `ModelError` when the process died."""
        try:
            while go_on():
                for message in self.receive(0.1):
                    if isinstance(message, Ready):
                        self.info = message.info
                        return True
                    if isinstance(message, LoadFailed):
                        raise _load_error(message)
                    replay.show(message)
                if self.gone:
                    raise ModelError(f"the engine process died while loading the model "
                                     f"({self.ending()}): {LOAD_HINT}")
            self.stop()
            return False
        finally:
            replay.close()

    def ending(self) -> str:
        """How the process ended: its signal's name (SIGSEGV, SIGKILL) or its exit
        status."""
        try:
            code = self.proc.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:  # its socket closed but it lives on: end it
            self.proc.kill()
            code = self.proc.wait()
        if code < 0:
            return signal.Signals(-code).name
        return f"exit status {code}"

    def stop(self) -> None:
        """End the process: its socket's end-of-file makes it exit; SIGKILL after
        `EXIT_GRACE_S`."""
        with self._send_lock:
            self.conn.close()
            self.gone = True
        deadline = time.monotonic() + EXIT_GRACE_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _load_error(failed: LoadFailed) -> Exception:
    if failed.kind == "usage":
        return UsageError(failed.message)
    if failed.kind == "model":
        return ModelError(failed.message)
    return ModelError(f"the engine process failed to load the model: {failed.message} "
                      "(its traceback is above)")


def _stderr_fd() -> int:
    """The run's stderr as a file descriptor for the engine's stdout (where there is
    none, /dev/null: never the run's stdout)."""
    try:
        if sys.__stderr__ is not None:
            return sys.__stderr__.fileno()
    except (OSError, ValueError):
        pass
    return subprocess.DEVNULL
