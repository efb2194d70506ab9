"""Host-side tracing of a run as OpenTelemetry spans (`run --trace FILE`, or a collector
named by OTEL_EXPORTER_OTLP_ENDPOINT).

Every guest call passes through the host, so the host traces it; the guest's code knows
nothing of it. The span tree:

    run                                   the whole run (model, batch size, controller)
    ├── load model
    ├── line 7                            admission to result: events `admitted`,
    │   ├── grammar compile               `first_token`, `finished`; GenAI attributes
    │   ├── start                         (gen_ai.request.*, gen_ai.usage.*,
    │   ├── mid-process  (one per call)   gen_ai.response.finish_reasons)
    │   └── fork replay
    ├── execute_tool NAME                 one per tool call (run/tools), the model's or a
    │                                     controller's, its line an attribute
    └── step                              one per forward pass, linked to the lines it
                                          served (kind, rows, tokens, ms per phase)

Spans are made with the times the engine measured (perf_counter, shifted once to the
epoch), handed to a `BatchSpanProcessor`, and encoded and written on its thread: the
step path pays only for building the span objects (bench/trace_overhead.py: a few
percent of a tiny-model step, less on a real one). `--trace` writes OTLP JSON lines
(one `TracesData` per batch, the OTLP file exporter's format); the OTLP/HTTP exporter
reads the standard OTEL_EXPORTER_OTLP_* variables. With tracing off none of this is
imported and the engine's hooks are no-ops (engine/trace_hooks.py).

Torch-free; needs the `trace` extra.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

from aici_cli.core.errors import UsageError
from aici_cli.engine import EngineTracer

if TYPE_CHECKING:
    from aici_cli.core.config import RunConfig
    from aici_cli.core.job import Job
    from aici_cli.core.line_stats import StepTimes
    from aici_cli.engine import Emit, Engine, Generation, StepClock

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# Spans wait here for the exporter's thread; a run makes one per guest call, so the SDK's
# default of 2,048 would drop spans of a busy run.
QUEUE_SPANS = 1 << 18
BATCH_SPANS = 4096


def tracing_requested(config: RunConfig) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return config.trace is not None or any(os.environ.get(v) for v in ENDPOINT_VARS)


def open_tracing(config: RunConfig) -> RunTracer | None:
    """The run's tracer, or None when the run is not traced (no --trace, no endpoint)."""
    if not tracing_requested(config):
        return None
    if config.ray is not None:
        raise UsageError("--trace (or OTEL_EXPORTER_OTLP_ENDPOINT) traces a local run; "
                         "it does not follow lines onto --ray workers yet")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise UsageError("tracing needs OpenTelemetry: pip install 'aici-batch[trace]'") \
            from None
    from aici_cli import __version__

    attributes = {"service.version": __version__}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "aici-batch"
    provider = TracerProvider(resource=Resource.create(attributes))
    stream: IO[str] | None = None
    if config.trace is not None:
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter

        try:
            stream = open(config.trace, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise UsageError(f"cannot write --trace {config.trace}: {e.strerror}") from None
        provider.add_span_processor(BatchSpanProcessor(
            FileSpanExporter(stream=stream), max_queue_size=QUEUE_SPANS,
            max_export_batch_size=BATCH_SPANS))
    if any(os.environ.get(v) for v in ENDPOINT_VARS):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(), max_queue_size=QUEUE_SPANS, max_export_batch_size=BATCH_SPANS))
    return RunTracer(provider, config, stream)


