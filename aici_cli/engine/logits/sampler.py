"""The sampler: one token a row, drawn with the line's sampling options
(`core/sampling.py: Sampling`). Greedy at temperature 0; otherwise temperature, then
min-p, top-k and top-p (vLLM's order, with transformers' typical-p, which vLLM lacks,
before top-p), each filter only where a row sets it.

Each row draws its uniform number from its own `torch.Generator`, seeded from the line,
so a line's output does not depend on which other lines share its batch. The draw is
then turned into a token by inverse-CDF over the row's (filtered) distribution, batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aici_cli.core.sampling import Sampling


def row_generator(seed: int, sample: int = 0) -> torch.Generator:
    """The generator of sample `sample` of a line seeded `seed`: sample 0 uses the seed
    itself, so n=1 is unchanged; the others are spread over 63 bits."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed + sample * 0x9E3779B97F4A7C15) % (1 << 63))
    return g


def branch_generator(seed: int, sample: int, path: tuple[int, ...]) -> torch.Generator:
    """The generator of a fork's new branch `path` (its index at each fork) of sample
    `sample`: seeded from the line's seed and the path alone, so a branch samples the same
    tokens whatever the batch (branch 0 keeps its forking generation's generator)."""
    mixed = (seed + sample * 0x9E3779B97F4A7C15) % (1 << 63)
    for k in path:
        mixed = (mixed * 0xBF58476D1CE4E5B9 + (k + 1) * 0x94D049BB133111EB) % (1 << 63)
    g = torch.Generator(device="cpu")
    g.manual_seed(mixed)
    return g


@dataclass(frozen=True)
class Draw:
    """How one row samples: its line's sampling options, and its own random stream (the
    one piece of state the sampler advances)."""

    sampling: Sampling
    generator: torch.Generator


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a row's logits give (float32): what logprobs report."""
    return torch.log_softmax(logits.float(), dim=-1)


# Below this a temperature is greedy: logits / t would overflow to inf (and the softmax to
# NaN) long before the distribution differs from the argmax.
MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, greedy: Sequence[int], rows: Sequence[int],
           draws: Sequence[Draw]) -> list[int]:
    """Pick one token for each of `rows` (indices into logits [b, V], already masked with
    -inf, in any float dtype), drawn as `draws` (one per row) say. Greedy rows take
    `greedy[row]` (the argmax the caller already has); rows with a temperature are sampled
    in fp32, each filter applied to the rows that set it."""
    out = [greedy[r] for r in rows]
    hot = [i for i, d in enumerate(draws) if d.sampling.temperature >= MIN_TEMPERATURE]
    if not hot:
        return out
    options = [draws[i].sampling for i in hot]
    temps = torch.tensor([s.temperature for s in options], dtype=torch.float32)[:, None]
    hot_logits = logits[[rows[i] for i in hot]].float().cpu() / temps  # [h, V]
    if any(s.min_p > 0 for s in options):
        hot_logits = _min_p(hot_logits, torch.tensor([s.min_p for s in options]))
    if any(s.top_k > 0 for s in options):
        hot_logits = _top_k(hot_logits, [s.top_k for s in options])
    if any(s.typical_p < 1.0 for s in options):
        hot_logits = _typical(hot_logits, torch.tensor([s.typical_p for s in options]))
    probs = torch.softmax(hot_logits, dim=-1)  # [h, V]
    top_p = torch.tensor([s.top_p for s in options], dtype=torch.float32)[:, None]
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=draws[i].generator) for i in hot])[:, None]
    u = u * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp(max=logits.shape[-1] - 1)[:, 0]
    # searchsorted can land on a zero-probability token only through float rounding at the
    # very end of the CDF; step back to the last token with mass.
    for k, i in enumerate(hot):
        tok = int(picked[k])
        if probs[k, tok] <= 0:
            tok = int((probs[k] > 0).nonzero()[-1])
        out[i] = tok
    return out


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop the tokens whose probability is below `min_p` [h] times the row's most likely
    token's (at the sampling temperature)."""
    probs = torch.softmax(logits, dim=-1)
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


def _top_k(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens (0: all; ties with the k-th stay)."""
    vocab = logits.shape[-1]
    ks = [min(k, vocab) if k > 0 else 0 for k in top_k]
    on = torch.tensor([k > 0 for k in ks])[:, None]
    values = logits.topk(max(ks), dim=-1).values  # [h, kmax], descending
    kth = values.gather(-1, torch.tensor([max(k, 1) - 1 for k in ks])[:, None])
    return logits.masked_fill(on & (logits < kth), float("-inf"))


def _typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022), as transformers' TypicalLogitsWarper:
    keep the tokens whose surprisal is nearest the row's entropy, the fewest that hold `mass`
    [h] of the probability (the nearest always stays). A row at 1 is left as it is: its
    cumulative sum can reach 1 early by rounding and would drop its least likely tokens."""
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p * log_p.exp()).nansum(dim=-1, keepdim=True)  # 0 * -inf is no mass
    distance, order = (-log_p - entropy).abs().sort(dim=-1)
    held = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (held < mass[:, None]).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    dropped = distance > distance.gather(-1, last)
    dropped = dropped.scatter(-1, order, dropped)
    return logits.masked_fill(dropped & (mass < 1.0)[:, None], float("-inf"))
