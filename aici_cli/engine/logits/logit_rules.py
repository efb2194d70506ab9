"""A line's logit rules, applied before its constraint's mask: `logit_bias`, then the
repetition, frequency and presence penalties (vLLM's order), and `min_tokens`' hold on
the tokens that would end the line.

Only rows whose line sets one of them pay anything: a step where no row does never
enters this module. The work is sparse: a penalty touches only the tokens the row's prompt
or output holds, a bias only its tokens, so a step costs a gather and a scatter over those
entries for all such rows at once, never a pass over [rows, V]. Each row keeps its output
tokens' counts up to date incrementally (a step adds its new tokens, a backtrack subtracts
what it removed). The rules apply in float32 (the step's logits are widened first when
the model's dtype is narrower, as vLLM does).

Drafts stay exact: a draft token is checked against the argmax of its position's logits
under the same rules, with the counts of the output followed by the draft tokens before
it (`draft_picks`). A step applies them to its rows before their masks
(`rules_before_masks`), from the plan's data: each row's rules (None: none, or the row is
not sampled), synced with its output when the plan was made, and its output's length.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from aici_cli.core.job import Job


@dataclass
class LogitRules:
    """One generation's rules, built from its job (`of`), and its output-token counts."""

    repetition: float
    frequency: float
    presence: float
    bias_tokens: np.ndarray  # [nb] int64, ascending
    bias_values: np.ndarray  # [nb] float32
    min_tokens: int
    held: np.ndarray  # [nh] int64: what min_tokens holds back: end-of-sequence, stop ids
    prompt_tokens: np.ndarray  # [np] int64: the prompt's distinct tokens (repetition only)
    prompt_set: frozenset[int] = frozenset()
    counts: dict[int, int] = field(default_factory=dict)  # output token -> occurrences
    counted: int = 0  # output tokens in `counts`
    # Repetition only: the output's tokens that the prompt lacks (keys; an ordered set).
    fresh: dict[int, None] = field(default_factory=dict)

    @classmethod
    def of(cls, job: Job, prompt: Sequence[int], eos: Collection[int]) -> LogitRules | None:
        """The rules of `job`'s generations, or None when it sets none."""
        s = job.sampling
        if not s.adjusts_logits:
            return None
        bias = np.array(s.logit_bias, dtype=np.float64).reshape(-1, 2)
        prompt_set = frozenset(prompt) if s.repetition_penalty != 1.0 else frozenset()
        return cls(s.repetition_penalty, s.frequency_penalty, s.presence_penalty,
                   bias[:, 0].astype(np.int64), bias[:, 1].astype(np.float32),
                   s.min_tokens, np.array(sorted(set(eos) | job.stop_token_ids), np.int64),
                   np.array(sorted(prompt_set), np.int64), prompt_set)

    @property
    def penalised(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0)

    def sync(self, output: Sequence[int]) -> None:
        """Count the output tokens appended since the last call (penalties only)."""
        if not self.penalised:
            return
        counts, fresh, repeats = self.counts, self.fresh, self.repetition != 1.0
        for token in output[self.counted :]:
            counts[token] = counts.get(token, 0) + 1
            if repeats and token not in self.prompt_set:
                fresh[token] = None
        self.counted = len(output)

    def truncate(self, output: Sequence[int], keep: int) -> None:
        """The output is about to be cut to its first `keep` tokens (a backtrack)."""
        if not self.penalised:
            return
        counts = self.counts
        for token in output[keep : self.counted]:
            counts[token] -= 1
            if not counts[token]:
                del counts[token]
                self.fresh.pop(token, None)
        self.counted = min(self.counted, keep)


