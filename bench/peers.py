"""Side-by-side benchmark of aici-batch against other constrained-generation stacks ("Fast").

Same model (the default), same prompts, same schemas (the first N of JSONSchemaBench's
Glaiveai2K; prompt = the chat message "Produce a JSON object matching this JSON Schema:
<schema>" rendered with the chat template), same batch size, greedy, same max_tokens.
Contenders (runners in bench/peers/):
  generate       transformers generate(), static left-padded batches, no constraint
  outlines       generate() + outlines-core JSON-schema processor, rows grouped by schema
                 (outlines applies one schema to a whole batch)
  outlines-rows  the same processors, one per row, in the same static batches as the rest
  lmfe           generate() + lm-format-enforcer prefix_allowed_tokens_fn, one per row
  xgrammar       generate() + xgrammar's HF logits processor, one grammar per row
  aici           aici-batch, built-in JSON-schema controller, fast-forward on
  aici-noff      the same with fast-forward off
  aici-wasm      aici-batch with the segment-based wasm controller (schema_segment.py)
  aici-logprobs  aici with every token's logprob and top 5 (`--logprobs 5`); opt-in

Each contender runs in its own subprocess, one after another, so imports, compile caches
and thread pools do not leak between them; every subprocess sets the same torch thread
count, loads the model, does a 2-token warm-up on a schema outside the set (setup, not
timed: it absorbs e.g. outlines' torch.compile), then times one pass over all prompts.
The whole sequence repeats R times; medians and min-max are reported, plus each figure as
a ratio against `aici`. Compliance = outputs that parse and validate (jsonschema, formats
not asserted) against the original schema / total. Peers are optional: install them with
bench/peers/requirements.txt; a missing one is reported as "not installed".

    python bench/peers.py --schemas 16 --max-tokens 256 --batch-size 8 --repeats 2
    python bench/peers.py --only aici,generate
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K"
WASM_SRC = REPO / "bench" / "controllers" / "schema_segment.py"

# contender -> (module in bench/peers/, keyword arguments of its run(), distributions)
CONTENDERS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "generate": ("generate_plain", {}, ("transformers", "torch")),
    "outlines": ("outlines_peer", {}, ("outlines", "outlines_core")),
    "outlines-rows": ("outlines_rows", {}, ("outlines", "outlines_core")),
    "lmfe": ("lmfe_peer", {}, ("lm-format-enforcer",)),
    "xgrammar": ("xgrammar_peer", {}, ("xgrammar",)),
    "aici": ("aici_peer", {"fast_forward": True}, ("aici-batch", "llguidance")),
    "aici-noff": ("aici_peer", {"fast_forward": False}, ("aici-batch", "llguidance")),
    "aici-wasm": ("aici_peer", {}, ("aici-batch", "llguidance", "wasmtime")),
    "aici-logprobs": ("aici_peer", {"logprobs": 5}, ("aici-batch", "llguidance")),
}
BASELINE = "aici"
DEFAULT_CONTENDERS = [name for name in CONTENDERS if name not in ("outlines", "aici-logprobs")]

# Outside the measured set, so no compiler cache gets a head start on a measured schema.
WARM_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
}


def message(schema: dict[str, Any]) -> list[dict[str, str]]:
    """The one chat message every contender is given for `schema`."""
    return [{"role": "user",
             "content": f"Produce a JSON object matching this JSON Schema: {json.dumps(schema)}"}]


def load_schemas(data: Path, n: int) -> list[tuple[str, dict[str, Any]]]:
    """The first `n` schemas of `data` by file name (the same set controller_costs.py uses)."""
    return [(f.stem, json.loads(f.read_text())) for f in sorted(data.glob("*.json"))[:n]]


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    """Parses as JSON and validates against the original schema (one rule for everyone)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        return bool(jsonschema.validators.validator_for(schema)(schema).is_valid(value))
    except Exception:  # a schema jsonschema itself cannot handle counts as not validated
        return False


