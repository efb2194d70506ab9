"""The files a command will write, checked before it does any work.

A path that cannot be written (its directory missing, a directory in its place, no
permission) is found before the model loads, as one usage-error line naming the option,
not as a traceback after an hour of work. Any option that writes a file joins with one
`(option, path)` pair: `check_writable([("--stats-out", path), ("--trace", path)])`.

Nothing is created: a file that does not exist yet is judged by its directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from aici_cli.core.config import RunConfig
from aici_cli.core.errors import UsageError

Target = tuple[str, "str | os.PathLike[str] | None"]


def run_outputs(config: RunConfig) -> list[Target]:
    """The files `aici-batch run` writes, each with the option that names it; an option
    that writes a file adds its pair here."""
    return [("-o", config.output), ("--stats-out", config.stats_out)]


def writable_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be written as a file, or None when it can (as far as can be
    told without writing: a full disk still shows only when writing)."""
    p = Path(path)
    if p.is_dir():
        return "it is a directory"
    if p.exists():
        return None if os.access(p, os.W_OK) else "permission denied"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        return f"directory {parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"permission denied in directory {parent}"
    return None


def check_writable(targets: Iterable[Target]) -> None:
    """Raise a one-line UsageError for the first `(option, path)` whose path cannot be
    written; None paths (an option not given) and "-" (stdout) pass."""
    for option, path in targets:
        if path is None or str(path) == "-":
            continue
        problem = writable_problem(path)
        if problem is not None:
            raise UsageError(f"cannot write {option} {path}: {problem}")
