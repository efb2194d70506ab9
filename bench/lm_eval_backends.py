"""lm-evaluation-harness on this engine against lm-eval's own `hf` backend, in one run.

A few-shot multiple-choice task written here (MMLU's shape: the question with its four
options lettered A-D, the answer one letter, so four one-token choices; the same first
`--shots` examples before every question, lm-eval's `first_n` sampler), evaluated by real
`lm_eval.simple_evaluate` with `--model aici-batch` and with `--model hf`: same model, fp32,
same batch size. Reports each backend's wall and CPU time (model loading apart), the
ratios, the largest per-request loglikelihood difference, whether every `is_greedy`
agrees, and both accuracies. Results land in out/lm_eval_backends.json. Run it with
`OMP_NUM_THREADS=1` on a shared machine (the load average is in the output).

    python bench/lm_eval_backends.py                      # 200 questions, 5-shot, batch 8
    python bench/lm_eval_backends.py --questions 40       # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LETTERS = "ABCD"

TASK_YAML = """\
task: bench_arithmetic_mc
custom_dataset: !function data.load
output_type: multiple_choice
training_split: train
test_split: test
fewshot_split: train
fewshot_config:
  sampler: first_n
num_fewshot: {shots}
doc_to_text: "{{{{question}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\n\\
C. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
description: "The following are multiple choice questions about arithmetic.\\n\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

DATA_PY = """\
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(**kwargs):
    return datasets.DatasetDict({
        split: datasets.Dataset.from_list(
            [json.loads(x) for x in (HERE / f"{split}.jsonl").read_text().splitlines()])
        for split in ("train", "test")})
"""


def questions(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` sums of two numbers, each with the right total and three wrong ones."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        right = a + b
        wrong = rng.sample([right + d for d in (-11, -10, -2, -1, 1, 2, 10, 11)], 3)
        options = [right, *wrong]
        rng.shuffle(options)
        out.append({"question": f"What is {a} + {b}?", "choices": [str(o) for o in options],
                    "answer": options.index(right)})
    return out


def write_task(folder: Path, n: int, shots: int) -> None:
    rows = questions(n + shots, seed=24)
    (folder / "task.yaml").write_text(TASK_YAML.format(shots=shots))
    (folder / "data.py").write_text(DATA_PY)
    for split, part in (("train", rows[:shots]), ("test", rows[shots:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def evaluate(lm: Any, folder: Path) -> tuple[float, float, dict[str, Any]]:
    """Wall and CPU seconds of one `simple_evaluate` (the CPU time, of every thread of
    the process, is what another busy process on a shared machine disturbs least)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(folder), include_defaults=False)
    t0, c0 = time.perf_counter(), time.process_time()
    out = lm_eval.simple_evaluate(model=lm, tasks=["bench_arithmetic_mc"], task_manager=tasks,
                                  log_samples=True, bootstrap_iters=0)
    return time.perf_counter() - t0, time.process_time() - c0, out


def answers(out: dict[str, Any]) -> list[tuple[float, bool]]:
    samples = sorted(out["samples"]["bench_arithmetic_mc"], key=lambda s: s["doc_id"])
    return [tuple(r[0]) for s in samples for r in s["resps"]]


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default=None, help="aici-batch --model (default model)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "lm_eval_backends.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from lm_eval.models.huggingface import HFLM

    from aici_cli.evals.lm_eval_backend import AiciBatchLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder, args.questions, args.shots)
        t0 = time.perf_counter()
        ours = AiciBatchLM(model=args.model, dtype="float32", device="cpu",
                           batch_size=args.batch_size)
        load_ours = time.perf_counter() - t0
        ours_s, ours_cpu, ours_out = evaluate(ours, folder)
        prefill = ours.engine.step_times
        path = ours.lm.model.name_or_path
        t0 = time.perf_counter()
        hf = HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=args.batch_size)
        load_hf = time.perf_counter() - t0
        hf_s, hf_cpu, hf_out = evaluate(hf, folder)

    mine, theirs = answers(ours_out), answers(hf_out)
    acc = ours_out["results"]["bench_arithmetic_mc"]["acc,none"]
    acc_hf = hf_out["results"]["bench_arithmetic_mc"]["acc,none"]
    report = {
        "questions": args.questions, "shots": args.shots, "choices": 4,
        "batch_size": args.batch_size, "dtype": "float32", "model": path,
        "requests": len(mine),
        "aici_batch_s": round(ours_s, 2), "hf_s": round(hf_s, 2),
        "speedup": round(hf_s / ours_s, 2),
        "aici_batch_cpu_s": round(ours_cpu, 2), "hf_cpu_s": round(hf_cpu, 2),
        "cpu_speedup": round(hf_cpu / ours_cpu, 2),
        "load_average": os.getloadavg(),
        "torch_threads": _torch_threads(),
        "load_s": {"aici_batch": round(load_ours, 2), "hf": round(load_hf, 2)},
        "max_abs_loglikelihood_diff": max(abs(a[0] - b[0]) for a, b in zip(mine, theirs)),
        "is_greedy_agree": all(a[1] == b[1] for a, b in zip(mine, theirs)),
        "accuracy": {"aici_batch": acc, "hf": acc_hf},
        "aici_batch_forward_passes": len(prefill),
        "aici_batch_tokens_fed": sum(s.tokens for s in prefill),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
