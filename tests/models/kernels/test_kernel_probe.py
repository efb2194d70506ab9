"""The kernel probe (`models/kernels/probe.py`): a mode whose kernels crash, hang or compute
wrong in the probe's child is never used; `auto` walks on to the next mode and says so,
an explicit mode is refused with the reason, verdicts are cached per machine, and
`aici-batch doctor` shows them. Faults are injected into the probe child
(`probe_child.FAULT_ENV`); the last tests run the real probe through `aici-batch run`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_model import write_tiny_gguf
from tiny_shapes import TINY

from aici_cli.core.errors import ModelError
from aici_cli.models.checks.probe_child import FAULT_ENV
from aici_cli.models.device import pick_dtype
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels import probe as kernel_probe
from aici_cli.models.kernels.probe import (
    ENV,
    KernelMode,
    candidates,
    choose_kernels,
    current_mode,
    run_probe,
    verdict,
)
from aici_cli.models.quant.quantize import resolve_mode
from aici_cli.models.sources.resolve import resolve_model

AICI = str(Path(sys.executable).parent / "aici-batch")


@pytest.fixture
def probing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The probe on, with a cache folder of the test's own."""
    monkeypatch.setenv(ENV, "on")
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return tmp_path / "cache"


def _mode(quantize: str, dtype: str = "bfloat16") -> KernelMode:
    return current_mode("cpu", dtype, quantize)


@pytest.mark.subprocess
@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_every_mode_passes_on_this_machine_with_a_step_time(probing: Path,
                                                            quantize: str) -> None:
    found = run_probe(_mode(quantize), TINY)
    assert found.ok, found.reason
    assert found.step_ms is not None and found.step_ms > 0
    assert found.max_error is not None and found.max_error < 0.03


@pytest.mark.subprocess
@pytest.mark.parametrize(("fault", "why"), [
    ("segv", "crashed the process (SIGSEGV)"),
    ("wrong", "off float32 over the same weights"),
])
def test_a_child_that_crashes_or_computes_wrong_rejects_the_mode(
        probing: Path, monkeypatch: pytest.MonkeyPatch, fault: str, why: str) -> None:
    monkeypatch.setenv(FAULT_ENV, fault)
    found = run_probe(_mode("int8"), TINY)
    assert not found.ok and found.reason is not None and why in found.reason


@pytest.mark.subprocess
def test_a_child_that_hangs_is_killed_and_rejects_the_mode(
        probing: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "hang")
    found = run_probe(_mode("int4"), TINY, timeout_s=8)
    assert not found.ok and "did not finish within 8 s" in str(found.reason)


@pytest.mark.subprocess
def test_a_verdict_is_cached_per_machine_and_mode(
        probing: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "segv:int4")
    assert not verdict(_mode("int4"), TINY).ok
    assert verdict(_mode("int8"), TINY).ok

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("probed again")

    monkeypatch.setattr(kernel_probe, "run_probe", no_child)
    assert not verdict(_mode("int4"), TINY).ok  # from the cache: no child
    assert verdict(_mode("int8"), TINY).ok
    other = KernelMode("cpu", "bfloat16", "int4", "SOMETHING-ELSE")
    with pytest.raises(AssertionError, match="probed again"):
        verdict(other, TINY)  # another capability is another verdict
    assert len(list((probing / "kernel-probe").glob("*.json"))) == 2


@given(dtype_auto=st.booleans(), quantize_auto=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]),
       quantize=st.sampled_from(["none", "int8", "int4"]))
def test_candidates_start_at_the_choice_and_vary_only_what_was_auto(
        dtype_auto: bool, quantize_auto: bool, dtype: str, quantize: str) -> None:
    def auto(dt: str) -> str:  # as resolve_mode: float32 runs unquantised
        return "none" if dt == "float32" else "int4"

    if quantize_auto:
        quantize = auto(dtype)
    found = candidates("auto" if dtype_auto else dtype, "auto" if quantize_auto else quantize,
                       dtype, quantize, auto)
    assert found[0] == (dtype, quantize)
    assert len(found) == len(set(found))
    if not dtype_auto:
        assert {dt for dt, _ in found} == {dtype}
    if not quantize_auto:
        assert {q for _, q in found} == {quantize}
    if dtype_auto and quantize_auto:
        assert found[-1] == ("float32", "none")  # the plainest mode comes last


