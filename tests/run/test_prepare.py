"""`aici-batch prepare` (run/prepare.py): it builds the compiled step's packages for one line
and for a full batch, after which a `--compile auto` run of any length starts compiled and
builds nothing; where the compiled step cannot run it says why and still exits 0; its
options are `run`'s own declarations.

Each test keeps its packages in a cache of its own (building one for the tiny model takes
~20-60 s on 2 cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.engine.forward import compiled, packaged_step
from aici_cli.models.kernels import probe as kernel_probe
from aici_cli.models.load import load_model
from aici_cli.models.quant.dense_copies import dense_verdict


def _prepare(model_dir: Path, *args: str) -> str:
    res = CliRunner().invoke(main, ["prepare", "--model", str(model_dir), "--device", "cpu",
                                    "--dtype", "float32", *args])
    assert res.exit_code == 0, res.output
    return res.stdout


def _packages(cache: Path) -> list[Path]:
    return sorted((cache / packaged_step.FOLDER).glob("*.pt2"))


@pytest.mark.heavy
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor needs a C++ compiler for CPU kernels")
def test_prepare_builds_the_steps_runs_take_and_a_short_auto_run_starts_compiled(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    out = _prepare(tiny_model_dir, "--batch-size", "2", "-q")
    assert "start with the compiled one-token step (1 and 2 rows, and 1 at --batch-size 1)" \
        in out
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    wanted = [packaged_step.package_file(lm.model, rows, cache_rows)
              for rows, cache_rows in ((1, 2), (2, 2), (1, 1))]
    assert all(path.is_file() for path in wanted)
    assert sorted(wanted) == _packages(tmp_path / "cache")

    # A one-line run far shorter than AUTO_MIN_STEPS, at the default --compile auto.
    rows = "".join(json.dumps({"prompt": p, "max_tokens": 6, "ignore_eos": True}) + "\n"
                   for p in ("hello", "the quick brown fox", "a b c"))
    # 1 row, then 2 (a full batch) with a 1-row tail, then 3 lines one at a time.
    for lines, batch in ((1, "2"), (3, "2"), (3, "1")):
        stats = tmp_path / f"stats{lines}-{batch}.json"
        res = CliRunner().invoke(main, [
            "run", "-", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype",
            "float32", "--batch-size", batch, "-q", "--stats-out", str(stats),
            # the tiny model repeats itself: its drafts would pay, and run eager
            "--draft-tokens", "0"],
            input="".join(rows.splitlines(keepends=True)[:lines]))
        assert res.exit_code == 0, res.output
        assert json.loads(stats.read_text())["compiled_steps"] > 0
    assert sorted(wanted) == _packages(tmp_path / "cache")  # nothing more was built

    # A second prepare finds everything built: no new package, and the same verdict.
    assert "(1 and 2 rows, and 1 at --batch-size 1)" in _prepare(tiny_model_dir,
                                                                 "--batch-size", "2", "-q")
    assert sorted(wanted) == _packages(tmp_path / "cache")


def test_where_the_step_cannot_compile_prepare_says_why_and_builds_nothing(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "compiler_problem", lambda device: "no C++ compiler")
    out = _prepare(tiny_model_dir)
    assert "steps stay eager here: no C++ compiler" in out
    assert _packages(tmp_path / "cache") == []


@pytest.mark.subprocess
def test_prepare_leaves_the_verdicts_a_quantised_runs_first_passes_ask_for(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 int4 run's first wide pass asks the probe about the dense kernels: prepare
    asks first, so that the run does not wait for a probe's child (~2 s)."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(kernel_probe.ENV, "on")
    monkeypatch.setattr(compiled, "compiler_problem", lambda device: "no C++ compiler")
    res = CliRunner().invoke(main, ["prepare", "--model", str(tiny_model_dir), "--device",
                                    "cpu", "--dtype", "bfloat16", "--quantize", "int4"])
    assert res.exit_code == 0, res.output

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("probed again: prepare left no verdict")

    monkeypatch.setattr(kernel_probe, "run_probe", no_child)
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", quantize="int4")
    assert dense_verdict(lm.model.config, torch.bfloat16).ok


def test_a_model_that_is_not_there_is_a_usage_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["prepare", "--model", str(tmp_path / "nothing")])
    assert res.exit_code == 2
    assert "nothing" in res.output


def test_prepare_takes_the_run_options_as_run_declares_them() -> None:
    run = {p.name: p for p in main.commands["run"].params}
    prepare = main.commands["prepare"].params
    assert {p.name for p in prepare} >= {"model", "dtype", "quantize", "batch_size"}
    for param in prepare:
        if param.name == "help":
            continue
        mine, theirs = param.to_info_dict(), run[param.name].to_info_dict()
        assert mine == theirs, param.name


@pytest.mark.parametrize("extra,hinted", [((), True), (("-q",), False),
                                          (("--compile", "off"), False)])
def test_a_long_run_that_stayed_eager_says_how_to_prepare(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        extra: tuple[str, ...], hinted: bool) -> None:
    from aici_cli.run import batch

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))  # no package here
    monkeypatch.setattr(compiled, "compiler_problem", lambda device: None)
    monkeypatch.setattr(batch, "PREPARE_HINT_PASSES", 5)
    line = json.dumps({"prompt": "hello", "max_tokens": 24, "ignore_eos": True})
    res = CliRunner().invoke(main, ["run", "-", "--model", str(tiny_model_dir), "--device",
                                    "cpu", "--dtype", "float32", *extra], input=line + "\n")
    assert res.exit_code == 0, res.output
    assert ("`aici-batch prepare` with its --model" in res.stderr) is hinted
    assert _packages(tmp_path / "cache") == []  # a short auto run builds nothing
