"""The device check's figures (bench/device_check.sh): steady decode on the accelerator,
against transformers' own best `generate()` and against the memory's limit.

Each subcommand is one step of the check, with its own time limit there, and writes its
figures to `--parts` as it goes (a step cut off by its limit keeps what it measured):

    hbm        the device's memory bandwidth: a device-to-device copy of 1 GiB, timed
    engine     this engine (the library: `Engine.run`), per batch size, unconstrained and
               JSON-schema constrained (`bench/data/device_schemas.json`): a warm-up run,
               then a timed one; steady decode apart from prefill and start-up, and the
               device->host syncs per decode step
    generate   transformers' `generate()` with a static cache and `model.forward` compiled
               with `torch.compile(mode="reduce-overhead")` (the gpt-fast recipe), warm
    summary    every part's figures in one JSON (`figures.json`) and `summary.md`
    schemas    rebuilds `bench/data/device_schemas.json` from ../shared/data

Timing: CUDA events on the device's stream (`torch.cuda.Event`), read once the run is
over, so timing adds no sync; `time.perf_counter` on a CPU. A step's time runs from the
start of its pass to the start of the next (its host work between passes included).
"Steady decode" is the decode steps with every row of the batch sampling, less the
run's last step (it also finishes the lines): tokens sampled over their time. Prefill is
the steps that fed prompts; start-up the time from `run` to the first pass (admission,
tokenizing, grammar compiles). Syncs: `torch.cuda.set_sync_debug_mode("warn")` during a
separate short run of the same batch, its warnings counted per decode step (None on a
CPU, where nothing syncs).

    python bench/device_bench.py engine --model out/models/1b --name one_b --parts out/parts
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
SCHEMAS = REPO / "bench" / "data" / "device_schemas.json"
GLAIVE = next((p / "shared" / "data" / "jsonschemabench" / "Glaiveai2K" for p in REPO.parents
               if (p / "shared" / "data").is_dir()),
              REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K")
TOPICS = ["a dragon", "the sea", "a city at night", "an old clock", "a robot", "the moon",
          "a lost key", "winter"]

# The figures the check promises, by name (None where a step did not run or on a CPU).
KEYS = ("gpu", "hbm_gb_s", "one_b_bytes_per_token", "one_b_hbm_limit_tok_s",
        "one_b_batch1_tok_s", "one_b_batch1_generate_tok_s", "one_b_batch8_tok_s",
        "one_b_batch8_generate_tok_s", "one_b_batch64_tok_s",
        "one_b_batch64_generate_tok_s", "one_b_batch64_json_tok_s", "default_batch1_tok_s",
        "default_batch1_generate_tok_s", "default_batch64_tok_s",
        "default_batch64_json_tok_s", "syncs_per_step", "syncs_per_step_json",
        "cuda_tests_passed", "cuda_tests_failed")


# ------------------------------------------------------------------------------ timing

class Clock:
    """Marks on the device's timeline (CUDA events) or the host's (perf_counter)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (on CUDA: waits for the later one)."""
        if not self.cuda:
            return float(end - start)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


@contextlib.contextmanager
def counting_syncs(on: bool) -> Iterator[list[Any]]:
    """The warnings `set_sync_debug_mode("warn")` gives for each device->host sync, as a
    list that grows while the block runs (stays empty where `on` is False)."""
    if not on:
        yield []
        return
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def is_sync(w: Any) -> bool:
    return "synchroniz" in str(w.message)


# ------------------------------------------------------------------------------ models

def model_spec(name: str) -> str | None:
    return None if name == "default" else name


def bytes_per_step(config: Any, dtype_bytes: int) -> int:
    """The weights one decode step reads: every layer's matrices and norms, the final
    norm and the output projection (tied or not; the input embedding reads only its
    rows). At batch 1 it is the bytes per token; the KV cache's reads come on top."""
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    layer = (h * heads * head_dim * 2 + h * kv * head_dim * 2
             + 3 * h * int(config.intermediate_size) + 2 * h)
    return (int(config.num_hidden_layers) * layer + h
            + int(config.vocab_size) * h) * dtype_bytes


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu ({line.split(':', 1)[1].strip()})"
    return f"cpu ({platform.processor() or platform.machine()})"


