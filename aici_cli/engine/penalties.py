"""A line's logit rules, applied before its constraint's mask: `logit_bias`, then the
repetition, frequency and presence penalties (vLLM's order), and `min_tokens`' hold on
the tokens that would end the line.

Only rows whose line sets one of them pay anything: a step where no row does never
enters this module. A penalised row keeps its output-token counts up to date
incrementally (a step adds its new tokens, a backtrack subtracts what it removed), so a
step costs a few elementwise passes over [rows, V] for the rows that use rules, not a
pass over their history. The rules apply in float32.

Drafts stay exact: a draft token is checked against the argmax of its position's logits
under the same rules, with the counts of the output followed by the draft tokens before
it (`draft_picks`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aici_cli.jobs import Job

if TYPE_CHECKING:  # generation.py imports this module
    from aici_cli.engine.generation import Generation
    from aici_cli.engine.masks import MaskVerdict
    from aici_cli.engine.passes import PassOutput


@dataclass
class LogitRules:
    """One generation's rules, built from its job (`of`), and its output-token counts."""

    repetition: float
    frequency: float
    presence: float
    bias: tuple[torch.Tensor, torch.Tensor] | None  # token ids [nb] long, biases [nb] fp32
    min_tokens: int
    held: list[int]  # what min_tokens holds back: end-of-sequence and stop_token_ids
    # With a penalty only: each token's count in the output ([V] float32), the output
    # tokens counted so far, and (repetition only) the prompt's tokens ([V] bool).
    counts: torch.Tensor | None = None
    counted: int = 0
    prompt_seen: torch.Tensor | None = None

    @classmethod
    def of(cls, job: Job, prompt: Sequence[int], vocab_size: int, eos: Collection[int],
           device: torch.device) -> LogitRules | None:
        """The rules of `job`'s generations, or None when it sets none."""
        if not job.adjusts_logits:
            return None
        bias = None
        if job.logit_bias:
            ids, values = zip(*job.logit_bias)
            bias = (torch.tensor(ids, dtype=torch.long, device=device),
                    torch.tensor(values, dtype=torch.float32, device=device))
        rules = cls(job.repetition_penalty, job.frequency_penalty, job.presence_penalty,
                    bias, job.min_tokens, sorted(set(eos) | job.stop_token_ids))
        if rules.penalised:
            rules.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if rules.repetition != 1.0:
            rules.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            rules.prompt_seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        return rules

    @property
    def penalised(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0)

    def sync(self, output: Sequence[int]) -> None:
        """Count the output tokens appended since the last call."""
        if self.counts is None or self.counted == len(output):
            return
        new = torch.tensor(output[self.counted :], dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, new, torch.ones_like(new, dtype=torch.float32))
        self.counted = len(output)

    def truncate(self, output: Sequence[int], keep: int) -> None:
        """The output is about to be cut to its first `keep` tokens (a backtrack)."""
        if self.counts is None or self.counted <= keep:
            self.counted = min(self.counted, keep)
            return
        gone = torch.tensor(output[keep : self.counted], dtype=torch.long,
                            device=self.counts.device)
        self.counts.index_add_(0, gone, torch.full_like(gone, -1, dtype=torch.float32))
        self.counted = keep


def apply_rules(logits: torch.Tensor, rules: Sequence[LogitRules],
                extra: Sequence[Sequence[int]] | None, hold: Sequence[bool]) -> None:
    """Apply each row's rules to `logits` [n, V] (float32) in place: row i under `rules[i]`
    (synced), as if its output were followed by `extra[i]`, its ending tokens held back
    where `hold[i]`."""
    device = logits.device
    biased = [(i, r.bias) for i, r in enumerate(rules) if r.bias is not None]
    if biased:
        rows = torch.cat([torch.full_like(ids, i) for i, (ids, _) in biased])
        cols = torch.cat([ids for _, (ids, _) in biased])
        values = torch.cat([values for _, (_, values) in biased])
        logits.index_put_((rows, cols), values, accumulate=True)
    penalised = [i for i, r in enumerate(rules) if r.counts is not None]
    if penalised:
        _penalize(logits, [rules[i] for i in penalised], penalised,
                  [extra[i] for i in penalised] if extra is not None else None)
    held = [(i, t) for i, r in enumerate(rules) if hold[i] for t in r.held]
    if held:
        at = torch.tensor(held, device=device)  # [h, 2]: row, token
        logits[at[:, 0], at[:, 1]] = float("-inf")


