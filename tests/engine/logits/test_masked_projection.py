"""The masked projection (engine/logits/masked_projection.py): logits at the allowed ids
alone give the tokens the full projection and the mask give."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import job_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import Job
from aici_cli.core.sampling import Sampling
from aici_cli.engine import Engine, model_runner
from aici_cli.engine.forward import compiled
from aici_cli.engine.logits.masked_projection import MaskedProjection
from aici_cli.engine.logits.sampler import Draw, RowStream, sample
from aici_cli.models import LoadedModel, load_model
from aici_cli.models.quant.quantize import Int8Linear, quantize_int8

T = 64  # the allowed sets' sizes: 1..T
KINDS = ("dense-float32", "dense-bfloat16", "int8-float32", "int8-bfloat16")


def head_of(kind: str, vocab: int, width: int, seed: int) -> torch.nn.Module:
    """An output projection [vocab, width] of `kind`, with weights from `seed`."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=g) * 0.2
    dtype = torch.float32 if kind.endswith("float32") else torch.bfloat16
    if kind.startswith("int8"):
        codes, scale = quantize_int8(weight)
        return Int8Linear(codes, scale, None, dtype)
    head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


def tokens(logits: torch.Tensor, disallowed: torch.Tensor, temperature: float,
           seed: int) -> list[int]:
    """Mask `logits` as `apply_masks` does, then each row's token: the argmax at
    temperature 0, else drawn with a generator seeded `seed`."""
    masked = logits.masked_fill(disallowed, float("-inf"))
    greedy = masked.argmax(dim=-1)
    rows = list(range(masked.shape[0]))
    draws = [Draw(Sampling(temperature=temperature, top_p=0.9), RowStream(seed + k))
             for k in rows]
    return sample(masked, greedy, rows, draws).tolist()


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**31 - 1),
       batch=st.integers(1, 4), vocab=st.integers(T, 700), width=st.sampled_from([16, 64, 96]),
       sizes=st.lists(st.integers(1, T), min_size=4, max_size=4),
       temperature=st.sampled_from([0.0, 0.7, 1.3]))
def test_masked_projection_picks_the_full_projections_tokens(
        kind: str, seed: int, batch: int, vocab: int, width: int, sizes: list[int],
        temperature: float) -> None:
    head = head_of(kind, vocab, width, seed)
    projection = MaskedProjection(head, vocab, threshold=T)
    g = torch.Generator().manual_seed(seed + 1)
    dtype = torch.float32 if kind.endswith("float32") else torch.bfloat16
    hidden = (torch.randn(batch, width, generator=g) * 3).to(dtype)
    disallowed = torch.ones(batch, vocab, dtype=torch.bool)
    for k in range(batch):
        disallowed[k, torch.randperm(vocab, generator=g)[: sizes[k]]] = False
    full = projection.full(hidden)
    logits = projection.project(hidden, ~disallowed, list(range(batch)))
    if kind.startswith("int8"):  # exact: the same values, so any draw picks the same token
        assert projection.used == 1
        assert torch.equal(logits.masked_fill(disallowed, float("-inf")),
                           full.masked_fill(disallowed, float("-inf")))
        assert tokens(logits, disallowed, temperature, seed) == \
            tokens(full, disallowed, temperature, seed)
    elif projection.used:  # dense: taken only where the argmax is provably the full one's
        assert tokens(logits, disallowed, 0.0, seed) == tokens(full, disallowed, 0.0, seed)
    else:  # the margin check refused: the full projection, as it was
        assert torch.equal(logits, full)


def test_a_clear_argmax_takes_the_dense_masked_projection_and_a_tie_does_not() -> None:
    head = head_of("dense-float32", 200, 32, 0)
    projection = MaskedProjection(head, 200, threshold=T)
    hidden = torch.randn(1, 32) * 3
    scores = projection.full(hidden)[0]
    top = int(scores.argmax())
    disallowed = torch.ones(1, 200, dtype=torch.bool)
    disallowed[0, [top, int(scores.argmin())]] = False
    logits = projection.project(hidden, ~disallowed, [0])
    assert projection.used == 1 and int(logits[0].argmax()) == top
    assert torch.isneginf(logits[0]).sum() == 198
    # Two tokens with the same weights tie exactly: no margin, the full projection.
    weight = projection.weight
    assert weight is not None
    with torch.no_grad():
        weight[1] = weight[0]
    disallowed = torch.ones(1, 200, dtype=torch.bool)
    disallowed[0, [0, 1]] = False
    assert torch.equal(projection.project(hidden, ~disallowed, [0]), projection.full(hidden))
    assert projection.used == 1


