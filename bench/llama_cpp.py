"""aici-batch beside llama.cpp on the same GGUF, in one run (docs/speed.md).

Rows (greedy, the default model's GGUF for both sides unless --gguf):

  one stream   one chat prompt, --stream-tokens tokens, no constraint, end-of-sequence
               ignored, at the default batch size: tok/s over the whole generation, peak
               RSS of the process, and the time from the command to the first token (a
               fresh `aici-batch run` of one line and one token; `llama-cli`-like for
               llama.cpp: load + 1 token)
  schemas      the held-out half of Glaiveai2K (`data_split.py`, the first --schemas of
               it in name order), --max-tokens tokens, JSON-schema constrained: tok/s and valid
               outputs, at batch 1 and 8, prompt-lookup drafts on and off
  prefill      one --prefill-tokens prompt (default 1,500: the few-shot prompts of
               evaluation jobs), one token out: seconds to the first token after the model
               is loaded and warm (a short prompt first), and prompt tokens per second.
               The prompt is plain text cut at that many tokens by the GGUF's tokenizer,
               so both sides feed the same tokens
  batch        8 plain prompts (no chat template, no constraint), --max-tokens tokens
               each, end-of-sequence ignored: ours at the default batch size against
               `llama-server -np 8` (for any model, random weights included, where the
               schemas' validity means nothing): tok/s over all 8

Every configuration runs in a subprocess of its own (clean peak RSS, no shared caches).
On a shared machine the load changes from minute to minute: `--rounds N` runs the
one-stream configurations N times in turn, both sides in every round, and reports each
one's median tok/s and the median over rounds of its ratio to llama.cpp in that round.
This project's side runs for each --quantize and --compile given; a compiled run first
warms its bucket (compile time reported apart: inductor caches it on disk for the next run).

The peer is llama-cpp-python (`pip install 'aici-batch[bench]'`, a ~15 min source build on
2 cores). On this machine's Xeon the default `-march=native` build segfaults in
`ggml_backend_amx_mul_mat` at the first matmul; build it without AMX:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" pip install 'llama-cpp-python==0.3.36'

**Another instruction set, from any machine.** Build the peer for it in a venv of its own
and force this project's side to the same one (`AICI_BATCH_ISA`, which also sets
`ATEN_CPU_CAPABILITY=avx2` below AVX-512), so an AVX-512 machine measures what an AVX2
CI runner or laptop runs:

    python -m venv /tmp/llvenv && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF" \
        /tmp/llvenv/bin/pip install 'llama-cpp-python==0.3.36'
    python bench/llama_cpp.py --isa avx2 --peer-python /tmp/llvenv/bin/python \
        --only stream,prefill --quantize auto --compile auto

Batch 8 on llama.cpp's side is its C++ server with 8 slots (`llama-server -np 8 -t N`,
found on PATH or with --llama-server; llama-cpp-python ships no such binary): requests go
to 127.0.0.1 only. Missing peers are reported as "not installed" and the bench exits 0
(CI never needs them).

    python bench/llama_cpp.py                                  # everything
    python bench/llama_cpp.py --quantize none,int4 --compile off,on --schemas 8
    python bench/llama_cpp.py --gguf big.gguf --only batch --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder leads sys.path, where this file would shadow the
# `llama_cpp` package it measures.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

REPO = Path(__file__).resolve().parent.parent
GLAIVE = next((p / "shared" / "data" / "jsonschemabench" / "Glaiveai2K" for p in REPO.parents
               if (p / "shared" / "data").is_dir()),
              REPO.parent / "shared" / "data" / "jsonschemabench" / "Glaiveai2K")
THREADS = 1  # set from --threads
ISA = ""  # set from --isa: this project's side forced to that instruction set
PEER_PYTHON = ""  # set from --peer-python: the interpreter whose llama_cpp is measured
STREAM_PROMPT = "Write a long story about a dragon who learns to read."
# Prose without repeats that a prompt-lookup draft or a prefix cache could exploit.
BATCH_PROMPTS = [f"{start} " for start in (
    "The history of the printing press begins", "A recipe for bread needs",
    "In the year 1850 the small harbour town", "The rules of chess say that",
    "Photosynthesis is the process by which", "Dear committee, I am writing to",
    "The first step in repairing a bicycle is", "Once upon a time in a forest")]
PREFILL_SEED = ("In the valley below the northern ridge, the river bends three times before "
                "it reaches the old mill, and each bend has a name the villagers remember. ")


def prefill_text(tokenizer: Any, tokens: int) -> str:
    """Plain text of exactly `tokens` tokens under `tokenizer` (numbered sentences, so no
    two stretches are the same), decoded back from the cut token ids."""
    parts, i = [], 0
    while True:
        parts.append(f"{i}. {PREFILL_SEED}")
        i += 1
        if i % 16 == 0:
            ids = tokenizer.encode("".join(parts), add_special_tokens=False)
            if len(ids) > tokens:
                return str(tokenizer.decode(ids[:tokens]))


def held_half(n: int) -> list[Path]:
    """The first `n` schemas of Glaiveai2K's held-out half (`data_split.py`: every figure
    reported comes from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("data_split", Path(__file__).with_name(
        "data_split.py"))
    assert spec is not None and spec.loader is not None
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    return [p for p in sorted(GLAIVE.glob("*.json")) if split.in_half(p, "held")][:n]


