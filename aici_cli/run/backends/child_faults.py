"""Fault injection for the test suite only: the engine process kills itself, as a native
crash or the OOM killer would, where its environment says. Unset (always, outside those
tests) nothing happens; the checks cost a comparison per line and per step.

    AICI_BATCH_TEST_ENGINE_CRASH_ON_ID     a line id: every life dies when it takes a row
    AICI_BATCH_TEST_ENGINE_CRASH_AT_STEP   N: the first life dies at the end of its step N
    AICI_BATCH_TEST_ENGINE_CRASH_AT_LOAD   set: the first life dies while it loads
    AICI_BATCH_TEST_ENGINE_CRASH_SIGNAL    the signal, SIGKILL (default) or SIGSEGV, ...

The step and load faults strike the first life only, so that a run sees one death there;
a line's fault strikes every life, as a line that crashes the engine would.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import NoReturn

from aici_cli.core.job import Job

CRASH_ON_ID_ENV = "AICI_BATCH_TEST_ENGINE_CRASH_ON_ID"
CRASH_AT_STEP_ENV = "AICI_BATCH_TEST_ENGINE_CRASH_AT_STEP"
CRASH_AT_LOAD_ENV = "AICI_BATCH_TEST_ENGINE_CRASH_AT_LOAD"
CRASH_SIGNAL_ENV = "AICI_BATCH_TEST_ENGINE_CRASH_SIGNAL"


@dataclass(frozen=True)
class Faults:
    on_id: str | None = None
    at_step: int | None = None
    at_load: bool = False
    signum: int = signal.SIGKILL

    @classmethod
    def from_environment(cls, life: int) -> Faults:
        env = os.environ
        step = env.get(CRASH_AT_STEP_ENV)
        name = env.get(CRASH_SIGNAL_ENV, "SIGKILL")
        return cls(on_id=env.get(CRASH_ON_ID_ENV),
                   at_step=int(step) if step and life == 1 else None,
                   at_load=bool(env.get(CRASH_AT_LOAD_ENV)) and life == 1,
                   signum=signal.Signals[name])

    def on_line(self, job: Job) -> None:
        if self.on_id is not None and str(job.id) == self.on_id:
            self._die()

    def on_step(self, step: int) -> None:
        if step == self.at_step:
            self._die()

    def at_load_time(self) -> None:
        if self.at_load:
            self._die()

    def _die(self) -> NoReturn:
        os.kill(os.getpid(), self.signum)
        while True:  # the signal is on its way
            time.sleep(1)
