"""One CPU capability's part of the kernel-path matrix
(tests/models/kernels/test_kernel_matrix.py), run as its own process: `ATEN_CPU_CAPABILITY`
is read when torch loads, so each capability needs a process, and a kernel that faults kills
only this one (the parent reads the signal). For each mode given (dtype, quantize, compile),
the default model runs the matrix's lines at batch 1 and at batch 8, with the kernel probe
off (the kernels themselves); one JSON line per (mode, batch) on stdout, written before the
next mode starts, so a death names the mode it happened in. Where a mode fails (its engine
raises, or a line ends in an error), the line also carries the probe's verdict on that
mode."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(modes: list[dict[str, str]], lines: list[dict[str, Any]]) -> None:

    from aici_cli.core.config import EngineConfig, JobDefaults
    from aici_cli.engine import Engine
    from aici_cli.formats.jobs import read_jobs
    from aici_cli.models.kernels.cpu_features import cpu_features
    from aici_cli.models.load import load_model
    from aici_cli.models.quant import dense_copies

    capability = cpu_features().capability
    own = dense_copies.MIN_SPEEDUP
    for mode in modes:
        print(json.dumps({"starting": mode, "capability": capability}), flush=True)
        # "wide": prompt tokens on dense copies of the int4 layers, whatever this CPU's
        # trial would say (models/quant/dense_copies.py).
        wide = mode.get("wide") == "on"
        dense_copies.MIN_SPEEDUP = 0.0 if wide else own
        lm = load_model(None, "cpu", mode["dtype"], mode["quantize"])
        for batch in (1, 8):
            jobs = list(read_jobs([json.dumps(line) for line in lines], JobDefaults()))
            results: list[dict[str, Any]] = []
            config = EngineConfig(batch_size=batch, compile=mode["compile"])
            started = time.perf_counter()
            raised = None
            engine = Engine(lm, config)
            try:
                engine.run(jobs, results.append)
            except Exception as e:  # noqa: BLE001 - a kernel that raises: the probe's case
                raised = f"{type(e).__name__}: {e}"
            passes = engine.runner.model_pass.wide
            record = {"mode": mode, "capability": capability, "batch": batch,
                      "wide": None if passes is None else passes.state,
                      "quantize": lm.quantize, "dtype": str(lm.dtype),
                      "seconds": round(time.perf_counter() - started, 2),
                      "results": results, "raised": raised}
            if raised is not None or any("error" in r for r in results):
                record["probe"] = _probe(mode)
            print(json.dumps(record), flush=True)


def _probe(mode: dict[str, str]) -> dict[str, Any]:
    """The kernel probe's verdict on `mode` on this machine (cached per machine)."""
    from dataclasses import asdict

    from aici_cli.models.kernels.probe import Shapes, current_mode, verdict
    from aici_cli.models.sources.resolve import resolve_with_name

    shapes = Shapes.of(resolve_with_name(None)[0])
    return asdict(verdict(current_mode("cpu", mode["dtype"], mode["quantize"]), shapes))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), json.loads(sys.argv[2]))
