"""The per-sequence and per-step figures the engine counts: a result's `stats`
(`LineStats`, the one declaration of its fields: the engine counts into it, error results
carry its zero value, the run tally and `aici-batch report` read results by its names)
and one forward pass's timings (`StepTimes`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LineStats:
    """A result's `stats`; timings are wall-clock ms of the steps the sequence took part
    in (a batched pass counts in full for every row that took part in it)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys came from the prefix cache
    output_tokens: int = 0
    forward_passes: int = 0  # passes this sequence took part in
    ff_tokens: int = 0  # output tokens fast-forwarded (appended without sampling)
    draft_tokens: int = 0  # output tokens taken from verified drafts (no pass of their own)
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    started_ms: float = 0.0  # admission, in ms after the engine started (a timeline's x)
    forward_ms: float = 0.0
    mask_ms: float = 0.0
    controller_ms: float = 0.0
    sample_ms: float = 0.0
    # How far the constraint bent the model: the probability its distribution (after the
    # line's logit rules, at temperature 1) gave the tokens the mask allowed, lowest and
    # mean over the constrained steps whose logits the pass computed whole (a masked
    # projection computes only the allowed ones), and how many steps that was. Left out
    # of a result whose line never had such a step.
    allowed_mass_min: float | None = None
    allowed_mass_mean: float | None = None
    allowed_mass_steps: int = 0

    def weigh(self, mass: float) -> None:
        """One more constrained step, whose mask allowed `mass` of the distribution."""
        n = self.allowed_mass_steps + 1
        low = self.allowed_mass_min
        self.allowed_mass_min = mass if low is None else min(low, mass)
        mean = self.allowed_mass_mean or 0.0
        self.allowed_mass_mean = mean + (mass - mean) / n
        self.allowed_mass_steps = n

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.allowed_mass_steps:
            for k in MASS_FIELDS:
                del out[k]
        for k, v in out.items():
            if isinstance(v, float):
                # A mass near zero is the figure of interest: kept to 1e-6 absolute.
                out[k] = round(v, 6 if k in MASS_FIELDS else 3)
        return out


MASS_FIELDS = ("allowed_mass_min", "allowed_mass_mean", "allowed_mass_steps")


#: The `stats` of a result that never ran (an input line that could not run).
ZERO_STATS: dict[str, int | float] = LineStats().as_dict()

#: The per-step timings a result's stats and `steps` records carry, in ms.
TIMING_FIELDS = ("forward_ms", "mask_ms", "controller_ms", "sample_ms")

STEP_FIELDS = ("forward_ms", "mask_ms", "controller_ms", "sample_ms", "overhead_ms", "step_ms")


@dataclass
class StepTimes:
    """One engine step (one forward pass). `mask_ms` is the mask cost the step waited for
    (mask filling runs beside the forward pass, so only what outlasts it shows here) plus
    applying the masks; `overhead_ms` is everything in the step but the forward pass."""

    kind: str  # "prefill" | "decode"
    rows: int
    tokens: int  # positions fed to the model
    forward_ms: float = 0.0
    mask_ms: float = 0.0
    mask_wait_ms: float = 0.0
    controller_ms: float = 0.0
    sample_ms: float = 0.0
    step_ms: float = 0.0

    @property
    def overhead_ms(self) -> float:
        return max(0.0, self.step_ms - self.forward_ms)


def shared_pass_times(passes: Iterable[StepTimes]) -> dict[str, float]:
    """The forward, mask and sample ms of a line run as several rows (samples, scored
    choices, a fork's branches) over the passes any of its rows took part in, each pass
    once: they add up within the line's `total_ms`, where the rows' own figures summed
    would count a shared pass once per row."""
    passes = list(passes)
    return {name: round(sum(getattr(t, name) for t in passes), 3)
            for name in ("forward_ms", "mask_ms", "sample_ms")}


def summed_stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The stats of a line run as several rows: the rows' work added up, the first token
    of any row, the last row to finish."""
    stats: dict[str, Any] = {}
    for r in results:
        for key, value in r.get("stats", {}).items():
            if key in MASS_FIELDS:
                continue  # not a sum: combined below
            if isinstance(value, bool):  # a flag: set when any row's is
                stats[key] = stats.get(key, False) or value
            elif isinstance(value, str):  # a reason (close_reason): the first row's
                stats.setdefault(key, value)
            else:
                stats[key] = round(stats.get(key, 0) + value, 3)
    stats["ttft_ms"] = min((r["stats"]["ttft_ms"] for r in results if r["stats"]["ttft_ms"]),
                           default=0.0)
    stats["total_ms"] = max(r["stats"]["total_ms"] for r in results)
    stats["started_ms"] = min(r["stats"].get("started_ms", 0.0) for r in results)
    weighed = [r["stats"] for r in results if r["stats"].get("allowed_mass_steps")]
    if weighed:  # the lowest of any row; the mean over every row's steps
        steps = sum(w["allowed_mass_steps"] for w in weighed)
        stats["allowed_mass_min"] = min(w["allowed_mass_min"] for w in weighed)
        stats["allowed_mass_mean"] = round(sum(
            w["allowed_mass_mean"] * w["allowed_mass_steps"] for w in weighed) / steps, 6)
        stats["allowed_mass_steps"] = steps
    return stats
