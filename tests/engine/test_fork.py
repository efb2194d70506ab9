"""Forks and storage (contract 0.2.0) in the engine: hand-written WAT guests on the tiny
model (tests/support/wat.py), picked by the first character of a line's `controller_arg`.

What a fork must do: its branches share the keys computed before it (each new branch's
first pass copies them, and its tokens equal a run that never forked), each branch has its
own guest (replayed to the fork point) that learns its index, the line's result lists the
branches in tree order, and each new fault ends its own line only.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
from factories import job_factory
from paths import ROOT
from wat import Guest, component, save, u32s

from aici_cli.control.actions import Sample, StepInput, TokenSet
from aici_cli.control.wasm import ControllerComponent, GuestLimits
from aici_cli.core.config import EngineConfig, RunConfig
from aici_cli.core.errors import ControllerError
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.models import LoadedModel
from aici_cli.run.backends.build import wasm_factory

RESULT_SCHEMA = json.loads((ROOT / "schemas" / "result-line.schema.json").read_text())

# Globals of the guests below: tokens sampled since the fork (-1: before it), the index.
STATE = (
    "(global $since (mut i32) (i32.const -1))",
    "(global $b (mut i32) (i32.const 0))",
)
IDS = {"ids": u32s(10, 11, 12, 13, 14)}

# `$p` = the address of token id 10 + (the branch index), as an allow-list of one.
ALLOW_OWN = "{ids} (local.set $n) (local.set $p) " \
    "(call $sample-allow (i32.add (local.get $p) (i32.shl (global.get $b) (i32.const 2))) " \
    "(i32.const 1))"

# Samples 3 tokens, forks into 3; each branch appends "<index>," to storage `order`, takes
# token 10 + index, samples 3 more tokens, then reports the `order` it sees, its index and
# (branch 2 only) a line output, and stops.
FORK = Guest(
    f"""
    (if (local.get $has-branch) (then
      (global.set $b (local.get $branch))
      (global.set $since (i32.const 0))
      (drop (call $append {{order}} (call $utoa (local.get $branch))))
      (drop (call $append {{order}} {{comma}}))
      (return {ALLOW_OWN})))
    (if (i32.ge_s (global.get $since) (i32.const 0)) (then
      (global.set $since (i32.add (global.get $since) (i32.const 1)))
      (if (i32.ge_s (global.get $since) (i32.const 4)) (then
        (call $get {{order}} (global.get $out))
        (call $set-output {{seen}} (i32.load (i32.const 68)) (i32.load (i32.const 72)))
        (call $set-output {{index}} (call $utoa (global.get $b)))
        (if (i32.eq (global.get $b) (i32.const 2)) (then
          (call $set-line-output {{winner}} {{two}})))
        (return (call $stop))))
      (return (call $sample-all))))
    (if (i32.eq (global.get $calls) (i32.const 4)) (then (return (call $fork (i32.const 3)))))
    (call $sample-all)
    """,
    data={**IDS, "order": "order", "comma": ",", "seen": "seen", "index": "index",
          "winner": "winner", "two": '"branch 2"'},
    funcs=STATE,
)


def unforked(k: int) -> Guest:
    """What branch k of FORK does, without a fork: 3 tokens, token 10 + k, 3 more."""
    return Guest(
        f"""
        (if (i32.eq (global.get $calls) (i32.const 4)) (then
          (global.set $b (i32.const {k}))
          (return {ALLOW_OWN})))
        (if (i32.ge_u (global.get $calls) (i32.const 8)) (then (return (call $stop))))
        (call $sample-all)
        """,
        data=IDS,
        funcs=STATE,
    )


def fork_at_start(n: int, then: str, data: dict[str, Any] | None = None) -> Guest:
    """Forks into `n` at its first call; each branch then runs `then` (its index in $b,
    its calls since the fork, the entry call included, in $since)."""
    return Guest(
        f"""
        (if (local.get $has-branch) (then
          (global.set $b (local.get $branch)) (global.set $since (i32.const 0))))
        (if (i32.lt_s (global.get $since) (i32.const 0)) (then
          (return (call $fork (i32.const {n})))))
        (global.set $since (i32.add (global.get $since) (i32.const 1)))
        {then}
        """,
        data=data or {},
        funcs=STATE,
    )


STOP_AFTER_3 = """
    (if (i32.gt_s (global.get $since) (i32.const 3)) (then (return (call $stop))))
    (call $sample-all)
