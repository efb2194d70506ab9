"""Ending a run early but cleanly on SIGINT/SIGTERM (see `Interrupts`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

from aici_cli.run.resume import InputLines, Interrupted


class Interrupts:
    """SIGINT/SIGTERM for the length of a run (main thread only).

    The first signal stops the admission of new lines: the rows in flight finish, every
    result is written, the summary is printed, and the run ends with 128 + the signal
    number. Before the engine starts (model loading) there is nothing to finish, so it
    raises `Interrupted` at once, as Ctrl-C normally does. A second signal exits at once:
    every finished result is already in the OS (one write per line), and `--resume`
    runs whatever did not finish.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.lines: InputLines | None = None  # set once the engine starts reading them
        self.signum: int | None = None
        self.engine_started = False  # from then on a signal only marks the outcome
        self.announced = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN:
                    continue  # ignored by whoever started us (a shell's background job)
                self._previous[sig] = previous
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            with contextlib.suppress(OSError, ValueError):  # a closed stderr must not stop us
                if sys.stderr.isatty():
                    os.write(2, b"\x1b[?25h")  # the progress bar hid the cursor
                os.write(2, f"aici-batch: {signal_name(signum)} again, stopping now\n"
                         .encode())
            os._exit(128 + signum)
        self.signum = signum
        if self.lines is not None:
            self.lines.stop = True
        if not self.engine_started or (self.lines is not None and self.lines.reading):
            raise Interrupted(signum)

    def should_admit(self) -> bool:
        return self.signum is None

    def take_news(self) -> int | None:
        """The signal that arrived since the last call, once: the run acknowledges it
        from its own loop, not from the handler, which may interrupt the progress bar
        mid-draw."""
        if self.signum is None or self.announced:
            return None
        self.announced = True
        return self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
