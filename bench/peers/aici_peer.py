"""`aici`, `aici-noff`, `aici-wasm`, `aici-logprobs`: aici-batch's own `run_batch` on the
same prompts (`aici-logprobs`: every token with its logprob and top 5, `--logprobs 5`).

`run_batch` loads the default model itself (so `model`/`tokenizer` are unused) and times
only the generation loop (`summary.wall_s`, after model load), which is what the generate()
peers time too. The built-in JSON-schema controller gets each line's `json_schema`; the
wasm variant gets the schema as the line's `controller_arg` and decides the constraint in
the component (`bench/controllers/schema_segment.py`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from .common import Messages, PeerRun

REQUIRES: tuple[str, ...] = ("aici_cli",)
BATCHING = "aici-batch continuous batching"


def run(model: Any, tokenizer: Any, prompts: list[Messages], schemas: list[dict[str, Any]],
        batch_size: int, max_tokens: int, *, fast_forward: bool = True,
        controller: str | None = None, logprobs: int | None = None) -> PeerRun:
    """One `run_batch` over all prompts; counts come from its summary, texts from results."""
    from aici_cli.core.config import EngineConfig, JobDefaults, RunConfig
    from aici_cli.run.batch import run_batch

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aici-peers-") as tmp:
        lines = Path(tmp) / "in.jsonl"
        with lines.open("w") as f:
            for i, (messages, schema) in enumerate(zip(prompts, schemas)):
                line: dict[str, Any] = {"id": str(i), "messages": messages}
                if controller is None:
                    line["json_schema"] = schema
                else:
                    line["controller_arg"] = json.dumps(schema)
                f.write(json.dumps(line) + "\n")
        config = RunConfig(
            input=str(lines), output=str(Path(tmp) / "out.jsonl"),
            engine=EngineConfig(batch_size=batch_size, fast_forward=fast_forward),
            defaults=JobDefaults(max_tokens=max_tokens, logprobs=logprobs), quiet=True,
            controller=controller,
        )
        summary = run_batch(config, on_result=results.append).summary
    run = PeerRun.empty(len(prompts))
    for r in results:
        run.texts[int(r["id"])] = r.get("text", "")
        if "error" in r:
            run.constraint_failures += 1
            run.notes.append(f"{r['error'].get('type')}: {r['error'].get('message', '')[:120]}")
    run.output_tokens = summary["output_tokens"]
    run.row_passes = summary["row_forward_passes"]
    run.batched_passes = summary["forward_passes"]
    run.wall_s = summary["wall_s"]
    run.dtype = summary.get("dtype")
    return run
