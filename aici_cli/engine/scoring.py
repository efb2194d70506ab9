"""Scoring choices by log-likelihood, as lm-evaluation-harness does for multiple choice.

A scored line runs one row per choice, each feeding the prompt and the choice; the prompt's
keys come from the prefix cache, so with a shared few-shot prefix cached a line costs one
pass (the rows feed only the question and their choice). A choice's score is the sum of
the log-probabilities of its tokens, each read from the logits of the position before it
in the same pass: nothing is sampled.

Choices of one token each after the same prompt tokens (MMLU's " A".." D") share one row:
the logits after the prompt score them all, so such a line costs one row and one pass
rather than one row per choice (`shared_token_choices`, `token_choice_results`).

Tokenization: the prompt and the choice are tokenized together, and the choice's tokens
are those past the longest common prefix with the prompt's own tokens. A token that merges
the end of the prompt with the start of the choice (" Paris" after "is") thus counts to the
choice, scored given the prompt tokens before it, which is what the model sees when it
writes the choice itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aici_cli.engine.generation import Generation
from aici_cli.engine.rows import common_prefix
from aici_cli.vocabulary.errors import GrammarError
from aici_cli.vocabulary.line_stats import summed_stats


def choice_sequences(tokenizer: Any, text: str, special: bool, context: Sequence[int],
                     options: Sequence[str]) -> list[tuple[list[int], int]]:
    """For each option: the ids of `text + option` tokenized together, and where the
    option's tokens start in them (at least 1: something must predict the first)."""
    ctx = np.asarray(context, dtype=np.int64)
    out = []
    for option in options:
        ids = list(tokenizer(text + option, add_special_tokens=special)["input_ids"])
        start = common_prefix(np.asarray(ids, dtype=np.int64), ctx)
        if start == 0:
            raise GrammarError("invalid_choices",
                               f"choice {option!r} merges with the whole prompt's first token; "
                               "it cannot be scored after it")
        out.append((ids, start))
    return out


def shared_token_choices(sequences: Sequence[tuple[list[int], int]]) -> list[int] | None:
    """When every choice is one token after the same context (the same ids before it),
    those tokens, in choice order; else None."""
    ids, start = sequences[0]
    context = ids[:start]
    if any(len(seq) != first + 1 or first != start or seq[:first] != context
           for seq, first in sequences):
        return None
    return [seq[start] for seq, _ in sequences]


def token_choice_scores(logits: torch.Tensor, tokens: Sequence[int]) -> list[tuple[float, bool]]:
    """Each token's log-probability in the next-token `logits` [1, V], and whether it is
    the most likely token (a tie counts as the first id)."""
    logprobs = torch.log_softmax(logits[-1].float(), dim=-1)
    best = int(logprobs.argmax())
    picked = logprobs[torch.tensor(list(tokens), device=logits.device)].tolist()
    return [(lp, token == best) for lp, token in zip(picked, tokens)]


def token_choice_results(result: dict[str, Any], options: Sequence[str],
                         scores: Sequence[tuple[float, bool]] | None) -> list[dict[str, Any]]:
    """The per-choice results of a line whose one-token choices shared one row: `result`
    (that row's) with each choice's score; the row's stats on the first only, so that the
    line's summed stats count its work once. `scores` None: the row failed."""
    zero = {k: (False if isinstance(v, bool) else 0) for k, v in result["stats"].items()}
    out = []
    for i, option in enumerate(options):
        one = {**result, "stats": result["stats"] if i == 0 else dict(zero)}
        if scores is not None:
            logprob, greedy = scores[i]
            one["score"] = score_fields(option, logprob, 1, greedy)
        out.append(one)
    return out


def scored_offsets(gen: Generation) -> list[int]:
    """Offsets, in the row's pending tokens, of the positions whose logits predict the
    choice's tokens: each token's predecessor."""
    assert gen.score_from is not None and gen.length < gen.score_from
    return list(range(gen.score_from - 1 - gen.length, len(gen.prompt) - 1 - gen.length))


def choice_logprob(gen: Generation, logits: torch.Tensor) -> tuple[float, bool]:
    """The choice's log-probability from `logits` [c, V] at `scored_offsets`, and whether
    each of its c tokens is the most likely one there (lm-evaluation-harness's
    `is_greedy`: greedy decoding would write the choice; a tie counts as the first id)."""
    assert gen.score_from is not None
    targets = torch.tensor(gen.prompt[gen.score_from :], device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy = bool((logprobs.argmax(dim=-1) == targets).all())
    return float(logprobs.gather(1, targets[:, None]).sum()), greedy


def score_fields(option: str, logprob: float, tokens: int, greedy: bool) -> dict[str, Any]:
    return {"choice": option, "logprob": round(logprob, 6), "tokens": tokens,
            "logprob_per_token": round(logprob / tokens, 6) if tokens else 0.0,
            "greedy": greedy}


def combine_scores(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result line for a scored line: `text` is the best choice (the first of equals,
    in the order given), `scores` every choice's, best first; `stats` add up the rows'."""
    line = {k: v for k, v in results[0].items() if k not in ("steps", "score", "text")}
    failed = next((r for r in results if r["finish_reason"] == "error"), None)
    scores = [r["score"] for r in results if "score" in r]
    ranked = sorted(scores, key=lambda s: -s["logprob"])  # stable: ties keep their order
    line["text"] = ranked[0]["choice"] if failed is None and ranked else ""
    line["finish_reason"] = "stop" if failed is None else "error"
    if failed is not None:
        line["error"] = failed["error"]
    line["scores"] = ranked
    line["stats"] = summed_stats(results)
    return line
