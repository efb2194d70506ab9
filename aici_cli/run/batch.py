"""`run_batch`: the library entry point behind `aici-batch run`.

Reads input lines lazily, runs them on a backend (`aici_cli.run.backends`: this process's
engine, or Ray workers with `--ray`), writes each result as soon as its sequence
finishes, and returns the run summary. The CLI is a thin layer over this. With
`resume`, lines that already have a result are skipped (see `aici_cli.run.resume`); with
`handle_signals`, SIGINT/SIGTERM end the run cleanly (see `Interrupts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from aici_cli.control.guest_tools import RunTools
from aici_cli.core.config import RunConfig
from aici_cli.core.errors import UsageError
from aici_cli.core.job import BadLine, Job
from aici_cli.formats.detect import detect_format
from aici_cli.formats.jobs import Translate, open_input, read_jobs
from aici_cli.formats.openai_batch import BatchFormat, refuse_requests
from aici_cli.models.progress import reporting_to
from aici_cli.run import controller_pin
from aici_cli.run.backends.protocol import Backend
from aici_cli.run.interrupts import Interrupts, signal_name
from aici_cli.run.live_input import LiveInput, may_block
from aici_cli.run.made_with import MODEL_KEYS, OPTION_KEYS, run_record
from aici_cli.run.out_paths import check_writable, run_outputs
from aici_cli.run.result_sink import ResultSink
from aici_cli.run.result_writer import ResultWriter
from aici_cli.run.resume import InputLines, OutputFile, ResumeError, ResumePlan
from aici_cli.run.summary import RunStart, run_facts, write_summary
from aici_cli.run.tools.calls import ToolHost
from aici_cli.run.tools.host import (
    guest_tool_host,
    open_tool_host,
    run_lines,
    served,
    with_restarts,
)
from aici_cli.run.ui import ModelLoading, RunDisplay, failure_line, load_progress, loading_what

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
    engine_deaths: int = 0  # engine processes that died (their lines ran again)

    @property
    def exit_code(self) -> int:
        """128 + signal when interrupted; 3 when the lines ran but the summary file could
        not be written; otherwise 1 when an engine process died (even if every line got
        its result: a crash is worth a look) or any result in the output (a resumed run's
        earlier ones too) is an error, unless `line_errors_ok`, else 0."""
        if self.interrupted is not None:
            return 128 + self.interrupted
        if self.summary_error is not None:
            return 3
        if self.engine_deaths:
            return 1
        failed = self.summary["errors"] or self.earlier_errors
        return 1 if failed and not self.line_errors_ok else 0


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
    ends once the model is ready.

    The set-up runs in order, each step once, and nothing is written to the output
    before the last check has passed: check the paths, open the files, plan the resume,
    pin the controller, start the tools' servers, build the backend, drive.
    """
    stderr = stderr or sys.stderr
    started = RunStart.since(t0)
    config = _checked(config)
    interrupts = Interrupts() if handle_signals else None
    with _RunFiles(config) as files, interrupts or contextlib.nullcontext():
        plan = _resume_plan(config, files)
        config, controller = _pinned(config, plan)
        tools = open_tool_host(config.tools, config.resume)  # a server's fault stops us here
        if tools is not None and not config.quiet:
            stderr.write(f"tools: {served(tools) or 'none'}\n")
        try:
            loading = loading or ModelLoading(stderr, config.quiet, loading_what(config.model))
            with reporting_to(load_progress(stderr, config.quiet)), loading:
                backend = _start_backend(config, guest_tool_host(tools, config.tools))
            started.load_s = time.perf_counter() - started.t0  # imports, model, controller
            try:
                record = _model_record(config, plan, backend, controller)
                return _drive(config, backend, files, plan, record, stderr, interrupts,
                              on_result, started, tools)
            finally:
                backend.close()
        finally:
            if tools is not None:
                tools.close()


def _checked(config: RunConfig) -> RunConfig:
    """Step 1, the paths: `--resume` with files it can read back, outputs writable before
    an hour's work rather than after it. With `--ordered`, the earliest unfinished line
    always holds a row (ordered.py): one line read ahead."""
    if config.resume and config.output == "-":
        raise UsageError("--resume needs -o FILE: results on stdout cannot be read back")
    if config.resume and config.input == "-":
        raise UsageError("--resume needs INPUT to be a file, to check it against the results")
    check_writable(run_outputs(config))
    if config.ordered:
        config = dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, lookahead=1))
    return config


