"""typical_p, locally typical sampling: the tokens it keeps are those transformers'
TypicalLogitsWarper keeps, on random logits with masked tokens among them; a row at 1 is
left alone beside rows that set it; the sampler draws only kept tokens. (The option's
range, `run` option, request name and record are
tests/core/test_sampling_definition.py's.)"""

from __future__ import annotations

import pytest
import torch

from aici_cli.core.sampling import Sampling
from aici_cli.engine.logits.sampler import Draw, _typical, row_stream, sample

NEG_INF = float("-inf")


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits of several spreads (from nearly flat to nearly one-hot), some tokens masked
    as a constraint masks them."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.1, 1.0, 3.0, 10.0]).repeat(rows // 4 + 1)[:rows, None]
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[1, : vocab // 2] = NEG_INF
    logits[2, 1:] = NEG_INF  # one token left: it stays
    return logits


@pytest.mark.parametrize("mass", [0.05, 0.2, 0.5, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keeps_the_tokens_transformers_typical_warper_keeps(mass: float, seed: int) -> None:
    from transformers import TypicalLogitsWarper

    logits = random_logits(12, 97, seed)
    theirs = TypicalLogitsWarper(mass)(torch.zeros(12, 1, dtype=torch.long), logits.clone())
    ours = _typical(logits, torch.full((12,), mass))
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    kept = ours.isfinite()
    assert torch.equal(ours[kept], logits[kept])  # kept logits are not changed


def test_a_row_at_one_is_left_alone_beside_rows_that_set_it() -> None:
    logits = random_logits(4, 50, 3)
    out = _typical(logits, torch.tensor([0.3, 1.0, 0.3, 1.0]))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert int(out[0].isfinite().sum()) < int(logits[0].isfinite().sum())


def test_the_sampler_draws_only_kept_tokens() -> None:
    from transformers import TypicalLogitsWarper

    logits = random_logits(4, 20, 4)[3:]  # a wide spread: typical_p 0.5 drops most tokens
    kept = set(TypicalLogitsWarper(0.5)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
               .isfinite()[0].nonzero()[:, 0].tolist())
    typical = Sampling(temperature=1.0, typical_p=0.5)
    drawn = {int(sample(logits, torch.tensor([0]), [0], [Draw(typical, row_stream(seed))])[0])
             for seed in range(300)}
    assert drawn <= kept and len(kept) < 20
    plain = Sampling(temperature=1.0)
    everything = {int(sample(logits, torch.tensor([0]), [0], [Draw(plain, row_stream(seed))])[0])
                  for seed in range(300)}
    assert not everything <= kept  # without it, tokens it drops are drawn too
