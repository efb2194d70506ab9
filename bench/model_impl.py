"""The project's own module (models/families/llama.py) against transformers' model classes, side by
side in one process: the engine's eager decode speed on one stream and on a batch, per
weight form, rounds interleaved (the machine is noisy), plus the two load paths' start-up.

    python bench/model_impl.py --rounds 3 --max-tokens 64 --quantize none,int4

`--archs` takes the default model (`default`) and/or random-weight models of its size
(hidden 576, 30 layers, 9 heads / 3 key-value heads, intermediate 1536, its tokenizer) in
each family the own module builds, made with transformers' config classes and saved once
under out/model_impl/:

    python bench/model_impl.py --archs llama,mistral,qwen2,qwen3 --batch-sizes 1 \
        --quantize none --rounds 5 --no-start-up

Both run the same packed passes through the same cache and attention; their logits are
equal bit for bit (tests/models/families/test_llama.py,
tests/models/families/test_own_families.py), so the difference is the Python around the ops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPT = "Write a long story about a robot who learns to paint."


def decode_rate(lm: Any, batch: int, max_tokens: int) -> float:
    """Generated tokens per second of `batch` greedy lines of `max_tokens` each."""
    from aici_cli.core.config import EngineConfig
    from aici_cli.core.job import Job
    from aici_cli.core.sampling import Sampling
    from aici_cli.engine.engine import Engine

    jobs = [Job(index=i, id=str(i), prompt=None, max_tokens=max_tokens,
                sampling=Sampling(temperature=0.0, top_p=1.0, seed=i), ignore_eos=True,
                messages=[{"role": "user", "content": f"{PROMPT} ({i})"}])
            for i in range(batch)]
    results: list[dict[str, Any]] = []
    engine = Engine(lm, EngineConfig(batch_size=batch, draft_tokens=0, compile="off"))
    started = time.perf_counter()
    engine.run(jobs, results.append)
    elapsed = time.perf_counter() - started
    return sum(r["stats"]["output_tokens"] for r in results) / elapsed


# The default model's shapes (SmolLM2-135M), for the random-weight models of each family.
DEFAULT_SHAPE: dict[str, Any] = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=8192)
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "qwen3": "Qwen3Config", "gemma3": "Gemma3TextConfig"}
MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "gemma3": "Gemma3ForCausalLM"}


def arch_model(arch: str) -> str | None:
    """The model spec of `arch`: None (the default model) for `default`, else the
    directory of a random-weight bfloat16 model of the default model's size in that
    family, with the default model's tokenizer (built on first use, ~10 s)."""
    if arch == "default":
        return None
    import shutil

    import torch
    import transformers

    from aici_cli.models import resolve_model

    directory = REPO / "out" / "model_impl" / arch
    if (directory / "model.safetensors").is_file():
        return str(directory)
    source = resolve_model(None)
    raw = json.loads((source / "config.json").read_text())
    ids = {k: raw[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    extra: dict[str, Any] = {"rope_theta": 100000.0}
    if arch == "gemma3":  # its own RoPE bases and 512-token window, as gemma-3-270m
        extra = {"query_pre_attn_scalar": 64, "sliding_window": 512}
    config = getattr(transformers, CONFIGS[arch])(**DEFAULT_SHAPE, **ids, **extra)
    if arch == "mistral":
        config.sliding_window = None  # as Mistral 7B v0.2 and later
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, MODELS[arch])(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    return str(directory)


def start_up(implementation: str, quantize: str, spec: str | None = None) -> float:
    """Seconds for a fresh process to import the loader and load the model `spec`."""
    code = ("import time; t = time.perf_counter(); from aici_cli.models.load import load_model; "
            f"load_model({spec!r}, quantize={quantize!r}, implementation={implementation!r}); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--quantize", default="none,int4")
    ap.add_argument("--archs", default="default",
                    help="default and/or llama, mistral, qwen2, qwen3, gemma3 (random weights)")
    ap.add_argument("--dtype", default="auto", help="the runs' --dtype (auto, float32, ...)")
    ap.add_argument("--no-start-up", action="store_true", help="skip the load timings")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "model_impl.json")
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    for arch in args.archs.split(","):
        spec = arch_model(arch)
        for quantize in args.quantize.split(","):
            rows += compare(arch, spec, quantize, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    return 0


def compare(arch: str, spec: str | None, quantize: str,
            args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both paths on one model and weight form: decode rates per batch size, rounds
    interleaved, and (unless --no-start-up) each path's load in a fresh process."""
    from aici_cli.models.families.llama import LlamaCausalLM
    from aici_cli.models.load import load_model

    impls = ("auto", "transformers")
    rows: list[dict[str, Any]] = []
    models = {impl: load_model(spec, dtype=args.dtype, quantize=quantize,
                               implementation=impl) for impl in impls}
    assert isinstance(models["auto"].model, LlamaCausalLM), arch  # the own module
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        decode_rate(models["auto"], batch, 8)  # warm both (allocator, kernels)
        decode_rate(models["transformers"], batch, 8)
        rates: dict[str, list[float]] = {impl: [] for impl in impls}
        for _ in range(args.rounds):
            for impl in impls:
                rates[impl].append(decode_rate(models[impl], batch, args.max_tokens))
        ratio = statistics.median(a / b for a, b in zip(rates["auto"],
                                                        rates["transformers"]))
        rows.append({"arch": arch, "quantize": quantize, "batch": batch,
                     "own_tok_s": rates["auto"],
                     "transformers_tok_s": rates["transformers"],
                     "median_ratio": round(ratio, 3)})
        print(f"{arch:8} {quantize:5} batch {batch:3}: own "
              f"{statistics.median(rates['auto']):7.1f} tok/s, transformers "
              f"{statistics.median(rates['transformers']):7.1f} tok/s,"
              f" ratio {ratio:.2f}", flush=True)
    if args.no_start_up:
        return rows
    loads = {impl: [start_up(impl, quantize, spec) for _ in range(args.rounds)]
             for impl in impls}
    print(f"{arch:8} {quantize:5} load (import + model + tokenizer): own "
          f"{statistics.median(loads['auto']):.2f} s, transformers "
          f"{statistics.median(loads['transformers']):.2f} s", flush=True)
    rows.append({"arch": arch, "quantize": quantize, "load_s": loads})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
