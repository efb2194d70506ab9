"""Penalties, logit_bias, min_tokens, stop_token_ids, ignore_eos, top_k, min_p and seed:
the math against a hand computation, greedy outputs against a cache-free reference, drafts
and fast-forward exact under them, constraints kept, and every field through `aici-batch
run` in both input formats, bad values included."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from engine_runs import output_ids, run
from factories import job_factory

from aici_cli.cli.main import main
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import Job
from aici_cli.core.sampling import Sampling
from aici_cli.engine import model_runner
from aici_cli.engine.logits.logit_rules import LogitRules, apply_rules
from aici_cli.engine.logits.sampler import Draw, row_stream, sample
from aici_cli.formats.jobs import load_schema
from aici_cli.formats.openai_batch import COMPLETIONS
from aici_cli.models import LoadedModel

NEG_INF = float("-inf")


job = job_factory(prompt="the quick brown fox the quick brown fox the quick",
                  max_tokens=24, logprobs=0)


def single_token(lm: LoadedModel, text: str) -> int:
    [token] = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(token)


# ------------------------------------------------------------------ the math, by hand

def rules(prompt: tuple[int, ...] = (0,), **kw: Any) -> LogitRules:
    made = LogitRules.of(job(1, **kw), list(prompt), {5})
    assert made is not None
    return made


def test_bias_then_repetition_then_frequency_and_presence_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -2.0],
                           [-1.0, 1.0, 0.25, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    a = rules(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
              logit_bias=((1, 1.5),))
    a.sync([4, 4, 2])  # 4 twice, 2 once; the prompt holds 0
    b = rules(prompt=(0, 1), repetition_penalty=0.5)  # below 1: repeats are favoured
    c = rules(frequency_penalty=1.0, min_tokens=3)
    c.sync([3])
    apply_rules(logits, [0, 1, 2], [a, b, c], [[], [], [3, 1]], [False, False, True])
    # a: bias first (-1 + 1.5 = 0.5, so token 1 is not a repeat and stays 0.5); then
    # repetition on the tokens of prompt + output (0: 2 / 2, 2: 0.5 / 2, 4: 3 / 2); then
    # 4: 1.5 - 0.5 * 2 - 0.25 and 2: 0.25 - 0.5 * 1 - 0.25.
    assert logits[0].tolist() == [1.0, 0.5, -0.5, 0.0, 0.25, -2.0]
    # b: a negative logit is multiplied, a positive one divided.
    assert logits[1].tolist() == [-0.5, 2.0, 0.25, 0.0, 0.0, 0.0]
    # c: the output [3] followed by the draft tokens [3, 1]; EOS (5) held back.
    assert logits[2].tolist() == [0.0, -1.0, 0.0, -2.0, 0.0, NEG_INF]


def test_counts_follow_backtracks() -> None:
    r = rules(frequency_penalty=1.0, repetition_penalty=2.0)
    r.sync([4, 4, 2])
    r.truncate([4, 4, 2], 1)  # a backtrack of 2
    r.sync([4, 3])
    assert r.counts == {4: 1, 3: 1}
    logits = torch.full((1, 6), 4.0)
    apply_rules(logits, [0], [r], None, [False])
    # 0 is in the prompt, 3 and 4 in the output; 2 was backtracked away.
    assert logits[0].tolist() == [2.0, 4.0, 4.0, 1.0, 1.0, 4.0]


def test_lines_without_rules_build_none() -> None:
    assert LogitRules.of(job(1), [0], {5}) is None
    # Sampling filters and stopping fields do not touch the logits before the mask.
    plain = job(1, top_k=3, min_p=0.1, ignore_eos=True, stop_token_ids=frozenset({2}))
    assert LogitRules.of(plain, [0], {5}) is None


def test_top_k_and_min_p_keep_only_their_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])

    def drawn(**kw: Any) -> set[int]:
        sampling = Sampling(temperature=1.0, **kw)
        return {int(sample(logits, torch.tensor([4]), [0], [Draw(sampling, row_stream(seed))])[0])
                for seed in range(300)}

    assert drawn() == {0, 1, 2, 3, 4}
    assert drawn(top_k=2, min_p=0.0) == {3, 4}
    assert drawn(top_k=1, min_p=0.0) == {4}
    # p(3) / p(4) = e^-1 ~ 0.37: kept at min_p 0.3, dropped at 0.5.
    assert drawn(top_k=0, min_p=0.3) == {3, 4}
    assert drawn(top_k=0, min_p=0.5) == {4}


# ----------------------------------------------------------- the engine, token by token

def hand_penalised(logits: torch.Tensor, prompt: list[int], output: list[int], j: Job,
                   eos: int) -> torch.Tensor:
    """The logits of the position after `output`, penalised with plain Python loops."""
    x = logits.clone()
    s = j.sampling
    for token, bias in s.logit_bias:
        x[token] += bias
    for token in set(prompt) | set(output):
        value = float(x[token])
        x[token] = value / s.repetition_penalty if value > 0 else value * s.repetition_penalty
    for token in set(output):
        x[token] -= s.frequency_penalty * output.count(token) + s.presence_penalty
    if len(output) < s.min_tokens:
        x[eos] = NEG_INF
    return x


@pytest.mark.parametrize("fields", [
    dict(frequency_penalty=0.7),
    dict(presence_penalty=1.5),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=-0.4, presence_penalty=0.9,
         logit_bias=((7, 2.5), (100, -3.0))),
    dict(min_tokens=6, logit_bias=((1, 4.0),)),  # EOS (1) favoured, held for 6 tokens
])
def test_greedy_output_is_the_penalised_argmax_at_every_token(lm: LoadedModel,
                                                              fields: dict[str, Any]) -> None:
    [eos] = lm.eos_token_ids
    j = job(1, max_tokens=16, **fields)
    result = run(lm, [j])[1]
    output = output_ids(result)
    prompt = lm.tokenizer(j.prompt)["input_ids"]
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    plain_picks = []
    for at in range(len(output) + (result["finish_reason"] == "stop")):
        row = logits[len(prompt) - 1 + at]
        expected = output[at] if at < len(output) else eos
        assert int(hand_penalised(row, prompt, output[:at], j, eos).argmax()) == expected, at
        plain_picks.append(int(row.argmax()))
    assert plain_picks != output  # the rules changed what greedy decoding writes


@pytest.mark.heavy
def test_drafts_stay_exact_under_penalties(lm: LoadedModel,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts are checked against the penalised argmax, with the counts of the draft
    tokens before each position: greedy outputs equal those without drafts, token by
    token; checking against the raw argmax instead would change them."""
    prompts = ["the quick brown fox the quick brown fox the quick",
               "Hello World Hello World Hello", "a b a b a b a b"]
    settings: list[dict[str, Any]] = [
        dict(presence_penalty=0.5), dict(frequency_penalty=-0.5),
        dict(repetition_penalty=0.8, presence_penalty=-1.0),
        dict(frequency_penalty=0.3, repetition_penalty=0.9, min_tokens=10),
        dict(logit_bias=((7, 1.0),), presence_penalty=0.5),
    ]
    jobs = [job(10 * i + k, p, max_tokens=40, **s)
            for i, s in enumerate(settings) for k, p in enumerate(prompts)]
    plain = run(lm, jobs, batch_size=4, draft_tokens=0)
    drafted = run(lm, jobs, batch_size=4, draft_tokens=4)
    for i in plain:
        assert output_ids(drafted[i]) == output_ids(plain[i]), i
        assert drafted[i]["finish_reason"] == plain[i]["finish_reason"]
    assert sum(r["stats"]["draft_tokens"] for r in drafted.values()) > 100

    # Inside the runner: without its check of drafts under penalties, outputs differ.
    monkeypatch.setattr(model_runner, "checked_draft_picks",
                        lambda out, picks, rules, outputs, drafts, b, failed: picks)
    unaccounted = run(lm, jobs, batch_size=4, draft_tokens=4)
    assert any(output_ids(unaccounted[i]) != output_ids(plain[i]) for i in plain)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "tags": {"type": "array", "items": {"enum": ["quick", "brown"]}, "maxItems": 4}},
    "required": ["name", "tags"], "additionalProperties": False}


