"""bench/device_check.sh --smoke: the GPU check's every step on CPU with the tiny model,
so the script that runs only on a lent GPU cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

# The figures the device check promises (bench/device_bench.py: KEYS), as numbers or, on
# a CPU and for the batch sizes the smoke run leaves out, null.
PROMISED = ("hbm_gb_s", "one_b_bytes_per_token", "one_b_batch1_tok_s",
            "one_b_batch1_generate_tok_s", "one_b_batch64_tok_s",
            "one_b_batch64_generate_tok_s", "one_b_batch64_json_tok_s",
            "default_batch1_tok_s", "syncs_per_step", "cuda_tests_failed")


@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_check_smoke_runs_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PY": sys.executable, "OUT_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    done = subprocess.run(["bash", "bench/device_check.sh", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "device_check: passed" in done.stdout
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert isinstance(figures["gpu"], str) and figures["gpu"]
    for key in PROMISED:
        assert key in figures and (figures[key] is None
                                   or isinstance(figures[key], int | float)), key
    # What a CPU measures is there: every path of the engine's and generate()'s timing.
    for key in ("hbm_gb_s", "one_b_bytes_per_token", "one_b_batch1_tok_s",
                "one_b_batch1_generate_tok_s", "default_batch1_tok_s"):
        assert figures[key] > 0, key
    assert figures["syncs_per_step"] is None  # nothing syncs on a CPU
    assert figures["cuda_tests_failed"] == 0
    engine = figures["parts"]["engine_one_b"]
    assert {"batch1", "batch2", "batch2_json"} <= engine.keys()
    assert engine["batch2"]["full_rows"] == 2 and engine["batch2"]["steady_steps"] > 0
    assert engine["batch2_json"]["errors"] == 0
    assert {"batch1", "batch2"} <= figures["parts"]["generate_one_b"].keys()
    summary = (tmp_path / "summary.md").read_text()
    assert "| 1B | 1 |" in summary and "| summary |" not in summary
    assert not (ROOT / "docs" / "device" / "figures.json").exists() or "--smoke" not in (
        ROOT / "docs" / "device" / "summary.md").read_text()  # smoke figures stay out
