"""The packaged steps a run lacks, built in a process of its own while the run goes on.

A run at `--compile auto` whose buckets have no packaged step (packaged_step.py) runs
eagerly from its first step, and a builder process makes the packages, the bucket the
run uses most first: a process, not a thread, because export and inductor hold the
GIL for most of a build, and niced (NICE, inherited by the C++ compilers it starts),
so that the run's own work comes first on a machine of few cores. The run looks for
each package on disk (a stat every RECHECK_S at most) and takes it the step after it
appears (compiled.py). A package is published only once it agrees with the eager step
on its build inputs (`packaged_step.build`), so the run never loads one being checked.

The builder outlives the run: one started at the run's end (where a build beside it
would not pay, build_decision.py) or still working when the run ends goes on, in a
session of its own, so the next run starts compiled; `aici-batch prepare` run next
waits for the bucket it is building (the package's lock) and builds the rest. Builders
take turns (a lock in the packages' folder), each skipping the packages already made.
Its output goes to BUILD_LOG there. `AICI_BATCH_STEP_BUILDS=off` starts none (the
steps then stay eager until `prepare` builds them).

The builder process is step_builder.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aici_cli.core.cache_paths import cache_dir
from aici_cli.core.file_lock import exclusive_lock

ENV = "AICI_BATCH_STEP_BUILDS"
NICE = 19
RECHECK_S = 0.25
BUILD_LOG = "builds.log"
CHILD = "aici_cli.engine.forward.step_builder"  # the builder process's module


def enabled() -> bool:
    """Whether a run may start a builder (`AICI_BATCH_STEP_BUILDS` is not `off`)."""
    return os.environ.get(ENV, "background").lower() not in ("off", "0", "no")


def folder() -> Path:
    """The packages' folder (packaged_step.FOLDER under the cache)."""
    from aici_cli.engine.forward.packaged_step import FOLDER

    return cache_dir() / FOLDER


@contextlib.contextmanager
def builders_turn(on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the builders' lock for the body: a builder at work finishes first (`on_wait`
    hears that it is waited for), and none builds meanwhile (`aici-batch prepare`)."""
    with exclusive_lock(folder(), "builder", on_wait):
        yield


@dataclass(frozen=True)
class BuildSource:
    """What the builder loads: the model's directory and the run's resolved choices
    (`load_model`'s arguments), so its layers, and so its packages' keys, are the run's."""

    path: str
    device: str
    dtype: str
    quantize: str
    implementation: str

    @classmethod
    def of(cls, lm: Any) -> BuildSource | None:
        """The source of a `LoadedModel` (None: it was not loaded from a directory)."""
        from aici_cli.models.families.llama import LlamaCausalLM

        if getattr(lm, "path", None) is None:
            return None
        own = isinstance(lm.model, LlamaCausalLM)
        return cls(str(lm.path), str(lm.device), str(lm.dtype).removeprefix("torch."),
                   lm.quantize, "auto" if own else "transformers")


class StepBuilds:
    """One run's builder process: started once, with the buckets to build in order."""

    def __init__(self, source: BuildSource, cache_rows: int) -> None:
        self.source = source
        self.cache_rows = cache_rows
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None  # perf_counter when it started
        self.during_run = False  # started before the run's end

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def start(self, rows: Sequence[int], during_run: bool) -> None:
        """Start the builder for `rows` (bucket row counts, most used first), in a
        session of its own so it outlives the run and hears none of its signals."""
        if self.started:
            return
        spec = {"source": asdict(self.source), "cache_rows": self.cache_rows,
                "rows": list(rows)}
        where = folder()
        where.mkdir(parents=True, exist_ok=True)
        with open(where / BUILD_LOG, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", CHILD, json.dumps(spec)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.perf_counter()
        self.during_run = during_run

    def problem(self) -> str | None:
        """Why the builder failed, once it ended with an error (the log's last line);
        None while it runs or where it succeeded."""
        code = self.process.poll() if self.process is not None else None
        if not code:
            return None
        try:
            lines = (folder() / BUILD_LOG).read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return f"the builder failed: {lines[-1] if lines else f'exit status {code}'}"[:300]

    def wait(self, timeout: float | None = None) -> int | None:
        """The builder's exit status once it ends (tests and benches; a run never waits)."""
        if self.process is None:
            return None
        return self.process.wait(timeout)
