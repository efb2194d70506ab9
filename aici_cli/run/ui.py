"""What a run shows on stderr: the model loading, progress (a bar on a terminal, a line
every few seconds elsewhere: a CI log, a pipe), a summary table at the end, and one line
counting the failed lines.

stdout carries results only. `quiet` silences all of this but the failed-lines line
(errors still reach stderr through the CLI).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from aici_cli.core.line_stats import STEP_FIELDS
from aici_cli.models.progress import LoadProgress, SilentProgress
from aici_cli.run.tally import compliance_rows, outcome_rows

T = TypeVar("T")


def load_progress(stream: IO[str], quiet: bool) -> LoadProgress:
    """How getting the model ready shows on stderr: nothing with `quiet`."""
    return SilentProgress() if quiet else ConsoleProgress(Console(file=stream, stderr=True))


class ConsoleProgress(LoadProgress):
    """The slow steps of getting a model ready (a GGUF conversion, once per model and
    machine) in the run's own style: a line saying what starts, and on a terminal one bar
    while it goes (a CI log gets the line only)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def note(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def steps(self, items: Iterable[T], total: int, description: str) -> Iterator[T]:
        if not self.console.is_terminal:
            yield from items
            return
        with Progress(TextColumn("[bold]aici-batch"), TextColumn(escape(description)),
                      BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=self.console, transient=True) as bar:
            task = bar.add_task("load", total=total or None)
            for item in items:
                yield item
                bar.advance(task)


def loading_what(model: str | None) -> str:
    """What start-up gets ready, as the loading note names it."""
    return f"model {model}" if model else "the default model"


class ModelLoading:
    """Start-up, said on stderr: imports and a model take seconds, and a log or a terminal
    would show nothing meanwhile.

    `start` comes first (the CLI calls it before its heavy imports): on a terminal a
    spinner turns, transient, so that an error before the model loads (a resume refused,
    say) is still its one line alone. `begin`, as the model starts loading, says so in a
    line (at once if start-up has already taken `after_s`, else once it has; a log gets
    the line only), and `finish` says when the model is ready, with the time since
    `start`. As a context manager, `begin` and `finish`."""

    def __init__(self, stream: IO[str], quiet: bool, what: str, after_s: float = 0.5,
                 console: Console | None = None) -> None:
        self.console = console or Console(file=stream, stderr=True)
        self.quiet = quiet
        self.what = what
        self.after_s = after_s
        self._said = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._spinner: Any = None
        self._t0: float | None = None

    def start(self) -> ModelLoading:
        if self._t0 is not None:
            return self
        self._t0 = time.perf_counter()
        if not self.quiet and self.console.is_terminal:
            self._spinner = self.console.status(f"aici-batch: loading {escape(self.what)}...")
            self._spinner.start()
        return self

    def _say(self) -> None:
        with self._lock:
            if self._timer is None:  # already over
                return
            self._said = True
            self.console.print(f"aici-batch: loading {self.what}...", markup=False,
                               highlight=False, soft_wrap=True)

    def _stop_spinner(self) -> None:
        if self._spinner is not None:
            self._spinner.stop()  # transient: the line is erased
            self._spinner = None

    def begin(self) -> ModelLoading:
        self.start()
        self._stop_spinner()
        if self.quiet or self._timer is not None:
            return self
        waited = time.perf_counter() - (self._t0 or 0.0)
        self._timer = threading.Timer(max(0.0, self.after_s - waited), self._say)
        self._timer.daemon = True
        self._timer.start()
        return self

    def finish(self, ok: bool = True) -> None:
        self._stop_spinner()
        seconds = time.perf_counter() - (self._t0 or time.perf_counter())
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            said, self._said = self._said, False
        if said and ok:
            self.console.print(f"aici-batch: {self.what} ready in {seconds:.1f} s",
                               markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> ModelLoading:
        return self.begin()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.finish(ok=exc_type is None)


class RunDisplay:
    """Progress while a run goes, the summary table after it. A context manager.

    On a terminal, a bar; elsewhere, with `interval_s` > 0, one line every `interval_s`
    seconds from a timer thread (so a long line still shows the run is alive), and none
    with `quiet`."""

    def __init__(self, stream: IO[str], total: int | None, quiet: bool = False,
                 console: Console | None = None, interval_s: float = 0.0) -> None:
        self.console = console or Console(file=stream, stderr=True)
        self.quiet = quiet
        self.total = total
        self.tokens = 0
        self.done = 0
        self.progress: Progress | None = None
        self.task: Any = None
        self.interval_s = interval_s
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        if not quiet and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]aici-batch"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[errors]} errors"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("run", total=total, tps="-", errors=0)
        self.errors = 0

    def __enter__(self) -> RunDisplay:
        self._t0 = time.perf_counter()
        if self.progress is not None:
            self.progress.start()
        elif not self.quiet and self.interval_s > 0:
            self._ticker = threading.Thread(target=self._tick, name="aici-progress",
                                            daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.console.print(self.progress_line(), markup=False, highlight=False,
                               soft_wrap=True)

    def progress_line(self) -> str:
        """`aici-batch: 120/1000 lines, 35.2 tok/s, 3 errors, 1m20s`: progress in a log."""
        elapsed = time.perf_counter() - self._t0
        of = f"/{self.total}" if self.total is not None else ""
        tps = self.tokens / elapsed if elapsed > 0 else 0.0
        errors = f"{self.errors} error{'' if self.errors == 1 else 's'}"
        minutes, seconds = divmod(int(elapsed), 60)
        shown = f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
        return f"aici-batch: {self.done}{of} lines, {tps:.1f} tok/s, {errors}, {shown}"

    def advance(self, result: dict[str, Any]) -> None:
        self.tokens += int(result.get("stats", {}).get("output_tokens", 0))
        self.errors += result.get("finish_reason") == "error"
        self.done += 1
        if self.progress is None:
            return
        elapsed = self.progress.tasks[0].elapsed or 0.0
        tps = f"{self.tokens / elapsed:.1f}" if elapsed > 0 else "-"
        self.progress.update(self.task, advance=1, tps=tps, errors=self.errors)

    def summary(self, summary: dict[str, Any]) -> None:
        if self.quiet:
            return
        self.console.print(summary_table(summary))

    def note(self, message: str, even_quiet: bool = False) -> None:
        if even_quiet or not self.quiet:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)


def failure_line(summary: dict[str, Any]) -> str | None:
    """One line for a run in which lines failed: how many, by type, and the first
    message (`aici-batch: 8 of 10 lines failed (invalid_line 6, empty_prompt 2); first:
    line 2: ...`); None when none failed."""
    errors = summary.get("errors", 0)
    if not errors:
        return None
    types = ", ".join(f"{t} {n}" for t, n in summary.get("error_types", {}).items())
    first = summary.get("first_error")
    shown = f"; first: {first['message']}" if first else ""
    lines = summary.get("lines", 0)
    return (f"aici-batch: {errors} of {lines} line{'' if lines == 1 else 's'} failed "
            f"({types}){shown}")


def _cached(summary: dict[str, Any]) -> str:
    """`cached / prompt (rate)`: the prefill the prefix cache saved."""
    cached, prompt = summary.get("cached_tokens", 0), summary.get("prompt_tokens", 0)
    return f"{cached}/{prompt} ({cached / prompt:.0%})" if prompt else "0"


def one_token_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The one-token steps compiled, and those run eager by why (where counted)."""
    eager = summary.get("eager_steps")
    if summary.get("compiled_steps") is None and not eager:
        return []
    why = ", ".join(f"{n} {reason}" for reason, n in (eager or {}).items())
    return [("one-token steps compiled / eager",
             f"{summary.get('compiled_steps') or 0} / {sum((eager or {}).values())}"
             + (f" ({why})" if why else ""))]


def summary_table(summary: dict[str, Any]) -> Table:
    """The run summary as a rich table (also used by `aici-batch report`)."""
    table = Table(title="aici-batch run", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    per_token = summary.get("row_passes_per_output_token",
                            summary.get("forward_passes_per_token"))
    rows = outcome_rows(summary)
    rows += [
        ("output tokens", str(summary["output_tokens"])),
        ("fast-forwarded tokens", str(summary["ff_tokens"])),
        ("prompt tokens from the prefix cache", _cached(summary)),
        ("forward passes (batched)", str(summary.get("batched_forward_passes",
                                                     summary["forward_passes"]))),
        ("row passes per output token",
         f"{per_token:.4f}" if per_token is not None else "- (no tokens generated)"),
    ]
    if "load_s" in summary:
        rows.append(("start-up (model load)", f"{summary['load_s']:.2f} s"))
    if summary.get("first_result_s") is not None:
        rows.append(("first result, from the start", f"{summary['first_result_s']:.2f} s"))
    rows += one_token_rows(summary)
    rows.append(("wall time (the lines)", f"{summary['wall_s']:.2f} s"))
    if summary["output_tokens"] or not summary["lines"]:
        rows.append(("tokens/s", f"{summary['tokens_per_s']:.1f}"))
    if "lines_per_s" in summary:
        rows.append(("lines/s", f"{summary['lines_per_s']:.2f}"))
    if "threads" in summary:
        rows.append(("CPU threads", str(summary["threads"])))
    if summary.get("answered"):
        rows.append(("accuracy", f"{summary['accuracy']:.1%} of {summary['answered']}"))
    rows += compliance_rows(summary)
    if "guest_call_ms" in summary:
        g = summary["guest_call_ms"]
        rows.append(("controller call p50 / p99", f"{g['p50']:.3f} / {g['p99']:.3f} ms"))
    for worker in summary.get("ray", {}).get("workers", []):
        rows.append((f"worker {worker['worker']} ({worker['node']})",
                     f"{worker['lines_per_s']:.2f} lines/s, {worker['tokens_per_s']:.1f} tok/s"))
    for name, value in rows:
        table.add_row(name, value)
    steps = summary.get("steps", {})
    for name in STEP_FIELDS:
        if name in steps:
            s = steps[name]
            table.add_row(f"step {name} p50 / p99", f"{s['p50']:.2f} / {s['p99']:.2f}")
    return table
