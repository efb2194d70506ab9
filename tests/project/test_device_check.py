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


@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_check_smoke_runs_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PY": sys.executable, "OUT_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "bench/device_check.sh", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "device_check: passed" in done.stdout
    for mode in ("none", "int4"):
        rows = json.loads((tmp_path / f"step_profile_{mode}.json").read_text())
        assert [r["batch"] for r in rows] == [1, 2] and {r["quantize"] for r in rows} == {mode}
    compare = json.loads((tmp_path / "generate_compare_off.json").read_text())
    assert [(r["quantize"], r["batch"]) for r in compare] == [
        ("none", 1), ("none", 2), ("int4", 1), ("int4", 2)]
    assert all(r["engine_tok_s"] > 0 and r["generate_tok_s"] > 0 for r in compare)
