"""The prefix cache: a line whose prompt starts like the keys a row holds takes them.

Every pass is checked against a cache-free forward over the row's whole token sequence
(1e-4 in fp32), so a wrong hit (wrong keys, wrong length, a copy from a row that had
moved on) fails; `stats.cached_tokens` and the prompt tokens actually fed show that the
cache was used at all, so a bypassed cache fails too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from factories import job_factory

from aici_cli.control.base import ControllerBase, Directive
from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.engine.plan import StepOutput, StepPlan
from aici_cli.engine.rows import Prepared, RowTable
from aici_cli.models import LoadedModel

TOL = 1e-4
PREFIX = ("Answer each question with one word.\n"
          "Q: What colour is the sky? A: blue\n"
          "Q: What colour is grass? A: green\n"
          "Q: What colour is snow? A: white\n")


job = job_factory(max_tokens=6)


class Probe:
    """Records every row's fed token sequence (its generation's own tokens, not what the
    plan says: a wrong copy must not go unseen) and next-token logits at every step."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.passes: list[tuple[list[int], torch.Tensor]] = []
        self.fed_tokens = 0
        original = engine.runner.execute_model
        rows = engine.scheduler.table.gens

        def execute_model(plan: StepPlan) -> StepOutput:
            seqs: list[list[int] | None] = []
            for k, chunk in enumerate(plan.chunks):
                gen = rows[plan.span[k]] if chunk else None
                if gen is None:
                    seqs.append(None)
                    continue
                assert (plan.lengths[k], list(chunk)) == (gen.length, gen.pending)
                seqs.append((gen.prompt + gen.output)[: gen.length + len(gen.pending)])
            self.fed_tokens += sum(len(c) for c in plan.chunks)
            out = original(plan)
            for k, seq in enumerate(seqs):
                if seq is not None:
                    self.passes.append((seq, out.passed.every[k].float().clone()))
            return out

        monkeypatch.setattr(engine.runner, "execute_model", execute_model)

    def assert_exact(self, lm: LoadedModel) -> None:
        assert self.passes
        with torch.inference_mode():
            for seq, logits in self.passes:
                reference = lm.model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                diff = (reference[: logits.shape[0]] - logits).abs().max().item()
                assert diff < TOL, f"pass over {len(seq)} tokens differs by {diff}"


def run(lm: LoadedModel, jobs: Sequence[Job], monkeypatch: pytest.MonkeyPatch,
        controller: type[ControllerBase] | None = None,
        **config: Any) -> tuple[dict[int, dict[str, Any]], Probe]:
    engine = Engine(lm, EngineConfig(draft_tokens=0, **config),
                    controller_factory=(lambda j: controller()) if controller else None)
    probe = Probe(engine, monkeypatch)
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    assert sorted(r["index"] for r in results) == sorted(j.index for j in jobs)
    return {r["index"]: r for r in results}, probe


def prompt_len(lm: LoadedModel, text: str) -> int:
    return len(lm.tokenizer(text)["input_ids"])


