"""lm-eval requests as engine lines (aici_cli/evals/requests.py), torch-free: grouping by
context (a property: every request in exactly one group, with lm-eval's `hf` truncation)
and gen_kwargs read as line fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.evals.requests import (
    EvalRequestError,
    cut_at_stops,
    generation_line,
    group_by_context,
    truncated,
)

tokens = st.lists(st.integers(0, 5), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tokens, tokens), min_size=1, max_size=12), st.integers(8, 20))
def test_every_request_lands_in_one_group_with_its_tokens(
        pairs: list[tuple[list[int], list[int]]], max_length: int) -> None:
    groups = group_by_context(pairs, max_length)
    seen = sorted(m for g in groups for m in g.members)
    assert seen == list(range(len(pairs)))
    assert [g.context for g in groups] == sorted({tuple(c) for c, _ in pairs})
    for g in groups:
        assert g.members == sorted(g.members)  # request order within a group
        for member, (ids, start) in zip(g.members, g.sequences):
            context, continuation = pairs[member]
            assert tuple(context) == g.context
            whole = context + continuation
            assert ids == whole[-(max_length + 1):] and ids[start:] == continuation
            assert len(ids) <= max_length + 1 and start >= 1


def test_a_continuation_longer_than_the_model_is_refused() -> None:
    with pytest.raises(EvalRequestError, match="does not fit the model's 4 positions"):
        truncated([1, 2], [3, 4, 5, 6, 7], max_length=4)


def test_gen_kwargs_as_line_fields() -> None:
    line = generation_line(3, {"until": ["\n\n", "Q:"], "max_gen_toks": 32, "do_sample": True,
                               "temperature": 0.7, "top_p": 0.9, "regex": "[0-9]+"},
                           256, "</s>")
    assert line == {"id": "gen3", "prompt": "(given as token ids)",
                    "stop": ["\n\n", "Q:", "</s>"], "max_tokens": 32, "temperature": 0.7,
                    "top_p": 0.9, "seed": 3, "regex": "[0-9]+"}
    greedy = generation_line(1, {"until": "\n", "temperature": 0.0}, 256, None)
    assert greedy["temperature"] == 0.0 and greedy["stop"] == ["\n"]
    assert greedy["max_tokens"] == 256
    # do_sample false (lm-eval's default) is greedy whatever the temperature says
    assert generation_line(1, {"temperature": 0.8}, 16, None)["temperature"] == 0.0
    assert generation_line(1, {"json_schema": '{"type": "object"}'}, 16, None)[
        "json_schema"] == {"type": "object"}
    assert generation_line(1, {"choice": "yes,no"}, 16, None)["choices"] == ["yes", "no"]
    with pytest.raises(EvalRequestError, match="not JSON"):
        generation_line(1, {"json_schema": "{"}, 16, None)


def test_cut_at_stops_as_lm_evals_hf_backend() -> None:
    assert cut_at_stops("a\nb Q: c", ["Q:", "\n"]) == "a"
    assert cut_at_stops("abc", ["", "x"]) == "abc"