class _Entries:
    """Sparse (row, token, value) entries of one kind of rule, gathered across rows and
    turned into tensors at once (numpy in between: a Python list of thousands of ints is
    slow to convert)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def add(self, row: int, cols: np.ndarray, values: np.ndarray | float = 0.0) -> None:
        self.rows.append(np.full(len(cols), row, dtype=np.int64))
        self.cols.append(cols)
        self.values.append(np.broadcast_to(np.asarray(values, dtype=np.float32), cols.shape))

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(np.concatenate(self.rows)).to(device),
                torch.from_numpy(np.concatenate(self.cols)).to(device))

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(self.values)).to(device)


def apply_rules(logits: torch.Tensor, rows: Sequence[int], rules: Sequence[LogitRules],
                extra: Sequence[Sequence[int]] | None, hold: Sequence[bool]) -> None:
    """Apply `rules[i]` (synced) to row `rows[i]` of `logits` [n, V] (float32) in place, as
    if its output were followed by `extra[i]`, its ending tokens held back where
    `hold[i]`."""
    device = logits.device
    bias, repeated, penalty, held = _Entries(), _Entries(), _Entries(), _Entries()
    for i, (row, r) in enumerate(zip(rows, rules)):
        if len(r.bias_tokens):
            bias.add(row, r.bias_tokens, r.bias_values)
        counts, fresh = r.counts, r.fresh
        if extra is not None and extra[i]:  # a draft position: the draft tokens before it
            counts, fresh = dict(counts), dict(fresh)
            for token in extra[i]:
                counts[token] = counts.get(token, 0) + 1
                if r.repetition != 1.0 and token not in r.prompt_set:
                    fresh[token] = None
        if r.repetition != 1.0:  # each token once: the prompt's, then the output's others
            repeated.add(row, np.concatenate(
                [r.prompt_tokens, np.fromiter(fresh, dtype=np.int64, count=len(fresh))]),
                r.repetition)
        if counts and (r.frequency or r.presence):
            tokens = np.fromiter(counts, dtype=np.int64, count=len(counts))
            times = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
            penalty.add(row, tokens, -(r.frequency * times + r.presence))
        if hold[i]:
            held.add(row, r.held)
    if bias.rows:
        logits.index_put_(bias.index(device), bias.tensor(device), accumulate=True)
    if repeated.rows:
        at = repeated.index(device)
        value, factor = logits[at], repeated.tensor(device)
        logits[at] = torch.where(value > 0, value / factor, value * factor)
    if penalty.rows:
        logits.index_put_(penalty.index(device), penalty.tensor(device), accumulate=True)
    if held.rows:
        logits[held.index(device)] = float("-inf")


def only_held_allowed(allowed: torch.Tensor, held: np.ndarray) -> bool:
    """Whether a row's mask ([V] bool, True: allowed) allows nothing but `held` tokens:
    then the constraint's end ends the line, min_tokens or not."""
    others = allowed.clone()
    others[torch.from_numpy(held).to(allowed.device)] = False
    return not bool(others.any())


def draft_picks(logits: torch.Tensor, rules: Sequence[LogitRules],
                drafts: Sequence[Sequence[int]], output_lengths: Sequence[int]) -> list[int]:
    """The argmax after each fed draft token under each row's rules, rows concatenated:
    `logits` [sum(len(d) - 1), V] (float32, modified) holds, for each draft d, the
    positions after d[0], ..., d[-2]; the one after d[j] sees the output followed by
    d[: j + 1]. (A draft holds no ending token, so min_tokens' hold applies by length.)"""
    flat_rules: list[LogitRules] = []
    extra: list[Sequence[int]] = []
    hold: list[bool] = []
    for r, d, length in zip(rules, drafts, output_lengths):
        for j in range(len(d) - 1):
            flat_rules.append(r)
            extra.append(d[: j + 1])
            hold.append(length + j + 1 < r.min_tokens)
    apply_rules(logits, range(len(flat_rules)), flat_rules, extra, hold)
    return logits.argmax(dim=-1).tolist()


def rules_before_masks(logits: torch.Tensor, rules: Sequence[LogitRules | None],
                       outputs: Sequence[int], skip: Collection[int],
                       allowed: torch.Tensor | None) -> torch.Tensor:
    """A step's rules on the rows whose line sets them (but those in `skip`: failed, or
    answered with a directive), before the masks `allowed` ([b, V] bool, True:
    allowed; None: none) apply: returns the logits [b, V] to mask and sample from,
    widened to float32 when a row has rules (the others' argmax is unchanged: widening
    is exact), `logits` itself when none has."""
    if not any(r is not None for r in rules):
        return logits
    ks, ruled, hold = [], [], []
    for k, r in enumerate(rules):
        if r is None or k in skip:
            continue
        ks.append(k)
        ruled.append(r)
        # A constraint that allows nothing but an ending token ends the line there.
        hold.append(outputs[k] < r.min_tokens and not (
            allowed is not None and only_held_allowed(allowed[k], r.held)))
    if not ks:
        return logits
    logits = logits.float()  # a copy from a narrower dtype; else in place, as masks are
    apply_rules(logits, ks, ruled, None, hold)
    return logits
