"""`SupervisedEngine`: the `Backend` of a local run whose engine runs in a child process
(`engine_child.py`), so that nothing native (a crash in a kernel, the OOM killer, a
`kill -9`) takes the run down.

This process reads the input, answers bad lines, writes and fsyncs every result (the
run's sink, unchanged) and owns what a resume needs; it imports no torch. The engine
process gets the good lines, at most `batch_size + lookahead` without a result at a
time, so its engine admits and chooses prefixes as an in-process one does, and sends
each result as its line finishes.

Faults. When the engine process dies (a signal, an exit with an error), a new one
loads and the lines the dead one held run again, the same `Job`s (so under
`--deterministic` the results are those of a run without the death); a result is taken
only for a line the current life holds, so none is written twice; what a death costs a
line is `line_deaths.py`. A controller's tool calls come as messages and are answered
here, where the tools live (`tool_relay.py`). Each death is one warning (`note`), and
the run exits 1. A death while the model loads stops the run (`ModelError`): that is no
line's fault.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aici_cli.control.guest_tools import RunTools
from aici_cli.core.config import RunConfig
from aici_cli.core.errors import ModelError
from aici_cli.core.job import BadLine, Job, error_result
from aici_cli.models.progress import current_progress
from aici_cli.run.backends.child_messages import (
    Admission,
    Drained,
    EndOfInput,
    Figures,
    Finished,
    Started,
    ToolCall,
)
from aici_cli.run.backends.engine_process import EngineProcess
from aici_cli.run.backends.line_deaths import (
    ALONE_AFTER,
    LINE_DEATHS,
    LineDeaths,
    crash_result,
    death_note,
)
from aici_cli.run.backends.progress_relay import ProgressReplay
from aici_cli.run.backends.tool_relay import serve_call
from aici_cli.run.live_input import LiveInput
from aici_cli.run.summary import summarize
from aici_cli.run.tally import RunTally

if TYPE_CHECKING:
    from aici_cli.engine import Emit

WAIT_S = 0.1  # longest wait for the engine: how often the run looks at Ctrl-C and input
# Deaths in a row of lives that held no line: no line is to blame, and the engine
# cannot run here (a fault at start-up, memory gone before any line).
EMPTY_DEATHS = 3


class SupervisedEngine:
    """A local run's engine in a child process; see the module docstring."""

    def __init__(self, config: RunConfig, guest_tools: RunTools | None = None) -> None:
        self.config = config
        self.guest_tools = guest_tools  # what the controllers' relayed tool calls reach
        self.cap = config.engine.batch_size + config.engine.lookahead
        self.lives = 0
        self.deaths = 0  # of engine processes, for the run's exit status
        self.empty_deaths = 0
        self.line_deaths = LineDeaths()
        self.figures = Figures()  # every life's, as received
        self.compiled_before = 0  # compiled steps of the lives before this one
        self.eager_before: dict[str, int] = {}  # eager one-token steps of those lives
        self.owed: dict[int, Job] = {}  # by index: sent to this life, no result yet
        self.started: set[int] = set()  # of those, the lines that took a row
        self.again: deque[Job] = deque()  # lines to send (again) before new input
        self.alone: deque[Job] = deque()  # lines to run with nothing else in flight
        self.running_alone = False
        self.emit: Emit = lambda result: None
        self.note: Callable[[str], None] = lambda message: None
        # Where loads report, restarts' too (they happen outside the run's `reporting_to`).
        self.progress = current_progress()
        process = self._new_life()
        assert process is not None  # nothing stops the first load but an exception
        self.process: EngineProcess = process
        self.model_name = str(self.process.info["model_name"])
        self.quantize = str(self.process.info["quantize"])
        self.dtype = str(self.process.info.get("meta", {}).get("dtype", ""))

    def _new_life(self, go_on: Callable[[], bool] = lambda: True) -> EngineProcess | None:
        """A new engine process, once its model is ready (None: `go_on()` turned False
        first). Its load progress shows as a load in this process would."""
        self.lives += 1
        tools = self.guest_tools  # told to the process only where the run allows any
        process = (EngineProcess(self.config, self.lives) if tools is None
                   else EngineProcess(self.config, self.lives, tuple(tools.infos)))
        try:
            ready = process.wait_ready(ProgressReplay(self.progress), go_on)
        except BaseException:
            process.stop()
            raise
        self.told = True  # the admission the engine last heard: on, as it starts
        self.end_sent = False
        return process if ready else None

    def close(self) -> None:
        self.process.stop()

    def in_flight(self) -> int:
        return len(self.started)

    # ------------------------------------------------------------------------ run

    def run(self, items: Iterator[Job | BadLine], emit: Emit,
            should_admit: Callable[[], bool], note: Callable[[str], None],
            live: LiveInput[Job | BadLine] | None = None) -> None:
        """As `Backend.run`. With `live` the input is read on its reader thread, waited
        for only while the engine holds no line."""
        self.emit, self.note = emit, note
        source: Iterator[Job | BadLine | None] | None = iter(items)
        if live is not None:
            live.start(items)
            source = live.items(lambda: not self.owed)
        while True:
            admitting = should_admit()
            if admitting != self.told:
                self.process.send(Admission(admitting))
                self.told = admitting
            if admitting:
                source = self._hand_out(source)
                if source is None and not self._to_send() and not self.end_sent:
                    # At once, lines still in flight: the engine then knows no line can
                    # come, so a run's tail (a one-line input) takes the compiled step of
                    # its busy rows only, not of the batch size's.
                    self.process.send(EndOfInput())
                    self.end_sent = True
            busy = bool(self.owed) or self.end_sent or not self.told or source is None
            drained = False
            for message in self.process.receive(WAIT_S if busy else 0.0):
                drained = self._take(message) or drained
            if drained and (self.end_sent or not self.told):
                return
            if self.process.gone:
                self._died()
                if not should_admit() or (source is None and not self._waiting()):
                    return
                process = self._new_life(should_admit)
                if process is None:
                    return
                self.process = process

    def _waiting(self) -> bool:
        """Whether lines are in flight or wait to be sent again."""
        return bool(self.owed or self._to_send())

    def _to_send(self) -> bool:
        """Whether this life is still to get lines once the input has ended: those to run
        again, or to run alone (each only once nothing is in flight). Only a death adds
        to them, and a death starts a new life, which hears of the end anew."""
        return bool(self.again or self.alone)

    def _hand_out(self, source: Iterator[Job | BadLine | None] | None
                  ) -> Iterator[Job | BadLine | None] | None:
        """Send lines while fewer than `cap` are in flight: those to run again first,
        then new ones (bad ones are answered here); returns the source, or None once it
        has ended. A line to run alone waits until nothing is in flight, and nothing
        goes with it."""
        if self.running_alone:
            return source
        if self.alone:
            if not self.owed:
                self.running_alone = True
                self._send([self.alone.popleft()])
            return source
        batch: list[Job] = []
        while len(self.owed) + len(batch) < self.cap:
            if self.again:
                batch.append(self.again.popleft())
                continue
            item = next(source, _END) if source is not None else None
            if item is _END:
                source = None
            if not isinstance(item, (Job, BadLine)):  # nothing ready, or the end
                break
            if isinstance(item, BadLine):
                self.emit(error_result(item))
                continue
            batch.append(item)
        self._send(batch)
        return source

    def _send(self, jobs: list[Job]) -> None:
        if jobs:
            for job in jobs:
                self.owed[job.index] = job
            self.process.send(jobs)

    def _take(self, message: object) -> bool:
        """Act on one message of the engine; whether it says the engine drained."""
        if isinstance(message, Started):
            if message.index in self.owed:
                self.started.add(message.index)
        elif isinstance(message, Finished):
            self._add(message.figures)
            index = message.result["index"]
            if self.owed.pop(index, None) is None:  # not a line this life holds
                return False
            self.started.discard(index)
            self.line_deaths.forget(index)
            self.empty_deaths = 0
            if not self.owed:
                self.running_alone = False
            self.emit(message.result)
        elif isinstance(message, Drained):
            self._add(message.figures)
            return True
        elif isinstance(message, ToolCall):  # answered from the tools' thread
            serve_call(self.guest_tools, message, self.process.send)
        return False

    def _add(self, figures: Figures) -> None:
        mine = self.figures
        mine.steps += figures.steps
        mine.compile_ms += figures.compile_ms
        mine.call_times += figures.call_times
        if figures.compiled_steps is not None:
            mine.compiled_steps = self.compiled_before + figures.compiled_steps
        mine.eager_steps = {why: self.eager_before.get(why, 0) + figures.eager_steps.get(why, 0)
                            for why in {**self.eager_before, **figures.eager_steps}}

    # ---------------------------------------------------------------------- deaths

    def _died(self) -> None:
        """The engine process is gone: charge the lines that held a row, send every
        line it held again (or end it as `engine_crash`), and say so."""
        how = self.process.ending()
        self.deaths += 1
        self.compiled_before = self.figures.compiled_steps or 0
        self.eager_before = dict(self.figures.eager_steps)
        again: list[Job] = []
        crashed: list[int] = []
        for index, job in sorted(self.owed.items()):
            if index not in self.started:
                again.append(job)  # it only waited: no death of its
                continue
            deaths = self.line_deaths.strike(job)
            if deaths >= LINE_DEATHS:
                crashed.append(index)
                self.emit(crash_result(job, how, deaths))
            elif deaths >= ALONE_AFTER:
                self.alone.append(job)
            else:
                again.append(job)
        self.again.extendleft(reversed(again))
        struck = [i for i in sorted(self.started) if i not in crashed]
        self.note(death_note(how, self.process.info, struck, crashed))
        self.empty_deaths = 0 if self.started else self.empty_deaths + 1
        if self.empty_deaths >= EMPTY_DEATHS:
            raise ModelError(f"the engine process died {self.empty_deaths} times in a row "
                             f"({how}) with no line running: the engine cannot run here")
        self.owed.clear()
        self.started.clear()
        self.running_alone = False

    # -------------------------------------------------------------------- summary

    def summary(self, config: RunConfig, tally: RunTally, wall: float) -> dict[str, Any]:
        info = self.process.info
        figures = self.figures
        summary = summarize(config, tally, figures.steps, wall, dict(info["meta"]),
                            figures.compile_ms, figures.call_times)
        summary["threads"] = info["threads"]  # what torch used, not what was asked
        if figures.compiled_steps is not None:
            summary["compiled_steps"] = figures.compiled_steps
        summary["eager_steps"] = dict(figures.eager_steps)
        return summary


_END = object()  # the source's end, from `next`
