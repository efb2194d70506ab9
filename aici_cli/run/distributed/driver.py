"""`RayBackend`: the driver of a Ray run, a `Backend` (`aici_cli.run.backends.protocol`) like
the local engine.

The driver reads the input lazily through the same `read_jobs` as a local run: a bad line
becomes its error result here and never leaves the driver. Good lines go to workers in
chunks (`run_chunk`, a streaming actor call that yields each result as its line
finishes), each worker holding at most `chunks_in_flight` chunks: the input is read only
as fast as the workers take it, so the object store holds a few chunks, not the input.
Every result goes through the run's sink (tagged, written in one write, fsynced, shown).

Lines go by a digest of their prompt's start to the same worker where it has room, so
lines sharing a system prompt or few-shot prefix meet the same prefix cache.

Faults. A worker that dies (killed, out of memory, node lost) fails its chunks; Ray
restarts the actor (`max_restarts`) and the driver gives the chunks' unfinished lines to
whichever worker has room. A line is written at most once: a result is taken only from
the chunk that holds the line now, and a failed chunk is dropped with its generator. A
line in flight at `ALONE_AFTER` deaths runs alone on a worker kept free for it, so the
next death is its own; at `LINE_LOSSES` it ends as a `worker_lost` error result.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from aici_cli.core.config import RunConfig
from aici_cli.core.errors import ClusterError, one_line
from aici_cli.core.job import BadLine, Job, error_result
from aici_cli.engine import Emit
from aici_cli.run.distributed.placement import (
    Worker,
    check_resources,
    component_bytes,
    connect,
    start_workers,
    stop_workers,
)
from aici_cli.run.distributed.summary import RunFigures
from aici_cli.run.distributed.worker import Delivery
from aici_cli.run.live_input import LiveInput
from aici_cli.run.tally import RunTally

LINE_LOSSES = 3  # worker deaths a line may be in flight at before it is `worker_lost`
ALONE_AFTER = 2  # from this many, the line runs alone, so that a death is its own
WAIT_S = 0.5  # longest wait for a result: how often the loop checks for Ctrl-C
PREFIX_CHARS = 256  # of a prompt (or its first message), for choosing a worker
PROBES = 3  # `ready` calls to a lost worker that fail in a row before it counts as gone
REPROBE_S = 0.5  # between `ready` calls to a restarting worker


@dataclass
class Chunk:
    """Lines handed to one worker in one `run_chunk` call."""

    id: int
    worker: Worker
    epoch: int  # the worker's epoch when handed out: its death fails every such chunk
    lines: dict[int, Job]  # by index: those without a result yet
    alone: bool = False


class RayBackend:
    """The lines of a run on Ray workers; see the module docstring."""

    def __init__(self, config: RunConfig, workers: list[Worker], owns: bool) -> None:
        assert config.ray is not None
        self.config = config
        self.workers = workers
        self.owns = owns  # this run connected to Ray, so it disconnects (a local
        # instance it started stops with it)
        self.model_name = str(workers[0].info["model"])
        self.quantize = str(workers[0].info.get("quantize", "none"))
        self.dtype = str(workers[0].info.get("dtype", ""))
        # Each result as its line finishes; Ray Client has no streaming calls, so
        # there a chunk's results come when it ends (a death then costs the chunk).
        self.streaming = not client_mode()
        self.cap = config.ray.chunks_in_flight
        self.chunk_lines = config.ray.chunk_lines or config.engine.batch_size
        self.chunks: dict[Any, Chunk] = {}  # by its call (ObjectRefGenerator or ObjectRef)
        self.probes: dict[Any, Worker] = {}  # `ready` calls to restarting workers
        self.reprobe: dict[str, float] = {}  # by worker: when to ask again (monotonic)
        self.open: dict[str, list[Job]] = {w.name: [] for w in workers}  # filling chunks
        self.retry: deque[Job] = deque()  # lost once: handed out again as usual
        self.alone: deque[Job] = deque()  # lost `ALONE_AFTER` times: one at a time
        self.losses: dict[int, int] = {}  # by index, lines lost at least once
        self.figures = RunFigures()
        self.next_chunk = 0
        self.emit: Emit = lambda result: None
        self.note: Callable[[str], None] = lambda message: None

    @classmethod
    def start(cls, config: RunConfig) -> RayBackend:
        options = config.ray
        assert options is not None
        # Workers load the model by path (a shared file system or the same path on
        # every node) or by short name (each node's own cache).
        config = dataclasses.replace(config, model=_absolute(config.model))
        wasm = component_bytes(config)  # a missing or bad file fails before Ray starts
        owns = connect(options, config.quiet)
        try:
            check_resources(options)
            workers = start_workers(config, wasm)
        except BaseException:
            if owns:
                ray.shutdown()
            raise
        return cls(config, workers, owns)

    def close(self) -> None:
        stop_workers(self.workers, disconnect=self.owns)

    def in_flight(self) -> int:
        return sum(len(chunk.lines) for chunk in self.chunks.values())

    # ------------------------------------------------------------------------ run

    def run(self, items: Iterator[Job | BadLine], emit: Emit,
            should_admit: Callable[[], bool], note: Callable[[str], None],
            live: LiveInput[Job | BadLine] | None = None) -> None:
        """As `Backend.run`. The input is read in place, `live` or not: the lines decode
        in the workers' processes while the driver waits for it."""
        self.emit, self.note = emit, note
        source: Iterator[Job | BadLine] | None = iter(items)
        while True:
            admitting = should_admit()
            if admitting:
                self._hand_out_alone()
                source = self._hand_out(source)
            else:  # Ctrl-C: lines not yet handed out have no result; --resume runs them
                source = None
                self.retry.clear()
                self.alone.clear()
                for lines in self.open.values():
                    lines.clear()
            self._probe_again()
            waitables = [*self.chunks, *self.probes]
            if not waitables:
                if not admitting or not self._waiting(source):
                    return
                if self.reprobe:
                    time.sleep(REPROBE_S)
                    continue
                if all(w.dead for w in self.workers):
                    raise ClusterError(
                        "every Ray worker died for good (no restarts left); the results "
                        "written so far stay, and --resume runs the rest")
                continue  # a worker was just freed for lines that run alone
            ready, _ = ray.wait(waitables, num_returns=1, timeout=WAIT_S)
            for ref in ready:
                if ref in self.probes:
                    self._probe_answered(ref)
                else:
                    self._take(ref)

    def _waiting(self, source: Iterator[Job | BadLine] | None) -> bool:
        """Whether lines remain to be handed out."""
        return (source is not None or bool(self.retry) or bool(self.alone)
                or any(self.open.values()))

    def _hand_out(self, source: Iterator[Job | BadLine] | None
                  ) -> Iterator[Job | BadLine] | None:
        """Read and hand out lines while some worker has room; returns the source, or
        None once it is exhausted."""
        while any(w.takes(self.cap) for w in self.workers):
            job = self.retry.popleft() if self.retry else None
            if job is None and source is not None:
                job, source = self._read(source)
            if job is None:
                break
            worker = self._target(job)
            chunk = self.open[worker.name]
            chunk.append(job)
            if len(chunk) >= self.chunk_lines:
                self._submit(worker, chunk)
        # A partial chunk goes out at the end of the input, or to a worker with nothing.
        for worker in self.workers:
            chunk = self.open[worker.name]
            if chunk and worker.takes(self.cap) and (source is None or not worker.in_flight):
                self._submit(worker, chunk)
        return source

    def _read(self, source: Iterator[Job | BadLine]
              ) -> tuple[Job | None, Iterator[Job | BadLine] | None]:
        """The next good line (bad ones are answered here), and the source or None."""
        for item in source:
            if isinstance(item, BadLine):
                self.emit(error_result(item))
                continue
            return item, source
        return None, None

    def _target(self, job: Job) -> Worker:
        """The worker of the job's prompt start where it has room, else the least
        loaded one with room."""
        preferred = self.workers[_affinity(job) % len(self.workers)]
        if preferred.takes(self.cap):
            return preferred
        return min((w for w in self.workers if w.takes(self.cap)),
                   key=lambda w: (w.in_flight, len(self.open[w.name])))

    def _hand_out_alone(self) -> None:
        """Lines lost `ALONE_AFTER` times run one at a time, on a worker that takes no
        other chunk meanwhile (reserved): its death is then that line's alone."""
        if not self.alone:
            for worker in self.workers:
                if worker.reserved and not worker.in_flight:
                    worker.reserved = False
            return
        reserved = [w for w in self.workers if w.reserved and not w.dead]
        if not reserved:
            usable = [w for w in self.workers if not w.dead]
            if not usable:
                return
            worker = min(usable, key=lambda w: (not w.up, w.in_flight))
            worker.reserved = True
            self.retry.extendleft(reversed(self.open[worker.name]))
            self.open[worker.name].clear()
            reserved = [worker]
        for worker in reserved:
            if worker.up and not worker.in_flight and self.alone:
                self._submit(worker, [self.alone.popleft()], alone=True)

    def _submit(self, worker: Worker, jobs: list[Job], alone: bool = False) -> None:
        self.next_chunk += 1
        if self.streaming:
            call = worker.actor.run_chunk.options(num_returns="streaming").remote(
                self.next_chunk, list(jobs))
        else:
            call = worker.actor.run_chunk_whole.remote(self.next_chunk, list(jobs))
        self.chunks[call] = Chunk(self.next_chunk, worker, worker.epoch,
                                  {job.index: job for job in jobs}, alone)
        worker.in_flight += 1
        jobs.clear()

    # -------------------------------------------------------------------- results

    def _take(self, call: Any) -> None:
        """The next result of a chunk (or its end, or its worker's death); all of
        them at once without streaming."""
        chunk = self.chunks[call]
        try:
            deliveries = [ray.get(next(call))] if self.streaming else ray.get(call)
        except StopIteration:
            self._finished(call, chunk)
            return
        except ray.exceptions.RayError as e:
            self._lost(call, chunk, e)
            return
        for delivery in deliveries:
            self._deliver(chunk, delivery)
        if not self.streaming:
            self._finished(call, chunk)

    def _deliver(self, chunk: Chunk, delivery: Delivery) -> None:
        if delivery.figures is not None:
            self.figures.engines.append(delivery.figures)
            return
        result = delivery.result
        assert result is not None
        job = chunk.lines.pop(result["index"], None)
        if job is None:  # not a line this chunk still owes: never written twice
            return
        self.losses.pop(job.index, None)
        self.emit(result)
        self.figures.delivered(chunk.worker, result, delivery.sent_at)

    def _finished(self, gen: Any, chunk: Chunk) -> None:
        del self.chunks[gen]
        chunk.worker.in_flight -= 1
        self.retry.extend(chunk.lines.values())  # none: a chunk yields every line

    def _lost(self, gen: Any, chunk: Chunk, error: Exception) -> None:
        """The chunk's worker died: its unfinished lines go out again (or end as
        `worker_lost`), and the worker waits for Ray's restart."""
        del self.chunks[gen]
        worker = chunk.worker
        worker.in_flight -= 1
        if chunk.epoch == worker.epoch:  # the first chunk to report this death
            worker.epoch += 1
            worker.up = False
            worker.losses += 1
            self.retry.extend(self.open[worker.name])
            self.open[worker.name].clear()
            self.probes[worker.actor.ready.remote()] = worker
            self.note(f"Ray worker {worker.name} lost ({one_line(error, 200)}); its unfinished "
                      "lines go to other workers")
        for job in chunk.lines.values():
            self._strike(job, worker)

    def _strike(self, job: Job, worker: Worker) -> None:
        n = self.losses[job.index] = self.losses.get(job.index, 0) + 1
        self.figures.reassigned += 1
        if n >= LINE_LOSSES:
            self.losses.pop(job.index)
            self.emit(error_result(BadLine(
                job.index, job.id, "worker_lost",
                f"line {job.index}: its Ray worker died {n} times while running it, the "
                f"last time ({worker.name}) with no other line: the line itself kills "
                "its worker (out of memory, a crash); the other lines ran on")))
        elif n >= ALONE_AFTER:
            self.alone.append(job)
        else:
            self.retry.append(job)

    def _probe_again(self) -> None:
        """Ask the restarting workers that are due whether they are up."""
        now = time.monotonic()
        for worker in self.workers:
            due = self.reprobe.get(worker.name)
            if due is not None and due <= now:
                del self.reprobe[worker.name]
                self.probes[worker.actor.ready.remote()] = worker

    def _probe_answered(self, ref: Any) -> None:
        """A lost worker's `ready`: restarted (back in service), or gone for good."""
        worker = self.probes.pop(ref)
        try:
            info = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            # Restarting (a new process loading the model): Ray refuses calls until it
            # is up, so ask again a little later.
            self.reprobe[worker.name] = time.monotonic() + REPROBE_S
            return
        except ray.exceptions.RayError as e:
            # A call that reached the dying process fails too; only a run of failures
            # means that no restart comes (Ray's restarts are used up).
            worker.probe_failures += 1
            if worker.probe_failures < PROBES:
                self.reprobe[worker.name] = time.monotonic() + REPROBE_S
                return
            info = {"error": ("gone", f"no restart ({one_line(e, 200)})")}
        worker.probe_failures = 0
        if "error" in info:
            worker.dead = True
            worker.reserved = False
            self.retry.extend(self.open[worker.name])
            self.open[worker.name].clear()
            self.note(f"Ray worker {worker.name} is gone for good: {info['error'][1]}")
            return
        worker.info = {**info, **worker.info}  # the first life's controller compile stays
        worker.up = True

    # -------------------------------------------------------------------- summary

    def summary(self, config: RunConfig, tally: RunTally, wall: float) -> dict[str, Any]:
        return self.figures.summary(config, tally, wall, self.workers)


def client_mode() -> bool:
    """Whether this process reaches Ray through Ray Client (`--ray ray://...`)."""
    return bool(ray.util.client.ray.is_connected())


def _affinity(job: Job) -> int:
    """A stable digest of the prompt's start (its first message for a chat line)."""
    if job.prompt is not None:
        head = job.prompt[:PREFIX_CHARS]
    else:
        first = job.messages[0] if job.messages else {}
        head = json.dumps(first, sort_keys=True, ensure_ascii=False)[:PREFIX_CHARS]
    return zlib.crc32(head.encode("utf-8", "surrogatepass"))


def _absolute(model: str | None) -> str | None:
    """A model path as an absolute one (workers start elsewhere); names stay."""
    if model is None:
        return None
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


