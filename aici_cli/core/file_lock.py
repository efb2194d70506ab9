"""An exclusive lock between processes of one machine, for the caches under `cache_dir()`.

A cache entry that takes long to make (a compiled wasm component, a converted GGUF) is
made by one process while the others wait for it and then read its result, instead of
each making its own copy. Advisory `flock` on a hidden lock file beside the entries: the
lock goes with the process, so a run that dies holding it releases it.

Torch-free.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

try:  # POSIX only; elsewhere concurrent processes may each do the work
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def exclusive_lock(folder: Path, name: str,
                   on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `folder/.<name>.lock` for the body.

    `on_wait` is called once, before blocking, when another process holds the lock (to
    say why nothing happens). Where locks are not available (no fcntl, a read-only or
    lock-less file system) the body runs unlocked: then each process does the work, which
    the caches tolerate (entries are installed by atomic renames).
    """
    if fcntl is None:
        yield
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
