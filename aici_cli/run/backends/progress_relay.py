"""A model's load progress across the process boundary: the engine process reports to a
`RelayProgress` (its `LoadProgress`, see `models/progress.py`), which sends each event as
a message; the run replays them on its own `LoadProgress` (`ProgressReplay`), so a user
sees the same notes and bar (a GGUF's first conversion) as from an in-process load.

Torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, TypeVar

from aici_cli.models.progress import LoadProgress
from aici_cli.run.backends.child_messages import (
    ProgressAdvance,
    ProgressDone,
    ProgressNote,
    ProgressSteps,
)

T = TypeVar("T")


class RelayProgress(LoadProgress):
    """The engine process's `LoadProgress`: every event goes to `send`."""

    def __init__(self, send: Callable[[Any], object]) -> None:
        self.send = send

    def note(self, message: str) -> None:
        self.send(ProgressNote(message))

    def steps(self, items: Iterable[T], total: int, description: str) -> Iterator[T]:
        self.send(ProgressSteps(total, description))
        try:
            for item in items:
                yield item
                self.send(ProgressAdvance())
        finally:
            self.send(ProgressDone())


class ProgressReplay:
    """The events of a `RelayProgress`, shown on `progress` (the run's)."""

    def __init__(self, progress: LoadProgress) -> None:
        self.progress = progress
        # The bar of the steps under way: `self.progress.steps` over an endless feed, advanced
        # one item per `ProgressAdvance` (it is pulled, the events are pushed).
        self.bar: Iterator[None] | None = None

    def show(self, message: object) -> bool:
        """Show `message` if it is a progress event; whether it was one."""
        if isinstance(message, ProgressNote):
            self.progress.note(message.message)
        elif isinstance(message, ProgressSteps):
            self.close()
            self.bar = iter(self.progress.steps(itertools.repeat(None), message.total,
                                                message.description))
            next(self.bar, None)  # the bar appears at its first item, as a load's does
        elif isinstance(message, ProgressAdvance):
            if self.bar is not None:
                next(self.bar, None)
        elif isinstance(message, ProgressDone):
            self.close()
        else:
            return False
        return True

    def close(self) -> None:
        """End the bar under way, if any (the engine finished or died mid-steps)."""
        bar, self.bar = self.bar, None
        if isinstance(bar, Generator):
            bar.close()
