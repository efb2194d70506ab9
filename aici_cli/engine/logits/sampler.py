"""The sampler: one token a row, drawn with the line's sampling options
(`core/sampling.py: Sampling`). Greedy at temperature 0; otherwise temperature, then
min-p, top-k and top-p (vLLM's order, with transformers' typical-p, which vLLM lacks,
before top-p), each filter only where a row sets it.

Each row draws its uniform number from its own counter-based stream (`RowStream`: a hash
of the line's key and the count of its draws), keyed from the line, so a line's output does
not depend on which other lines share its batch, and no generator lives on the host. The
draw is then turned into a token by inverse-CDF over the row's (filtered) distribution,
batched, where the logits are: the sampled tokens are read back with the greedy ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aici_cli.core.sampling import Sampling

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


class RowStream:
    """A row's random stream, counter-based: its n-th uniform number is a hash of (`key`,
    n) (`uniforms`), computed where the logits are, so no generator state lives on the host
    and the numbers a line draws depend on its key and how many it drew, never on the batch
    or the device. `drawn` advances by one for each token the sampler draws for the row;
    a row that backtracks draws new numbers, as a stateful generator would."""

    __slots__ = ("key", "drawn")

    def __init__(self, key: int) -> None:
        self.key = key % (1 << 63)
        self.drawn = 0

    def __repr__(self) -> str:
        return f"RowStream(key={self.key:#x}, drawn={self.drawn})"


def row_stream(seed: int, sample: int = 0) -> RowStream:
    """The stream of sample `sample` of a line seeded `seed`: sample 0 keys on the seed
    itself; the others are spread over 63 bits."""
    return RowStream(seed + sample * _GOLDEN)


def branch_stream(seed: int, sample: int, path: tuple[int, ...]) -> RowStream:
    """The stream of a fork's new branch `path` (its index at each fork) of sample
    `sample`: keyed by the line's seed and the path alone, so a branch samples the same
    tokens whatever the batch (branch 0 keeps its forking generation's stream)."""
    mixed = (seed + sample * _GOLDEN) % (1 << 63)
    for k in path:
        mixed = (mixed * _MIX1 + (k + 1) * _MIX2) % (1 << 63)
    return RowStream(mixed)


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 two's complement torch multiplies by."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 `x` (torch's `>>` is arithmetic on signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[h] int64 keys and counters -> [h] float32 uniform in [0, 1): SplitMix64's
    finaliser over key + (counter + 1) * golden ratio, in wrapping int64 arithmetic (what
    torch's integer multiply does on every device), the top 24 bits as the float.
    `uniform_reference` is the same in Python integers."""
    x = keys + (counters + 1) * _signed(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    x = x ^ _shr(x, 31)
    return _shr(x, 40).to(torch.float32) * 2.0**-24


def uniform_reference(key: int, counter: int) -> float:
    """`uniforms` of one (key, counter), in Python's integers (for tests)."""
    m = (1 << 64) - 1
    x = (key + (counter + 1) * _GOLDEN) & m
    x = ((x ^ (x >> 30)) * _MIX1) & m
    x = ((x ^ (x >> 27)) * _MIX2) & m
    x = x ^ (x >> 31)
    return (x >> 40) * 2.0**-24


@dataclass(frozen=True)
class Draw:
    """How one row samples: its line's sampling options, and its own random stream (the
    one piece of state the sampler advances)."""

    sampling: Sampling
    stream: RowStream


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a row's logits give (float32): what logprobs report."""
    return torch.log_softmax(logits.float(), dim=-1)


# Below this a temperature is greedy: logits / t would overflow to inf (and the softmax to
# NaN) long before the distribution differs from the argmax.
MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, greedy: torch.Tensor, rows: Sequence[int],
           draws: Sequence[Draw]) -> torch.Tensor:
    """One token for each of `rows` (indices into logits [b, V], already masked with
    -inf, in any float dtype), drawn as `draws` (one per row) say: [len(rows)] int64 on
    the logits' device, nothing read back. Greedy rows take `greedy[row]` (the argmax [b]
    the caller already has); rows with a temperature are sampled in fp32 where the logits
    are, each filter applied to the rows that set it, their uniform numbers from their
    streams (`uniforms`), each stream advanced by one."""
    device = logits.device
    at = torch.tensor(list(rows), dtype=torch.long, device=device)
    out = greedy.index_select(0, at)
    hot = [i for i, d in enumerate(draws) if d.sampling.temperature >= MIN_TEMPERATURE]
    if not hot:
        return out
    options = [draws[i].sampling for i in hot]
    temps = torch.tensor([s.temperature for s in options], dtype=torch.float32,
                         device=device)[:, None]
    hot_logits = logits[[rows[i] for i in hot]].float() / temps  # [h, V]
    if any(s.min_p > 0 for s in options):
        hot_logits = _min_p(hot_logits, torch.tensor([s.min_p for s in options],
                                                     device=device))
    if any(s.top_k > 0 for s in options):
        hot_logits = _top_k(hot_logits, [s.top_k for s in options])
    if any(s.typical_p < 1.0 for s in options):
        hot_logits = _typical(hot_logits, torch.tensor([s.typical_p for s in options],
                                                       device=device))
    probs = torch.softmax(hot_logits, dim=-1)  # [h, V]
    if any(s.top_p < 1.0 for s in options):
        top_p = torch.tensor([s.top_p for s in options], dtype=torch.float32,
                             device=device)[:, None]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.cumsum(dim=-1)
    streams = [draws[i].stream for i in hot]
    u = uniforms(torch.tensor([s.key for s in streams], dtype=torch.long, device=device),
                 torch.tensor([s.drawn for s in streams], dtype=torch.long, device=device))
    for s in streams:
        s.drawn += 1
    u = u[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp(max=logits.shape[-1] - 1)  # [h, 1]
    # searchsorted can land on a zero-probability token only through float rounding at the
    # very end of the CDF; step back to the last token with mass.
    vocab = probs.shape[-1]
    last = vocab - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    picked = torch.where(probs.gather(-1, picked) > 0, picked, last)[:, 0]
    return out.index_copy(0, torch.tensor(hot, dtype=torch.long, device=device), picked)


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
    on = torch.tensor([k > 0 for k in ks], device=logits.device)[:, None]
    values = logits.topk(max(ks), dim=-1).values  # [h, kmax], descending
    kth = values.gather(-1, torch.tensor([max(k, 1) - 1 for k in ks],
                                         device=logits.device)[:, None])
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
