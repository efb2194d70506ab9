"""`aici-batch report --baseline PREV.jsonl`: this run's lines against the last run's.

Lines are matched by id *and* input digest (`input_sha256`): the same id over an edited
prompt is another question, counted apart (`input_changed`), never compared. Over the
matched lines with an expected answer in both runs (the paired lines):

- which answers changed, each way (right -> wrong, wrong -> right);
- the accuracy delta (now - before) with a 95% paired bootstrap interval: the paired
  lines resampled with replacement. A line's difference is -1, 0 or +1, so a resample's
  mean is fixed by how many of each it draws, a multinomial draw: `iterations` resamples
  cost O(iterations), not O(iterations x lines);
- McNemar's exact test: under "no change", each discordant line (b right -> wrong,
  c wrong -> right) goes either way with probability 1/2, so p = P(min(b, c) or fewer of
  b + c fair coin flips land one way), two-sided.

`--fail-on-regression` fails only when accuracy fell and p is below `--alpha`.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ReportError
from aici_cli.report.lines import LineOutcome, line_outcome
from aici_cli.report.summarize import parse_results

BOOTSTRAP_ITERATIONS = 10_000
BOOTSTRAP_SEED = 0  # the interval is part of a CI log: the same files give the same one


def read_outcomes(path: str | Path) -> list[LineOutcome]:
    """The outcome of every result line of a file (the baseline)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as fh:
            return [line_outcome(r) for r in parse_results(fh)]
    except OSError as e:
        raise ReportError(f"--baseline {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ReportError(f"--baseline {path}: not UTF-8 text: {e.reason}") from None
    except ReportError as e:
        raise ReportError(f"--baseline {path}: {e}") from None


def mcnemar_p(b: int, c: int) -> float:
    """McNemar's exact two-sided p-value for b and c discordant pairs (1.0 for none)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap(b: int, c: int, n: int, iterations: int = BOOTSTRAP_ITERATIONS,
                     seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The 95% percentile interval of the accuracy delta over `n` paired lines of which
    `b` went right -> wrong (-1) and `c` wrong -> right (+1)."""
    if n == 0:
        return 0.0, 0.0
    # Imported here: numpy is a tenth of a second of `report`'s start, needed only here.
    import numpy as np

    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, [b / n, c / n, (n - b - c) / n], size=iterations)
    deltas = (draws[:, 1] - draws[:, 0]) / n
    low, high = np.percentile(deltas, [2.5, 97.5])
    return float(low), float(high)


@dataclass
class Change:
    """A matched line whose answer changed."""

    before: LineOutcome
    now: LineOutcome

    @property
    def way(self) -> str:
        """right->wrong, wrong->right, or changed (no expected answer, or no verdict)."""
        if self.before.correct is True and self.now.correct is False:
            return "right->wrong"
        if self.before.correct is False and self.now.correct is True:
            return "wrong->right"
        return "changed"


@dataclass
class Comparison:
    baseline: str
    matched: int = 0
    only_now: int = 0
    only_before: int = 0
    input_changed: int = 0  # same id, another input digest: not compared
    changes: list[Change] = field(default_factory=list)
    paired: int = 0  # matched lines with an expected answer in both runs
    right_to_wrong: int = 0
    wrong_to_right: int = 0
    accuracy_before: float | None = None
    accuracy_now: float | None = None
    newly_failing: int = 0  # matched lines that passed before and error/are invalid now

    @property
    def delta(self) -> float | None:
        if self.accuracy_before is None or self.accuracy_now is None:
            return None
        return self.accuracy_now - self.accuracy_before

    @property
    def interval(self) -> tuple[float, float] | None:
        if not self.paired:
            return None
        return paired_bootstrap(self.right_to_wrong, self.wrong_to_right, self.paired)

    @property
    def p_value(self) -> float | None:
        return mcnemar_p(self.right_to_wrong, self.wrong_to_right) if self.paired else None

    def regression(self, alpha: float) -> str | None:
        """Why this is a significant accuracy drop at level `alpha`, or None."""
        delta, p = self.delta, self.p_value
        if delta is None or p is None or delta >= 0 or p >= alpha:
            return None
        assert self.accuracy_before is not None and self.accuracy_now is not None
        return (f"accuracy fell {-delta:.4f} ({self.accuracy_before:.4f} -> "
                f"{self.accuracy_now:.4f}) on {self.paired} paired lines against "
                f"{self.baseline}: {self.right_to_wrong} right->wrong, {self.wrong_to_right} "
                f"wrong->right, McNemar p = {p:.4g} < {alpha:g} (--fail-on-regression)")

    def as_dict(self) -> dict[str, Any]:
        interval = self.interval
        return {
            "baseline": self.baseline, "matched": self.matched, "only_now": self.only_now,
            "only_baseline": self.only_before, "input_changed": self.input_changed,
            "paired": self.paired, "accuracy_before": _round(self.accuracy_before),
            "accuracy_now": _round(self.accuracy_now), "delta": _round(self.delta),
            "delta_95ci": [_round(x) for x in interval] if interval else None,
            "mcnemar_p": _round(self.p_value, 6), "right_to_wrong": self.right_to_wrong,
            "wrong_to_right": self.wrong_to_right, "newly_failing": self.newly_failing,
            "changed": [{"id": c.now.name, "way": c.way, "before": c.before.text,
                         "now": c.now.text, "expected": c.now.answer} for c in self.changes],
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    return round(value, digits) if value is not None else None


def compare(now: Iterable[LineOutcome], before: Iterable[LineOutcome],
            baseline: str) -> Comparison:
    """This run's lines against the baseline's (repeated ids pair up in file order)."""
    out = Comparison(baseline)
    waiting: dict[tuple[str, str | None], deque[LineOutcome]] = defaultdict(deque)
    before_ids: set[str] = set()
    for line in before:
        waiting[(line.id, line.digest)].append(line)
        before_ids.add(line.id)
    right_before = right_now = 0
    for line in now:
        queue = waiting.get((line.id, line.digest))
        if not queue:
            if line.id in before_ids:
                out.input_changed += 1
            else:
                out.only_now += 1
            continue
        old = queue.popleft()
        out.matched += 1
        if old.status == "ok" and line.status in ("error", "invalid"):
            out.newly_failing += 1
        if old.text != line.text or old.status != line.status:
            out.changes.append(Change(old, line))
        if old.correct is None or line.correct is None:
            continue
        out.paired += 1
        right_before += old.correct
        right_now += line.correct
        out.right_to_wrong += old.correct and not line.correct
        out.wrong_to_right += line.correct and not old.correct
    left = sum(len(q) for q in waiting.values())
    out.only_before = max(0, left - out.input_changed)
    if out.paired:
        out.accuracy_before = right_before / out.paired
        out.accuracy_now = right_now / out.paired
    return out
