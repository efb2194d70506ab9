"""`LocalEngine`: the `Backend` of a run in this process, one model and one `Engine`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from aici_cli.control.guest_tools import RunTools
from aici_cli.core.config import RunConfig
from aici_cli.core.job import BadLine, Job
from aici_cli.engine import Emit
from aici_cli.run import threads
from aici_cli.run.backends.build import build_engine, model_meta
from aici_cli.run.live_input import LiveInput
from aici_cli.run.summary import summarize
from aici_cli.run.tally import RunTally


class LocalEngine:
    """The `Backend` of a run in this process: one loaded model and one `Engine`
    (`build_engine`), traced when the run asks for it; its controllers' tool calls go
    to `guest_tools` (a span each, in a traced run)."""

    def __init__(self, config: RunConfig, guest_tools: RunTools | None = None) -> None:
        from aici_cli.run.tracing import open_tracing

        self.tracing = open_tracing(config)  # None unless --trace or an OTLP endpoint
        if self.tracing is not None and guest_tools is not None:
            guest_tools.trace = self.tracing.guest_tool_call
        try:
            threads.apply(config.threads)
            self.built = build_engine(
                config, tools=guest_tools.for_line if guest_tools is not None else None)
            self.engine = self.built.engine
            self.model_name = self.built.lm.name
            self.quantize = self.built.lm.quantize
            self.dtype = str(self.built.lm.dtype).removeprefix("torch.")
            if self.tracing is not None:
                self.tracing.loaded(self.built.lm, self.built.load_started,
                                    self.built.load_ended)
                self.tracing.attach(self.engine)
        except BaseException as e:
            if self.tracing is not None:
                self.tracing.close(failed=e)
            raise

    def run(self, items: Iterator[Job | BadLine], emit: Emit,
            should_admit: Callable[[], bool], note: Callable[[str], None],
            live: LiveInput[Job | BadLine] | None = None) -> None:
        """As `Backend.run`. With `live`, the engine takes what the reader thread has
        ready between steps (a None item: nothing yet) and waits for input only while
        it is idle, when waiting costs nothing."""
        if live is None:
            self.engine.run(items, emit, should_admit)
            return
        live.start(items)
        self.engine.run(live.items(self.engine.idle), emit, should_admit)

    def in_flight(self) -> int:
        return self.engine.in_flight()

    def summary(self, config: RunConfig, tally: RunTally, wall: float) -> dict[str, Any]:
        engine = self.engine
        summary = summarize(config, tally, engine.step_times, wall, model_meta(engine.lm),
                            engine.compile_ms, self.built.call_times)
        summary["threads"] = torch.get_num_threads()  # what torch used, not what was asked
        if engine.compiled_steps is not None:
            summary["compiled_steps"] = engine.compiled_steps
        summary["eager_steps"] = engine.eager_steps
        return summary

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()