class _RunFiles:
    """Step 2, the files: the input (with a reader thread where it may wait on its
    producer, so that running lines keep decoding meanwhile; unstarted, it costs nothing)
    and the output, opened and locked at once, so that a second run on the same file is
    refused before it loads a model. Nothing in the output changes until `prepare`."""

    def __init__(self, config: RunConfig) -> None:
        self.source = open_input(config.input)
        self.live: LiveInput[Job | BadLine] | None = (
            LiveInput(config.engine.lookahead) if may_block(self.source) else None)
        self.output: OutputFile | None = None
        try:
            self.output = OutputFile(config.output) if config.output != "-" else None
            if self.output is not None and self.output.same_file_as(self.source):
                raise UsageError(f"the output {config.output} is the input file")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> _RunFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.output is not None:
            self.output.close()
        if self.live is not None:
            self.live.close()
        # A reader still blocked in a read of it (after an interrupt) keeps it open:
        # closing would wait for that read. The process's exit closes it.
        if self.source is not sys.stdin.buffer and (self.live is None
                                                    or not self.live.reading):
            self.source.close()


def _resume_plan(config: RunConfig, files: _RunFiles) -> ResumePlan | None:
    """Step 3, with `--resume`: the results already in the output, checked against the
    input."""
    if files.output is None or not config.resume:
        return None
    return files.output.plan(config.input)


def _pinned(config: RunConfig, plan: ResumePlan | None) -> tuple[RunConfig, str | None]:
    """Step 4: the controller pinned to its digest (`run/controller_pin.py`), and a
    resumed run's options checked against its earlier results' before the model loads."""
    config = controller_pin.pin(config)
    controller = controller_pin.controller_digest(config)
    if plan is not None:
        _check_made_with(config, plan, run_record(config, "", controller), OPTION_KEYS)
    return config, controller


def _model_record(config: RunConfig, plan: ResumePlan | None, backend: Backend,
                  controller: str | None) -> dict[str, Any]:
    """What made this run's results (`made_with`), once the backend says which model; a
    resumed run's earlier results are checked against the model too."""
    record = run_record(config, backend.model_name, controller, backend.quantize,
                        getattr(backend, "dtype", ""))
    if plan is not None:
        _check_made_with(config, plan, record, MODEL_KEYS)
    return record


def _start_backend(config: RunConfig, guest_tools: RunTools | None = None) -> Backend:
    """Ray workers with `--ray`; else the engine in a child process (`--engine-process
    child`, the default), or in this one (`inline`, and for a traced run: the tracer
    attaches to the engine and writes its spans from this process). `guest_tools`: what
    the controllers' tool calls reach (a local run's only: Ray runs serve no tools)."""
    from aici_cli.run.tracing import open_tracing, tracing_requested

    if config.ray is None:
        if config.engine_process not in ("child", "inline"):
            raise UsageError(f"engine_process must be 'child' or 'inline', not "
                             f"{config.engine_process!r}")
        if config.engine_process == "inline" or tracing_requested(config):
            from aici_cli.run.backends.local import LocalEngine  # imports torch

            return LocalEngine(config, guest_tools)
        from aici_cli.run.backends.supervised import SupervisedEngine

        return SupervisedEngine(config, guest_tools)

    open_tracing(config)  # refuses --trace with --ray
    from aici_cli.run.distributed import start_ray_backend  # checks that Ray is installed

    return start_ray_backend(config)


def _check_made_with(config: RunConfig, plan: ResumePlan, record: dict[str, Any],
                     keys: set[str]) -> None:
    """Refuse to resume onto results made with other options (only `keys` of `record`),
    unless `--resume-mixed`, which notes them in `plan.mixed` instead."""
    diff = plan.made_otherwise(record, keys)
    if diff is None:
        return
    if not config.resume_mixed:
        raise ResumeError(f"--resume: {config.output} holds results made with {diff}; run "
                          "with the same options, or add --resume-mixed to mix them in one "
                          "file")
    plan.mixed.append(diff)


def _announce_resume(display: RunDisplay, config: RunConfig, plan: ResumePlan) -> None:
    if config.quiet:
        return
    scan = plan.scan
    if scan.torn_line:
        _note(display, f"{config.output}: cut off its incomplete last line (line "
                       f"{scan.torn_line}, {scan.torn_bytes} bytes) left by an interrupted "
                       "run; that input line runs again")
    for diff in plan.mixed:
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


