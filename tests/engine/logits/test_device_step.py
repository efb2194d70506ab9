"""The step's tail as it runs on an accelerator, tested on the CPU: the packed bitmask
unpacked bitwise where the logits are equals the host's unpacking bit for bit; the
counter-based sampler's numbers are its reference hash's, its tokens follow the asked
distribution and a seeded line's tokens do not depend on its batch; and a step reads
back from the device once (every host read of a tensor counted while the runner runs)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from engine_runs import run
from factories import job_factory
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.sampling import Sampling
from aici_cli.engine import Engine
from aici_cli.engine import model_runner as runner_module
from aici_cli.engine.logits import masks as masks_module
from aici_cli.engine.logits.masks import apply_masks, unpack_bits, unpack_bits_bitwise
from aici_cli.engine.logits.sampler import (
    Draw,
    RowStream,
    sample,
    uniform_reference,
    uniforms,
)
from aici_cli.models.load import LoadedModel


@settings(max_examples=80, deadline=None)
@given(vocab=st.integers(1, 400).filter(lambda v: v % 32 != 0), rows=st.integers(1, 5),
       seed=st.integers(0, 2**31 - 1))
def test_the_bitmask_unpacked_bitwise_equals_the_hosts_unpacking(vocab: int, rows: int,
                                                                  seed: int) -> None:
    words = (vocab + 31) // 32
    rng = np.random.default_rng(seed)
    packed = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64)
    packed = packed.astype(np.int32)
    # The reference: numpy's own unpacking of the little-endian bytes, bit t of word t//32.
    want = np.unpackbits(packed.view(np.uint8), axis=1, count=vocab, bitorder="little")
    got = unpack_bits(torch.from_numpy(packed), vocab)  # the CPU's: numpy's
    assert got.dtype == torch.bool and got.shape == (rows, vocab)
    assert np.array_equal(got.numpy(), want.astype(bool))
    bitwise = unpack_bits_bitwise(torch.from_numpy(packed), vocab)  # an accelerator's
    assert bitwise.dtype == torch.bool and torch.equal(bitwise, got)
    # And bit by bit, as the bitmask's contract states it.
    for r in range(rows):
        for t in rng.integers(0, vocab, size=8):
            assert bool(got[r, t]) == bool((int(packed[r, t // 32]) >> (t % 32)) & 1)


def test_a_row_whose_mask_allows_nothing_is_flagged_on_the_device() -> None:
    logits = torch.randn(3, 40)
    allowed = torch.zeros(3, 40, dtype=torch.bool)
    allowed[0, 7] = True
    allowed[2] = True
    greedy, empty = apply_masks(logits, allowed)
    assert empty is not None and empty.tolist() == [False, True, False]
    assert int(greedy[0]) == 7


@settings(max_examples=200, deadline=None)
@given(key=st.integers(0, 2**63 - 1), counter=st.integers(0, 2**40))
def test_the_streams_numbers_are_the_reference_hash(key: int, counter: int) -> None:
    got = uniforms(torch.tensor([key]), torch.tensor([counter]))
    assert float(got[0]) == uniform_reference(key, counter)
    assert 0.0 <= float(got[0]) < 1.0


def test_sampled_tokens_follow_the_asked_distribution() -> None:
    """A chi-square test over 6,000 draws of one row (a small vocabulary, temperature 0.7
    over fixed logits): the counter-based numbers give the softmax's frequencies."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]])
    temperature = 0.7
    p = torch.softmax(logits[0] / temperature, dim=-1).double().numpy()
    stream = RowStream(12345)
    draw = Draw(Sampling(temperature=temperature), stream)
    greedy = logits.argmax(dim=-1)
    n = 6000
    counts = collections.Counter(int(sample(logits, greedy, [0], [draw])[0]) for _ in range(n))
    assert stream.drawn == n
    observed = [counts.get(t, 0) for t in range(len(p))]
    assert chisquare(observed, p * n).pvalue > 1e-3, (observed, p * n)


def test_a_seeded_line_samples_the_same_tokens_at_any_batch(lm: LoadedModel) -> None:
    """The same seeded lines alone, in a batch of 8 and among 63 others: one row's
    numbers come from its own stream, whatever shares the pass."""
    job = job_factory(lambda index: dict(prompt=f"Story {index % 5}:"), max_tokens=10,
                      temperature=0.9, top_p=0.95)
    lines = [job(i, seed=100 + i) for i in range(64)]
    alone = {i: run(lm, [lines[i]], batch_size=1)[i]["text"] for i in (0, 3, 41)}
    eight = run(lm, lines[:8], batch_size=8)
    many = run(lm, lines, batch_size=64)
    for i, text in alone.items():
        assert many[i]["text"] == text
        if i < 8:
            assert eight[i]["text"] == text


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts, per call of the runner's step, the host reads of a tensor (each a
    device-to-host sync on an accelerator): item, tolist, cpu, numpy, nonzero, bool, int,
    float, index."""
    names = ["item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__",
             "__float__", "__index__"]
    counts: list[int] = []
    state = {"on": False}

    def wrap(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if state["on"]:
                counts[-1] += 1
                state["on"] = False  # a read inside a read is the same read
                try:
                    return original(self, *args, **kwargs)
                finally:
                    state["on"] = True
            return original(self, *args, **kwargs)
        return counted

    for name in names:
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    execute = runner_module.ModelRunner.execute_model

    def step(self: Any, plan: Any) -> Any:
        counts.append(0)
        state["on"] = True
        try:
            return execute(self, plan)
        finally:
            state["on"] = False

    monkeypatch.setattr(runner_module.ModelRunner, "execute_model", step)
    yield counts


def test_a_step_reads_back_once(lm: LoadedModel, host_reads: list[int],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows with drafts, sampled rows, constrained and free rows in one batch: every
    step of the run reads from the device at most once. As on an accelerator: the masks
    unpack in torch's bitwise ops (the CPU's numpy unpacking reads host memory it owns),
    and the masked projection, a CPU-only path that gathers the allowed ids on the host,
    is off."""
    monkeypatch.setattr(masks_module, "unpack_bits", unpack_bits_bitwise)
    job = job_factory(lambda index: dict(prompt=f"Line {index} of the list says"),
                      max_tokens=16)
    regex = Constraint("regex", "[a-z ]{4,30}")
    lines = [job(1, constraint=regex), job(2, temperature=0.8, seed=3),
             job(3, constraint=regex, temperature=0.7, seed=4), job(4),
             job(5, prompt="a a a a a a")]
    engine = Engine(lm, EngineConfig(batch_size=4, draft_tokens=4))
    engine.runner.projection = None
    results: list[dict[str, Any]] = []
    engine.run(lines, results.append)
    assert len(results) == 5 and all(r["finish_reason"] in ("stop", "length") for r in results)
    assert len(host_reads) > 10
    assert max(host_reads) <= 1, host_reads


