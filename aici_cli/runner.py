"""`run_batch`: the library entry point behind `aici-batch run`.

Reads input lines lazily, runs them on the engine, writes each result as soon as its
sequence finishes, and returns the run summary. The CLI is a thin layer over this. With
`resume`, lines that already have a result are skipped (see `aici_cli.resume`); with
`handle_signals`, SIGINT/SIGTERM end the run cleanly (see `Interrupts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Protocol

import torch

from aici_cli import __version__, threads
from aici_cli.engine.intake import ControllerFactory, Emit
from aici_cli.engine.loop import Engine
from aici_cli.interrupts import Interrupts, signal_name
from aici_cli.jobs import Translate, open_input, read_jobs
from aici_cli.live_input import LiveInput, may_block
from aici_cli.made_with import OPTION_KEYS, digest, run_record
from aici_cli.models.load import load_model
from aici_cli.models.progress import reporting_to
from aici_cli.openai_batch import BatchFormat, line_format, refuse_requests
from aici_cli.ordered import InputOrder
from aici_cli.out_paths import check_writable, run_outputs
from aici_cli.results import ResultWriter
from aici_cli.resume import InputLines, OutputFile, ResumeError, ResumePlan
from aici_cli.stats import RunTally, percentile
from aici_cli.ui import ModelLoading, RunDisplay, failure_line, load_progress, loading_what
from aici_cli.vocabulary.config import RunConfig, load_quantize
from aici_cli.vocabulary.errors import UsageError
from aici_cli.vocabulary.job import Job, LineError
from aici_cli.vocabulary.line_stats import StepTimes

if TYPE_CHECKING:
    from aici_cli.control.wasm import ControllerComponent

# fsync the output at most this often: an fsync costs milliseconds, more than a short
# result takes to produce, and a process crash loses nothing without one (see ResultWriter).
SYNC_INTERVAL_S = 1.0


@dataclass
class RunOutcome:
    summary: dict[str, Any]  # this run's lines only (not those a resume skipped)
    interrupted: int | None = None  # the signal that stopped the run before every line ran
    earlier_errors: int = 0  # error results already in the output of a resumed run
    skipped: int = 0  # lines a resumed run found done
    line_errors_ok: bool = False  # --exit-zero-on-line-errors
    summary_error: str | None = None  # why the --stats-out file could not be written

    @property
    def exit_code(self) -> int:
        """128 + signal when interrupted; 3 when the lines ran but the summary file could
        not be written; otherwise 1 when any result in the output (a resumed run's earlier
        ones too) is an error, unless `line_errors_ok`, else 0."""
        if self.interrupted is not None:
            return 128 + self.interrupted
        if self.summary_error is not None:
            return 3
        failed = self.summary["errors"] or self.earlier_errors
        return 1 if failed and not self.line_errors_ok else 0


def load_controller(config: RunConfig) -> ControllerComponent:
    """The `--controller` component, compiled (or loaded from the compile cache)."""
    from aici_cli.control.wasm import ComponentError, ControllerComponent, GuestLimits
    from aici_cli.registry.operations import controller_file

    assert config.controller is not None
    path = controller_file(config.controller)
    try:
        return ControllerComponent.load(path, GuestLimits(call_ms=config.controller_call_ms))
    except ComponentError as e:  # an oci:// one is named by its reference, not its cache file
        raise UsageError(str(e).replace(str(path), config.controller)) from None


def wasm_factory(config: RunConfig, engine: Engine, call_times: list[float],
                 component: ControllerComponent) -> ControllerFactory:
    """A factory giving every job its own runner of the `--controller` component."""
    from aici_cli.control.wasm import TokenizerServices, WasmController
    from aici_cli.vocabulary.errors import ControllerError

    lm = engine.lm
    services = TokenizerServices(
        lm.tokenizer, lm.vocab_size, min(lm.eos_token_ids), engine.compiler.tokenizer
    )

    def factory(job: Job) -> WasmController:
        if job.constraint is not None and job.constraint != config.defaults.constraint:
            raise ControllerError(
                "invalid_line", "a line's json_schema/regex/choices/grammar cannot be combined "
                "with --controller; the controller decides the constraints",
            )
        arg = job.extra.get("controller_arg", config.controller_arg)
        if not isinstance(arg, str):
            arg = json.dumps(arg)
        return WasmController(component, arg, services, engine.compiler,
                              config.engine.fast_forward, call_times)

    return factory


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _check_resume(config: RunConfig) -> None:
    if config.resume and config.output == "-":
        raise UsageError("--resume needs -o FILE: results on stdout cannot be read back")
    if config.resume and config.input == "-":
        raise UsageError("--resume needs INPUT to be a file, to check it against the results")


def run_batch(config: RunConfig, stderr: IO[str] | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None,
              handle_signals: bool = False, t0: float | None = None,
              loading: ModelLoading | None = None) -> RunOutcome:
    """Run every input line to exactly one result line. Raises `UsageError`/`ModelError`
    for problems that stop the whole run before any line is read.

    With `config.resume`, input lines whose result is already in the output are skipped
    and new results are appended. With `handle_signals` (the CLI), SIGINT/SIGTERM end the
    run early but cleanly (see `Interrupts`); the outcome says so. `t0` (a
    `time.perf_counter()`) is when the caller started, for the summary's start-up time
    (the CLI's, so that its imports count); `loading` the start-up note it started, which
    ends once the model is ready."""
    stderr = stderr or sys.stderr
    started = _Start.since(t0)
    _check_resume(config)
    check_writable(run_outputs(config))  # before an hour's work, not after it
    if config.ordered:  # the earliest unfinished line always holds a row (ordered.py)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine,
                                                                         lookahead=1))
    source = open_input(config.input)
    # An input that may wait on its producer is read on a thread of its own, so running
    # lines keep decoding meanwhile. The Ray driver reads in place: its workers decode in
    # processes of their own while it waits.
    live: LiveInput[Job | LineError] | None = (
        LiveInput(config.engine.lookahead) if config.ray is None and may_block(source)
        else None)
    output: OutputFile | None = None
    try:
        # Opened (and locked) early, so that a second run on the same file is refused before
        # it loads a model; nothing in it changes until the run is sure to go ahead.
        output = OutputFile(config.output) if config.output != "-" else None
        if output is not None and output.same_file_as(source):
            raise UsageError(f"the output {config.output} is the input file")
        interrupts = Interrupts() if handle_signals else None
        with interrupts or contextlib.nullcontext():
            return _run(config, stderr, on_result, source, output, interrupts, live, started,
                        loading)
    finally:
        if output is not None:
            output.close()
        if live is not None:
            live.close()
        # A reader still blocked in a read of it (after an interrupt) keeps it open: closing
        # would wait for that read. The process's exit closes it.
        if source is not sys.stdin.buffer and (live is None or not live.reading):
            source.close()


@dataclass
class _Start:
    """When the run began (UTC, ISO 8601; and as a `perf_counter`), and how long start-up
    (imports, the model loading) took."""

    at: str
    t0: float
    load_s: float = 0.0

    @classmethod
    def since(cls, t0: float | None = None) -> _Start:
        now = time.perf_counter()
        t0 = now if t0 is None else t0
        wall = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=now - t0)
        return cls(at=wall.isoformat(timespec="seconds"), t0=t0)


def _run(config: RunConfig, stderr: IO[str],
         on_result: Callable[[dict[str, Any]], None] | None, source: BinaryIO,
         output: OutputFile | None, interrupts: Interrupts | None,
         live: LiveInput[Job | LineError] | None = None,
         started: _Start | None = None, loading: ModelLoading | None = None) -> RunOutcome:
    started = started or _Start.since()
    plan = output.plan(config.input) if output is not None and config.resume else None
    total = plan.remaining if plan is not None else _count_lines(config.input)
    config = pin_controller(config)
    controller = controller_digest(config)
    mixed: list[str] = []  # with --resume-mixed: how earlier results were made otherwise
    if plan is not None:  # the options before the model loads, the model once it has
        _check_made_with(config, plan, run_record(config, "", controller), OPTION_KEYS, mixed)
    loading = loading or ModelLoading(stderr, config.quiet, loading_what(config.model))
    with reporting_to(load_progress(stderr, config.quiet)), loading:
        backend = _start_backend(config)
    started.load_s = time.perf_counter() - started.t0  # imports, model, controller
    try:
        record = run_record(config, backend.model_name, controller)
        if plan is not None:
            _check_made_with(config, plan, record, {"model"}, mixed)
        if output is not None:
            output.prepare(plan)
        out = output.stream() if output is not None else sys.stdout
        peeked, input_format, why = _detect_format(source, config.input_format)
        batch_format = BatchFormat(backend.model_name, why) if input_format == "openai" else None
        lines = InputLines(itertools.chain(peeked, source),
                           skip=plan.done if plan is not None else None)
        display = RunDisplay(stderr, total=total, quiet=config.quiet,
                             interval_s=config.progress_interval_s)
        if plan is not None:
            _announce_resume(display, config, plan, mixed)
        translate = (batch_format.translate if batch_format is not None
                     else refuse_requests(why))
        return _drive(config, backend, out, lines, display, interrupts, on_result, plan,
                      batch_format, translate, live, record, started)
    finally:
        backend.close()


class Backend(Protocol):
    """Where the lines run: this process's engine (`LocalEngine`) or Ray workers
    (`aici_cli.distributed.driver.RayBackend`). Started before the output is touched, so
    that a model or controller that cannot load leaves it as it was."""

    model_name: str

    def run(self, items: Iterator[Job | LineError], emit: Emit,
            should_admit: Callable[[], bool], note: Callable[[str], None]) -> None:
        """Every item to exactly one `emit`ted result, as `Engine.run` does."""

    def in_flight(self) -> int:
        """Lines started and not yet finished."""
        ...

    def summary(self, config: RunConfig, tally: RunTally, wall: float) -> dict[str, Any]:
        """The run summary (`--stats-out`, `schemas/stats.schema.json`)."""
        ...

    def close(self) -> None: ...


class LocalEngine:
    """The `Backend` of a run in this process: one loaded model and one `Engine`."""

    def __init__(self, config: RunConfig) -> None:
        from aici_cli.tracing import open_tracing

        self.tracing = open_tracing(config)  # None unless --trace or an OTLP endpoint
        try:
            threads.apply(config.threads)
            started = time.perf_counter()
            self.lm = load_model(config.model, config.device, config.dtype,
                                 load_quantize(config))
            self.model_name = self.lm.name
            self.engine = Engine(self.lm, config.engine)
            if self.tracing is not None:
                self.tracing.loaded(self.lm, started)
                self.tracing.attach(self.engine)
            self.call_times: list[float] = []  # ms of every wasm guest call in the run
            if config.controller is not None:
                self.engine.set_controller_factory(wasm_factory(
                    config, self.engine, self.call_times, load_controller(config)))
        except BaseException as e:
            if self.tracing is not None:
                self.tracing.close(failed=e)
            raise

    def run(self, items: Iterator[Job | LineError | None], emit: Emit,
            should_admit: Callable[[], bool], note: Callable[[str], None]) -> None:
        """As `Backend.run`; a None item (a live input) means "nothing ready yet"."""
        self.engine.run(items, emit, should_admit)

    def in_flight(self) -> int:
        return self.engine.in_flight()

    def idle(self) -> bool:
        """No row has work and no line waits for one: waiting for input costs nothing."""
        return self.engine.idle()

    def summary(self, config: RunConfig, tally: RunTally, wall: float) -> dict[str, Any]:
        summary = summarize(config, tally, self.engine.step_times, wall, model_meta(self.lm),
                            self.engine.compile_ms, self.call_times)
        summary["threads"] = torch.get_num_threads()  # what torch used, not what was asked
        if self.engine.compiled_steps is not None:
            summary["compiled_steps"] = self.engine.compiled_steps
        return summary

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()


def _start_backend(config: RunConfig) -> Backend:
    if config.ray is None:
        return LocalEngine(config)
    from aici_cli.tracing import open_tracing

    open_tracing(config)  # refuses --trace with --ray
    from aici_cli.distributed import start_ray_backend  # checks that Ray is installed

    return start_ray_backend(config)


# How far `--format auto` reads for a line that decides the format: lines (not counting
# blank ones) and bytes, since the lines read are held until the run sees them.
DETECT_LINES = 1000
DETECT_BYTES = 64 * 1024 * 1024


def _detect_format(source: BinaryIO, wanted: str) -> tuple[list[bytes], str, str]:
    """The input format, and why (for the error of a line in the other one): `wanted`,
    or for "auto" that of the first line shaped like either (an OpenAI batch request,
    with any of custom_id/method/url/body, or a line with a field of aici-batch's own),
    skipping lines that are neither (invalid JSON, `{}`). Returns the lines read to
    decide, which the run must still see."""
    if wanted != "auto":
        return [], wanted, f"--format {wanted}"
    peeked: list[bytes] = []
    size = 0
    for raw in source:
        peeked.append(raw)
        size += len(raw)
        if raw.strip():
            decided = _line_format(raw)
            if decided is not None:
                return peeked, decided, f"--format auto, decided by line {len(peeked)}"
        if len(peeked) >= DETECT_LINES or size >= DETECT_BYTES:
            break
    return peeked, "aici", f"--format auto: no line in the first {len(peeked)} decided"


def _line_format(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    except (ValueError, RecursionError):  # bad UTF-8 or JSON: this line's own error later
        return None
    return line_format(obj)


def pin_controller(config: RunConfig) -> RunConfig:
    """`config` with an `oci://` `--controller` resolved to one digest (a tag asks the
    registry once, here) and pulled into the component cache, so every line of the run,
    on every worker, uses that component."""
    from aici_cli.registry.refs import is_oci

    if not is_oci(config.controller):
        return config
    from dataclasses import replace

    from aici_cli.registry.operations import pin_controller as pin

    assert config.controller is not None
    return replace(config, controller=str(pin(config.controller, config.plain_http).ref))


def controller_digest(config: RunConfig) -> str | None:
    """What `made_with` records of the `--controller`: the digest of its file, or for a
    (pinned) `oci://` one the artifact by digest (None: no controller, or a file that
    cannot be read, which loading it reports)."""
    if config.controller is None:
        return None
    from aici_cli.registry.refs import is_oci, parse_ref

    if is_oci(config.controller):
        return parse_ref(config.controller).by_digest()
    try:
        return digest(Path(config.controller).read_bytes())
    except OSError:
        return None


def controller_summary(config: RunConfig) -> dict[str, str | None]:
    """The summary's `controller`: what --controller named (an oci:// one pinned to the
    digest the run used), and that digest (a file's: as `made_with` records it)."""
    from aici_cli.registry.refs import is_oci, parse_ref

    assert config.controller is not None
    digest = (parse_ref(config.controller).digest if is_oci(config.controller)
              else controller_digest(config))
    return {"source": config.controller, "digest": digest}


def _check_made_with(config: RunConfig, plan: ResumePlan, record: dict[str, Any],
                     keys: set[str], mixed: list[str]) -> None:
    """Refuse to resume onto results made with other options (only `keys` of `record`),
    unless `--resume-mixed`, which notes them in `mixed` instead."""
    diff = plan.made_otherwise(record, keys)
    if diff is None:
        return
    if not config.resume_mixed:
        raise ResumeError(f"--resume: {config.output} holds results made with {diff}; run "
                          "with the same options, or add --resume-mixed to mix them in one "
                          "file")
    mixed.append(diff)


def _announce_resume(display: RunDisplay, config: RunConfig, plan: ResumePlan,
                     mixed: list[str]) -> None:
    if config.quiet:
        return
    scan = plan.scan
    if scan.torn_line:
        _note(display, f"{config.output}: cut off its incomplete last line (line "
                       f"{scan.torn_line}, {scan.torn_bytes} bytes) left by an interrupted "
                       "run; that input line runs again")
    for diff in mixed:
        _note(display, f"--resume-mixed: {config.output} holds results made with {diff}; "
                       "the new results are added beside them")
    if plan.unrecorded:
        n = plan.unrecorded
        _note(display, f"{config.output}: {n} {'result says' if n == 1 else 'results say'} "
                       "nothing of the model and options that made them (an older "
                       "aici-batch wrote them): they are kept as if made with this run's")
    _note(display, f"resuming: {len(plan.done)} of {plan.total} lines of {config.input} "
                   f"already have results in {config.output}; running the other "
                   f"{plan.remaining}")


def _note(display: RunDisplay, message: str) -> None:
    display.console.print(message, markup=False, highlight=False, soft_wrap=True)


class ResultSink:
    """Where each result goes the moment its line finishes: tagged with its input line's
    digest, turned into the output format, written (one write per line), counted, shown,
    and handed to the caller's `on_result`."""

    def __init__(self, lines: InputLines, writer: ResultWriter, display: RunDisplay,
                 batch_format: BatchFormat | None,
                 on_result: Callable[[dict[str, Any]], None] | None,
                 after: Callable[[], None], made_with: dict[str, Any] | None = None,
                 ordered: bool = False) -> None:
        self.lines = lines
        # --ordered: results wait here for the lines before them (None: written at once).
        self.order: InputOrder[tuple[dict[str, Any], dict[str, Any]]] | None = (
            InputOrder(self._write) if ordered else None)
        self.made_with = made_with  # what made every result (`aici_cli.made_with`)
        self.schema_lines: set[int] = set()  # lines in flight that ask for a JSON schema
        self.writer = writer
        self.display = display
        self.batch_format = batch_format
        self.on_result = on_result
        self.after = after  # once the input is all read, the engine no longer asks to admit
        self.tally = RunTally()

    def __call__(self, result: dict[str, Any]) -> None:
        result = self.lines.tag(result, self.made_with)
        if result.get("index") in self.schema_lines:
            self.schema_lines.discard(result["index"])
            if result.get("finish_reason") == "error":
                result = _schema_error(result)
        fmt = self.batch_format
        line = fmt.output(result) if fmt is not None else result
        if self.order is not None:
            self.order.put(int(result.get("index", 0)), (line, result))
        else:
            self._write((line, result))
        self.tally.add(result)
        self.display.advance(result)
        self.after()

    def _write(self, item: tuple[dict[str, Any], dict[str, Any]]) -> None:
        line, result = item
        self.writer.write(line)
        if self.on_result is not None:
            self.on_result(result)


def _drive(config: RunConfig, backend: Backend, out: IO[str], lines: InputLines,
           display: RunDisplay, interrupts: Interrupts | None,
           on_result: Callable[[dict[str, Any]], None] | None,
           plan: ResumePlan | None, batch_format: BatchFormat | None = None,
           translate: Translate | None = None,
           live: LiveInput[Job | LineError] | None = None,
           made_with: dict[str, Any] | None = None,
           started: _Start | None = None) -> RunOutcome:
    """Run `lines` on the backend, writing each result as it finishes (as an OpenAI
    batch output line with `batch_format`), reading them on `live`'s thread if given."""
    writer = ResultWriter(out, sync_interval_s=SYNC_INTERVAL_S)

    def announce() -> None:
        signum = interrupts.take_news() if interrupts is not None else None
        if signum is not None and not config.quiet:
            in_flight = backend.in_flight()
            finishing = f", finishing the {_lines(in_flight)} in flight" if in_flight else ""
            _note(display, f"{signal_name(signum)}: starting no new lines{finishing} "
                           "(again to stop at once)")

    def should_admit() -> bool:
        announce()
        if interrupts is not None and not interrupts.should_admit():
            return False
        return sink.order is None or not sink.order.full  # --ordered: room to hold results

    sink = ResultSink(lines, writer, display, batch_format, on_result, announce, made_with,
                      config.ordered)
    if interrupts is not None:
        interrupts.lines = lines
        interrupts.engine_started = True
    t0 = time.perf_counter()
    try:
        with display:
            jobs = _not_done(read_jobs(lines, config.defaults, translate), lines,
                             sink.schema_lines)
            if sink.order is not None:
                jobs = sink.order.track(jobs)

            def note(message: str) -> None:
                if not config.quiet:
                    _note(display, message)

            if live is not None and isinstance(backend, LocalEngine):
                live.start(jobs)
                backend.run(live.items(backend.idle), sink, should_admit, note)
            else:
                backend.run(jobs, sink, should_admit, note)
    finally:
        if sink.order is not None:
            sink.order.flush()
        writer.sync()
    wall = time.perf_counter() - t0
    # An interrupt that came after every line got its result cost nothing: the run is whole.
    signum = interrupts.signum if interrupts is not None and not lines.all_written else None
    summary = _run_facts(backend.summary(config, sink.tally, wall), config, started,
                         signum is not None)
    outcome = RunOutcome(summary, interrupted=signum,
                         earlier_errors=plan.scan.errors if plan is not None else 0,
                         skipped=len(plan.done) if plan is not None else 0,
                         line_errors_ok=config.exit_zero_on_line_errors,
                         summary_error=_write_summary(config.stats_out, summary))
    if summary["lines"] == 0 and not outcome.skipped and signum is None:
        display.note(f"aici-batch: warning: {_input_name(config)} has no lines to run "
                     "(it is empty or blank)")
    else:
        display.summary(summary)
    failed = failure_line(summary)
    if failed is not None:
        display.note(failed, even_quiet=True)
    if signum is not None and not config.quiet:
        _note(display, _interrupted_note(config, outcome, plan))
    return outcome


def _run_facts(summary: dict[str, Any], config: RunConfig, started: _Start | None,
               interrupted: bool) -> dict[str, Any]:
    """The run summary with what a log needs beside the figures: the version, when the run
    started, start-up and total time, whether it was interrupted or ordered."""
    started = started or _Start.since()
    return {**summary, "version": __version__, "started_at": started.at,
            "load_s": round(started.load_s, 3),
            "total_s": round(time.perf_counter() - started.t0, 3),
            "interrupted": interrupted, "ordered": config.ordered}


def _write_summary(path: str | None, summary: dict[str, Any]) -> str | None:
    """Write the `--stats-out` file; why it could not be written (checked before the run,
    its directory may still have gone since), or None."""
    if not path:
        return None
    try:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        return f"cannot write --stats-out {path}: {e.strerror or e}"
    return None


def _input_name(config: RunConfig) -> str:
    return "stdin" if config.input == "-" else config.input


def model_meta(lm: Any) -> dict[str, str]:
    """What the summary says of the model a run used."""
    return {"model": lm.name, "device": str(lm.device),
            "dtype": str(lm.dtype).removeprefix("torch."),
            "quantize": getattr(lm, "quantize", "none")}


def summarize(config: RunConfig, tally: RunTally, steps: list[StepTimes], wall: float,
              model: dict[str, str], compiled: list[float],
              call_times: list[float]) -> dict[str, Any]:
    """The run summary (`--stats-out`, `schemas/stats.schema.json`) from the results'
    tally and the engines' step times, grammar compile times and guest call times."""
    meta = {**model, "batch_size": config.engine.batch_size}
    summary = tally.run_summary(steps, wall, meta)
    if compiled:
        summary["grammar_compile_ms"] = {
            "grammars": len(compiled),
            "p50": round(percentile(compiled, 50), 3),
            "p99": round(percentile(compiled, 99), 3),
        }
    if config.controller is not None:
        summary["controller"] = controller_summary(config)
        summary["guest_call_ms"] = {
            "calls": len(call_times),
            "p50": round(percentile(call_times, 50), 3),
            "p99": round(percentile(call_times, 99), 3),
        }
    return summary


def _interrupted_note(config: RunConfig, outcome: RunOutcome, plan: ResumePlan | None) -> str:
    assert outcome.interrupted is not None
    name = signal_name(outcome.interrupted)
    have = outcome.skipped + outcome.summary["lines"]
    if config.output == "-":
        return f"{name}: stopped after {_lines(have)}; the others have no result"
    total = plan.total if plan is not None else _count_lines(config.input)
    done = f"{have} of {_lines(total)}" if total is not None else _lines(have)
    return (f"{name}: stopped with {done} done in {config.output}; run again with "
            "--resume to run the rest")


def _not_done(items: Iterator[Job | LineError], lines: InputLines,
              schema_lines: set[int]) -> Iterator[Job | LineError]:
    """Drop items of lines that already have a result (`InputLines` hands those on as
    blank lines, which `read_jobs` skips; this keeps that true whatever it does with
    them), noting in `schema_lines` the lines that ask for JSON under a schema."""
    for item in items:
        if item.index in lines.skip:
            continue
        if item.json_schema if isinstance(item, LineError) else (
                item.constraint is not None and item.constraint.kind == "json_schema"):
            schema_lines.add(item.index)
        yield item


def _schema_error(result: dict[str, Any]) -> dict[str, Any]:
    """An error result of a line that asked for JSON under a schema, with `valid: false`
    (no valid output came), so compliance over every schema line counts it."""
    if "valid" in result:
        return result
    out: dict[str, Any] = {}
    for key, value in result.items():
        if key == "error":
            out["valid"] = False
        out[key] = value
    out.setdefault("valid", False)
    return out


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"