def test_a_shared_prefix_is_computed_once_and_every_pass_stays_exact(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    questions = ["Q: What colour is coal? A:", "Q: What colour is milk? A:",
                 "Q: What colour is a lemon? A:", "Q: What colour is blood? A:",
                 "Q: What colour is the sea? A:", "Q: What colour is night? A:"]
    jobs = [job(i + 1, PREFIX + q) for i, q in enumerate(questions)]
    results, probe = run(lm, jobs, monkeypatch, batch_size=2)
    probe.assert_exact(lm)
    shared = prompt_len(lm, PREFIX) - 2  # the last prefix token may merge with a question
    cached = [results[j.index]["stats"]["cached_tokens"] for j in jobs]
    assert sum(c >= shared for c in cached) >= len(jobs) - 1, cached
    prompt_total = sum(results[j.index]["stats"]["prompt_tokens"] for j in jobs)
    generated = sum(results[j.index]["stats"]["output_tokens"] for j in jobs)
    # What was fed: every prompt token not taken from the cache, and each generated token
    # but the last of each line (it never needs a pass).
    assert probe.fed_tokens == prompt_total - sum(cached) + generated - len(jobs)

    plain, _ = run(lm, jobs, monkeypatch, batch_size=2, prefix_cache=False)
    assert all(r["stats"]["cached_tokens"] == 0 for r in plain.values())
    assert [plain[j.index]["text"] for j in jobs] == [results[j.index]["text"] for j in jobs]


def test_a_hit_ending_inside_the_chat_template(lm: LoadedModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    system = {"role": "system", "content": "You are terse."}
    jobs = [job(i + 1, messages=[system, {"role": "user", "content": text}])
            for i, text in enumerate(["Name a colour.", "Name a fruit.", "Name a tree."])]
    results, probe = run(lm, jobs, monkeypatch, batch_size=1)
    probe.assert_exact(lm)
    for j in jobs[1:]:
        st = results[j.index]["stats"]
        # The system turn and the start of the user turn come from the cache.
        assert 0 < st["cached_tokens"] < st["prompt_tokens"] - 1


def test_a_hit_on_a_whole_prompt_feeds_only_its_last_token(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    text = PREFIX + "Q: What colour is coal? A:"
    results, probe = run(lm, [job(1, text), job(2, text, seed=9)], monkeypatch, batch_size=1)
    probe.assert_exact(lm)
    assert results[1]["stats"]["cached_tokens"] == 0
    assert results[2]["stats"]["cached_tokens"] == prompt_len(lm, text) - 1
    assert results[1]["text"] == results[2]["text"]


class Rewriter(ControllerBase):
    """After its second token, takes back two and fast-forwards three of its own."""

    def __init__(self) -> None:
        self.calls = 0

    def advance(self, tokens: Sequence[int]) -> Directive:
        self.calls += 1
        if self.calls == 2:
            return Directive(backtrack=2, ff_tokens=(5, 6, 7))
        return Directive()


def test_backtracks_and_splices_next_to_rows_that_copied_the_same_prefix(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [job(i + 1, PREFIX + f"Q: Item {i}? A:", max_tokens=8) for i in range(5)]
    results, probe = run(lm, jobs, monkeypatch, controller=Rewriter, batch_size=3)
    probe.assert_exact(lm)
    assert sum(r["stats"]["cached_tokens"] > 0 for r in results.values()) >= 3
    assert all(r["stats"]["ff_tokens"] >= 3 for r in results.values())


def test_n_samples_share_the_prompt_through_the_cache(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    text = PREFIX + "Q: What colour is coal? A:"
    results, probe = run(lm, [job(1, text, n=4, temperature=1.0)], monkeypatch, batch_size=4)
    probe.assert_exact(lm)
    samples = results[1]["choices"]
    assert sorted(s["stats"]["cached_tokens"] for s in samples) == [0] + [
        prompt_len(lm, text) - 1] * 3


def test_lines_whose_prefix_is_cached_are_admitted_first(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    other = "Translate each word into French.\nhouse: maison\ncat: chat\ndog: chien\n"
    jobs = [job(i + 1, (PREFIX if i % 2 == 0 else other) + f"Q{i}:") for i in range(8)]
    ahead, probe = run(lm, jobs, monkeypatch, batch_size=1)
    probe.assert_exact(lm)
    in_order, _ = run(lm, jobs, monkeypatch, batch_size=1, lookahead=1)
    cached_ahead = sum(r["stats"]["cached_tokens"] for r in ahead.values())
    cached_in_order = sum(r["stats"]["cached_tokens"] for r in in_order.values())
    # In input order the one row alternates between the two prefixes; read ahead, the
    # lines of one prefix run together and only the first of each group misses.
    assert sum(r["stats"]["cached_tokens"] > 10 for r in ahead.values()) == len(jobs) - 2
    assert cached_ahead > 3 * cached_in_order
    assert [in_order[j.index]["text"] for j in jobs] == [ahead[j.index]["text"] for j in jobs]


def test_eviction_keeps_the_rows_that_waiting_lines_need_then_the_recent_ones() -> None:
    table = RowTable(3)  # no cache: choosing a row copies nothing
    a, b, c = [np.arange(start, start + 40) for start in (1000, 2000, 3000)]
    for row, held in enumerate((a, b, c)):
        table.held[row] = held
        table.release(row)  # released in row order: row 0 is the least recent
    unrelated = np.arange(9000, 9010)
    # A waiting line needs row 0's keys: the least recent row without a use goes.
    ahead = [Prepared.of(job(7, "x"), [*a[:30].tolist(), 5])]
    assert table.row_for(unrelated, ahead) == 1
    # Nothing waiting needs any: the least recently released goes.
    assert table.row_for(unrelated, []) == 0
    # A prompt that starts like a row's keys takes that row, in place.
    assert table.row_for(np.concatenate([c[:10], unrelated]), []) == 2
