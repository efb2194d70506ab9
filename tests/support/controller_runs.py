"""Running a controller component through `aici-batch run` (the CLI, in process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from aici_cli.cli.main import main


def run_controller(model_dir: Path | None, wasm: Path, lines: list[dict[str, Any]],
                   *extra: str) -> tuple[int, dict[int, dict[str, Any]]]:
    """Exit code and results by line index; `model_dir` None: the default model (bf16)."""
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    model = ["--model", str(model_dir), "--dtype", "float32"] if model_dir is not None else []
    res = CliRunner().invoke(main, [
        "run", "-", *model, "--device", "cpu", "--controller", str(wasm), "-q", *extra,
    ], input=stdin)
    results = {}
    for line in res.stdout.splitlines():
        r = json.loads(line)
        results[r["index"]] = r
    return res.exit_code, results
