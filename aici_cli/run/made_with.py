"""What shapes a result, recorded in it (`made_with`), so that `--resume` refuses to mix
results made two ways in one file.

Every result carries the model that made it (as results name it, with the quantization
it ran at: `--quantize auto` resolves per model, known once it loads) and the run options
that set what a line asks for, where they differ from the defaults: the line defaults
(`--max-tokens`, `--temperature`, `--json-schema`, `--grammar`, `--stop`, ...), the
options that change what a JSON output may be or how it ends (`--json-permissive`,
`--close-at-limit`, `--loop-guard`, `--schema-retries`, `--logprobs-mode`) and the
`--controller` (the digest of its .wasm) with its `--controller-arg`. Per result rather
than beside the file: a torn or partly resumed file, and resumes across local and
`--ray` runs, keep it.

Not recorded, because they do not change what is asked, only how it is computed:
`--batch-size`, `--device`, `--dtype`, `--deterministic`, `--draft-tokens`, `--no-ff`,
`--no-prefix-cache`, `--wide-prefill`, `--lookahead`, the Ray options, timeouts and
output options. Some of them change a line's tokens in the last bits of its logits (see
docs/reliability.md, "Reproducible results") exactly as another batch does, which no run
controls either.

Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aici_cli.core.config import FIELD_OPTIONS, EngineConfig, JobDefaults, RunConfig

FIELD = "made_with"

# A record key -> the run option that sets it (for messages).
_OPTIONS = {
    "model": "--model", "quantize": "--quantize", **FIELD_OPTIONS,
    "json_permissive": "--json-permissive", "close_at_limit": "--close-at-limit",
    "loop_guard": "--loop-guard", "schema_retries": "--schema-retries",
    "logprobs_mode": "--logprobs-mode", "controller": "--controller",
    "controller_arg": "--controller-arg",
}


# Known once the model loads: its name and the quantization it runs at.
MODEL_KEYS = {"model", "quantize"}
# The recorded run options known before the model loads.
OPTION_KEYS = set(_OPTIONS) - MODEL_KEYS


def _full(config: RunConfig, controller: str | None) -> dict[str, Any]:
    """Every recorded option of `config` (without the model)."""
    d, e = config.defaults, config.engine
    constraint = d.constraint
    record: dict[str, Any] = {
        "quantize": "none", "json_schema": None, "regex": None, "choices": None, "grammar": None,
        "stop": list(d.stop), "max_tokens": d.max_tokens, **d.sampling.run_values(),
        "ignore_eos": d.ignore_eos, "n": d.n, "score": d.score, "logprobs": d.logprobs,
        "schema_fallback": d.schema_fallback, "json_permissive": not e.strict_json,
        "close_at_limit": e.close_at_limit, "loop_guard": e.loop_guard,
        "schema_retries": e.schema_retries, "logprobs_mode": e.logprobs_mode,
        "controller": controller, "controller_arg": config.controller_arg,
    }
    if constraint is not None and constraint.kind == "json_schema":
        record["json_schema"] = digest(json.dumps(constraint.value, sort_keys=True).encode())
    elif constraint is not None and constraint.kind == "regex":
        record["regex"] = constraint.value
    elif constraint is not None and constraint.kind == "choice":
        record["choices"] = list(constraint.value)
    elif constraint is not None and constraint.kind == "lark":
        record["grammar"] = digest(constraint.value.encode())
    return record


# What a run with every default records: a record holds only what differs from it.
DEFAULTS = _full(RunConfig(input="-", engine=EngineConfig(), defaults=JobDefaults()), None)


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def run_record(config: RunConfig, model: str, controller: str | None,
               quantize: str = "none", dtype: str = "") -> dict[str, Any]:
    """The `made_with` of this run's results: the model, and the options that differ
    from the defaults. `controller` is the digest of the `--controller` file; `quantize`
    what the model runs at (`none`: its own dtype); `dtype` the activations' dtype,
    recorded beside a quantisation (float32 with int4 is the int kernels' float32 path,
    not the model's own float32 numbers) and never compared on resume: it says how a
    result was computed, as `--dtype` does."""
    record: dict[str, Any] = {"model": model}
    full = {**_full(config, controller), "quantize": quantize}
    record.update({k: v for k, v in full.items() if v != DEFAULTS[k]})
    if quantize != "none" and dtype:
        record["dtype"] = dtype
    varies = batch_variant_paths(config.engine, quantize, dtype) if dtype else []
    if varies:
        record["batch_variant"] = varies
    return record


def batch_variant_paths(engine: EngineConfig, quantize: str, dtype: str) -> list[str]:
    """The paths of this run at which a line's tokens may still depend on the lines that
    share its passes (docs/speed.md, "A line's text and its neighbours"; none under
    `--deterministic`). Recorded, never compared on resume: like `--batch-size`, they
    change how a result is computed, not what is asked.

    A quantised float32 or bf16 CPU run (the defaults) computes every token from its own
    row: the int kernels, the attention operator (`aici::rows_attention`, float32
    arithmetic for both), the prompt tokens' dense copies in tiles of one shape
    (`models/quant/prompt_tokens.py`), the compiled step's ops as eager rounds them. What
    is left:

    - `attention`: SDPA's, where the operator does not attend (float16 passes,
      unquantised runs, GPUs);
    - `dense-gemm`: an unquantised run's linear layers, whose BLAS rounds a row by the
      pass's row count;
    - `compiled-steps`: the compiled one-token step of such a run, whose attention is
      not the eager passes';
    - `long-prompts`: prompts longer than the attention's PER_QUERY_MAX (256 tokens) on
      SDPA, whose bits depend on where the prefix cache cut them;
    - `wide-prefill`: a 16-bit quantised run's prompt tokens in one dense GEMM a pass
      (`--wide-prefill`), which rounds a row by the pass's width."""
    if engine.deterministic:
        return []
    wide = ["wide-prefill"] if engine.wide_prefill and quantize != "none" \
        and dtype != "float32" else []
    int_kernels = quantize != "none" and dtype in ("float32", "bfloat16")
    if int_kernels:
        return wide + (["long-prompts"] if engine.prefix_cache else [])
    paths = ["attention"]
    if quantize == "none":
        paths.append("dense-gemm")
    if engine.compile != "off":
        paths.append("compiled-steps")
    return paths + wide


def mismatch(made: dict[str, Any], now: dict[str, Any], keys: set[str] | None = None
             ) -> tuple[str, str] | None:
    """("--max-tokens 64", "--max-tokens 128") for the first option in which two records
    differ (among `keys` when given), or None when they agree."""
    for key in _OPTIONS:
        if keys is not None and key not in keys:
            continue
        old, new = made.get(key, DEFAULTS.get(key)), now.get(key, DEFAULTS.get(key))
        if old != new:
            return _shown(key, old), _shown(key, new)
    return None


def _shown(key: str, value: Any) -> str:
    option = _OPTIONS[key]
    if value is None or value is False or value == [] or (
            key == "controller_arg" and value == ""):
        return f"no {option}"
    if value is True:
        return option
    if key == "stop":
        return " ".join(f"--stop {s!r}" for s in value)
    if key == "choices":
        return f"--choices {','.join(value)!r}"
    if key in ("json_schema", "grammar", "controller"):
        return f"{option} ({value})"
    if isinstance(value, str):
        return f"{option} {value!r}" if key in ("regex", "controller_arg") else \
            f"{option} {value}"
    return f"{option} {value}"
