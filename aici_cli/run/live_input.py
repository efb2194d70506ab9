"""Reading an input that may block (stdin, a pipe) on its own thread, so that the lines
already running keep decoding while the next one is awaited.

The engine asks for lines between steps (`Engine.run`'s live source: a None item means
"nothing ready yet"). Read on the engine's thread, a producer that writes a line a
second would hold every row for that second at each read; here a reader thread turns
the input into items (reading, parsing and checking each line) and queues them, and the
engine takes what is there. While the engine is idle it waits for the next item a short
while at a time, so an interrupt is still seen at once (`Interrupts`: the first signal
stops admission, the rows in flight finish). End of input ends the run as before.

The thread is a daemon: after an interrupt it may stay blocked in a read until the
process exits, so the file it reads is left open then (closing a buffered file another
thread is reading blocks until that read returns), and it must not be `sys.stdin`'s own
buffer, which the interpreter flushes at exit (see `jobs.open_input`).
"""

from __future__ import annotations

import io
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Generic, TypeVar

T = TypeVar("T")

# How long an idle engine waits for the next item before it looks at interrupts again.
IDLE_WAIT_S = 0.1


class _End:
    """The reader reached the end of its items."""


class _Failed:
    """Reading raised: the exception is raised again on the engine's thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def may_block(source: BinaryIO) -> bool:
    """Whether reading `source` can wait on a producer: anything but a regular file
    (stdin from a pipe or terminal, a FIFO, `<(command)`). A stream without a file
    descriptor (an in-memory buffer) never waits."""
    try:
        return not stat.S_ISREG(os.fstat(source.fileno()).st_mode)
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


class LiveInput(Generic[T]):
    """Items read ahead on a thread of their own, at most `capacity` waiting."""

    def __init__(self, capacity: int) -> None:
        self._queue: queue.Queue[T | _End | _Failed] = queue.Queue(maxsize=max(1, capacity))
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, items: Iterator[T]) -> None:
        self._thread = threading.Thread(target=self._read, args=(items,), daemon=True,
                                        name="aici-input")
        self._thread.start()

    def items(self, idle: Callable[[], bool]) -> Iterator[T | None]:
        """The items in order, for `Engine.run`: None when none is ready; while `idle()`
        (no row has work) it first waits up to `IDLE_WAIT_S` for one. Raises what reading
        raised; ends after the last item."""
        while True:
            try:
                item = self._queue.get(timeout=IDLE_WAIT_S) if idle() else \
                    self._queue.get_nowait()
            except queue.Empty:
                yield None
                continue
            if isinstance(item, _End):
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    @property
    def reading(self) -> bool:
        """Whether the reader thread is still at work (after `close`: blocked in a read)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop reading: the reader ends at its next item (or its current read's end)."""
        self._closed.set()

    def _read(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
        except BaseException as e:  # raised again where the items are consumed
            self._put(_Failed(e))
            return
        self._put(_End())

    def _put(self, item: Any) -> bool:
        """Queue `item`, waiting for room; False once closed (nobody takes it)."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=IDLE_WAIT_S)
                return True
            except queue.Full:
                continue
        return False
