"""`ToolLoop`: the tool rounds of a run, between the input and the backend, whatever the
backend (this process's engine, or its child's).

The backend gets the input through `items` and hands every result to `emit`. A result
whose calls the host serves is not written: its calls go to the host (`ToolHost.call`,
answered on the host's own thread), and the line's row is free at once, for other lines.
When a round's answers are all in, `items` hands the backend the line's next round ahead of
new input; its last round's result, with the transcript (`Conversation.final`), goes to the
run's sink. So a slow tool holds no row: the batch keeps decoding while calls are out.

Everything here runs on the backend's thread; the host's thread only says, through a
queue, which line's answers are in.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from aici_cli.core.job import BadLine, Job
from aici_cli.run.tools.calls import CallOutcome, ToolHost
from aici_cli.run.tools.conversation import Conversation, served_line

if TYPE_CHECKING:
    from aici_cli.engine import Emit

# How long `items` waits for answers when the backend holds no line (so nothing else
# could happen meanwhile) before it gives the backend a None ("nothing yet"), which
# lets the run look at interrupts.
IDLE_WAIT_S = 0.1

_END = object()


class ToolLoop:
    """See the module docstring. `trace(index, name, outcome)`: a span per call."""

    def __init__(self, host: ToolHost, max_rounds: int, sink: Emit,
                 trace: Callable[[int, str, CallOutcome], None] | None = None) -> None:
        self.host = host
        self.max_rounds = max_rounds
        self.sink = sink
        self.trace = trace
        self.talks: dict[int, Conversation] = {}  # lines in a conversation, by index
        self.in_backend: set[int] = set()  # lines handed to the backend, no result yet
        self.answered: queue.SimpleQueue[int] = queue.SimpleQueue()  # lines whose answers are in
        self.open = True  # whether the run's own admission was open when last asked

    def idle(self) -> bool:
        """The backend holds no line: waiting for input or answers costs nothing."""
        return not self.in_backend

    def should_admit(self, run_admits: Callable[[], bool]) -> Callable[[], bool]:
        """The backend's admission: the run's (`run_admits`), and while lines are in a
        conversation, open for their next rounds even when the run's is shut (an
        interrupt lets the lines in flight finish; `--ordered` waits on one of them)."""
        def admits() -> bool:
            self.open = run_admits()
            return self.open or bool(self.talks)

        return admits

    def items(self, source: Iterator[Job | BadLine | None]) -> Iterator[Job | BadLine | None]:
        """The backend's items: lines whose answers are in, first, then `source`'s (a
        None from either: nothing ready yet), while the run admits; ends when `source`
        has ended and no line is in a conversation."""
        live: Iterator[Job | BadLine | None] | None = source
        while True:
            yield from self._next_rounds(wait=False)
            if live is not None and self.open:
                item = next(live, _END)
                if item is _END:
                    live = None
                    continue
                if isinstance(item, (Job, BadLine)):
                    self._take(item)
                yield item  # type: ignore[misc]
                continue
            if live is None and not self.talks:
                return
            yield from self._next_rounds(wait=self.idle())
            yield None

    def _take(self, item: Job | BadLine) -> None:
        self.in_backend.add(item.index)
        if isinstance(item, Job) and served_line(item, self.host.tools):
            self.talks[item.index] = Conversation(item)

    def _next_rounds(self, wait: bool) -> Iterator[Job]:
        """The next rounds of the lines whose answers are in (waiting a moment for one
        when `wait`); a line whose call failed gets its error result instead."""
        try:
            index: int | None = self.answered.get(timeout=IDLE_WAIT_S) if wait else None
        except queue.Empty:
            return
        while True:
            if index is None:
                try:
                    index = self.answered.get_nowait()
                except queue.Empty:
                    return
            talk = self.talks[index]
            self._traced(talk)
            failed = talk.answered()
            if failed is not None:
                del self.talks[index]
                self.sink(talk.failed(failed))
            else:
                self.in_backend.add(index)
                yield talk.next_round()
            index = None

    def _traced(self, talk: Conversation) -> None:
        if self.trace is not None:
            for call, future in talk.pending:
                self.trace(talk.job.index, call["function"]["name"], future.result())

    def emit(self, result: dict[str, Any]) -> None:
        """A result from the backend: its calls sent, or the line's result written."""
        index = result.get("index")
        self.in_backend.discard(index)  # type: ignore[arg-type]
        talk = self.talks.get(index)  # type: ignore[arg-type]
        if talk is None:
            self.sink(result)
            return
        calls = talk.calls_to_run(result, self.host.tools, self.max_rounds)
        if calls is None:
            del self.talks[talk.job.index]
            self.sink(talk.final(result))
            return
        futures = [self.host.call(talk.job.index, name, arguments) for name, arguments in calls]
        talk.sent(result, calls, futures)
        _when_all(futures, lambda: self.answered.put(talk.job.index))


def _when_all(futures: list[Future[CallOutcome]], then: Callable[[], None]) -> None:
    """Call `then` (on whichever thread ends the last) once every future is done."""
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Future[CallOutcome]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one)