def versions(dists: tuple[str, ...]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for d in dists:
        try:
            found[d] = version(d)
        except PackageNotFoundError:
            found[d] = "?"
    return found


def peer_module(name: str) -> Any:
    """bench/peers/<module> for contender `name` (this script's folder is on sys.path)."""
    return importlib.import_module(f"peers.{CONTENDERS[name][0]}")


def missing(name: str) -> str | None:
    """'not installed: ...' when a package the peer imports is absent; None when present."""
    absent = [m for m in peer_module(name).REQUIRES if importlib.util.find_spec(m) is None]
    if absent:
        return (f"not installed: {', '.join(absent)} "
                "(pip install -r bench/peers/requirements.txt, see its header)")
    return None


# ------------------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> int:
    """One contender, one repeat, in this (fresh) process; writes its JSON to --result."""
    import torch

    torch.set_num_threads(args.threads)
    name = args.worker
    module_name, kwargs, dists = CONTENDERS[name]
    out: dict[str, Any] = {"contender": name, "threads": torch.get_num_threads(),
                           "versions": versions(dists)}
    try:
        module = peer_module(name)
        out["batching"] = module.BATCHING
        if name == "aici-wasm":
            kwargs = {"controller": args.wasm}
            out["batching"] += "; wasm controller (schema as controller_arg)"
        picked = load_schemas(args.data, args.schemas)
        schemas = [s for _, s in picked]
        prompts = [message(s) for s in schemas]
        t0 = time.perf_counter()
        model = tokenizer = None
        if module_name != "aici_peer":
            from aici_cli.models.load import load_model

            lm = load_model(None, implementation="transformers")  # peers call generate()
            model, tokenizer = lm.model, lm.tokenizer
            out["dtype"] = str(lm.dtype).removeprefix("torch.")
        try:
            module.run(model, tokenizer, [message(WARM_SCHEMA)], [WARM_SCHEMA], 1, 2, **kwargs)
        except ImportError as e:
            out["status"] = f"unavailable: {type(e).__name__}: {e}"
            Path(args.result).write_text(json.dumps(out, indent=2) + "\n")
            return 0
        out["setup_s"] = round(time.perf_counter() - t0, 3)
        run = module.run(model, tokenizer, prompts, schemas, args.batch_size, args.max_tokens,
                         **kwargs)
    except Exception as e:
        traceback.print_exc()
        out["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        Path(args.result).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    valid = [is_valid(t, s) for t, s in zip(run.texts, schemas)]
    out.update({
        "status": "ok",
        "wall_s": round(run.wall_s, 3),
        "output_tokens": run.output_tokens,
        "row_passes": run.row_passes,
        "batched_passes": run.batched_passes,
        "batches": run.batches,
        "tokens_per_s": round(run.output_tokens / run.wall_s, 2) if run.wall_s else 0.0,
        "passes_per_token": (round(run.row_passes / run.output_tokens, 4)
                             if run.output_tokens else None),
        "valid": sum(valid),
        "total": len(valid),
        "compliance": round(sum(valid) / len(valid), 4) if valid else 0.0,
        "constraint_failures": run.constraint_failures,
        "dtype": run.dtype or out.get("dtype"),
        "notes": run.notes[:20],
        "rows": [{"schema": stem, "valid": v, "text": t}
                 for (stem, _), v, t in zip(picked, valid, run.texts)],
    })
    Path(args.result).write_text(json.dumps(out, indent=2) + "\n")
    return 0


# ------------------------------------------------------------------------ orchestrator


def build_wasm(out_dir: Path) -> tuple[Path | None, str | None]:
    """schema_segment.wasm in out_dir, rebuilt only when the source is newer (takes a while)."""
    target = out_dir / "schema_segment.wasm"
    if target.is_file() and target.stat().st_mtime >= WASM_SRC.stat().st_mtime:
        return target, None
    try:
        from aici_cli.control.componentize import build_controller

        res = build_controller(WASM_SRC, target)
    except Exception as e:  # BuildError, componentize-py missing, ...
        return None, f"unavailable: controller build failed: {str(e).splitlines()[0]}"
    print(f"built {target} in {res.seconds:.1f} s", file=sys.stderr)
    return target, None


def spawn(name: str, rep: int, args: argparse.Namespace, runs_dir: Path,
          wasm: Path | None) -> dict[str, Any]:
    """Run one contender in a fresh interpreter; its result JSON, or an error entry."""
    result = runs_dir / f"{name}.r{rep}.json"
    log = runs_dir / f"{name}.r{rep}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
           "--result", str(result), "--data", str(args.data), "--schemas", str(args.schemas),
           "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size),
           "--threads", str(args.threads)]
    if wasm is not None:
        cmd += ["--wasm", str(wasm)]
    with tempfile.TemporaryDirectory(prefix="peers-cache-") as cache, log.open("w") as err:
        # A private torch.compile cache per process: no contender inherits compiled kernels.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache,
               "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(cmd, stdout=err, stderr=subprocess.STDOUT, env=env,
                                  timeout=args.timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"contender": name, "status": f"error: timed out after {args.timeout} s"}
    if result.is_file():
        return json.loads(result.read_text())
    tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
    return {"contender": name,
            "status": f"error: exit {proc.returncode}: {tail[0][:160] if tail else ''} ({log})"}


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def aggregate(name: str, runs: list[dict[str, Any]], static: str | None) -> dict[str, Any]:
    """Medians and min-max over the repeats that completed."""
    ok = [r for r in runs if r.get("status") == "ok"]
    entry: dict[str, Any] = {"contender": name, "runs": len(runs), "ok_runs": len(ok)}
    if static is not None:
        entry["status"] = static
        return entry
    if not ok:
        entry["status"] = runs[0].get("status", "error") if runs else "not run"
        return entry
    entry["status"] = "ok" if len(ok) == len(runs) else f"ok ({len(runs) - len(ok)} failed)"
    for key in ("tokens_per_s", "passes_per_token", "wall_s", "compliance", "setup_s"):
        entry[key] = spread([r[key] for r in ok if r.get(key) is not None])
    first = ok[0]
    for key in ("batching", "versions", "threads", "dtype", "output_tokens", "valid", "total",
                "constraint_failures", "batches", "notes"):
        if key in first:
            entry[key] = first[key]
    return entry