def schema_ask(schema: dict[str, Any]) -> str:
    return f"Produce a JSON object matching this JSON Schema: {json.dumps(schema)}"


def _threads() -> int:
    """Both sides use OMP_NUM_THREADS threads (set by `spawn`; --threads)."""
    return int(os.environ.get("OMP_NUM_THREADS", "1"))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ this project's side


def ours(task: dict[str, Any]) -> dict[str, Any]:
    from aici_cli.core.config import EngineConfig
    from aici_cli.core.constraint import Constraint
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine
    from aici_cli.models.load import load_model

    lm = load_model(task["gguf"], "cpu", "auto", task["quantize"])
    config = EngineConfig(batch_size=task["batch"], draft_tokens=task["drafts"],
                          compile=task["compile"])

    def jobs(max_tokens: int) -> list[Job]:
        if task["kind"] == "stream":
            return [Job(index=1, id="s", max_tokens=max_tokens,
                        constraint=None, prompt=None, ignore_eos=True,
                        messages=[{"role": "user", "content": STREAM_PROMPT}])]
        if task["kind"] == "batch":
            return [Job(index=i + 1, id=f"b{i}", max_tokens=max_tokens, constraint=None,
                        prompt=text, messages=None, ignore_eos=True)
                    for i, text in enumerate(BATCH_PROMPTS)]
        out = []
        for i, path in enumerate(held_half(task["schemas"])):
            schema = json.loads(path.read_text())
            out.append(Job(index=i + 1, id=path.stem, max_tokens=max_tokens,
                           constraint=Constraint("json_schema", schema),
                           prompt=None, messages=[{"role": "user",
                                                   "content": schema_ask(schema)}]))
        return out

    if task["kind"] == "prefill":
        return _prefill(lm, config, task)
    compile_s = None
    if task["kind"] in ("batch", "stream"):
        # Warm: first-pass costs (the compiled step's package load, oneDNN's first
        # primitives) stay outside the timing, as on the peer's side (its server is warm;
        # llama-cpp-python has run a one-token completion of the same prompt, whose
        # prompt it may reuse, where this engine prefills it again).
        Engine(lm, config).run(jobs(2), lambda r: None)
    if task["compile"] == "on":  # warm the buckets this workload uses, outside the timing
        # (long enough for one-token steps at a full batch and at its tail; from a second
        # bucket on the rows dimension is dynamic, so that covers every bucket)
        warm = Engine(lm, config)
        warm.run(jobs(32), lambda r: None)
        compiled = warm.runner.model_pass.decode.compiled
        compile_s = round(sum(compiled.compile_s.values()), 1) if compiled else None
    engine = Engine(lm, config)
    engine.compiler  # noqa: B018 - the tokenizer wrapper is built once per run, not timed
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    engine.run(jobs(task["max_tokens"]), results.append)
    wall = time.perf_counter() - started
    tokens = sum(r["stats"]["output_tokens"] for r in results)
    out = {"tok_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 2),
           "valid": _valid(results, task), "peak_rss_mib": round(peak_rss_mib()),
           "compile_s": compile_s, "quantize": lm.quantize}
    if task["kind"] == "stream":
        out["decode_tok_s"] = _decode_rate(tokens, wall, results[0]["stats"]["ttft_ms"] / 1e3)
    return out


def _decode_rate(tokens: int, wall: float, first_s: float) -> float | None:
    """Tokens a second after the first (the prompt's prefill and the first token left
    out): llama-bench's `tg`, beside the `tok_s` of the whole request."""
    return round((tokens - 1) / (wall - first_s), 1) if tokens > 1 and wall > first_s else None