def _penalize(logits: torch.Tensor, rules: list[LogitRules], at: list[int],
              extra: list[Sequence[int]] | None) -> None:
    """Repetition, then frequency and presence penalties on rows `at` of `logits`."""
    device = logits.device
    counts = torch.stack([r.counts for r in rules if r.counts is not None])  # [p, V], a copy
    if extra is not None and any(extra):
        rows = [i for i, e in enumerate(extra) for _ in e]
        cols = [t for e in extra for t in e]
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.ones(len(cols), device=device), accumulate=True)
    index = torch.tensor(at, device=device)
    sub = logits.index_select(0, index)  # [p, V]
    in_output = counts > 0
    if any(r.repetition != 1.0 for r in rules):
        seen = in_output.clone()
        for i, r in enumerate(rules):
            if r.prompt_seen is not None:
                seen[i] |= r.prompt_seen
        rep = torch.tensor([r.repetition for r in rules], device=device)[:, None]
        scale = torch.where(sub > 0, 1.0 / rep, rep)
        sub = torch.where(seen, sub * scale, sub)
    frequency = torch.tensor([r.frequency for r in rules], device=device)[:, None]
    presence = torch.tensor([r.presence for r in rules], device=device)[:, None]
    sub -= frequency * counts + presence * in_output
    logits.index_copy_(0, index, sub)


def only_held_allowed(disallowed: torch.Tensor, held: Sequence[int]) -> bool:
    """Whether a row's mask ([V] bool, True: disallowed) allows nothing but `held` tokens:
    then the constraint's end ends the line, min_tokens or not."""
    allowed = ~disallowed
    allowed[list(held)] = False
    return not bool(allowed.any())


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
    apply_rules(logits, flat_rules, extra, hold)
    return logits.argmax(dim=-1).tolist()


def rules_before_masks(logits: torch.Tensor, gens: Sequence[Generation | None],
                       verdict: MaskVerdict) -> torch.Tensor:
    """The step's rules on the rows whose line sets them, before the masks: returns the
    logits [b, V] to mask and sample from, widened to float32 when a row has rules (the
    others' argmax is unchanged: widening is exact), `logits` itself when none has."""
    if not any(g is not None and g.rules is not None for g in gens):
        return logits
    ks, rules, hold = [], [], []
    for k, gen in enumerate(gens):
        if (gen is None or gen.rules is None or gen.finish is not None
                or gen.score_from is not None or k in verdict.deferred or k in verdict.failed):
            continue
        r = gen.rules
        r.sync(gen.output)
        ks.append(k)
        rules.append(r)
        # A constraint that allows nothing but an ending token ends the line there.
        hold.append(len(gen.output) < r.min_tokens and not (
            verdict.disallowed is not None and only_held_allowed(verdict.disallowed[k], r.held)))
    if not ks:
        return logits
    logits = logits.float()  # a copy from a narrower dtype; else in place, as masks are
    index = torch.tensor(ks, device=logits.device)
    sub = logits.index_select(0, index)
    apply_rules(sub, rules, None, hold)
    logits.index_copy_(0, index, sub)
    return logits


def checked_draft_picks(out: PassOutput, gens: Sequence[Generation | None],
                        drafts: Sequence[Sequence[int]], b: int) -> list[int]:
    """`PassOutput.draft_picks`, with the picks of rows that have rules taken under them
    (before any token of the step is handed over: the outputs are those the pass saw)."""
    picks = out.draft_picks(b)
    ruled = [(k, g) for k, g in enumerate(gens)
             if g is not None and g.rules is not None and drafts[k]]
    if not ruled:
        return picks
    spans = [(out.draft_at(k, b), len(drafts[k]) - 1) for k, _ in ruled]
    # A copy: the raw rows still give the draft tokens' logprobs.
    logits = torch.cat([out.every[b + at : b + at + n] for at, n in spans]).float()
    rules = []
    for _, g in ruled:
        assert g.rules is not None
        g.rules.sync(g.output)
        rules.append(g.rules)
    new = draft_picks(logits, rules, [drafts[k] for k, _ in ruled],
                      [len(g.output) for _, g in ruled])
    i = 0
    for at, n in spans:
        picks[at : at + n] = new[i : i + n]
        i += n
    return picks
