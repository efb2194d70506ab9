"""How often the closer finds no completion, from states a looping model could reach.

For each schema of one half of the split (bench/data_split.py) it compiles the schema as
a run does, then walks the matcher from its start with random allowed tokens, biased to
repeat what it took (a loop, as a small model writes it), and asks `Closer.completion`
for a way to finish from states along the walk. It reports the share of states with no
completion (the walk's misses), the completion's length and the walk's time, and the
schemas and texts of the misses. No model runs: only the tokenizer and the grammar.

    python bench/closing_walk.py --half held --per-subset 40
    python bench/closing_walk.py --real tests/data/real_states.jsonl

`--real FILE` walks, instead, from the states real models reached (bench/real_states.py:
where a loop began, where the limit cut a value), each fed to the matcher as the
tokenizer writes its text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from coverage_run import DATA, SUBSETS, sample_schemas  # noqa: E402

# The budget a completion may take (tokens): early_close.WALK_LIMIT.
LIMIT = 256


def allowed(m: Any) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")
    return np.flatnonzero(bits)


def walk(m: Any, rng: random.Random, steps: int, repeat: float) -> list[int]:
    """Consume up to `steps` random allowed tokens into `m`; with probability `repeat`
    take again one of the last few tokens where the grammar allows it (a loop)."""
    out: list[int] = []
    for _ in range(steps):
        if m.is_stopped() or m.is_error():
            break
        forced = m.compute_ff_tokens()
        if forced:
            m.consume_tokens(forced)
            out += forced
            continue
        choice = None
        if out and rng.random() < repeat:
            t = rng.choice(out[-4:])
            if m.validate_tokens([t]) == 1:
                choice = t
        if choice is None:
            ok = allowed(m)
            ok = ok[ok < m.tokenizer_size] if hasattr(m, "tokenizer_size") else ok
            if not ok.size:
                break
            choice = int(ok[rng.randrange(ok.size)])
        if not m.consume_token(choice):
            break
        if m.is_stopped() or m.is_accepting():  # a finished value closes nothing
            m.rollback(1)
            break
        out.append(choice)
    return out


def _invalid(validator: Any, text: str) -> str | None:
    """Why `text` is not a valid value of the schema (None when it is)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    if validator is None:
        return None
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else f"{error.validator}: {error.message[:120]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--half", default="held")
    ap.add_argument("--per-subset", type=int, default=40)
    ap.add_argument("--states", type=int, default=4, help="walks per schema")
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--repeat", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=10, help="misses printed")
    ap.add_argument("--real", type=Path, default=None,
                    help="states of real runs (bench/real_states.py) instead of walks")
    args = ap.parse_args()

    from aici_cli.control.grammar.closing import Closer
    from aici_cli.control.grammar.compiler import GrammarCompiler
    from aici_cli.control.grammar.early_close import VARIANTS
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.errors import GrammarError
    from aici_cli.models.sources.resolve import resolve_model
    from aici_cli.models.tokenizer.fast_tokenizer import read_hub_tokenizer

    tok = read_hub_tokenizer(resolve_model(None))
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    compiler = GrammarCompiler(tok, len(tok), eos)
    closer = Closer(tok, compiler.tokenizer.decode_bytes)
    if args.real is not None:
        rows = [json.loads(x) for x in args.real.read_text().splitlines()]
        picked = [(r["id"].split("/")[0], f'{r["id"]} ({r["kind"]})', r["schema"])
                  for r in rows]
        real_texts = [r["text"] for r in rows]
    else:
        picked = sample_schemas(DATA, list(SUBSETS), args.per_subset, args.seed, args.half)
        real_texts = []
    rng = random.Random(args.seed)
    unreplayable = 0
    states = misses = accepted = invalid = first_invalid = 0
    bad: list[dict[str, Any]] = []
    lengths: list[int] = []
    times: list[float] = []
    shown: list[dict[str, Any]] = []
    for i, (subset, name, schema) in enumerate(picked):
        try:
            grammar = compiler.compile(Constraint("json_schema", schema), relax=True)
        except GrammarError:
            continue
        for _ in range(1 if args.real else args.states):
            m = grammar.template.deep_copy()
            if args.real:
                text = real_texts[i]
                if not m.consume_tokens(tok(text, add_special_tokens=False)["input_ids"]):
                    unreplayable += 1  # the grammar differs from the run's (relaxed)
                    continue
            else:
                tokens = walk(m, rng, rng.randrange(1, args.max_steps), args.repeat)
                text = compiler.tokenizer.decode_bytes(tokens).decode("utf-8", "replace")
            if m.is_error() or m.is_stopped() or m.is_accepting():
                accepted += 1
                continue
            t0 = time.perf_counter()
            done = closer.completion(m, text, LIMIT, grammar.hints)
            times.append(time.perf_counter() - t0)
            states += 1
            if done is None:
                misses += 1
                if len(shown) < args.show:
                    shown.append({"schema": f"{subset}/{name}", "text": text})
            else:
                lengths.append(len(done))
                # As a close picks (early_close.py): the first completion the schema
                # accepts of the walk's variants, else the first.
                problem = "none"
                for option in closer.variants(m, text, LIMIT, grammar.hints, VARIANTS):
                    closed = text + compiler.tokenizer.decode_bytes(option).decode(
                        "utf-8", "replace")
                    problem = _invalid(grammar.validator, closed)
                    if problem is None:
                        break
                    first_invalid += option is done or option == done
                if problem is not None:
                    invalid += 1
                    if len(bad) < args.show:
                        bad.append({"schema": f"{subset}/{name}", "problem": problem,
                                    "closed": closed[-200:]})
    source = f"{args.real}" if args.real else f"{args.half} half"
    print(f"{len(picked)} schemas ({source}), {states} states "
          f"({accepted} ended complete, {unreplayable} not replayable): no completion "
          f"{misses} ({misses / max(states, 1):.3f})")
    if lengths:
        print(f"completion tokens p50/p99/max {np.percentile(lengths, 50):.0f}/"
              f"{np.percentile(lengths, 99):.0f}/{max(lengths)}")
    if times:
        print(f"walk ms p50/p99/max {1000 * np.percentile(times, 50):.1f}/"
              f"{1000 * np.percentile(times, 99):.1f}/{1000 * max(times):.1f}")
    print(f"closed but invalid {invalid} ({invalid / max(states - misses, 1):.3f}); "
          f"first completion invalid {first_invalid}")
    for miss in shown:
        print(json.dumps(miss))
    for b in bad:
        print(json.dumps(b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
