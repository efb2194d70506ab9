"""What `--quantize auto` loads, run over the table `run --help` and docs/speed.md state:
every option of `EXACT_OPTIONS` (named in the help text) loads a GGUF unquantised, and the
float32 run that `--dtype auto` picks on a CPU without bf16 keeps the int kernels.

The options parse as the CLI reads them (`run`'s own Click command, then `run_config`), and
the mode is `resolve_mode` of what `load_quantize` hands the loader: the code path a run
takes, without loading a model (the source's blocks are given)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.cli.run_config import run_config
from aici_cli.core.config import EXACT_OPTIONS, exact_options, load_quantize
from aici_cli.models.kernels import int_mm
from aici_cli.models.quant import quantize

CPU = torch.device("cpu")


def _config(args: list[str]) -> object:
    command = main.get_command(click.Context(main), "run")
    assert isinstance(command, click.Command)
    ctx = command.make_context("run", ["in.jsonl", *args])
    return run_config(**ctx.params)


@pytest.fixture
def int4_source(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A GGUF source of 4-bit blocks, on a CPU whose int kernels run."""
    monkeypatch.setattr(quantize, "available_blocks", lambda path: {"q4"})
    monkeypatch.setattr(int_mm, "unusable", lambda: None)
    return Path("model.gguf")


def _mode(args: list[str], dtype: torch.dtype, source: Path,
          device: torch.device = CPU) -> str:
    config = _config(args)
    return quantize.resolve_mode(load_quantize(config), source, dtype, device)  # type: ignore[arg-type]


def test_the_help_names_every_option_that_loads_unquantised() -> None:
    text = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    for flag in EXACT_OPTIONS:
        assert flag in text, flag


@pytest.mark.parametrize("flag", EXACT_OPTIONS)
def test_each_exact_option_loads_a_gguf_unquantised(flag: str, int4_source: Path) -> None:
    args = {"--dtype float32": ["--dtype", "float32"], "--score": ["--score"],
            "--logprobs": ["--logprobs", "0"], "--deterministic": ["--deterministic"]}[flag]
    config = _config(args)
    assert exact_options(config) == [flag]  # type: ignore[arg-type]
    dtype = torch.float32 if flag == "--dtype float32" else torch.bfloat16
    assert _mode(args, dtype, int4_source) == "none"
    # --quantize still says otherwise where it is given (not with --deterministic: refused
    # later, by the loader's caller).
    if flag != "--deterministic":
        assert _mode([*args, "--quantize", "int4"], dtype, int4_source) == "int4"


def test_the_defaults_keep_the_int_kernels_in_either_dtype_auto_picks(
        int4_source: Path) -> None:
    # A CPU without bf16: --dtype auto is float32, and runs the int kernels.
    assert _mode([], torch.float32, int4_source) == "int4"
    # A CPU with bf16.
    assert _mode([], torch.bfloat16, int4_source) == "int4"
    assert _mode(["--dtype", "bfloat16"], torch.bfloat16, int4_source) == "int4"


def test_gpus_float32_elsewhere_and_float_models_run_unquantised(
        int4_source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _mode([], torch.float32, int4_source, torch.device("cuda")) == "none"
    # A GPU runs the stored weights at --quantize auto in any dtype; int4 when asked.
    assert _mode([], torch.bfloat16, int4_source, torch.device("cuda")) == "none"
    assert _mode(["--quantize", "int4"], torch.bfloat16, int4_source,
                 torch.device("cuda")) == "int4"
    monkeypatch.setattr(int_mm, "unusable", lambda: "no AVX2 or NEON")
    assert _mode([], torch.float32, int4_source) == "none"
    monkeypatch.setattr(quantize, "available_blocks", lambda path: set())
    assert _mode([], torch.bfloat16, int4_source) == "none"