def _drive(config: RunConfig, backend: Backend, files: _RunFiles, plan: ResumePlan | None,
           made_with: dict[str, Any], stderr: IO[str], interrupts: Interrupts | None,
           on_result: Callable[[dict[str, Any]], None] | None,
           started: RunStart, tools: ToolHost | None = None) -> RunOutcome:
    """Step 6: the output prepared (truncated, or its torn tail cut), the input's format
    read from its first line, then every line run on the backend (with its tool rounds
    where the run serves tools), each result written as it finishes (as an OpenAI batch
    output line for an OpenAI batch input), the lines read on the live reader's thread
    where there is one."""
    if files.output is not None:
        files.output.prepare(plan)
    out = files.output.stream() if files.output is not None else sys.stdout
    lines, batch_format, translate = _input_lines(config, files, plan, backend.model_name)
    total = plan.remaining if plan is not None else _count_lines(config.input)
    display = RunDisplay(stderr, total=total, quiet=config.quiet,
                         interval_s=config.progress_interval_s)
    if plan is not None:
        _announce_resume(display, config, plan)
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
        return not sink.full  # --ordered: room to hold results

    def note(message: str) -> None:
        if not config.quiet:
            _note(display, message)

    sink = ResultSink(lines, writer, display, batch_format, on_result, announce, made_with,
                      config.ordered)
    if interrupts is not None:
        interrupts.lines = lines
        interrupts.engine_started = True
    t0 = time.perf_counter()
    try:
        with display:
            jobs = sink.not_done(read_jobs(lines, config.defaults, translate))
            run_lines(backend, jobs, sink, should_admit, note, files.live, tools,
                      config.tools.max_rounds)
    finally:
        sink.flush()
    wall = time.perf_counter() - t0
    # An interrupt that came after every line got its result cost nothing: the run is whole.
    signum = interrupts.signum if interrupts is not None and not lines.all_written else None
    summary = run_facts(with_restarts(backend.summary(config, sink.tally, wall), tools),
                        config, started, signum is not None)
    # Only a supervised engine (backends/supervised.py) has processes that die.
    deaths: int = getattr(backend, "deaths", 0)
    return _outcome(config, summary, signum, plan, display, deaths)


def _input_lines(config: RunConfig, files: _RunFiles, plan: ResumePlan | None,
                 model_name: str) -> tuple[InputLines, BatchFormat | None, Translate]:
    """The input's lines (those a resume found done skipped), its format read from its
    first line, and how a line of another format becomes one of ours."""
    peeked, input_format, why = detect_format(files.source, config.input_format)
    batch_format = BatchFormat(model_name, why) if input_format == "openai" else None
    translate = batch_format.translate if batch_format is not None else refuse_requests(why)
    lines = InputLines(itertools.chain(peeked, files.source),
                       skip=plan.done if plan is not None else None)
    return lines, batch_format, translate


def _outcome(config: RunConfig, summary: dict[str, Any], signum: int | None,
             plan: ResumePlan | None, display: RunDisplay,
             engine_deaths: int = 0) -> RunOutcome:
    """The run's outcome, once its summary is written (`--stats-out`) and shown."""
    outcome = RunOutcome(summary, interrupted=signum,
                         earlier_errors=plan.scan.errors if plan is not None else 0,
                         skipped=len(plan.done) if plan is not None else 0,
                         line_errors_ok=config.exit_zero_on_line_errors,
                         summary_error=write_summary(config.stats_out, summary),
                         engine_deaths=engine_deaths)
    if summary["lines"] == 0 and not outcome.skipped and signum is None:
        display.note(f"aici-batch: warning: {_input_name(config)} has no lines to run "
                     "(it is empty or blank)")
    else:
        display.summary(summary)
        hint = _prepare_hint(config, summary)
        if hint is not None:
            display.note(hint)
    failed = failure_line(summary)
    if failed is not None:
        display.note(failed, even_quiet=True)
    if engine_deaths and config.quiet:  # else each death had its warning
        display.note(f"aici-batch: the engine process died {engine_deaths} "
                     f"{'time' if engine_deaths == 1 else 'times'}; the lines it held ran "
                     "again", even_quiet=True)
    if signum is not None and not config.quiet:
        _note(display, _interrupted_note(config, outcome, plan))
    return outcome


# A run of at least this many passes whose one-token steps could have run compiled, and
# did not (`--compile auto`, no packaged step ready), says how to make them: at ~8 ms
# saved a step (docs/speed.md) that is over a second.
PREPARE_HINT_PASSES = 200


def _prepare_hint(config: RunConfig, summary: dict[str, Any]) -> str | None:
    """The one-line hint at `aici-batch prepare`, where this run would have gained from
    it: `compiled_steps` is 0 where the step is supported but never ran (None where it
    cannot run here: unsupported, no compiler, --compile off, --deterministic)."""
    if config.engine.compile != "auto" or config.ray is not None \
            or summary.get("compiled_steps") != 0 \
            or summary.get("forward_passes", 0) < PREPARE_HINT_PASSES:
        return None
    return (f"aici-batch: this run's {summary['forward_passes']} steps ran eager: "
            "`aici-batch prepare` with its --model, --dtype, --quantize and --batch-size "
            "builds the compiled step once (a few minutes; it waits for the builder a run "
            "starts after its last line), and runs like it then start with it "
            "(docs/speed.md)")


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _input_name(config: RunConfig) -> str:
    return "stdin" if config.input == "-" else config.input


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


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"
