"""`EngineWorker`: the body of a Ray actor, one loaded model and one `Engine`.

The engine runs in a thread of its own for the life of the actor, over a live feed of
lines: `run_chunk` (a streaming actor method, one call per chunk) puts its lines on the
feed and yields each result the moment the engine emits it. Chunks therefore share one
continuously refilled batch, as the lines of a local run do; a chunk's end never drains
the batch. Ray is imported by placement.py, which wraps the class as an actor.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aici_cli.core.config import RunConfig
from aici_cli.core.errors import ModelError, UsageError
from aici_cli.core.job import Job
from aici_cli.core.line_stats import StepTimes

# Fault injection for the test suite only: a worker whose process environment names a
# line id here kills its own process (SIGKILL) when that line reaches its engine, as a
# line that runs a worker out of memory would. Unset (always, outside those tests) it
# does nothing.
CRASH_ON_ID_ENV = "AICI_BATCH_TEST_CRASH_ON_ID"



@dataclass
class Figures:
    """The engine's own figures since the last `Figures` sent, for the run summary:
    sent with each chunk's end, so a worker's death loses only its unfinished chunks'."""

    steps: list[StepTimes]
    compile_ms: list[float]
    call_times: list[float]  # ms of each wasm guest call


@dataclass
class Delivery:
    """What a chunk yields: one line's result, with when it left the worker (time.time(),
    for the driver's cost per line; comparable where driver and worker share a clock),
    or, last, the figures."""

    result: dict[str, Any] | None = None
    sent_at: float = 0.0
    figures: Figures | None = None


class EngineWorker:
    """One model and one engine, fed chunks of lines; created by placement.py as a Ray
    actor. A model or controller that cannot load is kept as `ready()`'s error (one
    line, as a local run reports it) rather than raised, so the driver can stop the run
    with that message."""

    def __init__(self, name: str, config: RunConfig, wasm: bytes | None) -> None:
        self.name = name
        self.error: tuple[str, str] | None = None  # (kind, message)
        self.info: dict[str, Any] = {"worker": name, "node": _node(), "pid": os.getpid()}
        self.call_times: list[float] = []
        self.feed: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.outboxes: dict[int, queue.SimpleQueue[Delivery]] = {}  # by chunk id
        self.reported = (0, 0, 0)  # figures sent so far: steps, compile times, calls
        self.chunk_of: dict[int, int] = {}  # line index -> chunk id, lines in flight
        self.lock = threading.Lock()
        self.crash_on = os.environ.get(CRASH_ON_ID_ENV)
        try:
            self._load(config, wasm)
        except UsageError as e:
            self.error = ("usage", str(e))
        except ModelError as e:
            self.error = ("model", str(e))
        except Exception as e:  # a bug or a broken node: the message says which
            self.error = ("internal", f"{type(e).__name__}: {e}")
            traceback.print_exc()
        if self.error is None:
            threading.Thread(target=self._serve, name="aici-engine", daemon=True).start()

    def _load(self, config: RunConfig, wasm: bytes | None) -> None:
        from aici_cli.run.backends.build import build_engine, model_meta
        from aici_cli.run.threads import apply as apply_threads

        assert config.ray is not None
        # Ray sets OMP_NUM_THREADS from num_cpus; torch's own pool needs telling too (its
        # variables before torch is imported, else `torch.set_num_threads`).
        apply_threads(max(1, int(config.ray.cpus_per_worker)))
        built = build_engine(config, wasm)
        self.engine = built.engine
        self.call_times = built.call_times
        self.info.update(model_meta(built.lm), load_s=round(built.load_s, 3))
        if built.component is not None:
            self.info["controller"] = {"compile_ms": round(built.component.compile_ms, 3),
                                       "cache_hit": built.component.cache_hit}

    # ---------------------------------------------------------------- actor methods

    def ready(self) -> dict[str, Any]:
        """Where and what this worker is, or {"error": (kind, message)}."""
        return {"error": self.error} if self.error is not None else self.info

    def pid(self) -> int:
        return os.getpid()

    def run_chunk(self, chunk: int, jobs: list[Job]) -> Iterator[Delivery]:
        """Feed `jobs` to the engine and yield each one's result as it finishes (in
        finishing order, not input order), then the engine's figures since the last
        chunk ended."""
        outbox: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        with self.lock:
            self.outboxes[chunk] = outbox
            for job in jobs:
                self.chunk_of[job.index] = chunk
        for job in jobs:
            self.feed.put(job)
        for _ in jobs:
            yield outbox.get()
        with self.lock:
            del self.outboxes[chunk]
            figures = self._figures()
        yield Delivery(figures=figures)

    def run_chunk_whole(self, chunk: int, jobs: list[Job]) -> list[Delivery]:
        """`run_chunk` in one answer, for Ray Client, which has no streaming calls."""
        deliveries = list(self.run_chunk(chunk, jobs))
        now = time.time()
        for delivery in deliveries:
            delivery.sent_at = now
        return deliveries

    def _figures(self) -> Figures:
        """The figures since the last call (the engine thread only appends to them)."""
        steps, compiled, calls = (self.engine.step_times, self.engine.compile_ms,
                                  self.call_times)
        a, b, c = self.reported
        self.reported = (len(steps), len(compiled), len(calls))
        return Figures(steps[a:self.reported[0]], compiled[b:self.reported[1]],
                       calls[c:self.reported[2]])

    # ---------------------------------------------------------------------- engine

    def _serve(self) -> None:
        try:
            self.engine.run(self._lines(), self._emit)
        except BaseException:
            # The engine confines every line's faults; reaching here is a bug, and a
            # worker without its engine would leave its chunks waiting forever. Ending
            # the process makes it a lost worker: Ray restarts it, the driver reassigns.
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(70)

    def _lines(self) -> Iterator[Job | None]:
        """The live feed: the next line, or None at once while the engine has work
        (it asks again after its step); blocks only while the engine is idle."""
        while True:
            try:
                job = self.feed.get(block=self.engine.idle())
            except queue.Empty:
                yield None
                continue
            if self.crash_on is not None and job.id == self.crash_on:
                os.kill(os.getpid(), signal.SIGKILL)
            yield job

    def _emit(self, result: dict[str, Any]) -> None:
        result.setdefault("stats", {})["worker"] = self.name
        with self.lock:
            chunk = self.chunk_of.pop(result["index"], None)
            outbox = self.outboxes.get(chunk) if chunk is not None else None
        if outbox is not None:  # else a line handed here twice: its other result went out
            outbox.put(Delivery(result, time.time()))


def _node() -> str:
    """The node's address as Ray names it, else the host name."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:
        return socket.gethostname()
