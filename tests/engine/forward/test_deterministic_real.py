"""`--deterministic` on the default model: 16 Glaive JSON-schema prompts give the same
tokens and the same raw logprobs, bit for bit, at batch sizes 1, 3, 8 and 16, with drafts
on and off, in bf16 and fp32, and across a SIGKILL and `--resume` in the middle.

Marked `real_model` (a few minutes on 2 CPU cores: every pass makes one attention call per
token and layer).
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from paths import JSONSCHEMABENCH

from aici_cli.core.config import EngineConfig, JobDefaults
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.formats.jobs import read_jobs

pytestmark = pytest.mark.real_model

GLAIVE = JSONSCHEMABENCH / "Glaiveai2K"
MAX_TOKENS = 24


def write_input(path: Path) -> list[bytes]:
    """The 16 Glaive schemas first in the order of the SHA-1 of their file names, each a
    request for a realistic JSON object named by the schema's title, description or file
    stem, greedy, with every token's logprob in the result."""
    files = sorted(GLAIVE.glob("*.json"), key=lambda f: hashlib.sha1(f.name.encode()).hexdigest())
    lines = []
    for f in files[:16]:
        schema = json.loads(f.read_text())
        what = (schema.get("title") or schema.get("description") or f.stem
                if isinstance(schema, dict) else f.stem)
        lines.append(json.dumps({
            "id": f.stem, "prompt": "Write a realistic JSON object for: " + str(what)[:300],
            "json_schema": schema, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": True,
        }).encode() + b"\n")
    path.write_bytes(b"".join(lines))
    return lines


def tokens(result: dict[str, Any]) -> list[tuple[int, float]]:
    assert result["finish_reason"] != "error", result.get("error")
    return [(e["id"], e["logprob"]) for e in result["logprobs"]]


def engine_run(lm: Any, lines: list[bytes], **config: Any) -> dict[str, Any]:
    jobs = [j for j in read_jobs(lines, JobDefaults()) if isinstance(j, Job)]
    assert len(jobs) == len(lines), list(read_jobs(lines, JobDefaults()))
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(deterministic=True, **config)).run(jobs, results.append)
    return {r["id"]: tokens(r) for r in results}


def assert_same(got: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    assert set(got) == set(reference)
    for key, expected in reference.items():
        assert len(got[key]) == len(expected), f"{key} ({what}): length differs"
        for i, (a, b) in enumerate(zip(got[key], expected)):
            assert a == b, f"{key} ({what}): token {i} is {a}, batch 1 gave {b}"


@pytest.mark.skipif(not GLAIVE.is_dir(), reason="JSONSchemaBench data not present")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_glaive_outputs_are_identical_in_every_batch(dtype: str, tmp_path: Path) -> None:
    from aici_cli.models import load_model

    lm = load_model(None, device="cpu", dtype=dtype)
    lines = write_input(tmp_path / "in.jsonl")
    reference = engine_run(lm, lines, batch_size=1, draft_tokens=0)
    assert sum(len(t) for t in reference.values()) > 16 * 8
    # The prefix cache on throughout (the lines share their start); drafts alternate on
    # and off (tests/engine/forward/test_deterministic.py runs the full matrix on the tiny
    # model).
    for batch_size, drafts in [(3, 4), (8, 0), (8, 4), (16, 4)]:
        got = engine_run(lm, lines, batch_size=batch_size, draft_tokens=drafts)
        assert_same(got, reference, f"{dtype}, batch {batch_size}, drafts {drafts}")
    if dtype != "bfloat16":
        return

    # The CLI, killed mid-run at batch 3 and resumed at batch 8 (other batches, other rows,
    # other neighbours for the lines left): still the batch-1 tokens.
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    common = [sys.executable, "-m", "aici_cli", "run", str(src), "-o", str(out),
              "--device", "cpu", "--dtype", dtype, "--deterministic", "-q"]
    proc = subprocess.Popen([*common, "--batch-size", "3"], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= 4:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    done_before = out.read_bytes().count(b"\n")
    assert 4 <= done_before < 16
    resumed = subprocess.run([*common, "--batch-size", "8", "--resume"],
                             capture_output=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr.decode()
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 16
    assert_same({r["id"]: tokens(r) for r in results}, reference, "killed and resumed")