def test_fast_forward_and_drafts_stay_exact_under_rules_with_a_grammar(
        lm: LoadedModel) -> None:
    fields: dict[str, Any] = dict(presence_penalty=0.8, repetition_penalty=1.2,
                                  logit_bias=((7, 3.0),), max_tokens=60,
                                  constraint=Constraint("json_schema", SCHEMA))
    jobs = [job(1, **fields), job(2, prompt="A list", **fields)]
    base = run(lm, jobs, fast_forward=False, draft_tokens=0)
    for config in (dict(fast_forward=True, draft_tokens=0),
                   dict(fast_forward=True, draft_tokens=4)):
        other = run(lm, jobs, **config)
        for i in base:
            assert other[i]["text"] == base[i]["text"], (config, i)
    assert all(r["valid"] for r in base.values())


def test_a_strong_logit_bias_cannot_break_the_constraint(lm: LoadedModel) -> None:
    tokenizer = lm.tokenizer
    letters = sorted({single_token(lm, c) for c in "xyzq"})
    quote, brace = single_token(lm, '"'), single_token(lm, "}")
    jobs = [
        # Everything the grammar needs next pushed down, what it forbids pushed up.
        job(1, constraint=Constraint("json_schema", SCHEMA), max_tokens=60,
            logit_bias=tuple(sorted({(quote, -100.0), (brace, 100.0)}
                                    | {(t, 100.0) for t in letters}))),
        job(2, constraint=Constraint("regex", "[0-9]{3}"),
            logit_bias=tuple((t, 100.0) for t in letters)),
        job(3, constraint=Constraint("choice", ["yes", "no"]), min_tokens=5,
            ignore_eos=True, logit_bias=((lm.tokenizer("no")["input_ids"][0], 50.0),)),
    ]
    results = run(lm, jobs)
    assert results[1]["valid"], results[1]["text"]
    jsonschema.validate(json.loads(results[1]["text"]), SCHEMA)
    assert results[2]["text"].isdigit() and len(results[2]["text"]) == 3
    # The grammar's end ends the line, min_tokens and ignore_eos notwithstanding.
    assert results[3]["text"] in ("yes", "no") and results[3]["finish_reason"] == "stop"
    assert tokenizer.decode(output_ids(results[2])) == results[2]["text"]


