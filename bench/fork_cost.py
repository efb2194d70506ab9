"""What a fork costs, measured side by side in one run.

  1. replay: bringing a new branch's guest to the fork point (a new instance and its
     constructor, then every guest call before the fork again), for a componentize-py
     guest that forks after 0, 16, 64 and 256 calls (bench/controllers/fork_after.py);
  2. end to end on the default model: vote.py (one line forks into 5 branches) against
     the same answer written by 5 samples of a line without a fork
     (bench/controllers/answer_once.py, `n` = 5): wall time, forward passes, prompt tokens
     computed, controller and replay time.

    python bench/fork_cost.py --lines 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from controller_costs import NullServices  # noqa: E402

QUESTIONS = [
    "Is the sky blue on a clear day?", "Is fire cold?", "Do fish live in water?",
    "Is ice hot?", "Can birds fly?", "Is the sun a star?", "Is salt sweet?",
    "Do cats bark?", "Is snow white?", "Is grass purple?",
]


def replay_ms(component: Any, calls: int, repeats: int) -> float:
    """Median ms of `GuestInstance.replica()` after `calls` guest calls."""
    from aici_cli.control.actions import StepInput

    guest = component.instantiate(str(calls), [1, 2, 3], NullServices())
    guest.mid_process(StepInput())
    for i in range(calls):
        guest.mid_process(StepInput(tokens=(5 + i % 100,)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        guest.replica().close()
        times.append((time.perf_counter() - t0) * 1000)
    guest.close()
    return round(statistics.median(times), 2)


def run_lines(lm: Any, component: Any, lines: list[dict[str, Any]],
              batch_size: int) -> tuple[float, list[dict[str, Any]], Any]:
    from aici_cli.core.config import EngineConfig, RunConfig
    from aici_cli.core.job import Job
    from aici_cli.core.sampling import Sampling
    from aici_cli.engine import Engine
    from aici_cli.run.backends.build import wasm_factory

    config = EngineConfig(batch_size=batch_size)
    engine = Engine(lm, config)
    engine.set_controller_factory(wasm_factory(RunConfig(input="-", engine=config),
                                               engine, [], component))
    jobs = [Job(index=i + 1, id=str(i + 1), prompt=None, messages=line["messages"],
                max_tokens=8, sampling=Sampling(temperature=0.8, seed=i),
                n=line.get("n", 1),
                extra={"controller_arg": line["controller_arg"]})
            for i, line in enumerate(lines)]
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    engine.run(jobs, results.append)
    wall = time.perf_counter() - t0
    return wall, results, engine.step_times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lines", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "fork_cost")
    args = ap.parse_args()

    from aici_cli.control.componentize import build_controller
    from aici_cli.control.wasm import ControllerComponent
    from aici_cli.models import load_model

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    sources = {"fork_after": REPO / "bench" / "controllers" / "fork_after.py",
               "answer_once": REPO / "bench" / "controllers" / "answer_once.py",
               "vote": REPO / "controllers" / "examples" / "vote.py"}
    comps = {name: ControllerComponent.load(build_controller(src, args.out / f"{name}.wasm").out)
             for name, src in sources.items()}

    report["replay_ms_after_calls"] = {
        str(k): replay_ms(comps["fork_after"], k, args.repeats) for k in (0, 16, 64, 256)}
    print(json.dumps(report), flush=True)

    lm = load_model(None, device="cpu", dtype="auto")
    arg = {"pattern": "(yes|no|Yes|No)", "max_tokens": 3}
    questions = (QUESTIONS * (args.lines // len(QUESTIONS) + 1))[: args.lines]

    def lines(n: int) -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": f"{q} Answer yes or no."}],
                 "controller_arg": arg, "n": n} for q in questions]

    for name, comp, n in (("n=5 samples", comps["answer_once"], 5),
                          ("fork(5)", comps["vote"], 1)):
        walls, forward = [], []
        for _ in range(args.repeats):
            wall, results, steps = run_lines(lm, comp, lines(n), args.batch_size)
            walls.append(wall)
            forward.append(sum(t.forward_ms for t in steps) / 1000)
        choices = [c for r in results for c in r["choices"]]
        stats = [r["stats"] for r in results]
        report[name] = {
            "wall_s": round(statistics.median(walls), 2),
            "walls_s": [round(w, 2) for w in walls],
            "forward_s": round(statistics.median(forward), 2),
            "steps": len(steps),
            "sequences": len(choices),
            "errors": sum(r["finish_reason"] == "error" for r in results),
            "positions_fed": sum(t.tokens for t in steps),
            "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
            "cached_tokens": sum(s["cached_tokens"] for s in stats),
            "forward_passes": sum(s["forward_passes"] for s in stats),
            "controller_ms": round(sum(s["controller_ms"] for s in stats), 1),
            "guest_ms": round(sum(s.get("guest_ms", 0) for s in stats), 1),
            "replay_ms_per_branch": round(statistics.mean(
                [c["stats"]["replay_ms"] for c in choices if "replay_ms" in c["stats"]] or [0]),
                2),
        }
        print(json.dumps({name: report[name]}), flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
