"""Which rows draft (engine/draft.py `DraftGate`): a row drafts only while its drafts
bring more than they add to the pass (more where the step would otherwise run compiled),
and retries now and then."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine import Engine, Generation
from aici_cli.engine.draft import (
    COMPILED_MIN_GAIN,
    MAX_BACKOFF,
    PASS_COST_TOKENS,
    RETRY_AFTER,
    eager_min_gain,
)
from aici_cli.engine.scheduler import propose_drafts
from aici_cli.engine.update import accept_draft
from aici_cli.models.load import LoadedModel, load_model


def _gen(prompt: list[int], output: list[int]) -> Generation:
    job = Job(index=1, id="g", prompt="", messages=None, max_tokens=1000, constraint=None)
    gen = Generation(job, list(prompt), None, torch.Generator(), started=0.0)
    gen.length = len(prompt) + len(output)
    gen.output = list(output)
    gen.pending = [output[-1]] if output else []
    return gen


@settings(max_examples=60, deadline=None)
@given(accepted=st.lists(st.integers(0, 3), min_size=1, max_size=12),
       gap=st.integers(0, 20 * RETRY_AFTER), compiled=st.booleans(),
       others=st.integers(0, 14))
def test_a_row_drafts_only_while_its_drafts_pay(accepted: list[int], gap: int,
                                                compiled: bool, others: int) -> None:
    """After draft passes that brought `accepted` extra tokens each, the row drafts iff
    the running mean is at least the step's minimum gain (COMPILED_MIN_GAIN where the step
    would run compiled, else 3 R / (PASS_COST_TOKENS + R) for the 3 tokens a 4-token draft
    feeds after its first in an eager pass of R rows: the row and `others`), or `gap`
    tokens have passed since its last draft pass: RETRY_AFTER, doubled for each pass in a
    row after the first that brought nothing (at most MAX_BACKOFF times)."""
    gen = _gen([1, 2, 3], [1, 2, 3, 1, 2])
    gain = gen.draft.gain
    misses = 0
    for n in accepted:
        # The model confirms the first n draft tokens after the picked one.
        draft = [3, 1, 2, 3]
        predicted = [*draft[1 : 1 + n], 99, 99, 99][: len(draft) - 1]
        gen.pending = [gen.output[-1]]

        def take(g: Generation, token: int) -> float:
            g.output.append(token)
            g.length += 1
            g.pending = [token]
            return 0.0

        gen.pending = [3]
        gen.output.append(3)
        gen.length += 1
        accept_draft(gen, draft, 3, predicted, take)
        gain = (gain + n) / 2
        misses = 0 if n else misses + 1
        assert gen.draft.at == len(gen.output)
    assert gen.draft.gain == pytest.approx(gain)
    wait = RETRY_AFTER * 2 ** min(max(misses - 1, 0), MAX_BACKOFF)
    assert gen.draft.retry_wait() == wait
    gen.output.extend([7] * gap)
    gen.length += gap
    rows = 1 + others
    min_gain = COMPILED_MIN_GAIN if compiled else 3 * rows / (PASS_COST_TOKENS + rows)
    assert eager_min_gain(rows, 3) == pytest.approx(3 * rows / (PASS_COST_TOKENS + rows))
    expect = gain >= min_gain or gap >= wait
    assert gen.draft.worth(len(gen.output), compiled, rows, 3) is expect
    if compiled:  # a compiled step asks for more than an eager one of up to 15 rows
        assert gen.draft.worth(len(gen.output), False, rows, 3) or not expect
    # More rows in the pass ask for more: a row that drafts among many drafts among few.
    if not compiled and gen.draft.worth(len(gen.output), False, rows + 1, 3):
        assert gen.draft.worth(len(gen.output), False, rows, 3)
    gen.pending = [gen.output[-1]]
    # The pass's other rows: the same history, their gates never told of a draft pass.
    peers = [_gen([1, 2, 3], [9]) for _ in range(others)]
    for peer in peers:
        peer.draft.gain, peer.draft.at = 0.0, 10**6  # never draft
    drafts = propose_drafts([gen, None, *peers], 4, eos=set(), compiled=compiled)
    if not expect:
        assert drafts[0] == []
    assert drafts[1:] == [[] for _ in range(1 + others)]


@pytest.fixture(scope="module")
def lm32(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_compiled_steps_draft_only_where_drafts_pay_and_keep_the_tokens(
        lm32: LoadedModel) -> None:
    """A compiled run with drafts on gives the tokens of the run without drafts (fp32),
    and its multi-token passes are bounded by the gate: each is an accepted draft, one of
    the optimistic first tries, or a retry after RETRY_AFTER tokens."""
    jobs = [Job(index=1, id="s", max_tokens=120, constraint=None, prompt="a b c d e f",
                messages=None, ignore_eos=True)]

    def run(drafts: int) -> tuple[list[Any], Engine]:
        engine = Engine(lm32, EngineConfig(batch_size=1, compile="on", draft_tokens=drafts))
        out: list[dict[str, Any]] = []
        engine.run(jobs, out.append)
        return out, engine

    plain, _ = run(0)
    drafted, engine = run(4)
    assert drafted[0]["text"] == plain[0]["text"]
    draft_passes = sum(1 for s in engine.step_times if s.kind == "decode" and s.tokens > 1)
    accepted = drafted[0]["stats"]["draft_tokens"]
    # Each failed pass halves the running mean (a success brings at most 3 tokens: two
    # more failures before it falls under 1).
    assert draft_passes <= 2 + 3 * accepted + 120 // RETRY_AFTER + 1  # waits only grow
    assert engine.compiled_steps is not None and engine.compiled_steps > 0