def test_min_tokens_ignore_eos_and_stop_token_ids(lm: LoadedModel) -> None:
    [eos] = lm.eos_token_ids
    fox = single_token(lm, " fox")
    eager = ((eos, 100.0),)  # EOS as soon as it may come
    results = run(lm, [
        job(1, logit_bias=eager),
        job(2, logit_bias=eager, min_tokens=3),
        job(3, logit_bias=eager, ignore_eos=True, max_tokens=5),
        job(4, logit_bias=((fox, 100.0),), max_tokens=6),
        job(5, logit_bias=((fox, 100.0),), stop_token_ids=frozenset({fox})),
        job(6, logit_bias=((fox, 100.0),), stop_token_ids=frozenset({fox}), min_tokens=2),
        job(7, logit_bias=((fox, 100.0),), stop=("fox",), min_tokens=2),
    ])
    assert (results[1]["stats"]["output_tokens"], results[1]["finish_reason"]) == (0, "stop")
    assert (results[2]["stats"]["output_tokens"], results[2]["finish_reason"]) == (3, "stop")
    # With ignore_eos the EOS tokens are output tokens (empty text) up to max_tokens.
    assert output_ids(results[3]) == [eos] * 5 and results[3]["finish_reason"] == "length"
    assert results[3]["text"] == ""
    assert results[4]["text"] == " fox" * 6
    # A stop token id ends the line and stays out of the text and the token count.
    assert (results[5]["text"], results[5]["finish_reason"]) == ("", "stop")
    assert results[5]["stats"]["output_tokens"] == 0
    # Before min_tokens a stop token id is held back like EOS: two other tokens first.
    assert results[6]["stats"]["output_tokens"] == 2 and results[6]["finish_reason"] == "stop"
    assert "fox" not in results[6]["text"]
    # No stop string ends within the first min_tokens tokens' text (as vLLM).
    assert (results[7]["text"], results[7]["finish_reason"]) == (" fox fox ", "stop")


def test_a_fast_forwarded_stop_token_id_ends_the_line_as_a_sampled_one(
        lm: LoadedModel) -> None:
    """The grammar forces `{"name": "` (the value's quote a token of its own); a stop
    token id among the forced tokens cuts the line there with fast-forward on or off."""
    stop = single_token(lm, '"')
    jobs = [job(1, constraint=Constraint("json_schema", SCHEMA),
                stop_token_ids=frozenset({stop}), max_tokens=30)]
    on = run(lm, jobs, fast_forward=True)[1]
    off = run(lm, jobs, fast_forward=False)[1]
    assert on["text"] == off["text"] == '{"name": '
    assert on["finish_reason"] == off["finish_reason"] == "stop"
    assert on["stats"]["ff_tokens"] > 0 and off["stats"]["ff_tokens"] == 0


