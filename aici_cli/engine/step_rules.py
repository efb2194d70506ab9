"""A step's logit rules (penalties.py) on its rows: before the masks, on the rows whose
line sets them, and for the draft positions those rows fed (so that drafts check against
the penalised argmax)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aici_cli.engine.generation import Generation
from aici_cli.engine.masks import MaskVerdict
from aici_cli.engine.passes import PassOutput
from aici_cli.engine.penalties import apply_rules, draft_picks, only_held_allowed


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
    apply_rules(logits, ks, rules, None, hold)
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
