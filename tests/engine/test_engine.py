"""The decode loop on the tiny model: refill, determinism, fast-forward, stops, faults."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from factories import job_factory

from aici_cli.control.base import ControllerBase, Directive
from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import ControllerError
from aici_cli.core.job import BadLine, Job
from aici_cli.engine import Engine, StepClock
from aici_cli.models import LoadedModel

job = job_factory(prompt="Hello there", max_tokens=12)


def run(lm: LoadedModel, jobs: Sequence[Job | BadLine], **config: Any) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(**config)).run(jobs, results.append)
    return results


def by_index(results: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["index"]: r for r in results}


def test_every_job_gets_exactly_one_result(lm: LoadedModel) -> None:
    jobs: list[Job | BadLine] = [job(i, max_tokens=3 + i % 5) for i in range(1, 12)]
    jobs.insert(4, BadLine(99, "bad", "invalid_json", "line 99: not JSON"))
    results = run(lm, jobs, batch_size=4)
    assert sorted(r["index"] for r in results) == sorted(j.index for j in jobs)
    for r in results:
        if r["index"] == 99:
            assert r["finish_reason"] == "error"
        else:
            assert r["finish_reason"] in ("stop", "length")
            assert r["stats"]["output_tokens"] <= 3 + r["index"] % 5


def test_continuous_refill_does_not_wait_for_the_batch(lm: LoadedModel) -> None:
    # One long job and many short ones on two rows: the short ones stream through the
    # second row while the long one decodes, so the long one finishes last.
    long = job(1, max_tokens=40, prompt="a long story")
    shorts = [job(i, max_tokens=2, prompt=f"short {i}") for i in range(2, 8)]
    results = run(lm, [long, *shorts], batch_size=2)
    assert results[-1]["index"] == 1
    assert results[-1]["stats"]["output_tokens"] == 40


@pytest.mark.heavy
def test_sampled_output_does_not_depend_on_batch_size(lm: LoadedModel) -> None:
    jobs = [job(i, prompt=f"prompt number {i}", temperature=0.9, top_p=0.95, max_tokens=10)
            for i in range(1, 7)]
    texts = {}
    for bs in (1, 3, 6):
        texts[bs] = {r["index"]: r["text"] for r in run(lm, jobs, batch_size=bs)}
    assert texts[1] == texts[3] == texts[6]
    # And the seed matters: the same prompt with another seed samples differently.
    a = run(lm, [job(1, temperature=1.5, seed=1, max_tokens=10)])[0]["text"]
    b = run(lm, [job(1, temperature=1.5, seed=2, max_tokens=10)])[0]["text"]
    assert a != b


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "ok"],
}


def test_fast_forward_matches_token_by_token_and_saves_passes(lm: LoadedModel) -> None:
    jobs = [job(i, prompt=f"json {i}", max_tokens=60,
                constraint=Constraint("json_schema", SCHEMA)) for i in range(1, 5)]
    with_ff = by_index(run(lm, jobs, batch_size=4))
    without = by_index(run(lm, jobs, batch_size=4, fast_forward=False))
    for i in with_ff:
        assert with_ff[i]["text"] == without[i]["text"]
        assert without[i]["stats"]["ff_tokens"] == 0
        if with_ff[i]["finish_reason"] == "stop":
            assert with_ff[i]["valid"] is True
            assert set(with_ff[i]["json"]) == {"name", "tags", "ok"}
    ff_passes = sum(r["stats"]["forward_passes"] for r in with_ff.values())
    plain_passes = sum(r["stats"]["forward_passes"] for r in without.values())
    assert sum(r["stats"]["ff_tokens"] for r in with_ff.values()) > 0
    assert ff_passes < plain_passes


def test_choices_and_regex_are_enforced(lm: LoadedModel) -> None:
    results = by_index(run(lm, [
        job(1, constraint=Constraint("choice", ["red", "green", "blue"])),
        job(2, constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2}"), max_tokens=20),
    ]))
    assert results[1]["text"] in ("red", "green", "blue")
    assert results[1]["finish_reason"] == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", results[2]["text"])


def test_stop_string_cuts_the_text(lm: LoadedModel) -> None:
    free = run(lm, [job(1, max_tokens=30)])[0]["text"]
    assert len(free) > 4
    stop = free[2:4]
    cut = run(lm, [job(1, max_tokens=30, stop=(stop,))])[0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == free[: free.index(stop)]


def test_bad_grammar_is_a_line_error_and_others_run(lm: LoadedModel) -> None:
    results = by_index(run(lm, [
        job(1),
        job(2, constraint=Constraint("regex", "(unclosed")),
        job(3, constraint=Constraint("json_schema", {"type": 12})),
        job(4),
    ], batch_size=2))
    assert results[2]["finish_reason"] == "error"
    assert results[2]["error"]["type"] == "invalid_regex"
    assert results[3]["error"]["type"] == "invalid_schema"
    assert "line 3" in results[3]["error"]["message"]
    assert results[1]["finish_reason"] != "error" and results[4]["finish_reason"] != "error"


class FailingController(ControllerBase):
    """Fast-forwards two tokens, then fails on its third step."""

    def __init__(self) -> None:
        self.calls = 0

    def start(self, prompt: Sequence[int]) -> Directive:
        return Directive(ff_tokens=(5, 6))

    def advance(self, tokens: Sequence[int]) -> Directive:
        self.calls += 1
        if self.calls == 3:
            raise ControllerError("controller_trap", "boom on step 3")
        return Directive()


def test_controller_fault_ends_only_its_sequence(lm: LoadedModel) -> None:
    def factory(j: Job) -> FailingController | None:
        return FailingController() if j.index == 2 else None

    results: list[dict[str, Any]] = []
    engine = Engine(lm, EngineConfig(batch_size=3), controller_factory=factory)
    engine.run([job(1, max_tokens=10), job(2, max_tokens=10), job(3, max_tokens=10)],
               results.append)
    got = by_index(results)
    assert got[2]["finish_reason"] == "error"
    assert got[2]["error"] == {"type": "controller_trap", "message": "line 2: boom on step 3"}
    assert got[2]["stats"]["ff_tokens"] == 2
    assert got[1]["stats"]["output_tokens"] == 10 and got[3]["stats"]["output_tokens"] == 10


def test_step_stats_records_each_pass(lm: LoadedModel) -> None:
    r = run(lm, [job(1, max_tokens=40, constraint=Constraint("json_schema", SCHEMA))],
            step_stats=True)[0]
    steps = r["steps"]
    assert len(steps) == r["stats"]["forward_passes"]
    assert [s["kind"] for s in steps] == ["prefill"] + ["decode"] * (len(steps) - 1)
    assert [s["step"] for s in steps] == list(range(len(steps)))
    # Every output token was either sampled after a pass or forced by the controller.
    sampled = sum(s["sampled"] for s in steps)
    assert sampled + r["stats"]["ff_tokens"] == r["stats"]["output_tokens"]
    assert all(s["forward_ms"] > 0 for s in steps)


class BuggyController(FailingController):
    """Raises a plain exception (a host bug, not a controller fault) on its first step."""

    def advance(self, tokens: Sequence[int]) -> Directive:
        raise RuntimeError("unexpected")


def test_host_bug_in_a_controller_is_confined_to_its_line(lm: LoadedModel) -> None:
    results: list[dict[str, Any]] = []
    engine = Engine(lm, EngineConfig(batch_size=2),
                    controller_factory=lambda j: BuggyController() if j.index == 1 else None)
    engine.run([job(1), job(2, max_tokens=4)], results.append)
    got = by_index(results)
    assert got[1]["error"] == {"type": "internal_error",
                               "message": "line 1: RuntimeError: unexpected"}
    assert got[2]["finish_reason"] == "length"


def _oom_above(monkeypatch: pytest.MonkeyPatch, max_tokens_per_pass: int) -> list[int]:
    """Make every pass of more than `max_tokens_per_pass` tokens run out of memory, the way
    the CPU allocator reports it; returns the sizes of the passes that ran."""
    import aici_cli.engine.forward.passes as passes

    real = passes.forward
    sizes: list[int] = []

    def forward(model: Any, cache: Any, inputs: Any) -> torch.Tensor:
        n = int(inputs.input_ids.shape[1])
        if n > max_tokens_per_pass:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 123456789 bytes.")
        sizes.append(n)
        return real(model, cache, inputs)

    monkeypatch.setattr(passes, "forward", forward)
    return sizes


def test_out_of_memory_retries_with_fewer_rows(lm: LoadedModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [job(i, prompt=f"prompt number {i} " * 3, max_tokens=6) for i in range(1, 9)]
    expected = {r["index"]: r["text"] for r in run(lm, jobs, batch_size=4)}
    prompt_len = len(lm.tokenizer(jobs[0].prompt)["input_ids"])
    sizes = _oom_above(monkeypatch, 2 * prompt_len + 2)
    engine = Engine(lm, EngineConfig(batch_size=4))
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    assert {r["index"]: r["text"] for r in results} == expected
    assert all(r["finish_reason"] == "length" for r in results)
    # Inside the scheduler: the row cap is its own state, and no result shows it.
    assert engine.scheduler.table.live_cap == 2  # four prompts did not fit, two did
    assert max(sizes) <= 2 * prompt_len + 2


def test_out_of_memory_alone_fails_only_that_line(lm: LoadedModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [job(1, prompt="short"), job(2, prompt="a much longer prompt " * 8), job(3)]
    _oom_above(monkeypatch, 20)
    results = by_index(run(lm, jobs, batch_size=3))
    assert results[2]["finish_reason"] == "error"
    assert results[2]["error"]["type"] == "out_of_memory"
    assert results[2]["error"]["message"].startswith("line 2: out of memory")
    assert results[1]["finish_reason"] == results[3]["finish_reason"] == "length"


def _count_prompt_tokens(monkeypatch: pytest.MonkeyPatch, prompt: list[int]) -> list[int]:
    """Record, for each pass, how many of its tokens sit at prompt positions 1.. (every
    prefill of `prompt` feeds them; re-feeding only the last prompt token does not)."""
    import aici_cli.engine.forward.passes as passes

    real = passes.forward
    counts: list[int] = []

    def forward(model: Any, cache: Any, inputs: Any) -> torch.Tensor:
        positions = inputs.position_ids[0].tolist()
        counts.append(sum(1 for p in positions if 0 < p < len(prompt) - 1))
        return real(model, cache, inputs)

    monkeypatch.setattr(passes, "forward", forward)
    return counts


def test_n_samples_share_the_prompt_prefill(lm: LoadedModel,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "Tell me a long story about the quick brown fox " * 2
    ids = lm.tokenizer(prompt)["input_ids"]
    counts = _count_prompt_tokens(monkeypatch, ids)
    line = job(1, prompt=prompt, n=4, temperature=1.0, max_tokens=8)
    [result] = run(lm, [line], batch_size=4)
    # The prompt was prefilled once, not four times.
    assert sum(counts) == len(ids) - 2
    assert result["n"] == 4 and [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in result["choices"]]
    assert len(set(texts)) > 1  # sampled with their own generators
    for c in result["choices"]:
        assert c["finish_reason"] == "length" and c["stats"]["output_tokens"] == 8
        assert c["stats"]["prompt_tokens"] == len(ids)
    assert result["text"] == texts[0]
    assert result["stats"]["output_tokens"] == 32


def test_n_samples_survive_a_batch_smaller_than_n(lm: LoadedModel) -> None:
    """Samples wait for rows when the batch is smaller than n; sample 0 is what the same
    line with n=1 gives, and a line without n keeps the plain result shape."""
    prompt = "a story about Alice"
    together = run(lm, [job(1, prompt=prompt, n=3, temperature=0.8, max_tokens=6, seed=5),
                        job(2, prompt="other", max_tokens=4)], batch_size=2)
    line = by_index(together)[1]
    alone = [c["text"] for c in line["choices"]]
    first = run(lm, [job(1, prompt=prompt, temperature=0.8, max_tokens=6, seed=5)],
                batch_size=1)
    assert alone[0] == first[0]["text"]
    assert by_index(together)[2]["finish_reason"] == "length"
    assert "choices" not in by_index(together)[2]


def test_n_samples_with_a_grammar_each_follow_it(lm: LoadedModel) -> None:
    line = job(1, n=3, temperature=1.0, max_tokens=20,
               constraint=Constraint("regex", "[a-c]{3,6}"))
    [result] = run(lm, [line], batch_size=3, fast_forward=True)
    for c in result["choices"]:
        assert re.fullmatch("[a-c]{3,6}", c["text"]), c


def test_vanishing_temperature_is_greedy(lm: LoadedModel) -> None:
    greedy = run(lm, [job(1, max_tokens=8)])[0]["text"]
    tiny = run(lm, [job(1, max_tokens=8, temperature=1e-300)])[0]["text"]
    assert tiny == greedy


def test_samples_of_a_started_line_finish_after_admission_stops(lm: LoadedModel) -> None:
    """An interrupt stops admitting lines; the waiting samples of a line already started
    still run, so that line gets its result, and the next line does not start."""
    results: list[dict[str, Any]] = []
    admitted = iter([True, True])  # admit the first line only, then stop (an interrupt)
    Engine(lm, EngineConfig(batch_size=2)).run(
        [job(1, n=3, temperature=1.0, max_tokens=4), job(2)], results.append,
        should_admit=lambda: next(admitted, False),
    )
    assert [r["index"] for r in results] == [1]
    assert len(results[0]["choices"]) == 3


def test_prompt_lookup_drafts_keep_greedy_outputs_and_save_passes(lm: LoadedModel) -> None:
    """Verified drafts change nothing in what greedy decoding writes, only how many
    passes it takes; sampled rows and grammars keep working beside them."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "enum": ["quick brown fox", "lazy dog"]}}}, "required": ["a"]}
    jobs = [
        job(1, prompt="the quick brown fox the quick brown fox the quick", max_tokens=40),
        job(2, prompt="Hello World Hello World", max_tokens=40,
            constraint=Constraint("regex", "(Hello World ){2,8}")),
        job(3, prompt="A list", max_tokens=60, constraint=Constraint("json_schema", schema)),
        job(4, prompt="sampled", max_tokens=20, temperature=0.9),
        job(5, prompt="stop here", max_tokens=40, stop=("fox",)),
    ]
    plain = by_index(run(lm, jobs, batch_size=3, draft_tokens=0))
    drafted = by_index(run(lm, jobs, batch_size=3, draft_tokens=4))
    for i in plain:
        assert drafted[i]["text"] == plain[i]["text"], i
        assert drafted[i]["finish_reason"] == plain[i]["finish_reason"]
    taken = sum(r["stats"]["draft_tokens"] for r in drafted.values())
    assert taken > 0
    assert drafted[4]["stats"]["draft_tokens"] == 0  # sampled rows are never drafted
    passes = [sum(r["stats"]["forward_passes"] for r in rs.values()) for rs in (plain, drafted)]
    assert passes[1] < passes[0]


