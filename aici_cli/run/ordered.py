"""`--ordered`: results written in input order, through a bounded reorder buffer.

Lines finish out of order (short ones overtake long ones in a batch). `InputOrder`
learns the order from the items as they are read (`track`), holds each finished result
until every line read before it has been written (`put`), and writes the run of results
that is then complete, each still in one write (and fsynced like any other).

The buffer is bounded: once `limit` results wait for an earlier line, `full` is true and
the run admits no new line until the earliest one finishes (its rows then run only the
lines already started, which may still add their results: at most `limit` + the batch
size - 1 wait). The run admits in input order (`--lookahead 1`) so that the
earliest unfinished line always holds a row: a full buffer then always drains.

Costs: memory for at most `limit` results; rows left idle while the buffer is full (a
long line holds up the writing of everything after it); the prefix cache's choice of
which read-ahead line to admit first; results of lines that finished after an interrupt
or a kill but wait behind an unfinished one (a kill -9 loses them: `--resume` runs them
again; an interrupt writes them, in input order, as the run ends).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

# Finished results waiting for an earlier line; a result is a few KB.
DEFAULT_LIMIT = 1024

T = TypeVar("T")


class Indexed(Protocol):
    @property
    def index(self) -> int: ...  # the input line number


ItemT = TypeVar("ItemT", bound=Indexed)


class InputOrder(Generic[T]):
    """Writes held items (`T`, a result with whatever goes with it) in input order.
    `track` may run on another thread (a live input's reader) than `put`."""

    def __init__(self, write: Callable[[T], None], limit: int = DEFAULT_LIMIT) -> None:
        self.write = write
        self.limit = limit
        self._order: deque[int] = deque()  # line numbers read and not yet written, in order
        self._pending: set[int] = set()  # the same, for lookups
        self._held: dict[int, T] = {}
        self._lock = threading.Lock()

    def track(self, items: Iterator[ItemT]) -> Iterator[ItemT]:
        """`items`, noting the order in which lines are read."""
        for item in items:
            with self._lock:
                self._order.append(item.index)
                self._pending.add(item.index)
            yield item

    @property
    def full(self) -> bool:
        return len(self._held) >= self.limit

    @property
    def held(self) -> int:
        return len(self._held)

    def put(self, index: int, item: T) -> None:
        """Hold `item` (the result of line `index`), then write every held item no earlier
        line waits for."""
        ready: list[T] = []
        with self._lock:
            if index not in self._pending:  # not read through `track`: nothing to wait for
                ready.append(item)
            else:
                self._held[index] = item
            while self._order and self._order[0] in self._held:
                first = self._order.popleft()
                self._pending.discard(first)
                ready.append(self._held.pop(first))
        for held in ready:
            self.write(held)

    def flush(self) -> None:
        """Write what is still held, in input order: at the end of a run, only where lines
        read never started (an interrupt), which leaves their places empty."""
        with self._lock:
            ready = [self._held.pop(i) for i in sorted(self._held)]
            self._order.clear()
            self._pending.clear()
        for held in ready:
            self.write(held)