def schema_set(n: int) -> list[tuple[str, dict[str, Any]]]:
    """`n` schemas of the held half: the committed set, or the project's own example."""
    if SCHEMAS.is_file():
        schemas = json.loads(SCHEMAS.read_text())["schemas"]
        return list(schemas.items())[:n]
    files = sorted((REPO / "examples").glob("*.schema.json"))
    print(f"no {SCHEMAS}: using {', '.join(f.name for f in files)}", file=sys.stderr)
    return [(f.name, json.loads(f.read_text())) for f in files]


# ------------------------------------------------------------------------------ parts

class Parts:
    """A step's figures, written to `folder/name.json` after every measurement."""

    def __init__(self, folder: Path, name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{name}.json"
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")
        print(json.dumps({key: value}), flush=True)


def hbm(args: argparse.Namespace) -> int:
    """GB/s of a device-to-device copy (bytes read + bytes written), the best of rounds."""
    import torch

    from aici_cli.models.device import pick_device

    device = pick_device(args.device)
    parts = Parts(args.parts, "hbm")
    n = args.mib * 1024 * 1024
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    clock = Clock(device)
    dst.copy_(src)  # warm-up
    best = 0.0
    for _ in range(args.rounds):
        start = clock.mark()
        for _ in range(args.copies):
            dst.copy_(src)
        seconds = clock.seconds(start, clock.mark())
        best = max(best, 2 * n * args.copies / seconds / 1e9)
    parts.put("gpu", device_name(device))
    parts.put("hbm_gb_s", round(best, 1))
    parts.put("hbm_copy_mib", args.mib)
    return 0


# ------------------------------------------------------------------------------ engine

def engine_jobs(n: int, tokens: int, schemas: list[tuple[str, dict[str, Any]]] | None,
                chat: bool, temperature: float = 1.0) -> list[Any]:
    """`n` lines: greedy story prompts (end-of-sequence ignored, so each makes `tokens`),
    or one schema each, sampled at `temperature` (seed: the line's index; a random model's
    greedy JSON is a few tokens long, its sampled JSON long strings): the line ends where
    its JSON does, or is closed at `tokens`."""
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.job import Job
    from aici_cli.core.sampling import Sampling

    jobs = []
    for i in range(n):
        if schemas is None:
            ask, constraint = f"Write a story about {TOPICS[i % len(TOPICS)]}.", None
        else:
            name, schema = schemas[i % len(schemas)]
            ask = f"Reply with the JSON arguments of {name.rsplit('_', 1)[0]}."
            constraint = Constraint("json_schema", schema)
        jobs.append(Job(index=i + 1, id=str(i), max_tokens=tokens, constraint=constraint,
                        prompt=None if chat else ask + "\n",
                        messages=[{"role": "user", "content": ask}] if chat else None,
                        ignore_eos=schemas is None,
                        sampling=Sampling() if schemas is None
                        else Sampling(temperature=temperature, seed=i)))
    return jobs


def timed_run(engine: Any, jobs: list[Any], clock: Clock, syncs: bool = False
              ) -> dict[str, Any]:
    """One `engine.run`, each pass marked: the figures of its steady decode, prefill and
    start-up (and its syncs per decode step where `syncs`)."""
    runner = engine.runner
    original = runner.execute_model
    marks: list[tuple[Any, str, int, int]] = []
    results: list[dict[str, Any]] = []
    with counting_syncs(syncs) as caught:
        def marked(plan: Any) -> Any:
            sampled = sum(d is not None for d in plan.draws)
            marks.append((clock.mark(), plan.kind, sampled, len(caught)))
            return original(plan)

        runner.execute_model = marked
        try:
            start = clock.mark()
            engine.run(jobs, results.append)
            end = clock.mark()
        finally:
            del runner.execute_model
        total_syncs = sum(is_sync(w) for w in caught)
        counted = [sum(is_sync(w) for w in caught[m[3]:]) for m in marks]
    return step_figures(clock, start, end, marks, counted, total_syncs, results, syncs)


def step_figures(clock: Clock, start: Any, end: Any, marks: list[tuple[Any, str, int, int]],
                 counted: list[int], total_syncs: int, results: list[dict[str, Any]],
                 syncs: bool) -> dict[str, Any]:
    ends = [m[0] for m in marks[1:]] + [end]
    seconds = [clock.seconds(m[0], e) for m, e in zip(marks, ends, strict=True)]
    per_step = [a - b for a, b in zip(counted, counted[1:] + [0], strict=True)]
    decode = [i for i, m in enumerate(marks) if m[1] == "decode"]
    full = max((marks[i][2] for i in decode), default=0)
    steady = [i for i in decode if marks[i][2] == full and i != len(marks) - 1]
    steady = steady or decode
    tokens = sum(marks[i][2] for i in steady)
    steady_s = sum(seconds[i] for i in steady)
    figures: dict[str, Any] = {
        "tok_s": round(tokens / steady_s, 1) if steady_s else None,
        "step_ms_p50": round(1000 * statistics.median(seconds[i] for i in steady), 3)
        if steady else None,
        "steady_steps": len(steady), "decode_steps": len(decode), "full_rows": full,
        "prefill_ms": round(1000 * sum(s for s, m in zip(seconds, marks, strict=True)
                                       if m[1] == "prefill"), 1),
        "startup_ms": round(1000 * clock.seconds(start, marks[0][0]), 1) if marks else None,
        "run_ms": round(1000 * clock.seconds(start, end), 1),
        "output_tokens": sum(r.get("stats", {}).get("output_tokens", 0) for r in results),
        "errors": sum(1 for r in results if r.get("error")),
    }
    if syncs:
        figures["syncs_per_step"] = (round(sum(per_step[i] for i in decode) / len(decode), 2)
                                     if decode else None)
        figures["syncs_max"] = max((per_step[i] for i in decode), default=None)
        figures["syncs_run"] = total_syncs
    return figures


def host_breakdown(engine: Any) -> dict[str, float]:
    """The host's view of the decode steps (engine.step_times), p50 ms."""
    from aici_cli.run.tally import step_summary

    decode = [s for s in engine.step_times if s.kind == "decode"]
    if not decode:
        return {}
    summary = step_summary(decode)
    return {f"host_{k}_p50": v["p50"] for k, v in summary.items()}


def engine_bench(args: argparse.Namespace) -> int:
    import torch

    from aici_cli.core.config import EngineConfig
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model

    parts = Parts(args.parts, f"engine_{args.name}")
    started = time.perf_counter()
    lm = load_model(model_spec(args.model), args.device, args.dtype, "none")
    parts.put("load_s", round(time.perf_counter() - started, 1))
    clock = Clock(lm.device)
    dtype_bytes = torch.tensor([], dtype=lm.dtype).element_size()
    parts.put("gpu", device_name(lm.device))
    parts.put("dtype", str(lm.dtype).removeprefix("torch."))
    parts.put("bytes_per_token", bytes_per_step(lm.model.config, dtype_bytes))
    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    schemas = schema_set(args.schemas)
    cuda = lm.device.type == "cuda"
    plan = [(int(b), False) for b in args.batches.split(",") if b]
    plan += [(int(b), True) for b in args.json_batches.split(",") if b]
    plan.sort(key=lambda p: args.order.index(p[0]) if p[0] in args.order else 99)
    for bs, constrained in plan:
        key = f"batch{bs}{'_json' if constrained else ''}"
        # Drafts off: one token per row per step, as `generate()` makes them. The prefix
        # cache stays on (it also reads the lines ahead that fill the batch at once); the
        # timed run's prompts are cached by the warm-up's, which only prefill sees.
        config = EngineConfig(batch_size=bs, draft_tokens=0, compile=args.compile)
        engine = Engine(lm, config)
        engine.compiler  # noqa: B018 - the tokenizer wrapper, built outside the timing
        jobs = lambda n, c=constrained, bs=bs: engine_jobs(  # noqa: E731
            bs, n, schemas if c else None, chat, args.json_temperature)
        clock_start = time.perf_counter()
        engine.run(jobs(args.tokens), lambda r: None)  # warm-up: the same shapes
        warm_s = round(time.perf_counter() - clock_start, 1)
        figures = timed_run(engine, jobs(args.tokens), clock)
        figures.update(host_breakdown(engine), warm_s=warm_s,
                       compiled_steps=engine.compiled_steps,
                       compiled_step_problem=engine.compiled_step_problem)
        if bs in args.sync_batches:
            counted = timed_run(engine, jobs(args.sync_tokens), clock, syncs=cuda)
            figures["syncs_per_step"] = counted.get("syncs_per_step")
            figures["syncs_max"] = counted.get("syncs_max")
        parts.put(key, figures)
    return 0


# ---------------------------------------------------------------------------- generate

def generate_bench(args: argparse.Namespace) -> int:
    """transformers' `generate()`, static cache, compiled forward, warm: per batch size,
    decode tok/s between the first token and the last (CUDA events in a stopping
    criterion, called once per step; it never stops anything)."""
    import torch
    import transformers
    from peers.common import render
    from transformers import StoppingCriteria, StoppingCriteriaList

    from aici_cli.models.load import load_model

    parts = Parts(args.parts, f"generate_{args.name}")
    parts.put("transformers", transformers.__version__)
    lm = load_model(model_spec(args.model), args.device, args.dtype, "none",
                    implementation="transformers")
    model, tokenizer = lm.model, lm.tokenizer
    clock = Clock(lm.device)
    model.generation_config.cache_implementation = "static"
    eager_forward = model.forward

    def compiled(fullgraph: bool) -> str:
        """`model.forward` compiled; transformers' own compile of the decode step (a
        static cache makes it compile one in recent versions) off, so nothing compiles
        twice. Returns the recipe's words."""
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        model.forward = torch.compile(eager_forward, mode="reduce-overhead",
                                      fullgraph=fullgraph)
        if hasattr(model.generation_config, "disable_compile"):
            model.generation_config.disable_compile = True
        return ("static cache, forward compiled (reduce-overhead"
                + (", fullgraph)" if fullgraph else ", graph breaks allowed)"))

    recipe = compiled(True) if args.compile == "on" else "static cache"
    parts.put("recipe", recipe)

    class Marks(StoppingCriteria):
        def __init__(self) -> None:
            self.marks: list[Any] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.marks.append(clock.mark())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    for bs in (int(b) for b in args.batches.split(",") if b):
        messages = [[{"role": "user", "content": f"Write a story about {TOPICS[i % 8]}."}]
                    for i in range(bs)]
        enc = tokenizer([render(tokenizer, m) for m in messages], add_special_tokens=False,
                        padding=True, return_tensors="pt")
        enc = {k: v.to(lm.device) for k, v in enc.items()}

        def once(marks: Marks, enc: dict[str, Any] = enc) -> Any:
            with torch.inference_mode():
                return model.generate(**enc, do_sample=False, max_new_tokens=args.tokens,
                                      min_new_tokens=args.tokens,
                                      pad_token_id=tokenizer.pad_token_id,
                                      stopping_criteria=StoppingCriteriaList([marks]))
        for attempt in ("first", "again"):
            try:
                parts.put(f"batch{bs}", timed_generate(once, Marks, clock, bs, args.warmups,
                                                       enc["input_ids"].shape[1]))
                break
            except Exception as e:  # noqa: BLE001 - the figure is missing, the reason kept
                parts.put(f"batch{bs}", {"tok_s": None,
                                         "error": f"{type(e).__name__}: {e}"[:300]})
                if attempt == "again" or "fullgraph" not in recipe:
                    break
                recipe = compiled(False)  # a graph break in this version: allow them
                parts.put("recipe", recipe)
    return 0


def timed_generate(once: Callable[[Any], Any], marks_class: Callable[[], Any], clock: Clock,
                   bs: int, warmups: int, prompt_len: int) -> dict[str, Any]:
    warm = time.perf_counter()
    for _ in range(warmups):
        once(marks_class())
    warm_s = round(time.perf_counter() - warm, 1)
    marks = marks_class()
    start = clock.mark()
    out = once(marks)
    steps = len(marks.marks) - 1
    decode_s = clock.seconds(marks.marks[0], marks.marks[-1])
    return {"tok_s": round(bs * steps / decode_s, 1) if decode_s else None,
            "step_ms_p50": round(1000 * decode_s / steps, 3) if steps else None,
            "prefill_ms": round(1000 * clock.seconds(start, marks.marks[0]), 1),
            "new_tokens": int(out.shape[1] - prompt_len), "warm_s": warm_s}


# ----------------------------------------------------------------------------- summary

def tests_counts(log: Path) -> tuple[int | None, int | None]:
    """(passed, failed) from a pytest log's last line; None where it has none (cut off)."""
    if not log.is_file():
        return None, None
    text = log.read_text(errors="replace")
    tail = [line for line in text.splitlines() if re.search(r"\bin [\d.]+s\b", line)]
    if not tail:
        return None, None
    last = tail[-1]

    def count(word: str) -> int:
        found = re.search(rf"(\d+) {word}", last)
        return int(found.group(1)) if found else 0
    return count("passed"), count("failed") + count("error")


def load_parts(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def figure(parts: dict[str, dict[str, Any]], part: str, key: str, field: str = "tok_s"
           ) -> Any:
    value = parts.get(part, {}).get(key)
    return value.get(field) if isinstance(value, dict) else None


def synced(part: dict[str, Any], suffix: str) -> Any:
    """The syncs per decode step of the largest batch whose syncs were counted."""
    counted = [(int(m.group(1)), v.get("syncs_per_step")) for k, v in part.items()
               if isinstance(v, dict) and "syncs_per_step" in v
               and (m := re.fullmatch(rf"batch(\d+){suffix}", k))]
    return max(counted)[1] if counted else None


def ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b \
        else None


def collect(parts: dict[str, dict[str, Any]], tests_log: Path, mode: str) -> dict[str, Any]:
    """Every figure, the promised ones first, at top level by name."""
    passed, failed = tests_counts(tests_log)
    gpu = next((p["gpu"] for p in parts.values() if "gpu" in p), None)
    hbm_gb_s = parts.get("hbm", {}).get("hbm_gb_s")
    per_token = parts.get("engine_one_b", {}).get("bytes_per_token")
    limit = round(hbm_gb_s * 1e9 / per_token, 1) if hbm_gb_s and per_token else None
    out: dict[str, Any] = {
        "gpu": gpu, "hbm_gb_s": hbm_gb_s, "one_b_bytes_per_token": per_token,
        "one_b_hbm_limit_tok_s": limit,
        "syncs_per_step": synced(parts.get("engine_one_b", {}), ""),
        "syncs_per_step_json": synced(parts.get("engine_one_b", {}), "_json"),
        "cuda_tests_passed": passed, "cuda_tests_failed": failed,
    }
    for model in ("one_b", "default"):
        for bs in (1, 8, 64):
            out[f"{model}_batch{bs}_tok_s"] = figure(parts, f"engine_{model}", f"batch{bs}")
            out[f"{model}_batch{bs}_generate_tok_s"] = figure(parts, f"generate_{model}",
                                                             f"batch{bs}")
            out[f"{model}_batch{bs}_json_tok_s"] = figure(parts, f"engine_{model}",
                                                         f"batch{bs}_json")
    b1, b64 = out["one_b_batch1_tok_s"], out["one_b_batch64_tok_s"]
    out["done_when"] = {
        "one_b_batch1_hbm_share": ratio(b1, limit),
        "one_b_batch1_vs_generate": ratio(b1, out["one_b_batch1_generate_tok_s"]),
        "one_b_batch64_vs_generate": ratio(b64, out["one_b_batch64_generate_tok_s"]),
        "one_b_batch64_json_vs_unconstrained": ratio(out["one_b_batch64_json_tok_s"], b64),
    }
    out.update(mode=mode, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               versions=versions(), parts=parts)
    return {k: out.get(k) for k in KEYS} | out


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "llguidance"):
        with contextlib.suppress(Exception):
            found[name] = __import__(name).__version__
    return found


TARGETS = [  # (label, figure, target, met)
    ("1B, batch 1: share of the HBM limit", "one_b_batch1_hbm_share", "≥ 0.5",
     lambda v: v >= 0.5),
    ("1B, batch 1: against `generate()`", "one_b_batch1_vs_generate", "≥ 1.5×",
     lambda v: v >= 1.5),
    ("1B, batch 64: against `generate()`", "one_b_batch64_vs_generate", "≥ 2×",
     lambda v: v >= 2.0),
    ("1B, batch 64: JSON against unconstrained", "one_b_batch64_json_vs_unconstrained",
     "≥ 0.9×", lambda v: v >= 0.9),
]


def summary_md(figures: dict[str, Any], steps: str) -> str:
    def show(v: Any) -> str:
        return "—" if v is None else f"{v:,}" if isinstance(v, int | float) else str(v)

    done = figures["done_when"]
    rows = [(label, show(done[key]), target,
             "—" if done[key] is None else "yes" if met(done[key]) else "no")
            for label, key, target, met in TARGETS]
    default = figures["default_batch1_tok_s"]
    rows.append(("default shape, batch 1: tok/s", show(default), "≥ 1,000",
                 "—" if default is None else "yes" if default >= 1000 else "no"))
    syncs = figures["syncs_per_step"]
    rows.append(("device→host syncs per decode step (1B, largest batch)", show(syncs), "1",
                 "—" if syncs is None else "yes" if syncs <= 1 else "no"))
    failed = figures["cuda_tests_failed"]
    rows.append(("cuda-marked tests failed", show(failed), "0",
                 "—" if failed is None else "yes" if failed == 0 else "no"))
    v = figures["versions"]
    lines = [f"# Device check: {show(figures['gpu'])}, {figures['date']}", "",
             f"`bash bench/device_check.sh{' ' + figures['mode'] if figures['mode'] else ''}`; "
             + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
             "| target | figure | wanted | met |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    recipe = figures["parts"].get("generate_one_b", {}).get("recipe")
    lines += ["", f"`generate()`: {show(recipe)}, warm.", "",
              f"HBM (measured copy): {show(figures['hbm_gb_s'])} GB/s; 1B weights per "
              f"step: {show(figures['one_b_bytes_per_token'])} bytes; limit at batch 1: "
              f"{show(figures['one_b_hbm_limit_tok_s'])} tok/s.", "",
              "| model | batch | engine tok/s | JSON tok/s | `generate()` tok/s |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for model, label in (("one_b", "1B"), ("default", "default shape")):
        for bs in (1, 8, 64):
            lines.append(f"| {label} | {bs} | {show(figures[f'{model}_batch{bs}_tok_s'])} | "
                         f"{show(figures[f'{model}_batch{bs}_json_tok_s'])} | "
                         f"{show(figures[f'{model}_batch{bs}_generate_tok_s'])} |")
    lines += ["", "Every figure, per run (steady decode, prefill, start-up, host "
              "breakdown, syncs), is in figures.json beside this page.", ""]
    if steps:
        lines += ["## Steps", "", steps.strip(), ""]
    return "\n".join(lines)


def summary(args: argparse.Namespace) -> int:
    figures = collect(load_parts(args.parts), args.tests_log, args.mode)
    steps = args.steps.read_text() if args.steps and args.steps.is_file() else ""
    for folder in args.write:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
        (folder / "summary.md").write_text(summary_md(figures, steps))
        print(f"wrote {folder / 'figures.json'} and {folder / 'summary.md'}")
    print(json.dumps({k: figures[k] for k in KEYS}))
    return 0


def schemas(args: argparse.Namespace) -> int:
    """Rebuild the committed schema set from ../shared/data."""
    from data_split import in_half

    files = [p for p in sorted(GLAIVE.glob("*.json")) if in_half(p, "held")][:64]
    if not files:
        print(f"no schemas at {GLAIVE}", file=sys.stderr)
        return 1
    doc = {"about": SCHEMAS_ABOUT, "schemas": {p.name: json.loads(p.read_text())
                                               for p in files}}
    SCHEMAS.write_text(json.dumps(doc) + "\n")
    print(f"{len(files)} schemas in {SCHEMAS}")
    return 0


SCHEMAS_ABOUT = (
    "The first 64 schemas (sorted by file name) of the held half (bench/data_split.py) of "
    "JSONSchemaBench Glaiveai2K, for bench/device_bench.py on machines without "
    "../shared/data. Source: github.com/guidance-ai/jsonschemabench, data/Glaiveai2K, MIT "
    "License; unchanged. Rebuild: python bench/device_bench.py schemas")


# -------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--parts", type=Path, default=REPO / "out" / "device_check" / "parts")
    common.add_argument("--device", default="auto")
    runs = argparse.ArgumentParser(add_help=False, parents=[common])
    runs.add_argument("--model", default="default")
    runs.add_argument("--name", default="default", help="the figures' prefix: one_b, default")
    runs.add_argument("--dtype", default="bfloat16")
    runs.add_argument("--batches", default="1,8,64")
    runs.add_argument("--tokens", type=int, default=64)
    runs.add_argument("--compile", default="on")

    p = sub.add_parser("hbm", parents=[common])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--copies", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(run=hbm)
    p = sub.add_parser("engine", parents=[runs])
    p.add_argument("--json-batches", default="64")
    p.add_argument("--schemas", type=int, default=64)
    p.add_argument("--json-temperature", type=float, default=1.0)
    p.add_argument("--sync-batches", type=lambda s: [int(b) for b in s.split(",") if b],
                   default=[64], help="batches whose syncs are counted (a short extra run)")
    p.add_argument("--sync-tokens", type=int, default=16)
    p.add_argument("--order", type=lambda s: [int(b) for b in s.split(",") if b],
                   default=[1, 64, 8], help="batch sizes first measured first")
    p.set_defaults(run=engine_bench)
    p = sub.add_parser("generate", parents=[runs])
    p.add_argument("--warmups", type=int, default=2)
    p.set_defaults(run=generate_bench)
    p = sub.add_parser("summary", parents=[common])
    p.add_argument("--tests-log", type=Path, default=Path("/nonexistent"))
    p.add_argument("--steps", type=Path, default=None, help="the check's table of steps")
    p.add_argument("--mode", default="")
    p.add_argument("--write", type=Path, action="append", default=[])
    p.set_defaults(run=summary)
    p = sub.add_parser("schemas")
    p.set_defaults(run=schemas)
    args = ap.parse_args()
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
