"""The step's three parts through their own entry points: the scheduler's frozen plan in,
the runner's output out, the update applied; the runner leaves every piece of
scheduling state as it found it, and nothing is launched while a step runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from factories import job_factory

from aici_cli.engine.clock import StepClock
from aici_cli.engine.loop import Engine
from aici_cli.engine.plan import StepPlan
from aici_cli.models.load import LoadedModel
from aici_cli.vocabulary.config import EngineConfig
from aici_cli.vocabulary.constraint import Constraint

job = job_factory(lambda index: dict(id=str(index), prompt=f"Line {index} says"),
                  max_tokens=6)


def scheduling_state(engine: Engine) -> tuple[Any, ...]:
    table = engine.scheduler.table
    return (list(table.gens), list(table.waiting), list(table.ahead),
            [h.tolist() for h in table.held], table.live_cap, list(engine.finishing.retries))


def test_plan_run_update_by_hand(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(batch_size=3, draft_tokens=0))
    emitted: list[dict[str, Any]] = []
    engine.finishing.emit = emitted.append
    lines = [job(1, constraint=Constraint("regex", "[0-9]{3}")), job(2), job(3, n=2)]
    engine.scheduler.read_ahead(iter(lines), emitted.append)
    engine.scheduler.admit(emitted.append, new_lines=True)
    assert engine.in_flight() == 3 and not emitted
    engine.runner.open()
    try:
        plan = engine.scheduler.plan()
        assert isinstance(plan, StepPlan) and plan.kind == "prefill"
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.kind = "decode"  # type: ignore[misc]
        before = scheduling_state(engine)
        fed = [(g.length, list(g.pending), list(g.output)) for g in plan.gens if g is not None]
        out = engine.runner.execute(plan, StepClock())
        assert scheduling_state(engine) == before  # the runner schedules nothing
        # ... and feeds nothing into a generation: the update does.
        assert [(g.length, list(g.pending), list(g.output))
                for g in plan.gens if g is not None] == fed
        feeding = [k for k, g in enumerate(plan.gens) if g is not None]
        assert [k for k, _ in out.sampled] == feeding and 0 in feeding
        applied = engine.update.apply(plan, out)
        assert applied.done == feeding and applied.forking == []
        for k, token in out.sampled:
            gen = plan.gens[k]
            assert gen is not None and gen.output[:1] == [token]
            assert gen.pending == gen.output[-1:] and gen.length == len(gen.prompt)
        constrained = plan.gens[0]
        assert constrained is not None
        assert lm.tokenizer.decode(constrained.output[:1]).isdigit()
    finally:
        engine.runner.close()


def test_a_retry_waits_for_the_next_plan(lm: LoadedModel) -> None:
    """A relaxed line whose output does not validate is queued by the finishing step and
    launched only when the scheduler next admits: never inside the step that ended it."""
    never_valid = {"type": "string", "maxLength": 4, "pattern": "^(?=x)y"}  # relaxed: any
    line = job(1, constraint=Constraint("json_schema", never_valid), schema_fallback="relax",
               max_tokens=12)
    engine = Engine(lm, EngineConfig(batch_size=1, draft_tokens=0, schema_retries=1))
    stepping = [False]
    launched: list[bool] = []  # whether a step was running at each launch
    launch, step = engine.scheduler.launcher.launch, engine._step

    def counting(*args: Any) -> Any:
        launched.append(stepping[0])
        return launch(*args)

    def flagged() -> None:
        stepping[0] = True
        try:
            step()
        finally:
            stepping[0] = False

    # Inside the engine: which part runs when is what this test is about.
    engine.scheduler.launcher.launch = counting  # type: ignore[method-assign]
    engine._step = flagged  # type: ignore[method-assign]
    results: list[dict[str, Any]] = []
    engine.run([line], results.append)
    (result,) = results
    assert result["attempts"] == 2 and launched == [False, False]


def test_update_alone_changes_generations_and_never_rows(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(batch_size=2, draft_tokens=0))
    engine.finishing.emit = lambda r: None
    engine.scheduler.read_ahead(iter([job(1, max_tokens=1), job(2)]), lambda r: None)
    engine.scheduler.admit(lambda r: None, new_lines=True)
    engine.runner.open()
    try:
        plan = engine.scheduler.plan()
        out = engine.runner.execute(plan, StepClock())
        held = [np.array(h) for h in engine.scheduler.table.held]
        rows = list(engine.scheduler.table.gens)
        applied = engine.update.apply(plan, out)
        assert list(engine.scheduler.table.gens) == rows  # retiring is the engine's
        assert all((a == b).all() for a, b in zip(held, engine.scheduler.table.held))
        first = plan.gens[0]
        assert first is not None and first.finish is not None  # max_tokens 1: done
        assert 0 in applied.done
    finally:
        engine.runner.close()
