"""`run_batch`: the library entry point behind `aici-batch run`.

Reads input lines lazily, runs them on the engine, writes each result as soon as its
sequence finishes, and returns the run summary. The CLI is a thin layer over this.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aici_cli.engine.loop import ControllerFactory, Engine, EngineConfig
from aici_cli.jobs import Job, JobDefaults, ResultWriter, UsageError, open_input, read_jobs
from aici_cli.models import load_model
from aici_cli.stats import RunTally, percentile
from aici_cli.ui import RunDisplay


@dataclass(frozen=True)
class RunConfig:
    input: str  # path or "-"
    output: str = "-"  # path or "-"
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    defaults: JobDefaults = field(default_factory=JobDefaults)
    stats_out: str | None = None
    quiet: bool = False
    controller: str | None = None  # path of a .wasm controller component
    controller_arg: str = ""  # its argument, for lines without their own `controller_arg`
    controller_call_ms: int = 50  # deadline per guest call


@dataclass
class RunOutcome:
    summary: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return 1 if self.summary["errors"] else 0


def wasm_factory(config: RunConfig, engine: Engine,
                 call_times: list[float]) -> ControllerFactory:
    """A factory giving every job its own runner of the `--controller` component."""
    from aici_cli.control.base import ControllerError
    from aici_cli.control.wasm import ComponentError, ControllerComponent, Limits
    from aici_cli.control.wasm_controller import TokenizerServices, WasmController

    assert config.controller is not None
    try:
        component = ControllerComponent.load(
            config.controller, Limits(call_ms=config.controller_call_ms)
        )
    except ComponentError as e:
        raise UsageError(str(e)) from None
    lm = engine.lm
    services = TokenizerServices(
        lm.tokenizer, lm.vocab_size, min(lm.eos_token_ids), engine.compiler.tokenizer
    )

    def factory(job: Job) -> WasmController:
        if job.constraint is not None and job.constraint != config.defaults.constraint:
            raise ControllerError(
                "invalid_line", "a line's json_schema/regex/choices cannot be combined with "
                "--controller; the controller decides the constraints",
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


def run_batch(config: RunConfig, stderr: IO[str] | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> RunOutcome:
    """Run every input line to exactly one result line. Raises `UsageError`/`ModelError`
    for problems that stop the whole run before any line is read."""
    stderr = stderr or sys.stderr
    source = open_input(config.input)
    total = _count_lines(config.input)
    lm = load_model(config.model, config.device, config.dtype)
    out: IO[str]
    if config.output == "-":
        out = sys.stdout
    else:
        try:
            out = open(config.output, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as e:
            raise UsageError(f"cannot write {config.output}: {e.strerror}") from None
    writer = ResultWriter(out)
    tally = RunTally()
    engine = Engine(lm, config.engine)
    call_times: list[float] = []  # ms of every wasm guest call in the run
    if config.controller is not None:
        engine.controller_factory = wasm_factory(config, engine, call_times)
    display = RunDisplay(stderr, total=total, quiet=config.quiet)
    t0 = time.perf_counter()

    def emit(result: dict[str, Any]) -> None:
        writer.write(result)
        tally.add(result)
        display.advance(result)
        if on_result is not None:
            on_result(result)

    try:
        with display:
            engine.run(read_jobs(source, config.defaults), emit)
    finally:
        if out is not sys.stdout:
            out.close()
        if source is not sys.stdin.buffer:
            source.close()
    wall = time.perf_counter() - t0
    meta = {
        "model": lm.name,
        "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "batch_size": config.engine.batch_size,
    }
    summary = tally.summary(engine.step_times, wall, meta)
    compiled = engine.compile_ms
    if compiled:
        summary["grammar_compile_ms"] = {
            "grammars": len(compiled),
            "p50": round(percentile(compiled, 50), 3),
            "p99": round(percentile(compiled, 99), 3),
        }
    if config.controller is not None:
        summary["guest_call_ms"] = {
            "calls": len(call_times),
            "p50": round(percentile(call_times, 50), 3),
            "p99": round(percentile(call_times, 99), 3),
        }
    if config.stats_out:
        Path(config.stats_out).write_text(json.dumps(summary, indent=2) + "\n")
    display.summary(summary)
    return RunOutcome(summary)