class FakeClock:
    """Seconds that advance only when a test says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1000.0


def test_step_clock_splits_a_step_into_its_phases() -> None:
    clock = FakeClock()
    step = StepClock(clock)
    for mark, spent_ms in (("forward", 1), ("forwarded", 20), ("masks_ready", 2),
                           ("masked", 0.5), ("sampled", 0.25)):
        clock.advance(spent_ms)
        step.mark(mark)
    times = step.times("decode", rows=3, tokens=5)
    clock.advance(4)
    step.finish(times, controller_ms=3.0)
    assert (times.forward_ms, times.mask_wait_ms, times.mask_ms, times.sample_ms) == (
        pytest.approx(20), pytest.approx(2), pytest.approx(2.5), pytest.approx(0.25))
    assert times.controller_ms == 3.0
    assert times.step_ms == pytest.approx(27.75)
    assert times.overhead_ms == pytest.approx(7.75)  # everything but the forward pass


def test_result_timings_come_from_the_engine_clock(lm: LoadedModel,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    ticking = Engine(lm, EngineConfig(batch_size=2), now=lambda: clock.t)
    original = ticking.runner.model_pass.run

    def slow_pass(*args: Any, **kwargs: Any) -> Any:
        clock.advance(10)  # every forward pass takes exactly 10 ms
        return original(*args, **kwargs)

    monkeypatch.setattr(ticking.runner.model_pass, "run", slow_pass)
    results: list[dict[str, Any]] = []
    ticking.run([job(1, max_tokens=3), job(2, prompt="Other words", max_tokens=5)],
                results.append)
    by_index = {r["index"]: r for r in results}
    for index, passes in ((1, 3), (2, 5)):
        st = by_index[index]["stats"]
        assert st["forward_passes"] == passes
        assert st["forward_ms"] == pytest.approx(10.0 * passes)
        assert st["total_ms"] == pytest.approx(10.0 * passes)
    assert all(s.forward_ms == pytest.approx(10.0) for s in ticking.step_times)


@pytest.mark.parametrize("kind", ["score", "samples"])
def test_a_line_of_several_rows_counts_a_shared_pass_once(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A scored line's choices (or a line's n samples) run as rows of the same passes:
    the line's forward_ms is the time of those passes, within its total_ms, not one pass
    per row added up."""
    clock = FakeClock()
    ticking = Engine(lm, EngineConfig(batch_size=4, draft_tokens=0), now=lambda: clock.t)
    original = ticking.runner.model_pass.run

    def slow_pass(*args: Any, **kwargs: Any) -> Any:
        clock.advance(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(ticking.runner.model_pass, "run", slow_pass)
    if kind == "score":
        line = job(1, constraint=Constraint("choice", ["yes", "no", "maybe"]), score=True)
    else:
        line = job(1, max_tokens=3, n=3)
    results: list[dict[str, Any]] = []
    ticking.run([line], results.append)
    [result] = results
    st = result["stats"]
    passes = len(ticking.step_times)
    # Row passes exceed the engine's: the rows shared passes, which count once in time.
    assert st["forward_passes"] > passes
    assert st["forward_ms"] == pytest.approx(10.0 * passes)
    assert st["forward_ms"] + st["mask_ms"] + st["sample_ms"] <= st["total_ms"] + 1e-6