def test_rules_leave_raw_logprobs_as_the_model_gives_them(lm: LoadedModel) -> None:
    """Raw logprobs are the model's (as vLLM reports them by default); masked ones are
    those of the distribution the rules and the mask leave."""
    j = job(1, presence_penalty=2.0, max_tokens=8, logprobs=2)
    raw = run(lm, [j])[1]
    masked = run(lm, [j], logprobs_mode="masked")[1]
    output = output_ids(raw)
    assert output_ids(masked) == output
    prompt = lm.tokenizer(j.prompt)["input_ids"]
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    for at, (r, m) in enumerate(zip(raw["logprobs"], masked["logprobs"])):
        row = logits[len(prompt) - 1 + at]
        plain = torch.log_softmax(row, dim=-1)[output[at]]
        ruled = torch.log_softmax(hand_penalised(row, prompt, output[:at], j, -1), dim=-1)
        assert math.isclose(r["logprob"], float(plain), abs_tol=1e-4)
        assert math.isclose(m["logprob"], float(ruled[output[at]]), abs_tol=1e-4)
    assert any(not math.isclose(r["logprob"], m["logprob"], abs_tol=1e-3)
               for r, m in zip(raw["logprobs"], masked["logprobs"]))


def test_sampled_lines_with_rules_do_not_depend_on_the_batch(lm: LoadedModel) -> None:
    jobs = [job(i, prompt=f"prompt number {i}", temperature=0.9, top_k=20, min_p=0.05,
                presence_penalty=0.5, max_tokens=10) for i in range(1, 6)]
    texts = [{i: r["text"] for i, r in run(lm, jobs, batch_size=bs).items()} for bs in (1, 5)]
    assert texts[0] == texts[1]


# --------------------------------------------------------------- through `aici-batch run`

PROMPT = "the quick brown fox the quick"


def good_lines(lm: LoadedModel) -> dict[str, dict[str, Any]]:
    """One line per field (and a baseline), with what it should do checked below."""
    [eos] = lm.eos_token_ids
    fox = single_token(lm, " fox")
    quick = single_token(lm, " quick")
    return {
        "baseline": {},
        "frequency_penalty": {"frequency_penalty": 2},
        "presence_penalty": {"presence_penalty": 2},
        "repetition_penalty": {"repetition_penalty": 2},
        "logit_bias": {"logit_bias": {str(fox): 100}},
        "min_tokens": {"min_tokens": 3, "logit_bias": {str(eos): 100}},
        "stop_token_ids": {"stop_token_ids": [quick]},
        "ignore_eos": {"ignore_eos": True, "logit_bias": {str(eos): 100}},
        "top_k": {"top_k": 1, "temperature": 2.0},
        "min_p": {"min_p": 1.0, "temperature": 2.0},
        "seed": {"seed": 5, "temperature": 1.0},
        "seed_again": {"seed": 5, "temperature": 1.0},
    }


BAD: dict[str, list[Any]] = {
    "frequency_penalty": [2.5, "x"],
    "presence_penalty": [-3, True],
    "repetition_penalty": [0, -1],
    "logit_bias": [{"abc": 1}, {"5": 101}, {"999999": 1}, [5]],
    "min_tokens": [-1, 9],  # 9 > max_tokens
    "stop_token_ids": [[-1], [999999], "3"],
    "ignore_eos": ["yes"],
    "top_k": [-2, 1.5],
    "min_p": [1.5, -0.1],
    "seed": [-1, 2**63, "x"],
}


def check_good(lm: LoadedModel, results: dict[str, dict[str, Any]]) -> None:
    """What each field does, from the texts, finish reasons and token counts."""
    base = results["baseline"]
    assert base["text"].startswith(" quick")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        assert results[name]["text"] != base["text"], name
    assert results["logit_bias"]["text"] == " fox" * 8
    assert results["min_tokens"]["tokens"] == 3 and results["min_tokens"]["finish"] == "stop"
    # The first token is " quick": the line ends there, the token left out.
    assert (results["stop_token_ids"]["text"], results["stop_token_ids"]["finish"],
            results["stop_token_ids"]["tokens"]) == ("", "stop", 0)
    assert results["ignore_eos"]["tokens"] == 8 and results["ignore_eos"]["finish"] == "length"
    assert results["top_k"]["text"] == results["min_p"]["text"] == base["text"]
    assert results["seed"]["text"] == results["seed_again"]["text"] != base["text"]


