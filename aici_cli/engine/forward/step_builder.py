"""The builder process of step_builds.py: `python -m aici_cli.engine.forward.step_builder
SPEC` builds the packaged steps a run lacks.

It loads the model as the run did (`step_builds.BuildSource`: so its layers, and so its
packages' keys, are the run's) and drives one `ModelPass` at `--compile on` per bucket: a
prompt pass over that many rows, then a one-token step, which builds and checks the
package as a `--compile on` run does (packaged_step.py). It runs niced, in its turn
among builders (`step_builds.builders_turn`), skips what is built already, and records
each build's time for the next forecast (`build_decision.record_build_s`). Its output
(one line a bucket; a failure's reason last) goes to the run's build log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from aici_cli.engine.forward.step_builds import NICE, BuildSource, builders_turn, folder

# Tokens of the synthetic prompt each row of a build feeds before its one-token step.
_PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)


def main(argv: list[str]) -> int:
    """The builder: build each bucket's package not made yet, in order; 1 where one
    failed (its reason the last line of the output)."""
    os.nice(NICE)
    spec = json.loads(argv[0])
    with builders_turn():  # taken before torch loads: a waiter sees a builder at once
        return _build(spec)


def _build(spec: dict[str, Any]) -> int:
    import torch

    from aici_cli.engine.forward import build_decision
    from aici_cli.models.kernels.probe import fingerprint
    from aici_cli.models.load import load_model

    source = BuildSource(**spec["source"])
    failed = None
    with torch.inference_mode():
        lm = load_model(source.path, source.device, source.dtype, source.quantize,
                        source.implementation)
        for rows in spec["rows"]:
            started = time.perf_counter()
            built, problem = build_bucket(lm, rows, spec["cache_rows"])
            if problem is not None:
                failed = f"{rows} rows: {problem}"
                print(failed, flush=True)
                continue
            if built:
                took = time.perf_counter() - started
                build_decision.record_build_s(folder(), fingerprint("cpu"), took)
                print(f"built the {rows}-row step in {took:.1f} s", flush=True)
    return 1 if failed else 0


def build_bucket(lm: Any, rows: int, cache_rows: int) -> tuple[bool, str | None]:
    """Build `lm`'s packaged step for `rows` rows of a `cache_rows`-row cache where it
    is missing: (whether it was built now, why it could not be)."""
    from aici_cli.engine.forward import packaged_step
    from aici_cli.engine.forward.attention import install
    from aici_cli.engine.forward.cache import row_cache
    from aici_cli.engine.forward.passes import ModelPass

    if packaged_step.package_file(lm.model, rows, cache_rows).is_file():
        return False, None
    install(lm.model)
    cache = row_cache(lm.model, int(lm.model.config.num_hidden_layers), cache_rows,
                      capacity=4 * len(_PROMPT))
    model_pass = ModelPass(lm, cache, compile="on")
    compiled = model_pass.decode.compiled
    if compiled is None:
        return False, model_pass.decode.reason or "the compiled step cannot run here"
    compiled.may_trace = False  # no package, no step: never torch.compile here
    empty: list[list[int]] = [[] for _ in range(rows)]
    model_pass.run(0, [0] * rows, [list(_PROMPT)] * rows, empty)
    model_pass.run(0, [len(_PROMPT)] * rows, [[_PROMPT[-1]]] * rows,
                   [[] for _ in range(rows)], rows_bound=rows)
    # Where the build put it (its key read as it began: a source file edited meanwhile
    # keys the next one elsewhere).
    if not compiled.package_path(rows).is_file():
        return False, (compiled.package_problem or model_pass.decode.reason
                       or "no package was made")
    return True, None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
