"""What the sampling fields cost per decode step: the same lines run plain, with
presence and frequency penalties, and with every logit rule (repetition penalty,
logit_bias, min_tokens too), greedy, at one batch size. Reports the median decode step
and the mean time a step spends applying the rules (`rules_before_masks`, and the draft
check under the rules), so their share of the step is plain.

    python bench/penalty_cost.py --model default --batch-size 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.core.sampling import Sampling
from aici_cli.engine import Engine
from aici_cli.engine import model_runner as loop  # where the step applies the rules
from aici_cli.models import load_model

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "presence+frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.3},
    "every rule": {"presence_penalty": 0.5, "frequency_penalty": 0.3,
                   "repetition_penalty": 1.2, "logit_bias": ((5, 2.0), (17, -3.0)),
                   "min_tokens": 32},
}

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "List the planets of the solar system and one fact about each.",
           "Explain how a bicycle gear works.",
           "Describe a walk through a market in the morning.",
           "What makes a good cup of tea?",
           "Summarize the rules of chess in a few sentences.",
           "Write a letter to a friend about a trip to the mountains.",
           "Give three tips for learning a new language."]


def timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - t0) * 1000)
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(None if args.model == "default" else args.model, dtype=args.dtype)
    print(f"{lm.name} {lm.dtype} V={lm.vocab_size} batch {args.batch_size}, "
          f"{args.max_tokens} tokens")
    rules_fn, drafts_fn = loop.rules_before_masks, loop.checked_draft_picks
    for name, fields in VARIANTS.items():
        steps: list[float] = []
        spent: list[float] = []
        passes = 0
        for _ in range(args.repeats):
            jobs = [Job(index=i + 1, id=str(i + 1), prompt=PROMPTS[i % len(PROMPTS)],
                        messages=None, max_tokens=args.max_tokens,
                        sampling=Sampling(temperature=0.0, top_p=1.0, seed=i, **fields))
                    for i in range(args.batch_size)]
            engine = Engine(lm, EngineConfig(batch_size=args.batch_size))
            loop.rules_before_masks = timed(rules_fn, spent)  # type: ignore[assignment]
            loop.checked_draft_picks = timed(drafts_fn, spent)  # type: ignore[assignment]
            try:
                engine.run(jobs, lambda result: None)
            finally:
                loop.rules_before_masks, loop.checked_draft_picks = rules_fn, drafts_fn
            steps += [s.step_ms for s in engine.step_times if s.kind == "decode"]
            passes += len(engine.step_times)
        step, rules = statistics.median(steps), sum(spent) / passes
        print(f"{name:20s} decode step p50 {step:7.2f} ms   rules {rules:6.3f} ms a step "
              f"on average ({100 * rules / step:4.1f}% of a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
