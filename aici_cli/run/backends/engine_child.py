"""The engine process of a local run: `python -m aici_cli.run.backends.engine_child FD PID`,
started by `engine_process.EngineProcess` with one end of a socket pair as FD and the
run's process id as PID.

It loads the model once (`build_engine`, as a Ray worker does; its load progress relayed,
`progress_relay.py`), says `Ready`, and runs its engine over a live feed of the lines the
run sends (a None item: nothing yet), sending `Started` as each line takes a row and
`Finished` with each result the moment it is emitted, the engine's figures since the last
message with it. A reader thread takes the run's messages off the socket at once, so the
run's sends never wait on a step, and hands a controller's tool answers to the guest that
waits for them (`tool_relay.py`).

It ignores SIGINT (the run owns Ctrl-C and says what to do through `Admission`), writes
nothing on stdout (the run's results may go there: fd 1 is the run's stderr), and dies
with the run: SIGKILL on the run's death (Linux's PR_SET_PDEATHSIG) and exit at the
socket's end-of-file.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NoReturn

from aici_cli.core.errors import ModelError, UsageError
from aici_cli.core.job import Job
from aici_cli.engine import EngineTracer
from aici_cli.run.backends.child_faults import Faults
from aici_cli.run.backends.child_messages import (
    Admission,
    Drained,
    EndOfInput,
    Figures,
    Finished,
    LoadFailed,
    Ready,
    Start,
    Started,
    ToolAnswered,
)
from aici_cli.run.backends.tool_relay import RelayedTools

if TYPE_CHECKING:
    from aici_cli.core.line_stats import StepTimes
    from aici_cli.engine import Generation, StepClock
    from aici_cli.run.backends.build import BuiltEngine

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _Wake:
    """A feed item that only wakes an idle engine (admission changed)."""


class _End:
    """The feed's end: no more lines come."""


class LineHooks(EngineTracer):
    """The engine's hooks where this process needs them: a line taking a row (told to
    the run, which charges a death only to lines that had one) and each step's end (for
    fault injection)."""

    def __init__(self, child: EngineChild) -> None:
        self.child = child

    def admission(self, job: Job) -> Any:
        self.child.started(job)
        return super().admission(job)

    def step(self, clock: StepClock, times: StepTimes, gens: list[Generation | None]) -> None:
        self.child.stepped()


