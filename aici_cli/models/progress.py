"""Where the slow, once-only steps of getting a model ready report themselves.

Assembling a packaged GGUF, waiting for another run's conversion and converting a GGUF
take from seconds to minutes, once per model and machine. They say so through the
`LoadProgress` in effect: by default a logged warning (a library caller sees what it
always saw), for the CLI its own console (one rich bar while a GGUF converts) or nothing
at all under `--quiet`. A context variable rather than a parameter, because the steps
sit several calls below `load_model` (resolve, the hub cache, a package's `provide`).

Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import TypeVar

logger = logging.getLogger("aici_cli.models")
T = TypeVar("T")


class LoadProgress:
    """The default: notes as logged warnings, no progress bar."""

    def note(self, message: str) -> None:
        """One line about a slow step that starts now."""
        logger.warning("%s", message)

    def steps(self, items: Iterable[T], total: int, description: str) -> Iterator[T]:
        """`items`, shown as `total` steps of `description` while they are consumed."""
        return iter(items)


class SilentProgress(LoadProgress):
    """`--quiet`: nothing (errors still reach the user as exceptions)."""

    def note(self, message: str) -> None:
        pass


_DEFAULT = LoadProgress()
_current: ContextVar[LoadProgress | None] = ContextVar("aici_cli_load_progress", default=None)


def current_progress() -> LoadProgress:
    return _current.get() or _DEFAULT


@contextlib.contextmanager
def reporting_to(progress: LoadProgress) -> Iterator[None]:
    """Model preparation inside the body reports to `progress`."""
    token = _current.set(progress)
    try:
        yield
    finally:
        _current.reset(token)
