"""The engine: lines in, one packed forward pass a step, results out.

This module is the engine's surface: the rest of the package imports these names from
here and never a module inside (import-linter's "The engine's surface" contract). Inside,
the orchestration (`engine.py`, `scheduler.py`, `model_runner.py`, `update.py`, ...) sits on
two sub-packages that never see a `Generation`: `forward/` (the pass: inputs, attention,
the KV cache, the compiled step) and `logits/` (masks, logit rules, sampling, logprobs).

The names load on first use (PEP 562), so that a process that only names a type here
(the run's own process, which drives an engine in a child) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aici_cli.engine.clock import StepClock
    from aici_cli.engine.engine import Engine
    from aici_cli.engine.generation import Generation
    from aici_cli.engine.intake import ControllerFactory, Emit, LineIntake
    from aici_cli.engine.rows import Prepared
    from aici_cli.engine.trace_hooks import NO_TRACE, EngineTracer

_WHERE = {
    "Engine": "engine", "LineIntake": "intake", "ControllerFactory": "intake",
    "Emit": "intake", "Prepared": "rows", "Generation": "generation", "StepClock": "clock",
    "EngineTracer": "trace_hooks", "NO_TRACE": "trace_hooks",
}

__all__ = ["NO_TRACE", "ControllerFactory", "Emit", "Engine", "EngineTracer", "Generation",
           "LineIntake", "Prepared", "StepClock"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
