"""The example controllers, built with the real toolchain, run through `aici-batch run`.

Building takes about 10 s per example and compiling it in wasmtime a few more (cached on
disk afterwards), so the components are built once per session (`built`, in conftest.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
from controller_runs import run_controller


def test_yes_no_segments_and_outputs(tiny_model_dir: Path, built: dict[str, Path]) -> None:
    code, results = run_controller(tiny_model_dir, built["yes_no"], [
        {"prompt": "Is the sky blue?", "controller_arg": {"question": "sky"}},
        {"prompt": "Is water dry?"},
    ])
    assert code == 0, results
    for r in results.values():
        assert r["finish_reason"] == "stop"
        assert r["outputs"]["answer"] in ("yes", "no")
        assert r["text"].startswith(" Answer: " + r["outputs"]["answer"] + "\nReason: ")
        assert r["outputs"]["reason"] == r["text"].split("\nReason: ", 1)[1].strip()
        assert r["stats"]["ff_tokens"] > 0  # the fixed text was forced, not sampled
        assert r["stats"]["guest_ms"] > 0
    assert "question: sky" in results[1]["logs"]


def test_per_token_controller_never_samples_lowercase(tiny_model_dir: Path,
                                                      built: dict[str, Path]) -> None:
    code, results = run_controller(tiny_model_dir, built["no_lowercase"], [
        {"prompt": "Shout something", "controller_arg": {"max_tokens": 12}},
        {"prompt": "Another one", "controller_arg": "{\"max_tokens\": 5}"},
    ], "--max-tokens", "40")
    assert code == 0, results
    for r in results.values():
        assert r["finish_reason"] == "stop"
        assert not re.search(r"[a-z]", r["text"]), r["text"]
    assert results[1]["stats"]["output_tokens"] <= 12
    assert results[2]["stats"]["output_tokens"] <= 5


def test_multi_step_program_with_json_segment(tiny_model_dir: Path,
                                              built: dict[str, Path]) -> None:
    code, results = run_controller(tiny_model_dir, built["profile"], [
        {"prompt": "Make up a person."},
    ], "--max-tokens", "200")
    r = results[1]
    assert code == 0, r
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "languages": {"type": "array", "items": {"type": "string"},
                                     "maxItems": 5}},
        "required": ["name", "age", "languages"], "additionalProperties": False,
    }
    jsonschema.validate(r["outputs"]["profile"], schema)
    assert r["outputs"]["name"] == r["outputs"]["profile"]["name"]
    assert "\nProfile (JSON): " in r["text"] and "\nBio: " in r["text"]


def test_splice_rewrites_the_generated_word(tiny_model_dir: Path,
                                            built: dict[str, Path]) -> None:
    code, results = run_controller(tiny_model_dir, built["rewrite"], [
        {"prompt": f"Pick a name {i}"} for i in range(6)
    ])
    assert code == 0, results
    for r in results.values():
        out = r["outputs"]
        assert out["final"] == out["word"][:1].upper() + out["word"][1:]
        assert out["rewrote"] == (out["final"] != out["word"])
        # The kept text holds the final word only: the original was backtracked.
        assert r["text"] == f"Name: {out['final']}.\n"


def test_controller_arg_from_cli_and_bad_lines(tiny_model_dir: Path,
                                               built: dict[str, Path]) -> None:
    code, results = run_controller(tiny_model_dir, built["no_lowercase"], [
        {"prompt": "A"},
        {"prompt": "B", "regex": "[0-9]+"},
        {"prompt": "C", "controller_arg": {"max_tokens": 0}},
    ], "--controller-arg", '{"max_tokens": 3}')
    assert code == 1
    assert results[1]["stats"]["output_tokens"] <= 3
    assert results[2]["error"]["type"] == "invalid_line"
    assert results[3]["finish_reason"] == "error"
    assert "max_tokens must be at least 1" in results[3]["error"]["message"]


@pytest.mark.parametrize("name", ["yes_no", "profile", "rewrite"])
def test_drafts_inside_segments_change_no_output(tiny_model_dir: Path, built: dict[str, Path],
                                                 name: str) -> None:
    """Prompt-lookup drafts run inside a wasm controller's grammar segments; what each
    example writes (text, outputs) is the same with them off. One row a pass: a row
    drafts there from a lower gain than among others (engine/draft.py)."""
    lines = [{"prompt": f"Make up a person {i}. Make up a person {i}."} for i in range(3)]
    off = run_controller(tiny_model_dir, built[name], lines, "--max-tokens", "120",
                         "--draft-tokens", "0", "--batch-size", "1")
    on = run_controller(tiny_model_dir, built[name], lines, "--max-tokens", "120",
                        "--draft-tokens", "6", "--batch-size", "1")
    assert off[0] == on[0]
    for i, r in off[1].items():
        assert on[1][i]["text"] == r["text"]
        assert on[1][i].get("outputs") == r.get("outputs")
    if name == "yes_no":  # its free-text segment loops on the tiny model: drafts were taken
        assert sum(r["stats"]["draft_tokens"] for r in on[1].values()) > 0


def test_vote_forks_and_reports_the_majority(tiny_model_dir: Path,
                                             built: dict[str, Path]) -> None:
    """vote.py as a component: 5 branches (the prompt computed once), each with an answer,
    the line's outputs counted from the line's storage by the last branch to answer."""
    arg = {"pattern": "[a-c]", "max_tokens": 2}
    code, results = run_controller(tiny_model_dir, built["vote"], [
        {"prompt": "Pick a letter: a, b or c.", "controller_arg": arg, "seed": 1},
        {"prompt": "Another pick.", "controller_arg": {**arg, "branches": 3}, "seed": 2},
    ], "--temperature", "1.0")
    assert code == 0, results
    for index, n in ((1, 5), (2, 3)):
        r = results[index]
        assert r["finish_reason"] == "stop" and r["branches"] == n
        answers = [c["outputs"]["answer"] for c in r["choices"]]
        assert [c["branch"] for c in r["choices"]] == [[k] for k in range(n)]
        assert all(a in ("a", "b", "c") and c["text"] == a
                   for a, c in zip(answers, r["choices"]))
        votes = {a: answers.count(a) for a in answers}
        assert r["outputs"]["votes"] == votes  # (keys in the order the branches answered)
        assert votes[r["outputs"]["answer"]] == max(votes.values())
        assert set(r["outputs"]) == {"answer", "votes"}
        # One branch computed the prompt; the others took its keys (all but the last token,
        # which each row feeds for its own logits).
        prompt = r["choices"][0]["stats"]["prompt_tokens"]
        assert sorted(c["stats"]["cached_tokens"] for c in r["choices"]) == (
            [0] + [prompt - 1] * (n - 1))


@pytest.mark.real_model
def test_vote_on_the_default_model(built: dict[str, Path]) -> None:
    """vote.py through `aici-batch run` on the default model (SmolLM2-135M-Instruct)."""
    question = {"role": "user", "content": "Is the sky blue on a clear day? Answer yes or no."}
    lines = [{"messages": [question], "seed": 7,
              "controller_arg": {"pattern": "(yes|no|Yes|No)", "max_tokens": 3}}]
    code, results = run_controller(None, built["vote"], lines, "--temperature", "0.8")
    assert code == 0
    r = results[1]
    assert r["finish_reason"] == "stop" and r["branches"] == 5
    answers = [c["outputs"]["answer"] for c in r["choices"]]
    assert all(a in ("yes", "no", "Yes", "No") and c["text"] == a
               for a, c in zip(answers, r["choices"]))
    votes = r["outputs"]["votes"]
    assert votes == {a: answers.count(a) for a in answers}
    assert votes[r["outputs"]["answer"]] == max(votes.values())
    assert sum(c["stats"]["cached_tokens"] > 0 for c in r["choices"]) == 4
    assert all(c["stats"]["replay_ms"] > 0 for c in r["choices"] if c["branch"] != [0])
