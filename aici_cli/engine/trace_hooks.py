"""The engine's tracing hooks: what it tells a tracer, and the tracer it has by default,
which does nothing.

`Engine.tracer` is `NO_TRACE` unless a run traces (`aici_cli/run/tracing.py` subclasses
`EngineTracer`). The hooks are few and sit off the per-token path: `step` once per
forward pass, `first_token` once per generation, the others once per line. With
`NO_TRACE` each is one call of an empty method, about 0.1 µs against a step of tens of
milliseconds (bench/trace_overhead.py measures both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aici_cli.core.job import Job
    from aici_cli.core.line_stats import StepTimes
    from aici_cli.engine.clock import StepClock
    from aici_cli.engine.generation import Generation
    from aici_cli.engine.intake import Emit


class _Nothing:
    """A reusable context manager that does nothing (cheaper than a new nullcontext)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NOTHING = _Nothing()


class EngineTracer:
    """The hooks, as no-ops. A subclass overrides those it needs."""

    def wrap_emit(self, emit: Emit) -> Emit:
        """The emit the run uses (every result passes through it: a line's end)."""
        return emit

    def admission(self, job: Job) -> Any:
        """A context manager around making an admitted line's controllers (where its
        grammar compiles)."""
        return _NOTHING

    def admitted(self, gen: Generation) -> None:
        """A generation of an admitted line exists; its controller has not started."""

    def first_token(self, gen: Generation) -> None:
        """The generation's first sampled token."""

    def step(self, clock: StepClock, times: StepTimes, gens: list[Generation | None]) -> None:
        """A step ended: its clock marks, its times, the generations it served (None:
        released during the step)."""


NO_TRACE = EngineTracer()