"""

GUESTS = {
    "F": FORK,
    "0": unforked(0),
    "1": unforked(1),
    "2": unforked(2),
    # forks into 5 at once: more branches than rows
    "W": fork_at_start(5, STOP_AFTER_3),
    # forks into 2; branch 1 forks into 2 again at its first call: paths 0, 1.0, 1.1
    "N": fork_at_start(2, """
        (if (i32.and (i32.eq (global.get $calls) (i32.const 2))  ;; its entry
                     (i32.eq (global.get $b) (i32.const 1))) (then
          (global.set $since (i32.const -1))  ;; the nested fork's entry sets it again
          (global.set $b (i32.const 9))  ;; never read before the entry sets it
          (return (call $fork (i32.const 2)))))
        (if (i32.gt_s (global.get $since) (i32.const 2)) (then (return (call $stop))))
        (call $sample-all)
    """),
    # every branch forks into 3 again at its first call: 1 -> 3 -> 5 -> 7 sequences
    "C": fork_at_start(3, """
        (if (i32.eq (global.get $calls) (i32.const 2)) (then
          (global.set $since (i32.const -1))
          (return (call $fork (i32.const 3)))))
        (call $stop)
    """),
    # after the fork, one token, then a splice that takes back two
    "B": Guest(
        """
        (if (local.get $has-branch) (then
          (global.set $since (i32.const 0)) (return (call $sample-all))))
        (if (i32.eq (global.get $since) (i32.const 0)) (then
          (return (call $splice (i32.const 2) (i32.const 0) (i32.const 0)))))
        (if (i32.eq (global.get $calls) (i32.const 3)) (then (return (call $fork (i32.const 2)))))
        (call $sample-all)
        """,
        funcs=STATE,
    ),
    # appends 40 bytes to storage at every call
    "Q": Guest(
        "(drop (call $append {key} {value})) (call $sample-all)",
        data={"key": "k", "value": "x" * 40},
    ),
    "S": Guest("(call $sample-all)"),
}


@pytest.fixture(scope="module")
def guests(tmp_path_factory: pytest.TempPathFactory) -> ControllerComponent:
    folder = tmp_path_factory.mktemp("fork")
    path = save(folder, component(GUESTS, version="0.2.0"))
    return ControllerComponent.load(path, GuestLimits(storage_bytes=100), cache_dir=folder)


# job(index, arg): a line whose controller argument (one behaviour of GUESTS) is `arg`.
job = job_factory(lambda index, arg: dict(
    id=f"{arg}{index}", prompt=f"Line {index} says hello, and then {arg}",
    extra={"controller_arg": arg}))


def run(lm: LoadedModel, comp: ControllerComponent, jobs: list[Job],
        **config: Any) -> tuple[dict[int, dict[str, Any]], Engine]:
    cfg = EngineConfig(**{"draft_tokens": 0, **config})
    engine = Engine(lm, cfg)
    engine.set_controller_factory(wasm_factory(RunConfig(input="-", engine=cfg), engine,
                                               [], comp))
    results: list[dict[str, Any]] = []
    engine.run(jobs, results.append)
    for r in results:
        jsonschema.validate(r, RESULT_SCHEMA)
    assert len(results) == len(jobs)
    return {r["index"]: r for r in results}, engine


def test_fork_shares_keys_and_each_branch_matches_a_run_without_it(
        lm: LoadedModel, guests: ControllerComponent) -> None:
    prompt_len = len(lm.tokenizer("Line 1 says hello, and then F")["input_ids"])
    alone, engine = run(lm, guests, [job(1, "F")], batch_size=4)
    r = alone[1]
    assert r["finish_reason"] == "stop" and r["branches"] == 3
    assert [c["branch"] for c in r["choices"]] == [[0], [1], [2]]
    assert [c["outputs"]["index"] for c in r["choices"]] == [0, 1, 2]
    # Branches learn their index in order, at the fork: all see every append.
    assert all(c["outputs"]["seen"] == "0,1,2," for c in r["choices"])
    assert r["outputs"] == {"winner": "branch 2"}  # the line's own, from branch 2
    assert r["text"] == r["choices"][0]["text"]
    # Keys: each new branch copied what the forking row held (the prompt and the first
    # two tokens; the third, sampled before the fork, each row feeds for its own logits).
    for c in r["choices"][1:]:
        assert c["stats"]["cached_tokens"] == prompt_len + 2
        assert c["stats"]["output_tokens"] == 7 and c["stats"]["replay_ms"] > 0
    fed = sum(t.tokens for t in engine.step_times)
    assert fed < 2 * prompt_len  # the prompt was computed once, not once per branch
    # Tokens: every branch equals a line that does the same without forking (greedy,
    # fp32): the copied keys are the keys.
    lines = [job(i + 2, str(i)) for i in range(3)]
    ref, _ = run(lm, guests, [replace(j, prompt=job(1, "F").prompt) for j in lines],
                 batch_size=4)
    assert [c["text"] for c in r["choices"]] == [ref[i + 2]["text"] for i in range(3)]
    assert len({c["text"] for c in r["choices"]}) == 3


def test_fork_beyond_the_batch_waits_for_rows(lm: LoadedModel,
                                              guests: ControllerComponent) -> None:
    results, _ = run(lm, guests, [job(1, "W"), job(2, "S", max_tokens=6)], batch_size=2)
    r = results[1]
    assert r["finish_reason"] == "stop" and r["branches"] == 5
    assert [c["branch"] for c in r["choices"]] == [[k] for k in range(5)]
    assert all(c["stats"]["output_tokens"] == 3 for c in r["choices"])
    assert results[2]["finish_reason"] == "length" and "choices" not in results[2]


def test_nested_forks_are_listed_in_tree_order(lm: LoadedModel,
                                               guests: ControllerComponent) -> None:
    results, _ = run(lm, guests, [job(1, "N")], batch_size=4)
    r = results[1]
    assert r["finish_reason"] == "stop", r.get("error")
    assert [c["branch"] for c in r["choices"]] == [[0], [1, 0], [1, 1]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]


def test_samples_fork_independently(lm: LoadedModel, guests: ControllerComponent) -> None:
    results, _ = run(lm, guests, [job(1, "W", n=2, temperature=0.9)], batch_size=4)
    r = results[1]
    assert r["n"] == 2 and r["branches"] == 10
    assert [(c["sample"], c["branch"]) for c in r["choices"]] == [
        (s, [k]) for s in range(2) for k in range(5)]


def test_too_many_branches_ends_only_that_line(lm: LoadedModel,
                                               guests: ControllerComponent) -> None:
    results, _ = run(lm, guests, [job(1, "C"), job(2, "F"), job(3, "S", max_tokens=4)],
                     batch_size=3, max_branches=5)
    r = results[1]
    assert r["finish_reason"] == "error"
    assert r["error"]["type"] == "bad_action"
    assert r["error"]["message"] == (
        "line 1: branch 1: fork(3) would make 7 branches for the line, more than "
        "--max-branches 5 (the line's samples and every fork's branches count) "
        "(the line's other branches were stopped)")
    assert results[2]["finish_reason"] == "stop" and results[2]["branches"] == 3
    assert results[3]["finish_reason"] == "length"


def test_backtrack_past_the_fork_is_a_bad_action(lm: LoadedModel,
                                                 guests: ControllerComponent) -> None:
    results, _ = run(lm, guests, [job(1, "B"), job(2, "S", max_tokens=5)], batch_size=4)
    r = results[1]
    assert r["error"]["type"] == "bad_action"
    assert r["error"]["message"].startswith(
        "line 1: branch 0: splice backtracks 2 tokens past the fork point: only 1 were "
        "generated since the fork")
    assert results[2]["finish_reason"] == "length"


def test_storage_over_quota_ends_the_line(lm: LoadedModel,
                                          guests: ControllerComponent) -> None:
    results, _ = run(lm, guests, [job(1, "Q"), job(2, "S", max_tokens=5)], batch_size=4)
    r = results[1]
    assert r["error"] == {
        "type": "storage_quota",
        "message": "line 1: storage append 'k': the line's storage would hold 121 bytes of "
                   "keys and values, more than the 100 bytes allowed per line",
    }
    assert r["stats"]["output_tokens"] == 2  # the third call's append was refused
    assert results[2]["finish_reason"] == "length"


def test_replay_that_answers_otherwise_is_refused(guests: ControllerComponent) -> None:
    from fake_services import FakeServices

    guest = guests.instantiate("S", [1, 2, 3], FakeServices())
    assert guest.mid_process(StepInput()) == Sample(TokenSet("all"))
    assert guest.journal is not None
    replica = guest.replica()  # the same answers: fine
    assert replica.journal == guest.journal and replica.calls == 1
    guest.journal.actions[0] = Sample(TokenSet("allow", (5,)))  # as if it had answered so
    with pytest.raises(ControllerError) as info:
        guest.replica()
    assert info.value.type == "controller_nondeterministic"
    assert "answered call 1 with" in info.value.message


def test_a_forked_result_survives_the_openai_batch_format(
        lm: LoadedModel, guests: ControllerComponent) -> None:
    from aici_cli.formats.openai_batch import as_result, to_output

    results, _ = run(lm, guests, [job(1, "F")], batch_size=4)
    back = as_result(to_output(results[1], None, "m"))
    jsonschema.validate(back, RESULT_SCHEMA)
    assert back["branches"] == 3 and "n" not in back
    assert back["outputs"] == {"winner": "branch 2"}
    assert [(c["branch"], c["text"], c["outputs"]["index"]) for c in back["choices"]] == [
        (c["branch"], c["text"], c["outputs"]["index"]) for c in results[1]["choices"]]


@pytest.mark.heavy
def test_without_the_prefix_cache_branches_recompute_and_write_the_same(
        lm: LoadedModel, guests: ControllerComponent) -> None:
    shared, _ = run(lm, guests, [job(1, "F")], batch_size=4)
    alone, engine = run(lm, guests, [job(1, "F")], batch_size=4, prefix_cache=False)
    assert [c["text"] for c in alone[1]["choices"]] == [c["text"] for c in shared[1]["choices"]]
    assert all(c["stats"]["cached_tokens"] == 0 for c in alone[1]["choices"])
    prompt_len = alone[1]["choices"][0]["stats"]["prompt_tokens"]
    assert sum(t.tokens for t in engine.step_times) > 3 * prompt_len
