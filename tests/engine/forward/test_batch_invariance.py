"""A line's greedy tokens, and their logprobs, do not depend on its neighbours at the
default paths (not only under `--deterministic`): whatever the batch size, the order of
the lines, their prompts' lengths, drafts and prefix-cache hits, on the int kernels
(row-invariant by construction: activations quantised per row, one order of sums) with
every attention call of a float32 or bf16 pass through the one-token rows' operator
(engine/forward/attention.py), so a token fed in a prompt, a fast-forward chunk, a draft
or alone is one computation.

The model is the test suite's tiny Llama quantised to int4 on the project's int kernels,
float32 activations (what `--dtype auto` runs on a CPU without native bf16) and bf16 (with
it: the attention operator reads bf16, prompt tokens run on dense copies in tiles of one
shape, the compiled step rounds each op as eager does).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.engine.forward import attention
from aici_cli.models import LoadedModel, load_model
from aici_cli.models.kernels import int_mm
from aici_cli.models.quant import dense_copies
from aici_cli.models.quant.dense_copies import WideRows

WHY_NOT = int_mm.unusable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no int kernel: {WHY_NOT}")

WORDS = ["sky", "grass", "snow", "planet", "river", "stone", "tree", "cloud", "sea", "sun"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"]}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def lm_int4(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[LoadedModel]:
    """The tiny model at int4, float32 activations (what `--dtype auto` runs on a CPU
    without native bf16: no dense copies, `WideRows.for_model`) and bf16 (with native
    bf16: its prompt tokens on dense copies, made whatever the trial says here, so that
    they are tested on every machine)."""
    lm = load_model(str(tiny_model_dir), device="cpu", dtype=request.param, quantize="int4")
    assert lm.quantize == "int4"
    if request.param == "float32":
        assert WideRows.for_model(lm.model) is None
        yield lm
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
        yield lm
    wide = WideRows.for_model(lm.model)
    assert wide is not None and wide.dense, "no prompt token ran on a dense copy"


def make_jobs(lengths: list[int]) -> list[Job]:
    """One line per prompt length: a shared opening (prefix-cache hits), words repeated (so
    prompt-lookup drafts find matches), every third line held to a JSON schema (its
    fast-forwarded chunks), greedy."""
    jobs = []
    for i, n in enumerate(lengths):
        body = " ".join(WORDS[(i + j) % 4] for j in range(n))
        constraint = Constraint("json_schema", SCHEMA) if i % 3 == 2 else None
        jobs.append(Job(index=i + 1, id=f"l{i}", prompt=f"Answer briefly. {body}",
                        messages=None, max_tokens=12, constraint=constraint, logprobs=0))
    return jobs


def tokens(lm: LoadedModel, jobs: list[Job], batch_size: int, **config: Any
           ) -> dict[str, list[tuple[int, float]]]:
    """Each line's token ids with their raw logprobs: a rounding that depends on the
    neighbours shows in a logprob even where the argmax survives it."""
    engine = Engine(lm, EngineConfig(batch_size=batch_size, **config))
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    out = {}
    for r in results:
        assert r["finish_reason"] != "error", r.get("error")
        out[r["id"]] = [(e["id"], e["logprob"]) for e in r["logprobs"]]
    return out


@pytest.mark.heavy
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=9),
       batch_size=st.integers(1, 8), data=st.data())
def test_a_lines_tokens_do_not_depend_on_its_neighbours(
        lm_int4: LoadedModel, lengths: list[int], batch_size: int, data: Any) -> None:
    jobs = make_jobs(lengths)
    alone = {j.id: tokens(lm_int4, [j], 1)[j.id] for j in jobs}
    order = data.draw(st.permutations(jobs))
    got = tokens(lm_int4, list(order), batch_size)
    for key, want in alone.items():
        assert got[key] == want, (f"line {key} at batch {batch_size}:\n{json.dumps(got[key])}"
                                  f"\n!= {json.dumps(want)}")


def test_a_prompt_split_into_passes_gives_the_same_logits(lm_int4: LoadedModel) -> None:
    """The same 40 prompt tokens fed as one prompt, as a cached prefix and the rest, and
    one token a pass, alone and beside other rows' prompts: the last token's logits bit
    for bit (at bf16 every one of them on the dense copies' tiles)."""
    from aici_cli.engine.forward.cache import row_cache
    from aici_cli.engine.forward.passes import ModelPass

    attention.install(lm_int4.model)
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    def last_logits(splits: list[int], neighbours: int) -> torch.Tensor:
        cache = row_cache(lm_int4.model, lm_int4.model.config.num_hidden_layers,
                          1 + neighbours, 64)
        model_pass = ModelPass(lm_int4, cache)
        fed = 0
        for n in splits:
            # Neighbour rows feed as many tokens of their own beside it, from slot `fed`.
            chunks = [ids[fed : fed + n], *([ids[:n]] * neighbours)]
            with torch.inference_mode():
                out = model_pass.run(0, [fed] * (1 + neighbours), chunks,
                                     [[] for _ in chunks], prompt=[n] * len(chunks))
            fed += n
        return out.next_token_logits(1 + neighbours)[0].clone()

    whole = last_logits([40], 0)
    for splits, neighbours in [([40], 3), ([12, 28], 0), ([30, 5, 5], 2),
                               ([25, *[1] * 15], 0), ([25, *[1] * 15], 4)]:
        assert torch.equal(last_logits(splits, neighbours), whole), (splits, neighbours)



@pytest.mark.subprocess
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_the_compiled_step_gives_the_eager_bits_at_any_row_count(lm_int4: LoadedModel) -> None:
    """The compiled one-token step (`--compile on`) against eager passes, at 1 to 4 rows
    of different lengths: every line's tokens and raw logprobs bit for bit, so a run's
    text does not depend on whether its steps were built yet, nor on how many rows share
    a compiled step."""
    jobs = [dataclasses.replace(j, max_tokens=16) for j in make_jobs([3, 17, 9, 30, 5])]
    eager = tokens(lm_int4, jobs, 4, compile="off", draft_tokens=0)
    for batch_size in (4, 2, 1):
        fast = tokens(lm_int4, jobs, batch_size, compile="on", draft_tokens=0)
        differ = [k for k in eager if fast[k] != eager[k]]
        assert differ == [], f"batch {batch_size}: {differ}: {fast[differ[0]]} != " \
                             f"{eager[differ[0]]}"


def test_a_prompt_that_quotes_another_lines_answer_gets_its_own_keys(
        lm_int4: LoadedModel) -> None:
    """Line B's prompt is line A's prompt and answer: run after A in A's row, B may take
    A's keys, but only of its own kind (a 16-bit run computes prompt tokens on the dense
    copies, generated ones on the int kernels: rows.prompt_keys), so its tokens and
    logprobs are those of B alone."""
    a = make_jobs([12])[0]
    answer = Engine(lm_int4, EngineConfig(batch_size=1))
    done: list[dict[str, Any]] = []
    answer.run([a], done.append)
    b = dataclasses.replace(a, index=2, id="quotes", prompt=a.prompt + done[0]["text"])
    alone = tokens(lm_int4, [b], 1)
    engine = Engine(lm_int4, EngineConfig(batch_size=1, lookahead=1))
    results: list[dict[str, Any]] = []
    engine.run([a, b], results.append)
    after = next(r for r in results if r["id"] == "quotes")
    assert [(e["id"], e["logprob"]) for e in after["logprobs"]] == alone["quotes"]
    prompt_a = len(lm_int4.tokenizer(a.prompt)["input_ids"])
    cached = after["stats"]["cached_tokens"]
    assert cached > 0  # it took A's keys
    if engine.scheduler.table.prompt_kernels:
        assert cached <= prompt_a  # only A's prompt's
