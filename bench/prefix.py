"""Evaluation workloads with a shared few-shot prefix: the prefix cache side by side.

The 48-line multiple-choice eval in `examples/eval/eval.jsonl` (a 5-shot prefix of about
330 tokens on every line, four choices each), run three ways:

- `score`: `aici-batch run --score`: every choice ranked by log-likelihood;
- `json`:  the same lines asking for `{"answer": <choice>}` under a JSON schema whose
  `enum` is the four choices (16 tokens at most);
- `generate`: transformers `generate()` on the same prompts, greedy, static left-padded
  batches of the same size, 4 new tokens (enough for the answer), no constraint;

each aici-batch one with the prefix cache and with `--no-prefix-cache`, all in one
process on the default model. Reports wall time, prompt tokens actually fed to the model
(aici-batch: prompt tokens less those from the cache; generate(): the padded batches),
lines/s, and accuracy.

    python bench/prefix.py --batch-size 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EVAL = REPO / "examples" / "eval" / "eval.jsonl"


def json_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval asking for a JSON answer instead of scoring."""
    out = []
    for line in lines:
        options = [c.strip() for c in line["choices"]]
        schema = {"type": "object", "properties": {"answer": {"enum": options}},
                  "required": ["answer"], "additionalProperties": False}
        out.append({"id": line["id"], "json_schema": schema, "max_tokens": 16,
                    "answer": line["answer"].strip(),
                    "prompt": line["prompt"].removesuffix("Answer:")
                    + 'Reply with JSON such as {"answer": "..."}.\nAnswer: '})
    return out


def run_aici(lines: list[dict[str, Any]], batch_size: int, score: bool,
             prefix_cache: bool) -> dict[str, Any]:
    from aici_cli.core.config import EngineConfig, JobDefaults, RunConfig
    from aici_cli.run.batch import run_batch

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        config = RunConfig(
            input=str(src), output=str(out), quiet=True,
            engine=EngineConfig(batch_size=batch_size, prefix_cache=prefix_cache),
            defaults=JobDefaults(score=score, max_tokens=16),
        )
        t0 = time.perf_counter()
        outcome = run_batch(config)
        wall = time.perf_counter() - t0
        results = [json.loads(x) for x in out.read_text().splitlines()]
    s = outcome.summary
    if score:
        correct = sum(bool(r.get("correct")) for r in results)
    else:  # the JSON variant: correct when its answer field is the expected one
        correct = sum(_json_answer(r) == r.get("answer") for r in results)
    return {"wall_s": wall, "fed": s["prompt_tokens"] - s["cached_tokens"],
            "prompt_tokens": s["prompt_tokens"], "output_tokens": s["output_tokens"],
            "passes": s["forward_passes"], "correct": correct, "lines": len(results)}


def _json_answer(result: dict[str, Any]) -> Any:
    value = result.get("json")
    return value.get("answer") if isinstance(value, dict) else None


def run_generate(lines: list[dict[str, Any]], batch_size: int, model: Any, tokenizer: Any,
                 max_new: int) -> dict[str, Any]:
    import torch

    fed = output = 0
    correct = 0
    t0 = time.perf_counter()
    for start in range(0, len(lines), batch_size):
        batch = lines[start : start + batch_size]
        enc = tokenizer([b["prompt"] for b in batch], padding=True, return_tensors="pt")
        fed += int(enc["input_ids"].numel())
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new,
                                 pad_token_id=tokenizer.pad_token_id)
        for line, row in zip(batch, out[:, enc["input_ids"].shape[1]:].tolist()):
            text = tokenizer.decode(row, skip_special_tokens=True)
            output += len(row)
            answer = line["answer"].strip()
            correct += text.strip().startswith(answer) or f'"{answer}"' in text
    return {"wall_s": time.perf_counter() - t0, "fed": fed, "prompt_tokens": fed,
            "output_tokens": output, "passes": None, "correct": correct,
            "lines": len(lines)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "prefix.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from aici_cli.models.load import load_model

    lines = [json.loads(x) for x in EVAL.read_text().splitlines() if x.strip()]
    jlines = json_lines(lines)
    lm = load_model(None, implementation="transformers")  # generate() below is its own
    tok = lm.tokenizer
    tok.padding_side = "left"
    runs: dict[str, list[dict[str, Any]]] = {}
    contenders = {
        "score, prefix cache": lambda: run_aici(lines, args.batch_size, True, True),
        "score, no prefix cache": lambda: run_aici(lines, args.batch_size, True, False),
        "json, prefix cache": lambda: run_aici(jlines, args.batch_size, False, True),
        "json, no prefix cache": lambda: run_aici(jlines, args.batch_size, False, False),
        "generate(), 4 tokens": lambda: run_generate(lines, args.batch_size, lm.model, tok, 4),
        "generate(), json 16 tokens": lambda: run_generate(jlines, args.batch_size, lm.model,
                                                           tok, 16),
    }
    for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits all alike
        for name, fn in contenders.items():
            runs.setdefault(name, []).append(fn())
    base = min(r["wall_s"] for r in runs["score, prefix cache"])
    print(f"{len(lines)} lines, batch {args.batch_size}, best of {args.repeats}, "
          f"{lm.name} {str(lm.dtype).removeprefix('torch.')}")
    print(f"{'contender':28} {'wall s':>8} {'vs score+cache':>15} {'prompt tokens fed':>18} "
          f"{'lines/s':>8} {'accuracy':>9}")
    table = {}
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        table[name] = best
        print(f"{name:28} {best['wall_s']:8.2f} {best['wall_s'] / base:14.2f}x "
              f"{best['fed']:18,} {best['lines'] / best['wall_s']:8.2f} "
              f"{best['correct'] / best['lines']:9.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"batch_size": args.batch_size, "runs": runs,
                                    "best": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
