"""What `--quantize` costs in quality, against the bf16 run of the same model.

Three measures, each for every mode in --modes against `none` (dense weights), all at
--dtype activations (`int4-torch`: int4 on PyTorch's kernel, the project's int kernels
off; set AICI_BATCH_ISA=avx2 to measure what an AVX2 machine runs):

- KL divergence of the next-token distributions on held-out text (prose the project
  never tunes on: the GPL-3 text Debian ships, in windows of --window tokens), mean over
  positions, with the share of positions whose top-1 token agrees;
- JSON compliance on the held-out half of Glaiveai2K (`bench/data_split.py`: the first
  --schemas of its sorted files; no setting is tuned on them): outputs that parse and
  validate against their schema, at batch 8, greedy, --max-tokens (a `messages` line, or
  a `prompt` line for a model without a chat template, such as gemma-3-270m);
- the eval example's accuracy (examples/eval/eval.jsonl, `--score`);
- for a GGUF model, how far each way of putting its quantised matrices on the kernels
  is from the file's own values (`weights`: relative RMS error, and the largest error
  over the matrix's largest value, mean over the matrices of each type): the blocks
  mapped as runs map them (`aici_cli/models/gguf/kquant.py`), min/max int4 per group of 32,
  int8 per channel. Q5_K is measured on the file's Q6_K matrices written again as Q5_K
  (the test suite's encoder, `tests/support/arch_gguf.py`), where the file has none.

    python bench/quantize_quality.py --modes int8,int4 --schemas 32 --max-tokens 256
    python bench/quantize_quality.py --model gemma-3-270m --skip json,eval \
        --window 128 --windows 4

Results land in out/quantize_quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from data_split import in_half  # noqa: E402

# shared/ beside the checkout (or beside a folder above it, for a worktree)
GLAIVE = next((p / "shared" / "data" / "jsonschemabench" / "Glaiveai2K" for p in REPO.parents
               if (p / "shared" / "data").is_dir()),
              REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K")
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
EVAL = REPO / "examples" / "eval" / "eval.jsonl"


def dev_half(n: int) -> list[Path]:
    """The first `n` schemas of the held-out half (`data_split`): none tuned on."""
    return [p for p in sorted(GLAIVE.glob("*.json")) if in_half(p, "held")][:n]


def next_token_logprobs(lm: Any, text: str, window: int, windows: int) -> Any:
    import torch

    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0]
    out = []
    with torch.inference_mode():
        for w in range(windows):
            chunk = ids[w * window : (w + 1) * window]
            if len(chunk) < 2:
                break
            logits = lm.model(input_ids=chunk[None]).logits[0].float()
            out.append(logits.log_softmax(-1))
    return torch.cat(out)


def json_compliance(lm: Any, schemas: list[Path], max_tokens: int) -> dict[str, Any]:
    import jsonschema

    from aici_cli.core.config import EngineConfig
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.job import Job
    from aici_cli.engine.engine import Engine

    jobs, loaded = [], []
    for i, path in enumerate(schemas):
        schema = json.loads(path.read_text())
        loaded.append(schema)
        ask = f"Produce a JSON object matching this JSON Schema: {json.dumps(schema)}"
        chat = bool(getattr(lm.tokenizer, "chat_template", None))
        jobs.append(Job(index=i + 1, id=path.stem, max_tokens=max_tokens,
                        constraint=Constraint("json_schema", schema),
                        prompt=None if chat else f"{ask}\n",
                        messages=[{"role": "user", "content": ask}] if chat else None))
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    Engine(lm, EngineConfig(batch_size=8)).run(jobs, results.append)
    wall = time.perf_counter() - started
    valid = 0
    for r in results:
        try:
            jsonschema.validate(json.loads(r.get("text") or ""), loaded[r["index"] - 1])
            valid += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            pass
    tokens = sum(r["stats"].get("output_tokens", 0) for r in results)
    return {"valid": valid, "of": len(results), "wall_s": round(wall, 1), "tokens": tokens}


def eval_accuracy(lm: Any) -> dict[str, Any]:
    from aici_cli.core.config import EngineConfig
    from aici_cli.engine.engine import Engine
    from aici_cli.formats.jobs import read_jobs

    results: list[dict[str, Any]] = []
    with EVAL.open("rb") as f:
        items = list(read_jobs(f, _defaults()))
    Engine(lm, EngineConfig(batch_size=8)).run(items, results.append)
    answered = [r for r in results if "correct" in r]
    return {"correct": sum(bool(r["correct"]) for r in answered), "of": len(answered)}


def weight_errors(gguf_file: Path) -> dict[str, dict[str, Any]]:
    """{type: {mapping: [relative RMS error, max error / max |w|], ...}} over the
    matrices of `gguf_file` (module docstring)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from aici_cli.models.gguf import kquant
    from aici_cli.models.quant.quantize import quantize_int4, quantize_int8

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from arch_gguf import quantize_k

    def error(a: Any, w: Any) -> tuple[float, float]:
        return (float(np.sqrt(((a - w) ** 2).mean() / (w ** 2).mean())),
                float(np.abs(a - w).max() / np.abs(w).max()))

    def minmax4(w: Any) -> Any:
        c, d, m = quantize_int4(torch.from_numpy(w))
        return (c.float().view(w.shape[0], -1, 32) * d[..., None] + m[..., None]) \
            .reshape(w.shape).numpy()

    def int8(w: Any) -> Any:
        c, s = quantize_int8(torch.from_numpy(w))
        return (c.float() * s[:, None]).numpy()

    def blocks(raw: Any, kind: str) -> Any:
        c, d, m = kquant.int4_parts(raw, kind)
        return c.astype(np.float32) * np.repeat(d, 32, 1) + np.repeat(m, 32, 1)

    def values(raw: Any, kind: str) -> Any:
        return np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[kind]),
                                    dtype=np.float32)

    found: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for tensor in GGUFReader(str(gguf_file)).tensors:
        kind = tensor.tensor_type.name
        if kind not in kquant.TYPES or len(tensor.data.shape) != 2:
            continue
        raw = np.asarray(tensor.data)
        cases = [(kind, raw)]
        if kind == "Q6_K":
            cases.append(("Q5_K", quantize_k(values(raw, kind), "Q5_K")))
        for case, data in cases:
            w = values(data, case)
            ways = {"int4 g32 min/max": minmax4(w), "int8 per channel": int8(w)}
            if case not in kquant.INT8_ALWAYS:
                ways["int4 from the blocks"] = blocks(data, case)
            for way, got in ways.items():
                found.setdefault(case, {}).setdefault(way, []).append(error(got, w))
    return {case: {way: [round(float(np.mean([e[0] for e in v])), 4),
                         round(float(np.mean([e[1] for e in v])), 4), len(v)]
                   for way, v in by_way.items()}
            for case, by_way in sorted(found.items())}


