"""Building a native library into the cache folder, and finding it once a process.

`compile_library` compiles C files and one C++ file into a shared library: every file
at once, a compiler process each (one after another, the cores but one would wait; the
int kernels' C++ file, against torch's headers, takes ~80% of their ~12 s), then the
link, in a temporary folder beside the library, renamed into place (another process
may build the same one at once). A folder left by a process that ended mid-build is
removed by the next build once no build can still be using it (`sweep_stale`).

`once` finds a value (a library's path, or why there is none) once a process under one
lock: the first caller runs the finding while later ones wait for its value.
`in_background` starts that finding on a thread of its own, so that a build runs while
its process does other work (`int_mm.start_build`: a model's load converts its GGUF file
meanwhile), and the caller that needs it waits only for what is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

TIMEOUT_S = 300  # a compiler process that takes longer hangs
TEMP_PREFIX = ".int-"  # a build's temporary folder beside the library
# A temporary build folder older than this belongs to no running build (its compile and
# its link each time out at TIMEOUT_S).
STALE_S = 3 * TIMEOUT_S
T = TypeVar("T")

_FOUND: dict[Hashable, object] = {}
_FOUND_LOCK = threading.Lock()


def once(key: Hashable, find: Callable[[], T]) -> T:
    """`find()`'s value for `key`, found once a process (an exception stores nothing: the
    next caller runs `find` again)."""
    with _FOUND_LOCK:
        if key not in _FOUND:
            _FOUND[key] = find()
        return _FOUND[key]  # type: ignore[return-value]


def in_background(key: Hashable, find: Callable[[], object]) -> None:
    """`once(key, find)` on a daemon thread, where this process has no value for `key`
    yet. The thread prints nothing: an exception is dropped, for the next `once` of the
    key to raise again in its caller."""
    if key in _FOUND:
        return

    def quietly() -> None:
        with contextlib.suppress(Exception):  # raised again by the caller's own `once`
            once(key, find)

    threading.Thread(target=quietly, daemon=True, name="native-build").start()


def compile_library(built: Path, cc: str, c_files: list[tuple[Path, list[str]]],
                    c_flags: list[str], cxx: str, cxx_file: Path, cxx_flags: list[str],
                    libraries: list[str]) -> str | None:
    """The library at `built` from `c_files` (each with its own flags after `c_flags`)
    and `cxx_file` (`cxx_flags`, the link's too), linked with `libraries`: None, or why
    not in a few words (the first failing file's, in the order given, with its
    compiler's last line)."""
    built.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(built.parent)
    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX, dir=built.parent) as tmp:
        steps = [[cc, *c_flags, *flags, "-c", str(source)] for source, flags in c_files]
        steps.append([cxx, *cxx_flags, "-c", str(cxx_file)])
        objects = [str(Path(tmp) / f"{Path(step[-1]).name}.o") for step in steps]
        problem = _at_once([[*step, "-o", obj] for step, obj in zip(steps, objects)])
        if problem is not None:
            return f"building its library failed ({problem})"
        out = Path(tmp) / built.name
        done = subprocess.run([cxx, *cxx_flags, "-o", str(out), objects[-1], *objects[:-1],
                               *libraries], capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            return f"building its library failed ({_tail(done.stderr)})"
        os.replace(out, built)
    return None


def sweep_stale(folder: Path, older_than_s: float = STALE_S) -> int:
    """Remove the temporary build folders in `folder` that no build can still be using
    (older than `older_than_s`: a build's compilers time out long before), left by a
    process that ended while its background build ran (the thread is a daemon: nothing
    cleans up after it). Returns how many it removed."""
    removed = 0
    now = time.time()
    for path in folder.glob(f"{TEMP_PREFIX}*"):
        try:
            if path.is_dir() and now - path.stat().st_mtime > older_than_s:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        except OSError:  # another process swept it first
            continue
    return removed


def _at_once(commands: list[list[str]]) -> str | None:
    """`commands` run side by side: None, or the last line the first failing one (in
    their order) wrote."""
    running: list[subprocess.Popen[str]] = []
    try:
        for command in commands:
            running.append(subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True))
        errors = [c.communicate(timeout=TIMEOUT_S)[1] for c in running]
    finally:  # a timeout or a failed start leaves none running
        for c in running:
            if c.poll() is None:
                c.kill()
                c.wait()
    return next((_tail(e) for c, e in zip(running, errors) if c.returncode != 0), None)


def _tail(stderr: str) -> str:
    return (stderr.strip().splitlines() or ["no output"])[-1][:200]