def run_cli(path: Path, tiny_model_dir: Path, *options: str) -> list[dict[str, Any]]:
    out = path.with_suffix(".out.jsonl")
    res = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--model",
                                    str(tiny_model_dir), "--dtype", "float32", "-q",
                                    *options])
    assert res.exit_code in (0, 1), res.output
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_every_field_through_the_cli_in_the_own_format(lm: LoadedModel, tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    good = good_lines(lm)
    rows = [{"id": name, "prompt": PROMPT, "max_tokens": 8, **fields}
            for name, fields in good.items()]
    rows += [{"id": f"bad {name} {i}", "prompt": PROMPT, "max_tokens": 8, name: value}
             for name, values in BAD.items() for i, value in enumerate(values)]
    src = tmp_path / "lines.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    validator = jsonschema.Draft202012Validator(load_schema("result-line"))
    results = {}
    for r in run_cli(src, tiny_model_dir):
        validator.validate(r)
        results[r["id"]] = r
    check_good(lm, {name: {"text": r["text"], "finish": r["finish_reason"],
                           "tokens": r["stats"]["output_tokens"]}
                    for name, r in results.items() if name in good})
    for name, values in BAD.items():
        for i in range(len(values)):
            r = results[f"bad {name} {i}"]
            assert r["finish_reason"] == "error", (name, values[i])
            assert f"field '{name}" in r["error"]["message"], r["error"]


def test_every_field_through_the_cli_in_the_openai_format(lm: LoadedModel,
                                                          tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    good = good_lines(lm)

    def request(custom_id: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS,
                "body": {"model": "any", "prompt": PROMPT, "max_tokens": 8, **body}}

    rows = [request(name, **fields) for name, fields in good.items()]
    rows += [request(f"bad {name} {i}", **{name: value})
             for name, values in BAD.items() for i, value in enumerate(values)]
    chat_body = {"model": "any", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 4, "logit_bias": good["logit_bias"]["logit_bias"],
                 "top_k": None, "min_p": None}  # null: unset, as in vLLM
    rows.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                 "body": chat_body})
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    schema = load_schema("openai-batch-output")
    results = {}
    for line in run_cli(src, tiny_model_dir):
        jsonschema.validate(line, schema)
        results[line["custom_id"]] = line

    def summary(line: dict[str, Any]) -> dict[str, Any]:
        choice = line["response"]["body"]["choices"][0]
        return {"text": choice.get("text", choice.get("message", {}).get("content")),
                "finish": choice["finish_reason"],
                "tokens": line["response"]["body"]["usage"]["completion_tokens"]}

    check_good(lm, {name: summary(results[name]) for name in good})
    assert summary(results["chat"])["text"] == " fox" * 4
    for name, values in BAD.items():
        for i in range(len(values)):
            line = results[f"bad {name} {i}"]
            assert line["response"] is None, (name, values[i])
            # The request's own field is named, under `body`.
            assert f"field 'body.{name}" in line["error"]["message"], line["error"]


def test_run_options_are_defaults_for_lines(lm: LoadedModel, tiny_model_dir: Path,
                                            tmp_path: Path) -> None:
    [eos] = lm.eos_token_ids
    rows = [{"id": "a", "prompt": PROMPT, "max_tokens": 6, "logit_bias": {str(eos): 100}},
            {"id": "b", "prompt": PROMPT, "max_tokens": 6, "logit_bias": {str(eos): 100},
             "min_tokens": 0, "ignore_eos": False},
            {"id": "c", "prompt": PROMPT, "max_tokens": 2}]
    src = tmp_path / "lines.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {r["id"]: r for r in run_cli(src, tiny_model_dir, "--min-tokens", "4",
                                           "--ignore-eos", "--presence-penalty", "2",
                                           "--top-k", "5", "--min-p", "0.1")}
    # The run's --ignore-eos and --min-tokens apply where the line is silent.
    assert results["a"]["stats"]["output_tokens"] == 6
    assert results["a"]["finish_reason"] == "length"
    assert results["b"]["stats"]["output_tokens"] == 0
    # --min-tokens 4 is more than this line's max_tokens: its own error, naming the field.
    assert results["c"]["finish_reason"] == "error"
    assert "field 'min_tokens'" in results["c"]["error"]["message"]
    res = CliRunner().invoke(main, ["run", str(src), "--model", str(tiny_model_dir),
                                    "--presence-penalty", "3"])
    assert res.exit_code == 2 and "--presence-penalty" in res.output