def test_allowed_mass_equals_a_direct_computation(lm: LoadedModel, tiny_model_dir: Any) -> None:
    """Each constrained line's `allowed_mass_min`/`_mean` against transformers' own logits
    (float32, the same weights, one full forward per step) and llguidance's mask at each
    step: the probability the model gave the tokens the regex allowed."""
    import llguidance

    from aici_cli.control.grammar.compiler import ll_tokenizer
    from aici_cli.models import load_model

    regex = "[a-d]{2,5}( [a-d]{2,5}){0,3}"
    job = job_factory(lambda index, prompt: dict(prompt=prompt), max_tokens=12, logprobs=0,
                      constraint=Constraint("regex", regex))
    prompts = ["Letters: ", "The list is", "x y z"]
    lines = [job(i, p, temperature=0.8 * (i % 2), seed=i) for i, p in enumerate(prompts)]
    results = run(lm, lines, batch_size=3, draft_tokens=0, fast_forward=False,
                  close_at_limit=False, loop_guard=False)
    ref = load_model(str(tiny_model_dir), "cpu", "float32", "none",
                     implementation="transformers")
    ll = ll_tokenizer(lm.tokenizer, lm.vocab_size, sorted(lm.eos_token_ids))
    for line in lines:
        stats = results[line.index]["stats"]
        ids = [e["id"] for e in results[line.index]["logprobs"]]
        context = lm.tokenizer(line.prompt)["input_ids"]
        matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex(regex))
        masses = []
        for i in range(stats["allowed_mass_steps"]):
            words = np.frombuffer(bytes(matcher.compute_bitmask()), dtype=np.int32)
            allowed = unpack_bits(torch.from_numpy(words.copy())[None], lm.vocab_size)[0]
            with torch.inference_mode():
                logits = ref.model(input_ids=torch.tensor([context + ids[:i]])).logits[0, -1]
            probs = torch.softmax(logits.float()[: lm.vocab_size], dim=-1)
            masses.append(float(probs[allowed].sum()))
            if i < len(ids):
                assert matcher.consume_token(ids[i])
        assert stats["allowed_mass_steps"] in (len(ids), len(ids) + 1)  # + the end's step
        assert abs(stats["allowed_mass_min"] - min(masses)) < 1e-4, (stats, masses)
        assert abs(stats["allowed_mass_mean"] - sum(masses) / len(masses)) < 1e-4
    unconstrained = run(lm, [job_factory(max_tokens=4)(9, "Hello")], batch_size=1)[9]
    assert "allowed_mass_min" not in unconstrained["stats"]


class _Guest:
    """A controller that fills its own mask: it allows token `k` and meets the other
    lines' calls at a barrier (a call that waits alone times out), while checking that
    no two rows of its own line run at once."""

    def __init__(self, token: int, scope: object, barrier: threading.Barrier,
                 busy: dict[int, int]) -> None:
        self.token, self.scope, self.barrier, self.busy = token, scope, barrier, busy

    def matcher(self) -> None:
        return None

    def matcher_fault(self) -> Any:
        raise AssertionError("no matcher")

    def fill_mask(self, out: torch.Tensor) -> bool:
        key = id(self.scope)
        self.busy[key] = self.busy.get(key, 0) + 1
        assert self.busy[key] == 1, "two rows of one line at once"
        try:
            self.barrier.wait()
        finally:
            self.busy[key] -= 1
        out.zero_()
        out[self.token // 32] = 1 << (self.token % 32)
        return True


def test_guests_of_different_lines_fill_their_masks_at_once() -> None:
    """Four lines of two rows each: the lines' calls meet at a barrier as wide as the
    mask threads (up to four; so they ran at the same time), a line's own two rows one
    after the other; each row's mask is its own guest's."""
    from aici_cli.engine.logits.masks import CUSTOM_THREADS, TokenMasks

    masks = TokenMasks(8, 100)
    barrier = threading.Barrier(min(4, CUSTOM_THREADS), timeout=10)
    busy: dict[int, int] = {}
    scopes = [object() for _ in range(4)]
    guests = [_Guest(10 * k + 2, scopes[k // 2], barrier, busy) for k in range(8)]
    try:
        verdict = masks.fill(list(range(8)), guests)
    finally:
        masks.close()
    assert not verdict.failed and verdict.allowed is not None
    for k in range(8):
        assert verdict.allowed[k].nonzero().flatten().tolist() == [10 * k + 2]