class RunTracer(EngineTracer):
    """The engine's hooks as spans (see the module docstring)."""

    def __init__(self, provider: Any, config: RunConfig, stream: IO[str] | None) -> None:
        from opentelemetry import trace

        from aici_cli import __version__

        self._trace = trace
        self.provider = provider
        self.stream = stream
        self.tracer = provider.get_tracer("aici-batch", __version__)
        # perf_counter seconds -> epoch ns, fixed once so spans keep the engine's spacing.
        self.shift_ns = time.time_ns() - time.perf_counter_ns()
        self.model = config.model or "default"
        attributes: dict[str, Any] = {"aici.batch_size": config.engine.batch_size,
                                      "aici.input": config.input}
        if config.controller is not None:
            attributes["aici.controller"] = config.controller
        self.run = self.tracer.start_span("run", attributes=attributes)
        self.run_context = trace.set_span_in_context(self.run)
        self.lines: dict[int, Any] = {}  # line index -> its open span
        self.links: dict[int, Any] = {}  # line index -> a link to its span (made once)
        self.engine: Engine | None = None
        self.counts = {"lines": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0}
        self.steps = 0

    # --- the run ------------------------------------------------------------------------

    def ns(self, t: float) -> int:
        """A perf_counter time as epoch nanoseconds."""
        return int(t * 1e9) + self.shift_ns

    def loaded(self, lm: Any, started: float, ended: float) -> None:
        """The model is loaded: it took from `started` until `ended` (`perf_counter`s)."""
        self.model = lm.name
        self.run.set_attribute("gen_ai.request.model", lm.name)
        self.run.set_attribute("aici.device", str(lm.device))
        self.tracer.start_span("load model", context=self.run_context,
                               start_time=self.ns(started)).end(self.ns(ended))

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        engine.tracer = self

    def close(self, failed: BaseException | None = None) -> None:
        """End the run span, flush every span and close the file."""
        for key, value in self.counts.items():
            name = {"input_tokens": "gen_ai.usage.input_tokens",
                    "output_tokens": "gen_ai.usage.output_tokens"}.get(key, f"aici.{key}")
            self.run.set_attribute(name, value)
        self.run.set_attribute("aici.steps", self.steps)
        for span in self.lines.values():  # lines an interrupt left unfinished
            span.add_event("unfinished")
            span.end()
        self.lines.clear()
        if failed is not None:
            self._error(self.run, type(failed).__name__, str(failed))
        self.run.end()
        self.provider.shutdown()  # flushes the batch processors
        if self.stream is not None:
            self.stream.close()

    # --- the engine's hooks -------------------------------------------------------------

    def wrap_emit(self, emit: Emit) -> Emit:
        def traced(result: dict[str, Any]) -> None:
            self._finished(result)
            emit(result)

        return traced

    @contextlib.contextmanager
    def admission(self, job: Job) -> Iterator[None]:
        span = self._line(job)
        engine = self.engine
        compiled = len(engine.compile_ms) if engine is not None else 0
        yield
        if engine is not None and len(engine.compile_ms) > compiled:
            end = time.perf_counter()
            start = end - engine.compile_ms[-1] / 1000.0
            kind = job.constraint.kind if job.constraint is not None else "none"
            self.tracer.start_span(
                "grammar compile", context=self._trace.set_span_in_context(span),
                start_time=self.ns(start), attributes={"aici.grammar.kind": kind},
            ).end(self.ns(end))

    def admitted(self, gen: Generation) -> None:
        span = self._line(gen.job)
        span.add_event("admitted", {"aici.sample": gen.sample},
                       timestamp=self.ns(gen.started))
        controller = gen.controller
        if controller is not None and hasattr(controller, "trace"):
            controller.trace = self._call_trace(span)

    def first_token(self, gen: Generation) -> None:
        span = self.lines.get(gen.job.index)
        if span is not None:
            span.add_event("first_token", {"aici.sample": gen.sample},
                           timestamp=self.ns(time.perf_counter()))

    def step(self, clock: StepClock, times: StepTimes, gens: list[Generation | None]) -> None:
        served: dict[int, Any] = {}
        for gen in gens:
            if gen is not None and gen.job.index not in served:
                link = self.links.get(gen.job.index)
                if link is not None:
                    served[gen.job.index] = link
        marks = clock.marks
        self.tracer.start_span(
            "step", context=self.run_context, start_time=self.ns(marks["start"]),
            links=list(served.values()),
            attributes={
                "aici.step.index": self.steps, "aici.step.kind": times.kind,
                "aici.step.rows": times.rows, "aici.step.tokens": times.tokens,
                "aici.step.lines": sorted(served),
                "aici.step.forward_ms": round(times.forward_ms, 3),
                "aici.step.mask_ms": round(times.mask_ms, 3),
                "aici.step.controller_ms": round(times.controller_ms, 3),
                "aici.step.sample_ms": round(times.sample_ms, 3),
            },
        ).end(self.ns(marks["committed"]))
        self.steps += 1

    # --- the tools' hook (run/tools/loop.py) ---------------------------------------------

    def tool_call(self, index: int, name: str, outcome: Any, caller: str = "model") -> None:
        """A span per tool call (a `CallOutcome`), in the GenAI conventions'
        `execute_tool`. A line's span ends with each round (the engine's result), so the
        call's parent is the run, and its line is an attribute; `aici.tool.caller` says
        who called: the model (run/tools/loop.py) or the line's controller (aici:tools).
        Thread-safe: a controller's call is traced on the tools' thread."""
        attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                      "aici.line.index": index, "aici.tool.server": outcome.server,
                      "aici.tool.ms": outcome.ms, "aici.tool.caller": caller}
        span = self.tracer.start_span(f"execute_tool {name}", context=self.run_context,
                                      start_time=self.ns(outcome.t0), attributes=attributes)
        if outcome.error is not None:
            self._error(span, outcome.error[0], outcome.error[1])
        elif outcome.is_error:
            span.set_attribute("error.type", "tool_error")
        span.end(self.ns(outcome.t1))

    def guest_tool_call(self, index: int, name: str, outcome: Any) -> None:
        """`tool_call` of a call a controller made (`aici:tools`)."""
        self.tool_call(index, name, outcome, caller="controller")

    # --- spans of a line ----------------------------------------------------------------

    def _line(self, job: Job) -> Any:
        span = self.lines.get(job.index)
        if span is None:
            span = self.tracer.start_span(f"line {job.index}", context=self.run_context,
                                          attributes=self._request(job))
            self.lines[job.index] = span
            self.links[job.index] = self._trace.Link(span.get_span_context())
        return span

    def _request(self, job: Job) -> dict[str, Any]:
        """The line's request, in OpenTelemetry's GenAI semantic conventions."""
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if job.messages is not None else "text_completion",
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": job.max_tokens,
            "gen_ai.request.temperature": job.sampling.temperature,
            "gen_ai.request.top_p": job.sampling.top_p,
            "gen_ai.request.seed": job.sampling.seed,
            "aici.line.index": job.index,
            "aici.line.id": job.id,
        }
        if job.sampling.top_k > 0:
            attributes["gen_ai.request.top_k"] = job.sampling.top_k
        if job.sampling.frequency_penalty:
            attributes["gen_ai.request.frequency_penalty"] = job.sampling.frequency_penalty
        if job.sampling.presence_penalty:
            attributes["gen_ai.request.presence_penalty"] = job.sampling.presence_penalty
        if job.stop:
            attributes["gen_ai.request.stop_sequences"] = list(job.stop)
        if job.n > 1:
            attributes["gen_ai.request.choice.count"] = job.n
        if job.constraint is not None:
            attributes["aici.constraint"] = job.constraint.kind
        return attributes

    def _call_trace(self, line: Any) -> Any:
        context = self._trace.set_span_in_context(line)

        def call(name: str, t0: float, t1: float,
                 attributes: dict[str, Any] | None = None) -> None:
            self.tracer.start_span(name, context=context, start_time=self.ns(t0),
                                   attributes=attributes).end(self.ns(t1))

        return call

    def _finished(self, result: dict[str, Any]) -> None:
        index = result.get("index")
        span = None
        if isinstance(index, int):
            span = self.lines.pop(index, None)
            self.links.pop(index, None)
        if span is None:  # a line that never got a row: bad input, answered at once
            span = self.tracer.start_span(f"line {index}", context=self.run_context,
                                          attributes={"aici.line.index": index,
                                                      "aici.line.id": result.get("id", "")})
        reason = result.get("finish_reason", "")
        stats = result.get("stats") or {}
        choices = result.get("choices")
        reasons = ([c.get("finish_reason", "") for c in choices] if isinstance(choices, list)
                   else [reason])
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
        span.set_attribute("aici.finish_reason", reason)
        input_tokens, output_tokens = int(stats.get("prompt_tokens", 0)), int(
            stats.get("output_tokens", 0))
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        for key in ("cached_tokens", "ff_tokens", "forward_passes", "ttft_ms"):
            if key in stats:
                span.set_attribute(f"aici.{key}", stats[key])
        self.counts["lines"] += 1
        self.counts["input_tokens"] += input_tokens
        self.counts["output_tokens"] += output_tokens
        if reason == "error":
            self.counts["errors"] += 1
            error = result.get("error") or {}
            self._error(span, str(error.get("type", "error")), str(error.get("message", "")))
        span.add_event("finished", {"aici.finish_reason": reason})
        span.end()

    def _error(self, span: Any, kind: str, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, message[:500]))