class EngineChild:
    """One engine process's model, engine and socket."""

    def __init__(self, conn: Connection, start: Start) -> None:
        self.conn = conn
        self.config = start.config
        self.faults = Faults.from_environment(start.life)
        self.send_lock = threading.Lock()
        self.feed: queue.SimpleQueue[list[Job] | _Wake | _End] = queue.SimpleQueue()
        self.changed = threading.Condition()
        self.admitting = True
        self.ended = False  # the run said EndOfInput
        self.steps = 0
        self.reported = (0, 0, 0)  # figures sent so far: steps, compile times, calls
        # The run's tools its controllers may call, their calls relayed to the run.
        self.relay = (RelayedTools(start.tools, self.send, self.config.tools.call_timeout_s)
                      if start.tools is not None else None)

    def send(self, message: object) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except OSError:  # the run is gone
                os._exit(0)

    # ------------------------------------------------------------------------ load

    def load(self) -> None:
        """Build the engine and say `Ready`; or say `LoadFailed` and exit."""
        from aici_cli.models.progress import reporting_to
        from aici_cli.run import threads
        from aici_cli.run.backends.progress_relay import RelayProgress

        threads.apply(self.config.threads)  # before torch starts its pool
        try:
            self.faults.at_load_time()
            from aici_cli.run.backends.build import build_engine

            relay = self.relay
            with reporting_to(RelayProgress(self.send)):
                built = build_engine(self.config,
                                     tools=relay.for_line if relay is not None else None)
        except UsageError as e:
            self._fail("usage", str(e))
        except ModelError as e:
            self._fail("model", str(e))
        except Exception as e:  # a bug: its traceback goes to stderr, its name to the run
            traceback.print_exc()
            self._fail("internal", f"{type(e).__name__}: {e}")
        self.built = built
        self.engine = built.engine
        self.engine.tracer = LineHooks(self)
        self.send(Ready(self._info(built)))

    def _info(self, built: BuiltEngine) -> dict[str, Any]:
        import torch

        from aici_cli.run.backends.build import model_meta

        lm = built.lm
        return {"model_name": lm.name, "quantize": lm.quantize, "meta": model_meta(lm),
                "threads": torch.get_num_threads(), "pid": os.getpid(),
                "compile": ("off" if self.engine.compiled_steps is None
                            else self.config.engine.compile)}

    def _fail(self, kind: str, message: str) -> NoReturn:
        self.send(LoadFailed(kind, message))
        _exit(0)

    # ----------------------------------------------------------------------- serve

    def serve(self) -> None:
        """Run the engine until the run says EndOfInput; between runs of it (admission
        off: Ctrl-C, a full `--ordered` buffer) wait for admission or the end."""
        threading.Thread(target=self._read, name="aici-feed", daemon=True).start()
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.admitting or self.ended)
                if not self.admitting:
                    return
            self.engine.run(self._lines(), self._emit, lambda: self.admitting)
            self.send(Drained(self._figures()))
            if self.ended:
                return

    def _read(self) -> None:
        """The run's messages, as they come; the socket's end (the run died) ends this
        process."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                _exit(0)
            if isinstance(message, list):
                self.feed.put(message)
                continue
            if isinstance(message, ToolAnswered):  # a guest waits for it on the engine's thread
                if self.relay is not None:
                    self.relay.answered(message)
                continue
            with self.changed:
                if isinstance(message, Admission):
                    self.admitting = message.on
                elif isinstance(message, EndOfInput):
                    self.ended = True
                self.changed.notify_all()
            self.feed.put(_End() if isinstance(message, EndOfInput) else _Wake())

    def _lines(self) -> Iterator[Job | None]:
        """The live feed: the next line, or None at once while the engine has work
        (it asks again after its step); blocks only while the engine is idle."""
        while True:
            try:
                item = self.feed.get(block=self.engine.idle())
            except queue.Empty:
                yield None
                continue
            if isinstance(item, _End):
                return
            if isinstance(item, _Wake):
                yield None
                continue
            yield from item

    def _emit(self, result: dict[str, Any]) -> None:
        self.send(Finished(result, self._figures()))

    def started(self, job: Job) -> None:
        self.send(Started(job.index))  # before the line can crash the process
        self.faults.on_line(job)

    def stepped(self) -> None:
        self.steps += 1
        self.faults.on_step(self.steps)

    def _figures(self) -> Figures:
        """The engine's figures since the last call (all made on this thread)."""
        steps, compiled, calls = (self.engine.step_times, self.engine.compile_ms,
                                  self.built.call_times)
        a, b, c = self.reported
        self.reported = (len(steps), len(compiled), len(calls))
        return Figures(steps[a:], compiled[b:], calls[c:], self.engine.compiled_steps,
                       self.engine.eager_steps)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the run's process dies, however it dies (Linux; the kernel sends it
    when the thread that started this process ends, and a run starts it from the thread
    that runs it, for the run's length). Elsewhere the socket's end-of-file does it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before prctl took effect
        _exit(0)


def _exit(status: int) -> NoReturn:
    """End at once: no interpreter shutdown (torch's and the compiler's threads, atexit
    work) for a process whose every result is already sent."""
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str]) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run owns Ctrl-C
    fd, parent = int(argv[1]), int(argv[2])
    _die_with_parent(parent)
    sys.stdout = sys.stderr  # fd 1 is the run's stderr already; print() too
    faulthandler.enable()  # a native crash leaves its Python stack on stderr
    conn = Connection(fd)
    try:
        start = conn.recv()
    except (EOFError, OSError):
        _exit(0)
    child = EngineChild(conn, start)
    child.load()
    try:
        child.serve()
    except BaseException:
        # The engine confines every line's faults: reaching here is a bug. Ending with an
        # error makes it a death the run recovers from (the lines in flight run again).
        traceback.print_exc()
        _exit(70)
    _exit(0)


if __name__ == "__main__":
    main(sys.argv)
