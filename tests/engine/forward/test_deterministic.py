"""`--deterministic`: a line's tokens, and the logprob of every one, are bit-identical
whatever its batch size, neighbours, row, drafts, prefix-cache hits and `n`.

The engine runs here compare token ids and raw logprobs for equality (not closeness): the
logprobs are the model's own log-softmax at each position, so one rounding that depends
on the batch shows up as a differing float even where the argmax survives it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.cli.main import main
from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import ModelError
from aici_cli.core.job import Job
from aici_cli.core.sampling import Sampling
from aici_cli.engine import Engine, deterministic_check
from aici_cli.engine.forward.deterministic import TILE_ROWS, deterministic_linear
from aici_cli.models import LoadedModel, load_model

PREFIX = "Write the answer as JSON. Question: "


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 48), (48, 200)])
def test_linear_rows_do_not_depend_on_how_many_rows_share_the_gemm(
        dtype: torch.dtype, k: int, n: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype) * 0.1
    b = torch.randn(n, dtype=dtype)
    x = torch.randn(300, k, dtype=dtype)
    alone = torch.cat([deterministic_linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in (*range(2, TILE_ROWS + 3), 33, 100, 257, 300):
        assert torch.equal(deterministic_linear(x[:m], w, b), alone[:m]), f"{m} rows"
    # Rows of one GEMM in another order come out the same too.
    perm = torch.randperm(40)
    assert torch.equal(deterministic_linear(x[:40][perm], w, b), alone[:40][perm])
    # A 3-D input (the packed [1, T, K]) keeps its shape.
    assert deterministic_linear(x[None, :5], w, b).shape == (1, 5, n)


def test_plain_linear_differs_by_row_count_in_float32() -> None:
    """Why the padding exists: without it a float32 row computed alone (a GEMV) is not the
    same row computed in a batch on this machine's BLAS. Skipped where the BLAS happens to
    agree (then the padding is harmless)."""
    torch.manual_seed(0)
    w, x = torch.randn(576, 576), torch.randn(8, 576)
    if torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1]):
        pytest.skip("this BLAS computes a lone row like a batched one")
    assert torch.equal(deterministic_linear(x[:1], w, None), deterministic_linear(x, w, None)[:1])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def lm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype=request.param)


def jobs() -> list[Job]:
    """Lines of varied prompt lengths (several share a prefix, for cache hits), greedy and
    seeded-sampled, free and constrained (the grammar fast-forwards), one with n = 2."""
    questions = ["sky?", "the colour of grass, in one word?",
                 "snow " * 12, "x", "the largest planet?", "a long " * 20 + "question?"]
    constraints = [None, Constraint("regex", "[a-z]{2,12}( [a-z]{2,9}){0,3}"),
                   Constraint("json_schema", {"type": "object", "properties": {
                       "answer": {"type": "string", "maxLength": 12},
                       "score": {"type": "integer"}}, "required": ["answer", "score"]})]
    out = []
    for i, q in enumerate(questions):
        out.append(Job(
            index=i + 1, id=f"j{i}", prompt=PREFIX + q, messages=None, max_tokens=14,
            sampling=Sampling(temperature=0.0 if i % 3 else 0.9, top_p=1.0 if i % 2 else 0.8,
                              seed=i),
            constraint=constraints[i % 3], logprobs=0, n=2 if i == 4 else 1))
    return out


def signatures(lm: LoadedModel, batch_size: int, **config: Any) -> dict[str, Any]:
    """Each line's token ids with their raw logprobs, per sample."""
    engine = Engine(lm, EngineConfig(batch_size=batch_size, deterministic=True, **config))
    results: list[dict[str, Any]] = []
    engine.run(jobs(), results.append)
    return {r["id"]: _tokens(r) for r in results}


def _tokens(result: dict[str, Any]) -> Any:
    assert result["finish_reason"] != "error", result.get("error")
    samples: Sequence[dict[str, Any]] = result.get("choices") or [result]
    return [[(e["id"], e["logprob"]) for e in s["logprobs"]] for s in samples]


