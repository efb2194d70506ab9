"""The step's three parts through their own entry points: the scheduler's frozen plan in,
the runner's output out, the scheduler's update applied; the plan is data (no
generation reaches the runner), the runner leaves every piece of scheduling state and
every generation as it found it, and nothing is launched while a step runs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from factories import job_factory

from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.engine import Engine, Generation
from aici_cli.engine.plan import StepOutput, StepPlan
from aici_cli.models.load import LoadedModel

job = job_factory(lambda index: dict(id=str(index), prompt=f"Line {index} says"),
                  max_tokens=6)


def scheduling_state(engine: Engine) -> tuple[Any, ...]:
    scheduler = engine.scheduler
    table = scheduler.table
    return (list(table.gens), list(scheduler.waiting), list(scheduler.ahead),
            [h.tolist() for h in table.held], table.live_cap, list(scheduler.retries))


def generations_state(engine: Engine) -> list[tuple[Any, ...]]:
    return [(g.length, list(g.pending), list(g.output), g.finish)
            for g in engine.scheduler.table.gens if g is not None]


def holds_a_generation(value: Any) -> bool:
    """Whether `value` is, or holds (in a container or a dataclass), a Generation."""
    if isinstance(value, Generation):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(holds_a_generation(v) for v in value)
    if isinstance(value, dict):
        return any(holds_a_generation(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds_a_generation(getattr(value, f.name))
                   for f in dataclasses.fields(value))
    return False


def test_schedule_execute_update_by_hand(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(batch_size=3, draft_tokens=0))
    emitted: list[dict[str, Any]] = []
    lines = [job(1, constraint=Constraint("regex", "[0-9]{3}")), job(2), job(3, n=2)]
    scheduler = engine.scheduler
    scheduler.read_ahead(iter(lines), emitted.append)
    assert scheduler.admit(emitted.append, new_lines=True) == []
    assert engine.in_flight() == 3 and not emitted
    engine.runner.open()
    try:
        plan = scheduler.schedule(input_closed=True)
        assert isinstance(plan, StepPlan) and plan.kind == "prefill"
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.kind = "decode"  # type: ignore[misc]
        assert not holds_a_generation(plan)  # the runner gets data
        rows = list(scheduler.table.gens)
        before, fed = scheduling_state(engine), generations_state(engine)
        out = engine.runner.execute_model(plan)
        assert isinstance(out, StepOutput)
        assert scheduling_state(engine) == before  # the runner schedules nothing
        assert generations_state(engine) == fed  # ... and feeds nothing into a generation
        feeding = [k for k, chunk in enumerate(plan.chunks) if chunk]
        assert [k for k, _ in out.sampled] == feeding and 0 in feeding
        finished = scheduler.update_from_output(plan, out)
        assert not emitted  # results are the engine's to make, after the update
        for k in feeding:  # a finished row is released, the others go on in theirs
            gen = rows[plan.span[k]]
            assert gen is not None
            held = scheduler.table.gens[plan.span[k]]
            assert (gen in finished) == (gen.finish is not None) == (held is None)
        for k, token in out.sampled:
            gen = rows[plan.span[k]]
            assert gen is not None and gen.output[:1] == [token] and not gen.forking
            assert gen.pending == gen.output[-1:] and gen.length == len(gen.prompt)
        constrained = rows[plan.span[0]]
        assert constrained is not None
        assert lm.tokenizer.decode(constrained.output[:1]).isdigit()
        assert len(engine.step_times) == 1 and engine.step_times[0].kind == "prefill"
    finally:
        engine.runner.close()


def test_a_retry_waits_for_the_next_plan(lm: LoadedModel) -> None:
    """A relaxed line whose output does not validate is queued again when it finishes,
    and launched only when the scheduler next admits, before the next plan: never inside
    the step that ended it."""
    never_valid = {"type": "string", "maxLength": 4, "pattern": "^(?=x)y"}  # relaxed: any
    line = job(1, constraint=Constraint("json_schema", never_valid), schema_fallback="relax",
               max_tokens=12)
    engine = Engine(lm, EngineConfig(batch_size=1, draft_tokens=0, schema_retries=1))
    scheduler = engine.scheduler
    events: list[tuple[str, int]] = []  # (what, next attempts queued then)

    def recorded(name: str, call: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            events.append((name, len(scheduler.retries)))
            return call(*args, **kwargs)
        return wrapped

    for name in ("admit", "schedule", "update_from_output"):
        setattr(scheduler, name, recorded(name, getattr(scheduler, name)))
    results: list[dict[str, Any]] = []
    engine.run([line], results.append)
    (result,) = results
    assert result["attempts"] == 2
    # Steps are schedule then update, nothing between; no plan finds an attempt queued,
    # and exactly one admission launches one.
    names = [name for name, _ in events]
    steps = [i for i, name in enumerate(names) if name == "schedule"]
    assert steps and all(names[i + 1] == "update_from_output" for i in steps)
    assert all(queued == 0 for name, queued in events if name == "schedule")
    assert [queued for name, queued in events if name == "admit" and queued] == [1]


def test_update_releases_finished_rows_and_keeps_their_keys(lm: LoadedModel) -> None:
    engine = Engine(lm, EngineConfig(batch_size=2, draft_tokens=0))
    scheduler = engine.scheduler
    scheduler.read_ahead(iter([job(1, max_tokens=1), job(2)]), lambda r: None)
    scheduler.admit(lambda r: None, new_lines=True)
    engine.runner.open()
    try:
        plan = scheduler.schedule(input_closed=True)
        first, second = (scheduler.table.gens[row] for row in plan.span)
        assert first is not None and second is not None
        out = engine.runner.execute_model(plan)
        finished = scheduler.update_from_output(plan, out)
        assert finished == [first] and first.finish is not None  # max_tokens 1: done
        row = plan.span[0]
        assert scheduler.table.gens[row] is None  # released at once ...
        kept = (first.prompt + first.output)[: first.length]
        assert np.array_equal(scheduler.table.held[row], kept)  # ... keeping its keys
        assert scheduler.table.gens[plan.span[1]] is second and second.finish is None
    finally:
        engine.runner.close()


@pytest.mark.subprocess
def test_the_runner_side_never_loads_the_generation_module() -> None:
    """The model runner and all it imports (the plan, the pass, masks, logit rules,
    sampling) load without `engine/generation.py`: the forward side cannot reach a
    Generation, only the plan's data."""
    code = ("import sys, aici_cli.engine.model_runner; "
            "sys.exit('aici_cli.engine.generation' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
