"""Scoring choices by log-likelihood: each score against a direct computation with the
model (one full forward per choice, no cache), to 1e-4 in fp32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from factories import job_factory

from aici_cli.cli.main import main
from aici_cli.core.config import EngineConfig
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.models import LoadedModel

TOL = 1e-4
PREFIX = ("Answer each question with one word.\n"
          "Q: What colour is the sky? A: blue\n"
          "Q: What colour is grass? A: green\n"
          "Q: What colour is snow? A: white\n")
COLOURS = [" black", " white", " red", " green"]


# job(index, prompt, options): a line that scores `options`.
job = job_factory(lambda index, prompt, options: dict(
    prompt=prompt, constraint=Constraint("choice", options)), max_tokens=4, seed=0, score=True)


def direct_logprob(lm: LoadedModel, prompt: str, option: str) -> tuple[float, int]:
    """Sum of log-softmax over the option's tokens, one full forward, no cache."""
    whole = lm.tokenizer(prompt + option)["input_ids"]
    context = lm.tokenizer(prompt)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(whole, context)) if a != b),
                 min(len(whole), len(context)))
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    total = sum(float(logprobs[i - 1, whole[i]]) for i in range(start, len(whole)))
    return total, len(whole) - start


def run(lm: LoadedModel, jobs: list[Job], **config: Any) -> tuple[dict[int, Any], Engine]:
    engine = Engine(lm, EngineConfig(**config))
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    return {r["index"]: r for r in results}, engine


def test_scores_match_a_direct_computation(lm: LoadedModel) -> None:
    cases = [
        (PREFIX + "Q: What colour is coal? A:", COLOURS),
        # No space before the choices: their first token may merge with the prompt's end.
        ("The sky is blu", ["e", "e sky", "x"]),
        ("Pick one:", ["yes", "no", "yes"]),  # a repeated choice scores the same
    ]
    jobs = [job(i + 1, prompt, options) for i, (prompt, options) in enumerate(cases)]
    results, _ = run(lm, jobs, batch_size=3)
    for j, (prompt, options) in zip(jobs, cases):
        result = results[j.index]
        assert result["finish_reason"] == "stop"
        scores = result["scores"]
        assert sorted(s["choice"] for s in scores) == sorted(options)
        assert [s["logprob"] for s in scores] == sorted((s["logprob"] for s in scores),
                                                        reverse=True)
        assert result["text"] == scores[0]["choice"]
        for s in scores:
            expected, tokens = direct_logprob(lm, prompt, s["choice"])
            assert s["tokens"] == tokens
            assert abs(s["logprob"] - expected) < TOL, (s, expected)
            assert s["logprob_per_token"] == pytest.approx(expected / tokens, abs=TOL)
        assert result["stats"]["output_tokens"] == 0  # nothing was generated


def test_a_line_costs_one_pass_once_its_prefix_is_cached(lm: LoadedModel) -> None:
    questions = ["coal", "milk", "a lemon", "blood", "the sea"]
    jobs = [job(i + 1, PREFIX + f"Q: What colour is {q}? A:", COLOURS)
            for i, q in enumerate(questions)]
    results, engine = run(lm, jobs, batch_size=4, lookahead=1)
    prefix = len(lm.tokenizer(PREFIX)["input_ids"]) - 2
    # The first line's choices wait one pass for the one that computes the prompt.
    assert len(engine.step_times) == len(jobs) + 1
    for j in jobs[1:]:
        assert results[j.index]["stats"]["cached_tokens"] >= prefix * len(COLOURS)
        assert results[j.index]["stats"]["forward_passes"] == len(COLOURS)  # one each
    for j in jobs:
        for s in results[j.index]["scores"]:
            expected, _ = direct_logprob(lm, j.prompt or "", s["choice"])
            assert abs(s["logprob"] - expected) < TOL


def test_score_through_the_cli_with_answers_and_accuracy(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    rows = [{"prompt": PREFIX + "Q: What colour is coal? A:", "answer": " black"},
            {"prompt": PREFIX + "Q: What colour is milk? A:", "answer": " white"},
            {"prompt": "Pick one:", "choices": ["yes", "no"], "answer": "maybe"},
            {"prompt": "No choices here", "score": True, "choices": ["a"], "n": 2}]
    src, out, stats = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype",
            "float32", "--score", "--choices", ",".join(COLOURS), "--stats-out", str(stats),
            "-q"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output  # the last line is refused
    results = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [len(results[i]["scores"]) for i in (1, 2, 3)] == [4, 4, 2]
    assert results[3]["correct"] is False and results[3]["answer"] == "maybe"
    assert results[4]["error"]["message"].endswith("'n' must be 1")
    correct = sum(results[i]["correct"] for i in (1, 2, 3))
    summary = json.loads(stats.read_text())
    assert summary["answered"] == 3 and summary["accuracy"] == round(correct / 3, 4)
    report = CliRunner().invoke(main, ["report", str(out), "--json"])
    assert json.loads(report.output)["accuracy"] == summary["accuracy"]


def one_token_options(lm: LoadedModel, prompt: str, candidates: list[str]) -> list[str]:
    """The candidates that add exactly one token to the prompt's tokens."""
    context = lm.tokenizer(prompt)["input_ids"]
    return [c for c in candidates
            if lm.tokenizer(prompt + c)["input_ids"][:-1] == context
            and len(lm.tokenizer(prompt + c)["input_ids"]) == len(context) + 1]


def test_one_token_choices_share_one_row(lm: LoadedModel) -> None:
    """Choices of one token each (MMLU's letters) are scored from one row's next-token
    logits: one pass per line, the same scores, and `greedy` for the model's own pick."""
    prompts = [PREFIX + f"Q: What colour is {q}? A:" for q in ("coal", "milk", "the sea")]
    options = one_token_options(lm, prompts[0], [" the", " a", " model", " token", " yes",
                                                 " no", " key", " name", " value", " id"])
    assert len(options) >= 3 and all(one_token_options(lm, p, options) == options
                                     for p in prompts)
    jobs = [job(i + 1, p, options) for i, p in enumerate(prompts)]
    results, engine = run(lm, jobs, batch_size=2)
    for j in jobs:
        result = results[j.index]
        assert result["stats"]["forward_passes"] == 1
        assert result["stats"]["prompt_tokens"] == len(lm.tokenizer(j.prompt)["input_ids"]) + 1
        with torch.inference_mode():
            ids = lm.tokenizer(j.prompt)["input_ids"]
            logits = lm.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        best = int(logits.argmax())
        for s in result["scores"]:
            expected, tokens = direct_logprob(lm, j.prompt or "", s["choice"])
            assert tokens == 1 and abs(s["logprob"] - expected) < TOL
            token = lm.tokenizer(j.prompt + s["choice"])["input_ids"][-1]
            assert s["greedy"] == (token == best)
    assert len(engine.step_times) <= len(jobs)