def _defaults() -> Any:
    from aici_cli.core.config import JobDefaults

    return JobDefaults(score=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", default="int8,int4")
    ap.add_argument("--schemas", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of: kl,json,eval,weights")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "quantize_quality.json")
    ap.add_argument("--dtype", default="bfloat16",
                    help="the activation dtype of every mode (float32: the AVX2 default)")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the model's GGUF file, for the `weights` measure")
    args = ap.parse_args()

    import torch

    from aici_cli.models.load import load_model

    skip = set(filter(None, args.skip.split(",")))
    text = HELD_OUT.read_text() if HELD_OUT.is_file() else (REPO / "README.md").read_text()
    report: dict[str, Any] = {"modes": {}}
    if args.gguf is not None and "weights" not in skip:
        report["weights"] = weight_errors(args.gguf)
        for case, by_way in report["weights"].items():
            for way, (rms, peak, n) in by_way.items():
                print(f"{case:5} {way:21} {n:3} matrices: relative RMS {rms:.4f}, "
                      f"max/max|w| {peak:.4f}", flush=True)
    reference = None
    for mode in ["none", *args.modes.split(",")]:
        # `int4-torch`: int4 on PyTorch's kernel (the project's int kernels off), so the
        # cost of their 8-bit activations shows apart from the weights' rounding.
        quantize, _, torch_kernel = mode.partition("-")
        os.environ["AICI_BATCH_VNNI"] = "off" if torch_kernel == "torch" else "on"
        lm = load_model(args.model, "cpu", args.dtype, quantize)
        row: dict[str, Any] = {}
        if "kl" not in skip:
            lp = next_token_logprobs(lm, text, args.window, args.windows)
            if reference is None:
                reference = lp
            else:
                kl = torch.nn.functional.kl_div(lp, reference, log_target=True,
                                                reduction="none").sum(-1)
                row["kl_mean"] = round(float(kl.mean()), 5)
                row["kl_p99"] = round(float(kl.quantile(0.99)), 4)
                row["top1_agree"] = round(float((lp.argmax(-1) == reference.argmax(-1))
                                                .float().mean()), 4)
                row["positions"] = int(kl.numel())
        if "json" not in skip:
            row["json"] = json_compliance(lm, dev_half(args.schemas), args.max_tokens)
        if "eval" not in skip:
            row["eval"] = eval_accuracy(lm)
        report["modes"][mode] = row
        print(mode, json.dumps(row), flush=True)
        del lm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