def test_past_the_threshold_or_unmasked_the_projection_is_whole() -> None:
    projection = MaskedProjection(head_of("int8-float32", 300, 32, 1), 300, threshold=8)
    hidden = torch.randn(2, 32)
    disallowed = torch.ones(2, 300, dtype=torch.bool)
    disallowed[0, :3] = False
    disallowed[1, :9] = False  # one row past the threshold: every row whole
    assert torch.equal(projection.project(hidden, ~disallowed, [0, 1]), projection.full(hidden))
    assert torch.equal(projection.project(hidden, None, [0, 1]), projection.full(hidden))
    # A row that does not sample (deferred, failed) is not counted, and gets zeros.
    out = projection.project(hidden, ~disallowed, [0])
    assert projection.used == 1 and not out[1].any() and torch.isfinite(out[0, :3]).all()


def test_where_the_masked_projection_applies(lm: LoadedModel) -> None:
    cpu = torch.device("cpu")
    assert MaskedProjection.for_model(lm.model, lm.vocab_size, cpu, deterministic=True) is None
    meta = torch.device("meta")
    assert MaskedProjection.for_model(lm.model, lm.vocab_size, meta, False) is None
    projection = MaskedProjection.for_model(lm.model, lm.vocab_size, cpu, deterministic=False)
    assert projection is not None and not projection.exact
    greedy = Draw(Sampling(), RowStream(0))
    hot = Draw(Sampling(temperature=0.8), RowStream(0))
    mask = object()
    assert projection.may_use([greedy, None], [mask, None], [None, None], (), [(), ()], [[], []])
    assert not projection.may_use([hot], [mask], [None], (), [()], [[]])  # dense: greedy only
    assert not projection.may_use([greedy], [None], [None], (), [()], [[]])  # unconstrained
    assert not projection.may_use([greedy], [mask], [None], {0}, [()], [[]])  # logprobs
    assert not projection.may_use([greedy], [mask], [object()], (), [()], [[]])  # logit rules
    assert not projection.may_use([greedy], [mask], [None], (), [(1,)], [[]])  # scored
    assert not projection.may_use([greedy], [mask], [None], (), [()], [[3, 4]])  # drafts
    int8 = MaskedProjection(head_of("int8-float32", 50, 16, 0), 50)
    assert int8.may_use([hot], [mask], [None], (), [()], [[]])


job = job_factory(prompt="Pick one", max_tokens=16)
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"},
    "ok": {"type": "boolean"}}, "required": ["color", "n", "ok"]}


def greedy_and_sampled() -> list[Job]:
    return [job(1, constraint=Constraint("json_schema", SCHEMA), max_tokens=40),
            job(2, constraint=Constraint("choice", ["alpha", "beta", "gamma"])),
            job(3, constraint=Constraint("json_schema", SCHEMA), temperature=0.9, seed=7,
                max_tokens=40),
            job(4, constraint=Constraint("choice", ["yes", "no"]), temperature=1.2)]


def run_both(lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, jobs: list[Job],
             **config: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The lines' results with the masked projection off, then on; and the passes it took."""
    results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    made: list[MaskedProjection] = []
    real = MaskedProjection.for_model

    def for_model(*args: Any, **kwargs: Any) -> MaskedProjection | None:
        projection = real(*args, **kwargs)
        made.extend([projection] if projection is not None else [])
        return projection

    for on in (False, True):
        monkeypatch.setattr(model_runner.MaskedProjection, "for_model",
                            for_model if on else (lambda *a, **k: None))
        Engine(lm, EngineConfig(**config)).run(jobs, results[on].append)
    strip = [[{k: v for k, v in r.items() if k != "stats"} for r in results[on]]
             for on in (False, True)]
    return strip[0], strip[1], sum(f.used for f in made)


def test_engine_results_are_the_same_with_the_masked_projection(
        lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    off, on, used = run_both(lm, monkeypatch, greedy_and_sampled(), batch_size=2)
    assert off == on
    assert used > 0


def test_engine_results_are_the_same_with_an_int8_projection(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Int8: sampled rows take the masked projection too (the values are exact).
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32", quantize="int8")
    assert isinstance(lm.model.lm_head, Int8Linear)
    off, on, used = run_both(lm, monkeypatch, greedy_and_sampled(), batch_size=4)
    assert off == on
    assert used > 0


@pytest.mark.heavy
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_compiled_steps_take_the_masked_projection_with_the_same_results(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    hidden_steps: list[bool] = []
    real = compiled.CompiledDecode.run

    def run(self: compiled.CompiledDecode, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden_steps.append(kwargs.get("project", args[4] if len(args) > 4 else True) is False)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(compiled.CompiledDecode, "run", run)
    # Greedy lines only: a dense masked projection takes no sampled row.
    jobs = [job(1, constraint=Constraint("json_schema", SCHEMA), max_tokens=40),
            job(2, constraint=Constraint("json_schema", SCHEMA), prompt="Another", max_tokens=40),
            job(3, constraint=Constraint("choice", ["alpha", "beta", "gamma"]))]
    off, on, used = run_both(lm, monkeypatch, jobs, batch_size=2, compile="on",
                             draft_tokens=0)
    assert off == on
    assert used > 0 and any(hidden_steps)  # compiled steps stopped at hidden states