@pytest.mark.subprocess
def test_auto_walks_on_to_the_next_mode_and_an_explicit_mode_is_refused(
        probing: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64,
                                                      "intermediate_size": 128,
                                                      "vocab_size": 256,
                                                      "num_attention_heads": 4,
                                                      "num_key_value_heads": 2,
                                                      "num_hidden_layers": 2}))
    monkeypatch.setenv(FAULT_ENV, "segv:int4")

    def auto(dt: str) -> str:
        return "none" if dt == "float32" else "int4"

    choice = choose_kernels(tmp_path, "cpu", "auto", "auto", "bfloat16", "int4", auto)
    assert (choice.dtype, choice.quantize) == ("bfloat16", "int8")
    assert choice.note is not None and "bfloat16+int4: its kernels crashed the process " \
        "(SIGSEGV)" in choice.note and choice.note.count("\n") == 0
    with pytest.raises(ModelError, match=r"cannot run bfloat16\+int4 .*SIGSEGV.*doctor"):
        choose_kernels(tmp_path, "cpu", "bfloat16", "int4", "bfloat16", "int4", auto)
    monkeypatch.setenv(ENV, "off")  # skipped: the mode as chosen, no child
    assert choose_kernels(tmp_path, "cpu", "bfloat16", "int4", "bfloat16", "int4",
                          auto).quantize == "int4"


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AICI, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=600)


@pytest.mark.subprocess
def test_a_run_falls_back_says_so_in_one_line_and_records_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    import os

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    env = {**os.environ, ENV: "on", "AICI_BATCH_CACHE": str(tmp_path / "cache"),
           FAULT_ENV: "segv:int4", "AICI_BATCH_ENGINE_PROCESS": "inline"}
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"prompt": f"hello {i}", "max_tokens": 4}) + "\n"
                             for i in range(3)))
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    ran = _run(["run", str(lines), "--model", str(gguf), "--dtype", "bfloat16", "-o",
                str(out), "--stats-out", str(stats)], env, tmp_path)
    assert ran.returncode == 0, ran.stderr
    notes = [line for line in ran.stderr.splitlines() if "kernel probe" in line]
    assert len(notes) == 1 and "running bfloat16+int8 instead" in notes[0], ran.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 3 and all(r["made_with"]["quantize"] == "int8" for r in results)
    summary = json.loads(stats.read_text())
    assert summary["quantize"] == "int8"
    assert summary["kernel_probe"]["rejected"][0][0] == "bfloat16+int4"

    refused = _run(["run", str(lines), "--model", str(gguf), "--dtype", "bfloat16",
                    "--quantize", "int4", "-o", str(tmp_path / "no.jsonl")], env, tmp_path)
    assert refused.returncode == 2
    assert "SIGSEGV" in refused.stderr and "cannot run bfloat16+int4" in refused.stderr


@pytest.mark.subprocess
def test_doctor_prints_the_fingerprint_every_verdict_and_the_pick(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q4_1")
    env = {**os.environ, ENV: "on", "AICI_BATCH_CACHE": str(tmp_path / "cache"),
           FAULT_ENV: "wrong:int4"}
    ran = _run(["doctor", "--model", str(gguf), "--json"], env, tmp_path)
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["machine"] == kernel_probe.fingerprint("cpu")
    verdicts = {m["label"]: m for m in report["modes"]}
    # and the VNNI kernels' mode where this machine runs them (models/kernels/int_mm.py)
    vnni = int_mm.unusable() is None
    assert set(verdicts) == {f"{d}+{q}" for d in ("float32", "bfloat16")
                             for q in ("none", "int8", "int4")} | (
        {("bfloat16" if report["native_bf16"] else "float32") + "+vnni"} if vnni else set())
    assert report["vnni"] == {"used": vnni, "why_not": report["vnni"]["why_not"],
                              "variant": int_mm.variant().name if vnni else
                              report["vnni"]["variant"]}
    assert all(m["ok"] != (m["quantize"] == "int4") for m in verdicts.values())
    assert all(m["step_ms"] > 0 for m in verdicts.values() if m["ok"])
    # `auto`'s first mode is this machine's (int4 where bf16 is native, the CPU's own
    # kernels elsewhere): it is rejected, and walked past, only where it is the faulty int4.
    monkeypatch.setenv("AICI_BATCH_CACHE", env["AICI_BATCH_CACHE"])  # converted there
    cpu = torch.device("cpu")
    first = resolve_mode("auto", resolve_model(str(gguf)), pick_dtype("auto", cpu), cpu)
    auto = report["auto"]
    assert auto["quantize"] != "int4"
    assert bool(auto["rejected"]) == (first == "int4"), (first, auto)
    text = _run(["doctor", "--model", str(gguf)], env, tmp_path)  # cached: no child
    assert "REJECTED" in text.stdout and "auto picks" in text.stdout
    assert "int kernels " in text.stdout
    assert report["machine"] in text.stdout
