"""The engine: lines in, one packed forward pass a step, results out.

This module is the engine's surface: the rest of the package imports these names from
here and never a module inside (import-linter's "The engine's surface" contract). Inside,
the orchestration sits on two sub-packages that never see a `Generation`:

    engine.py               the decode loop: schedule, run the model, update, per step
    scheduler.py            rows, queues and the `StepPlan` of each step
    model_runner.py         a `StepPlan` in, a `StepOutput` out: the pass, masks, the sampler
    update.py               a `StepOutput` applied to the generations it planned
    plan.py                 `StepPlan` and `StepOutput`, what passes between those three
    rows.py                 the row table: which generation holds each cache row
    intake.py               admission: a line read ahead, tokenized, given its controllers
    launch.py               an admitted line's generations (its samples, scored choices)
    generation.py           `Generation`: one line, sample, scored row or branch
    decisions.py            every controller directive, applied in one place
    branches.py             a forking line's branches and their results
    draft.py                prompt-lookup drafts of greedy rows
    scoring.py              choices scored by log-likelihood
    stops.py                stop tokens, stop strings, `max_tokens`
    finishing.py            what becomes of a finished generation
    result_line.py          a finished generation's result line
    retry.py                another attempt at a relaxed schema's line
    deterministic_check.py  whether this machine keeps `--deterministic`'s promise
    clock.py                a step's timing marks
    trace_hooks.py          what the engine tells a tracer
    forward/                the pass: inputs, attention, the KV cache, the compiled step,
                            the deterministic mode's kernels
    logits/                 masks, the masked projection, logit rules, the sampler, logprobs

The names load on first use (PEP 562), so that a process that only names a type here
(the run's own process, which drives an engine in a child) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aici_cli.engine.clock import StepClock
    from aici_cli.engine.engine import Engine
    from aici_cli.engine.forward.compiled import step_row_counts
    from aici_cli.engine.forward.step_builds import builders_turn
    from aici_cli.engine.generation import Generation
    from aici_cli.engine.intake import ControllerFactory, Emit, LineIntake
    from aici_cli.engine.rows import Prepared
    from aici_cli.engine.trace_hooks import NO_TRACE, EngineTracer

_WHERE = {
    "Engine": "engine", "LineIntake": "intake", "ControllerFactory": "intake",
    "Emit": "intake", "Prepared": "rows", "Generation": "generation", "StepClock": "clock",
    "EngineTracer": "trace_hooks", "NO_TRACE": "trace_hooks",
    "step_row_counts": "forward.compiled", "builders_turn": "forward.step_builds",
}

__all__ = ["NO_TRACE", "ControllerFactory", "Emit", "Engine", "EngineTracer", "Generation",
           "LineIntake", "Prepared", "StepClock", "builders_turn", "step_row_counts"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