def _prefill(lm: Any, config: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Seconds from a loaded, warm engine to the first token of one long prompt."""
    from aici_cli.core.job import Job
    from aici_cli.engine import Engine

    def job(text: str) -> Job:
        return Job(index=1, id="p", prompt=text, messages=None, max_tokens=1,
                   constraint=None, ignore_eos=True)

    engine = Engine(lm, config)
    engine.run([job("Hello there.")], lambda r: None)  # warm: first-pass costs, not prefill
    text = prefill_text(lm.tokenizer, task["prefill_tokens"])
    walls = []
    # Twice, each engine with a fresh prefix cache (nothing of the prompt is cached): the
    # first pays what a run pays once (the dense copies of wide passes,
    # models/quant/dense_copies.py), the second is every later long prompt of the run.
    for _ in range(2):
        engine = Engine(lm, config)
        results: list[dict[str, Any]] = []
        started = time.perf_counter()
        engine.run([job(text)], results.append)
        walls.append(time.perf_counter() - started)
    fed = results[0]["stats"].get("prompt_tokens", task["prefill_tokens"])
    return {"first_token_s": round(walls[0], 3), "again_s": round(walls[1], 3),
            "prompt_tokens": fed, "prompt_tok_s": round(fed / walls[0], 1),
            "quantize": lm.quantize}


def first_token_s(quantize: str, gguf: str | None) -> float:
    """Wall seconds of `aici-batch run` on one line, one token (warm caches: run twice)."""
    line = json.dumps({"prompt": "Hello", "max_tokens": 1})
    cmd = [sys.executable, "-m", "aici_cli", "run", "-", "-q", "--quantize", quantize,
           "--device", "cpu", *(["--model", gguf] if gguf else [])]
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        subprocess.run(cmd, input=line, capture_output=True, text=True, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})
        best = min(best, time.perf_counter() - started)
    return round(best, 2)


def _valid(results: list[dict[str, Any]], task: dict[str, Any]) -> int | None:
    if task["kind"] != "schemas":
        return None
    import jsonschema

    schemas = {p.stem: json.loads(p.read_text()) for p in held_half(task["schemas"])}
    valid = 0
    for r in results:
        try:
            jsonschema.validate(json.loads(r.get("text") or ""), schemas[r["id"]])
            valid += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            pass
    return valid


# ---------------------------------------------------------------------- llama.cpp's side


def peer(task: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python in this process: one stream, or the schemas one at a time."""
    from llama_cpp import Llama, LlamaGrammar

    from aici_cli.models.load import load_model

    # The prompt text this project feeds (the GGUF's chat template, rendered the same).
    tokenizer = load_model(task["gguf"], "cpu", "auto", "none").tokenizer
    started = time.perf_counter()
    llm = Llama(model_path=task["gguf_path"], n_threads=_threads(), n_ctx=2048,
                verbose=False, seed=0)
    load_s = time.perf_counter() - started

    def prompt(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)

    if task["kind"] == "prefill":
        llm.create_completion("Hello there.", max_tokens=1, temperature=0.0)  # warm
        text = prefill_text(tokenizer, task["prefill_tokens"])
        llm.reset()  # nothing of the prompt is cached
        started = time.perf_counter()
        out = llm.create_completion(text, max_tokens=1, temperature=0.0)
        wall = time.perf_counter() - started
        fed = out["usage"]["prompt_tokens"]
        return {"first_token_s": round(wall, 3), "prompt_tokens": fed,
                "prompt_tok_s": round(fed / wall, 1)}
    if task["kind"] == "stream":
        eos = llm.token_eos()
        started = time.perf_counter()
        llm.create_completion(prompt(STREAM_PROMPT), max_tokens=1, temperature=0.0)  # warm
        first_s = load_s + time.perf_counter() - started
        # Forget the warm-up's prompt: llama-cpp-python would reuse its keys, where this
        # project's side prefills the prompt in the timed run (a fresh engine), so both
        # sides time the same work: the prompt, then every token.
        llm.reset()
        started = time.perf_counter()
        first_at, tokens = None, 0
        for chunk in llm.create_completion(prompt(STREAM_PROMPT), max_tokens=task["max_tokens"],
                                           temperature=0.0, logit_bias={eos: float("-inf")},
                                           stream=True):
            if first_at is None:
                first_at = time.perf_counter()
            # a chunk a token; the last, with the finish reason, also says how many
            tokens = chunk.get("usage", {}).get("completion_tokens", tokens + 1)
        wall = time.perf_counter() - started
        return {"tok_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 2),
                "decode_tok_s": _decode_rate(tokens, wall, (first_at or started) - started),
                "peak_rss_mib": round(peak_rss_mib()), "first_token_s": round(first_s, 2)}
    import jsonschema

    tokens = valid = refused = 0
    started = time.perf_counter()
    for path in held_half(task["schemas"]):
        schema = json.loads(path.read_text())
        try:
            grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        except Exception:  # noqa: BLE001 - its converter refuses some schemas
            refused += 1
            continue
        out = llm.create_completion(prompt(schema_ask(schema)), max_tokens=task["max_tokens"],
                                    temperature=0.0, grammar=grammar)
        tokens += out["usage"]["completion_tokens"]
        try:
            jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            pass
    wall = time.perf_counter() - started
    return {"tok_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 2),
            "valid": valid, "refused": refused}


def _start_server(task: dict[str, Any], binary: str) -> tuple[Any, str]:
    """`llama-server` with task["batch"] slots on a free 127.0.0.1 port, once healthy:
    the process and its base URL."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "-m", task["gguf_path"], "-np", str(task["batch"]),
                             "-t", str(_threads()), "-c", str(2048 * task["batch"]), "--host",
                             "127.0.0.1", "--port", str(port), *task["server_args"]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2).read()
            return proc, base
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.terminate()
                proc.wait(timeout=30)
                raise RuntimeError("llama-server did not start") from None
            time.sleep(0.5)


def server(task: dict[str, Any], binary: str) -> dict[str, Any]:
    """`llama-server -np 8 -t 2` on 127.0.0.1, the schemas (or the plain batch prompts,
    end-of-sequence ignored) sent 8 at a time."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from aici_cli.models.load import load_model

    tokenizer = load_model(task["gguf"], "cpu", "auto", "none").tokenizer
    proc, base = _start_server(task, binary)
    try:
        def post(body: dict[str, Any]) -> dict[str, Any]:
            req = urllib.request.Request(f"{base}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            return dict(json.loads(urllib.request.urlopen(req, timeout=600).read()))

        def plain(text: str) -> tuple[int, bool]:
            out = post({"prompt": text, "n_predict": task["max_tokens"], "temperature": 0.0,
                        "ignore_eos": True, "cache_prompt": False})
            return int(out.get("tokens_predicted", 0)), True

        def one(path: Path) -> tuple[int, bool]:
            schema = json.loads(path.read_text())
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": schema_ask(schema)}], tokenize=False,
                add_generation_prompt=True)
            out = post({"prompt": text, "n_predict": task["max_tokens"],
                        "temperature": 0.0, "json_schema": schema})
            try:
                jsonschema.validate(json.loads(out["content"]), schema)
                ok = True
            except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
                ok = False
            return int(out.get("tokens_predicted", 0)), ok

        if task["kind"] == "batch":
            post({"prompt": "Hello", "n_predict": 1})  # warm: first-pass costs
        started = time.perf_counter()
        with ThreadPoolExecutor(task["batch"]) as pool:
            done = (list(pool.map(plain, BATCH_PROMPTS)) if task["kind"] == "batch"
                    else list(pool.map(one, held_half(task["schemas"]))))
        wall = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    tokens = sum(t for t, _ in done)
    valid = sum(ok for _, ok in done) if task["kind"] == "schemas" else None
    return {"tok_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 2),
            "valid": valid}


# ----------------------------------------------------------------------------- driver


def worker(task: dict[str, Any]) -> dict[str, Any]:
    if task["side"] == "ours":
        return ours(task)
    if task["side"] == "server":
        return server(task, task["binary"])
    return peer(task)


def spawn(task: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    python = sys.executable
    if task["side"] == "ours" and ISA:
        env["AICI_BATCH_ISA"] = ISA  # and, below AVX-512, ATEN_CPU_CAPABILITY=avx2
    if task["side"] == "peer" and PEER_PYTHON:
        # Its own llama_cpp; this checkout and this environment's packages for the rest
        # (the prompt is rendered by this project's tokenizer, as its side renders it).
        python = PEER_PYTHON
        import sysconfig

        env["PYTHONPATH"] = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]])
    try:
        done = subprocess.run([python, __file__, "--worker", json.dumps(task)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--quantize", default="none,int4")
    ap.add_argument("--compile", default="off,on")
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--schemas", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--stream-batch-sizes", default="",
                    help="--batch-size of the one-stream rows (default: the engine's); "
                         "1 is `aici-batch run --batch-size 1`, a one-row cache")
    ap.add_argument("--only", default="stream,prefill,schemas,start")
    ap.add_argument("--prefill-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=1,
                    help="one-stream rounds, configurations interleaved (medians reported)")
    ap.add_argument("--drafts", default="4,0", help="prompt-lookup draft settings to run")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"))
    ap.add_argument("--server-args", default="",
                    help="extra llama-server arguments (e.g. --no-repack)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for both sides (on a shared machine: 1; oversubscribed "
                         "OpenMP threads wait on each other)")
    ap.add_argument("--isa", default="",
                    help="force this project's side to an instruction set (AICI_BATCH_ISA: "
                         "avx2, avx_vnni, ...), to compare with a llama.cpp built for it")
    ap.add_argument("--peer-python", default="",
                    help="the Python whose llama_cpp runs the peer (a venv with "
                         "llama-cpp-python built for --isa)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "llama_cpp.json")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0

    global THREADS, ISA, PEER_PYTHON
    THREADS, ISA, PEER_PYTHON = args.threads, args.isa, args.peer_python
    from aici_cli.models.sources.packaged import default_gguf_path

    gguf_path = args.gguf or str(default_gguf_path())
    only = set(args.only.split(","))
    have_peer = bool(PEER_PYTHON) or _importable("llama_cpp")
    base = {"gguf": args.gguf, "gguf_path": gguf_path, "schemas": args.schemas}
    rows: list[dict[str, Any]] = []

    def row(name: str, task: dict[str, Any]) -> dict[str, Any]:
        result = spawn({**base, **task}, args.timeout)
        rows.append({"row": name, **task, **result})
        shown = {k: v for k, v in result.items() if v is not None}
        print(f"{name:58} {json.dumps(shown)}", flush=True)
        return result

    quantizes, compiles = args.quantize.split(","), args.compile.split(",")
    drafts_list = [int(d) for d in args.drafts.split(",")]
    if "stream" in only:
        # One line at the default batch size, as `aici-batch run` of a one-line file: the
        # engine computes the busy row only (compiled: its 1-row bucket, whose packaged
        # step a cache of 8 rows can run; a 1-row cache's shapes are a package of their own).
        from aici_cli.core.config import EngineConfig
        stream_batches = ([int(b) for b in args.stream_batch_sizes.split(",")]
                          if args.stream_batch_sizes else [EngineConfig().batch_size])
        stream = [(f"one stream {args.stream_tokens} tok | ours {q} compile {c} drafts {d}"
                   + (f" batch {b}" if len(stream_batches) > 1 else ""),
                   {"side": "ours", "kind": "stream", "quantize": q, "compile": c,
                    "batch": b, "drafts": d, "max_tokens": args.stream_tokens})
                  for b in stream_batches for q in quantizes for c in compiles
                  for d in drafts_list]
        if have_peer:
            stream.append((f"one stream {args.stream_tokens} tok | llama-cpp-python",
                           {"side": "peer", "kind": "stream",
                            "max_tokens": args.stream_tokens}))
        first = len(rows)
        for _ in range(args.rounds):
            for name, task in stream:
                row(name, task)
        if args.rounds > 1:
            rows.extend(_round_medians(rows[first:], len(stream), have_peer))
    if "prefill" in only:
        prefill = [(f"prefill {args.prefill_tokens} tok | ours {q}",
                    {"side": "ours", "kind": "prefill", "quantize": q, "compile": "off",
                     "batch": 1, "drafts": 0, "prefill_tokens": args.prefill_tokens})
                   for q in quantizes]
        if have_peer:
            prefill.append((f"prefill {args.prefill_tokens} tok | llama-cpp-python",
                            {"side": "peer", "kind": "prefill",
                             "prefill_tokens": args.prefill_tokens}))
        for _ in range(args.rounds):  # interleaved, as the one-stream rows
            for name, task in prefill:
                row(name, task)
    if "schemas" in only:
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            for q in quantizes:
                for c in compiles:
                    for drafts in drafts_list:
                        row(f"{args.schemas} schemas batch {bs} | ours {q} compile {c} "
                            f"drafts {drafts}",
                            {"side": "ours", "kind": "schemas", "quantize": q, "compile": c,
                             "batch": bs, "drafts": drafts, "max_tokens": args.max_tokens})
            if bs == 1 and have_peer:
                row(f"{args.schemas} schemas batch 1 | llama-cpp-python",
                    {"side": "peer", "kind": "schemas", "max_tokens": args.max_tokens})
            if bs > 1 and args.llama_server:
                row(f"{args.schemas} schemas batch {bs} | llama-server -np {bs}",
                    {"side": "server", "kind": "schemas", "batch": bs,
                     "binary": args.llama_server, "server_args": args.server_args.split(),
                     "max_tokens": args.max_tokens})
    if "batch" in only:
        _batch_rows(args, row)
    if "start" in only:
        for q in quantizes:
            t = first_token_s(q, args.gguf)
            rows.append({"row": f"start to first token | ours {q}", "seconds": t})
            print(f"{'start to first token | ours ' + q:58} {t} s", flush=True)
    if not have_peer:
        print("llama.cpp: llama-cpp-python not installed (pip install 'aici-batch[bench]'; "
              "see this file's docstring for the build flags): its rows were skipped")
    if not args.llama_server:
        print("llama.cpp: no llama-server on PATH (--llama-server): batch rows skipped")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _batch_rows(args: argparse.Namespace, row: Any) -> None:
    """The plain batch-8 rows, --rounds times interleaved, then each one's median."""
    import statistics

    from aici_cli.core.config import EngineConfig

    n = len(BATCH_PROMPTS)
    batch = [(f"{n} plain x {args.max_tokens} tok | ours {q} compile {c}",
              {"side": "ours", "kind": "batch", "quantize": q, "compile": c,
               "batch": EngineConfig().batch_size, "drafts": d, "max_tokens": args.max_tokens})
             for q in args.quantize.split(",") for c in args.compile.split(",")
             for d in (int(x) for x in args.drafts.split(","))]
    if args.llama_server:
        batch.append((f"{n} plain x {args.max_tokens} tok | llama-server -np {n}",
                      {"side": "server", "kind": "batch", "batch": n,
                       "binary": args.llama_server, "server_args": args.server_args.split(),
                       "max_tokens": args.max_tokens}))
    rounds = [[row(name, task).get("tok_s") for name, task in batch]
              for _ in range(args.rounds)]
    if args.rounds < 2:
        return
    peer = args.llama_server is not None
    for j, (name, _) in enumerate(batch):
        speeds = [r[j] for r in rounds]
        ratios = [r[j] / r[-1] for r in rounds if peer and r[j] and r[-1]]
        summary = {"tok_s": statistics.median(x for x in speeds if x) if any(speeds) else None,
                   "ratio_to_peer": round(statistics.median(ratios), 2) if ratios else None,
                   "tok_s_rounds": speeds}
        print(f"{name + f' | median of {args.rounds} rounds':58} {json.dumps(summary)}",
              flush=True)


def _round_medians(measured: list[dict[str, Any]], per_round: int,
                   have_peer: bool) -> list[dict[str, Any]]:
    """Per configuration: the median tok/s over rounds and, with the peer in every round
    (its row last), the median of the round-by-round ratio to it."""
    import statistics

    rounds = [measured[i : i + per_round] for i in range(0, len(measured), per_round)]
    out = []
    for j in range(per_round - (1 if have_peer else 0)):
        speeds = [r[j].get("tok_s") for r in rounds]
        ratios = [r[j]["tok_s"] / r[-1]["tok_s"] for r in rounds
                  if have_peer and r[j].get("tok_s") and r[-1].get("tok_s")]
        summary = {"row": f"{rounds[0][j]['row']} | median of {len(rounds)} rounds",
                   "tok_s": statistics.median(x for x in speeds if x) if any(speeds) else None,
                   "ratio_to_peer": round(statistics.median(ratios), 2) if ratios else None,
                   "tok_s_rounds": speeds}
        if have_peer:
            summary["peer_tok_s_rounds"] = [r[-1].get("tok_s") for r in rounds]
        decode = [r[j]["decode_tok_s"] / r[-1]["decode_tok_s"] for r in rounds
                  if have_peer and r[j].get("decode_tok_s") and r[-1].get("decode_tok_s")]
        if decode:  # the same after the first token (one-stream rows)
            summary["decode_ratio_to_peer"] = round(statistics.median(decode), 2)
        print(f"{summary['row']:58} {json.dumps(summary)}", flush=True)
        out.append(summary)
    return out


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    sys.exit(main())
