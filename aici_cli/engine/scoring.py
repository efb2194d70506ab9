"""Scoring choices by log-likelihood, as lm-evaluation-harness does for multiple choice.

A scored line runs one row per choice, each feeding the prompt and the choice; the prompt's
keys come from the prefix cache, so with a shared few-shot prefix cached a line costs one
pass (the rows feed only the question and their choice). A choice's score is the sum of
the log-probabilities of its tokens, each read from the logits of the position before it
in the same pass: nothing is sampled.

Choices of one token each after the same prompt tokens (MMLU's " A".." D") share one row:
the logits after the prompt score them all, so such a line costs one row and one pass
rather than one row per choice (`shared_token_choices`, `token_choice_results`).

A scored row's state is its `ScoredChoice`; the choices' tokens come from the intake
(`intake.choice_sequences`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aici_cli.core.line_stats import summed_stats


@dataclass
class ScoredChoice:
    """A row that scores a choice rather than samples: its prompt is the line's prompt
    and the choice tokenized together, the choice's tokens from `start` on; or, for
    one-token choices after the same context, the context and the first one, and
    `token_choices` every choice's token. The row is read once; then its scores."""

    start: int
    choice: str
    token_choices: list[int] | None = None
    logprob: float = 0.0
    # Every choice token the most likely one (an empty choice: vacuously).
    greedy: bool = True
    token_scores: list[tuple[float, bool]] | None = None

    def offsets(self, length: int, prompt_len: int) -> list[int]:
        """Offsets, in the row's pending tokens (its cache holds `length`), of the
        positions whose logits predict the choice's tokens: each token's predecessor."""
        assert length < self.start
        return list(range(self.start - 1 - length, prompt_len - 1 - length))

    def read(self, prompt: Sequence[int], logits: torch.Tensor) -> None:
        """Take the scores from the logits [c, V] at `offsets`."""
        if self.token_choices is not None:
            self.token_scores = token_choice_scores(logits, self.token_choices)
        else:
            self.logprob, self.greedy = choice_logprob(prompt[self.start :], logits)

    def fields(self, prompt_len: int) -> dict[str, Any]:
        """The result's `score` (not for one-token choices: `token_choice_results`)."""
        return score_fields(self.choice, self.logprob, prompt_len - self.start, self.greedy)


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


def choice_logprob(targets: Sequence[int], logits: torch.Tensor) -> tuple[float, bool]:
    """The log-probability of the choice's tokens `targets` from `logits` [c, V] (the
    positions before each), and whether each is the most likely one there
    (lm-evaluation-harness's `is_greedy`: greedy decoding would write the choice; a tie
    counts as the first id)."""
    wanted = torch.tensor(list(targets), device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy = bool((logprobs.argmax(dim=-1) == wanted).all())
    return float(logprobs.gather(1, wanted[:, None]).sum()), greedy


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