@pytest.mark.heavy
def test_tokens_and_logprobs_are_the_same_in_any_batch(lm: LoadedModel) -> None:
    reference = signatures(lm, 1, draft_tokens=0, prefix_cache=False)
    assert all(reference[k] and all(reference[k]) for k in reference)
    for batch_size, drafts, prefix_cache in [(1, 4, True), (3, 4, True), (8, 4, True),
                                             (8, 0, False), (16, 4, True)]:
        got = signatures(lm, batch_size, draft_tokens=drafts, prefix_cache=prefix_cache)
        for key, tokens in reference.items():
            assert got[key] == tokens, (
                f"line {key} at batch {batch_size}, drafts {drafts}, "
                f"prefix cache {prefix_cache}:\n{json.dumps(got[key])}\n"
                f"!= {json.dumps(tokens)}")


# ------------------------------------------------------- any batch, order, cache state

@pytest.mark.heavy
@settings(max_examples=5, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(order=st.permutations(range(6)), batch_size=st.integers(2, 7),
       drafts=st.sampled_from([0, 4]), lookahead=st.sampled_from([1, 3, 64]),
       warm=st.booleans())
def test_any_batch_order_and_cache_state_gives_the_tokens_of_batch_1(
        lm: LoadedModel, reference: dict[str, Any], order: list[int], batch_size: int,
        drafts: int, lookahead: int, warm: bool) -> None:
    """Lines in any arrival order, at any batch size, lookahead and drafts, with the rows'
    caches cold or already holding other lines' prefixes (`warm`: the same engine ran
    the lines once before): every line's tokens and raw logprobs are batch 1's."""
    engine = Engine(lm, EngineConfig(batch_size=batch_size, deterministic=True,
                                     draft_tokens=drafts, lookahead=lookahead))
    lines = [jobs()[i] for i in order]
    if warm:
        engine.run(list(reversed(lines)), lambda r: None)
    results: list[dict[str, Any]] = []
    engine.run(lines, results.append)
    got = {r["id"]: _tokens(r) for r in results}
    assert got == reference


@pytest.fixture(scope="module")
def reference(lm: LoadedModel) -> dict[str, Any]:
    return signatures(lm, 1, draft_tokens=0, prefix_cache=False)


# ------------------------------------------------------------- the machine check

@pytest.mark.heavy
def test_the_machine_check_passes_here_and_is_cached(lm: LoadedModel, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    Engine(lm, EngineConfig(deterministic=True))
    [verdict] = list((tmp_path / "invariance").glob("*.json"))
    assert json.loads(verdict.read_text())["ok"] is True

    def checked(*args: Any) -> None:
        raise AssertionError("checked again: the verdict was not cached")

    monkeypatch.setattr(deterministic_check, "kernel_problem", checked)
    Engine(lm, EngineConfig(deterministic=True))


def test_a_machine_whose_gemm_rounds_by_row_count_is_refused(
        lm: LoadedModel, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake BLAS whose rounding depends on how many rows share the GEMM (as some CPUs'
    and GPUs' do): the mode refuses with a one-line reason, in the library and the CLI."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))

    def by_row_count(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        out = deterministic_linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return out + (1e-3 if rows % 2 else 0.0)

    monkeypatch.setattr(deterministic_check, "deterministic_linear", by_row_count)
    with pytest.raises(ModelError, match="cannot be guaranteed on this machine: .*rounds"):
        Engine(lm, EngineConfig(deterministic=True))
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    res = CliRunner().invoke(main, ["run", str(src), "--model", str(tiny_model_dir),
                                    "--dtype", str(lm.dtype).removeprefix("torch."),
                                    "--deterministic", "-q"])
    assert res.exit_code == 2
    assert "--deterministic cannot be guaranteed on this machine" in res.output
    assert len(res.output.strip().splitlines()) == 1
