"""The kernel-path matrix on the real default model: every ATen CPU capability this host
supports x dtype (float32, bfloat16) x quantize (none, int8, int4, and int4 with its wide
passes on dense copies: models/quant/dense_copies.py), at batch 1 and 8, each
capability in a process of its own (`kernel_matrix_run.py`). Bounded to keep CI short:
float32 with int8/int4 (explicit modes only, ~150 ms a step) and the compiled step in the
mode `auto` picks (a cold compile costs about a minute on 2 cores) run at the host's own
capability only. The kernels run with the probe off. Asserted: no process
dies by a signal; every cell gives one result per line; a mode whose lines end in an
error is one the kernel probe rejects on this machine (so neither `auto` nor an explicit
run ever uses it), and never the plainest mode (float32, unquantised) nor the one `auto`
picks on the host; in every other cell every schema line is valid, and the float32
unquantised tokens equal the reference run's (eager, batch 1, the host's capability) in
every cell (any capability, batch and compile).

docs/testing.md says which capabilities a run covers: those of the machine it runs on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
from paths import SUPPORT

from aici_cli.models.checks.doctor import capabilities

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
]
PROMPTS = ["Count: 1, 2, 3,",
           # a prefill past 64 tokens: bf16 attention takes another kernel there
           "Numbers: " + ", ".join(str(i) for i in range(40)) + ","]
# Small on purpose: 6 modes x 2 batches x up to 3 capabilities, and float32 activations
# through the int4 kernel take ~150 ms a step on 2 cores (docs/speed.md).
LINES: list[dict[str, Any]] = (
    [{"id": f"p{i}", "prompt": p, "max_tokens": 6, "temperature": 0, "logprobs": True}
     for i, p in enumerate(PROMPTS)]
    + [{"id": f"s{i}", "messages": [{"role": "user", "content": "Answer in JSON."}],
        "json_schema": s, "max_tokens": 20, "temperature": 0}
       for i, s in enumerate(SCHEMAS)])
MODES = [{"dtype": "float32", "quantize": "none", "compile": "off"}] + [
    {"dtype": "bfloat16", "quantize": q, "compile": "off"} for q in ("none", "int8", "int4")
] + [{"dtype": "bfloat16", "quantize": "int4", "compile": "off", "wide": "on"}]
# float32 activations through the int8/int4 kernels (explicit modes only: `auto` runs
# float32 unquantised) take ~150 ms a step: at the host's capability only.
HOST_ONLY = [{"dtype": "float32", "quantize": q, "compile": "off"} for q in ("int8", "int4")]


def _run(capability: str, modes: list[dict[str, str]]) -> list[dict[str, Any]]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower(),
           "AICI_BATCH_KERNEL_PROBE": "off"}
    ran = subprocess.run([sys.executable, str(SUPPORT / "kernel_matrix_run.py"),
                          json.dumps(modes), json.dumps(LINES)], capture_output=True,
                         text=True, env=env, timeout=1500)
    records = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    started = [r for r in records if "starting" in r]
    if ran.returncode != 0:
        died = (f"died by {signal.Signals(-ran.returncode).name}" if ran.returncode < 0
                else f"exited {ran.returncode}")
        pytest.fail(f"{capability}: {died} in mode {started[-1] if started else None}: "
                    f"{ran.stderr[-1500:]}")
    assert all(r["capability"] == capability for r in records), records[:1]
    return [r for r in records if "results" in r]


def _auto_mode(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """What `--dtype auto --quantize auto` runs for the default model here: the first mode
    the kernel probe passes."""
    import torch

    from aici_cli.models.checks.doctor import auto_kernels
    from aici_cli.models.kernels.probe import ENV
    from aici_cli.models.sources.resolve import resolve_with_name

    monkeypatch.setenv(ENV, "on")
    choice = auto_kernels(resolve_with_name(None)[0], torch.device("cpu"))
    return choice.dtype, choice.quantize


def _ids(result: dict[str, Any]) -> list[int]:
    return [entry["id"] for entry in result["logprobs"]]


@pytest.mark.real_model
def test_every_kernel_path_of_this_host_runs_and_agrees(
        monkeypatch: pytest.MonkeyPatch) -> None:
    caps = capabilities(every=True)
    host = caps[-1]
    auto = _auto_mode(monkeypatch)
    # The compiled step in the mode `auto` runs here (bfloat16+int4 with native bf16,
    # float32 without, or where the probe turns bfloat16 down); its float32 tokens are
    # also checked against eager on the tiny model (test_compiled_decode.py).
    compiled = [{"dtype": auto[0], "quantize": auto[1], "compile": "on"}]
    cells: list[dict[str, Any]] = []
    for capability in caps:
        cells += _run(capability, MODES + (HOST_ONLY + compiled if capability == host else []))
    assert len(cells) == 2 * (len(caps) * len(MODES) + len(HOST_ONLY) + len(compiled))
    for cell in cells:  # one result per line, errors too, unless the engine raised
        indexes = sorted(r["index"] for r in cell["results"])
        assert cell["raised"] or indexes == list(range(1, len(LINES) + 1)), \
            (cell["capability"], cell["mode"])
    for cell in [c for c in cells if "probe" in c]:
        mode, verdict = cell["mode"], cell["probe"]
        where = f"{cell['capability']} {mode} batch {cell['batch']}"
        # shown with -s: the kernel paths this machine must never take
        print(f"fails, and the kernel probe rejects it: {where}: {verdict['reason']}")
        assert not verdict["ok"], (where, cell["raised"],
                                   [r.get("error") for r in cell["results"]])
        assert (mode["dtype"], mode["quantize"]) != ("float32", "none"), where
        assert cell["capability"] != host or (mode["dtype"], mode["quantize"]) != auto, where
    cells = [c for c in cells if "probe" not in c]
    reference = next(c for c in cells if c["capability"] == host and c["batch"] == 1
                     and c["mode"] == MODES[0])
    want = {r["id"]: _ids(r) for r in reference["results"] if r["id"].startswith("p")}
    for cell in cells:
        where = f"{cell['capability']} {cell['mode']} batch {cell['batch']}"
        results = {r["id"]: r for r in cell["results"]}
        assert results.keys() == {line["id"] for line in LINES}, where
        assert cell["quantize"] == cell["mode"]["quantize"], where
        if cell["mode"].get("wide"):  # its prefills ran on the dense copies
            assert cell["wide"] == "dense", where
        for i, schema in enumerate(SCHEMAS):
            result = results[f"s{i}"]
            assert result["finish_reason"] in ("stop", "length"), (where, result)
            assert result["valid"] is True, (where, result["text"])
            jsonschema.validate(json.loads(result["text"]), schema)
        if cell["mode"]["dtype"] == "float32" and cell["mode"]["quantize"] == "none":
            got = {k: _ids(results[k]) for k in want}
            assert got == want, where
