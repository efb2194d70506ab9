"""What the masked projection saves: the default model's output projection for the
next-token rows of a step, whole (`MaskedProjection.full`) against at the allowed ids
alone (`MaskedProjection.project`: reading the mask's allowed ids, the gathered product
and, for a dense projection, the float64 margin check), for 1..4096 allowed tokens,
batch 1 and 8.

Printed per (batch, allowed): the fastest of `--reps` calls of each in milliseconds (the
fastest, the two interleaved: the machine's cores may be shared), their ratio, and how
often the masked projection was taken (a dense projection's margin check may refuse it, and
then pays the gathered product, the check and the full projection). Under
`torch.inference_mode`, as the engine's steps run. The projection is the model's own
(`load_model(None)`, `--dtype`/`--quantize` as `run` takes them); the hidden states are
the model's own final ones over random tokens.

    python bench/masked_projection.py --dtype bfloat16 --quantize int8
    python bench/masked_projection.py --dtype float32
    python bench/masked_projection.py --dtype bfloat16 --quantize none
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aici_cli.engine.logits.masked_projection import MaskedProjection  # noqa: E402
from aici_cli.models import load_model  # noqa: E402

SIZES = (1, 8, 64, 512, 4096)
BATCHES = (1, 8)


def best_ms(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """The fastest call of each of `fns`, interleaved so that both meet the same load."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps + 1):  # the first round warms (first-call allocations)
        for fn, spent in zip(fns, times):
            started = time.perf_counter()
            fn()
            spent.append((time.perf_counter() - started) * 1000)
    return [min(spent[1:]) for spent in times]


def row(projection: MaskedProjection, hidden: torch.Tensor, n: int, reps: int) -> str:
    """One table row: `hidden` [b, width]'s rows, each allowing `n` random tokens."""
    b, vocab = hidden.shape[0], projection.vocab_size
    disallowed = torch.ones(b, vocab, dtype=torch.bool)
    for k in range(b):
        disallowed[k, torch.randperm(vocab)[:n]] = False
    rows = list(range(b))
    before = projection.used
    full, masked = best_ms([lambda: projection.full(hidden),
                            lambda: projection.project(hidden, disallowed, rows)], reps)
    taken = (projection.used - before) / (reps + 1)  # 100%: the margin check never refused
    return f"| {b} | {n} | {full:.3f} | {masked:.3f} | {masked / full:.2f} | {taken:.0%} |"


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(None, device="cpu", dtype=args.dtype, quantize=args.quantize)
    projection = MaskedProjection.for_model(lm.model, lm.vocab_size, torch.device("cpu"),
                                            False, threshold=max(SIZES))
    assert projection is not None, "the projection cannot be gathered (int4?)"
    # Past any set threshold:
    projection = MaskedProjection(projection.head, lm.vocab_size, max(SIZES))
    head = type(projection.head).__name__
    width = lm.model.config.hidden_size
    print(f"{head} {lm.vocab_size} x {width}, {lm.dtype}, {torch.get_num_threads()} threads")
    print("| batch | allowed | full ms | masked ms | masked / full | taken |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in BATCHES:
        ids = torch.randint(0, lm.vocab_size, (1, 16 + b))
        hidden = lm.model(ids, project=False).logits[0, -b:].contiguous()  # [b, width]
        for n in SIZES:
            print(row(projection, hidden, n, args.reps))


if __name__ == "__main__":
    main()