def ratios(entries: dict[str, dict[str, Any]]) -> None:
    """Each median as a ratio against the baseline's median (None where undefined)."""
    base = entries.get(BASELINE)
    for entry in entries.values():
        entry["vs_aici"] = {}
        for key in ("tokens_per_s", "passes_per_token", "wall_s", "compliance"):
            mine = (entry.get(key) or {}).get("median")
            theirs = ((base or {}).get(key) or {}).get("median")
            entry["vs_aici"][key] = (round(mine / theirs, 3)
                                     if mine is not None and theirs else None)


def fmt_spread(s: dict[str, float] | None, digits: int) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"x{v:.2f}"


def table(entries: dict[str, dict[str, Any]]) -> str:
    head = (f"{'contender':14} {'tok/s med [min-max]':>24} {'vs':>6} {'pass/tok':>8} {'vs':>6} "
            f"{'wall s med [min-max]':>24} {'vs':>6} {'valid':>7} {'vs':>6} {'setup s':>7}")
    lines = [head, "-" * len(head)]
    for name, e in entries.items():
        if "tokens_per_s" not in e:
            lines.append(f"{name:14} {e['status']}")
            continue
        r = e["vs_aici"]
        ppt = (e.get("passes_per_token") or {}).get("median")
        setup = (e.get("setup_s") or {}).get("median")
        lines.append(
            f"{name:14} {fmt_spread(e['tokens_per_s'], 1):>24} {fmt_ratio(r['tokens_per_s']):>6} "
            f"{'-' if ppt is None else f'{ppt:.3f}':>8} {fmt_ratio(r['passes_per_token']):>6} "
            f"{fmt_spread(e['wall_s'], 2):>24} {fmt_ratio(r['wall_s']):>6} "
            f"{str(e.get('valid')) + '/' + str(e.get('total')):>7} "
            f"{fmt_ratio(r['compliance']):>6} {'-' if setup is None else f'{setup:.1f}':>7}")
    lines.append("")
    for name, e in entries.items():
        if "tokens_per_s" not in e:
            continue
        extra = f"; constraint failures {e['constraint_failures']}" \
            if e.get("constraint_failures") else ""
        vers = ", ".join(f"{k} {v}" for k, v in (e.get("versions") or {}).items())
        calls = "" if name.startswith("aici") else f"{e.get('batches')} generate() calls; "
        lines.append(f"{name}: {e.get('batching')}; {calls}{e.get('output_tokens')} output "
                     f"tokens; {vers}{extra}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--schemas", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=",".join(DEFAULT_CONTENDERS),
                    help=f"comma-separated subset of: {', '.join(CONTENDERS)} (default: all "
                         "but `outlines`: one schema per batch, so distinct schemas run as "
                         "batches of one, ~9 min a run here)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads in every contender's process (default: all cores)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per contender run")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "peers")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--wasm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        ap.error(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")
    if not args.data.is_dir() or not any(args.data.glob("*.json")):
        print(f"no schemas at {args.data}", file=sys.stderr)
        return 2
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)

    static: dict[str, str | None] = {n: missing(n) for n in names}
    wasm = None
    if "aici-wasm" in names and static["aici-wasm"] is None:
        wasm, static["aici-wasm"] = build_wasm(args.out)

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            if static[name] is not None:
                continue
            t0 = time.perf_counter()
            res = spawn(name, rep, args, runs_dir, wasm if name == "aici-wasm" else None)
            runs[name].append(res)
            print(f"[{rep + 1}/{args.repeats}] {name}: {res.get('status')}, "
                  f"{res.get('tokens_per_s', '-')} tok/s, {res.get('valid', '-')}/"
                  f"{res.get('total', '-')} valid ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr)

    entries = {n: aggregate(n, runs[n], static[n]) for n in names}
    ratios(entries)
    report = {
        "settings": {"schemas": args.schemas, "data": str(args.data),
                     "max_tokens": args.max_tokens, "batch_size": args.batch_size,
                     "repeats": args.repeats, "threads": args.threads, "greedy": True,
                     "model": "default (load_model(None))"},
        "contenders": entries,
        "runs": {n: [{k: v for k, v in r.items() if k != "rows"} for r in rs]
                 for n, rs in runs.items()},
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    dtype = next((e.get("dtype") for e in entries.values() if e.get("dtype")), "?")
    print(f"{args.schemas} Glaiveai2K schemas, batch {args.batch_size}, max_tokens "
          f"{args.max_tokens}, greedy, {args.threads} torch threads, dtype {dtype}, "
          f"{args.repeats} repeat(s); vs = ratio to {BASELINE} (medians)")
    print(table(entries))
    print(f"report: {args.out / 'report.json'}; per-run outputs: {runs_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
