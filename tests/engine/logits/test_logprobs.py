"""Per-token logprobs: every value against a cache-free forward over the tokens before it
(1e-4 in fp32), for sampled, fast-forwarded and draft tokens alike."""

from __future__ import annotations

import math

import pytest
import torch
from engine_runs import output_ids, run
from factories import job_factory

from aici_cli.core.constraint import Constraint
from aici_cli.models import LoadedModel

TOL = 1e-4


job = job_factory(max_tokens=24, logprobs=3)


def reference(lm: LoadedModel, prompt: str, output: list[int]) -> torch.Tensor:
    """Log-softmax [len(output), V]: row j is the distribution output[j] was drawn from."""
    ids = lm.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids + output])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(output)], dim=-1)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array",
                                                    "items": {"enum": ["red", "blue"]}}},
          "required": ["name", "tags"]}


def test_raw_logprobs_of_sampled_forced_and_draft_tokens(lm: LoadedModel) -> None:
    jobs = [
        job(1, "Once upon a time the the the the", max_tokens=20),  # loops: drafts
        job(2, "Person:", constraint=Constraint("json_schema", SCHEMA)),  # forced keys
        job(3, "Pick a colour:", constraint=Constraint("choice", ["red", "green", "blue"])),
        job(4, "Sampled:", temperature=1.0, logprobs=0),
        job(5, "No logprobs here", logprobs=None),
    ]
    results = run(lm, jobs, batch_size=4)
    assert "logprobs" not in results[5]
    assert sum(r["stats"]["ff_tokens"] for r in results.values()) > 0
    assert sum(r["stats"]["draft_tokens"] for r in results.values()) > 0
    for j in jobs[:4]:
        result = results[j.index]
        entries = result["logprobs"]
        assert len(entries) == result["stats"]["output_tokens"]
        assert all(e is not None for e in entries)
        expected = reference(lm, j.prompt or "", output_ids(result))
        for row, e in zip(expected, entries):
            assert abs(e["logprob"] - float(row[e["id"]])) < TOL
            assert len(e["top_logprobs"]) == j.logprobs
            tops = [t["logprob"] for t in e["top_logprobs"]]
            assert tops == sorted(tops, reverse=True)
            assert tops == pytest.approx(row.topk(len(tops)).values.tolist(), abs=TOL)
            assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        assert lm.tokenizer.decode(output_ids(result), skip_special_tokens=True) == (
            result["text"])


def test_masked_logprobs_follow_the_constraint(lm: LoadedModel) -> None:
    options = ["red", "green", "blue"]
    jobs = [job(1, "Pick a colour:", constraint=Constraint("choice", options), logprobs=20),
            job(2, "Person:", constraint=Constraint("json_schema", SCHEMA))]
    results = run(lm, jobs, batch_size=2, logprobs_mode="masked")
    first = results[1]["logprobs"][0]
    # Only allowed tokens are listed, and they hold all the probability.
    assert 1 <= len(first["top_logprobs"]) <= len(options)
    assert math.fsum(math.exp(t["logprob"]) for t in first["top_logprobs"]) == (
        pytest.approx(1.0, abs=1e-4))
    person = results[2]
    forced = [e for e in person["logprobs"] if e["logprob"] == 0.0]
    assert len(forced) >= person["stats"]["ff_tokens"] > 0
    assert all(e["top_logprobs"] == [{k: v for k, v in e.items() if k != "top_logprobs"}]
               for e in forced)
    assert all(e["logprob"] <= 0.0 for e in person["logprobs"])
