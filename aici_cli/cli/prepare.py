"""`aici-batch prepare`: build once, ahead of the runs, what they would build on first use
(thin: the work is in `aici_cli.run.prepare`, imported once the options are read)."""

from __future__ import annotations

import click

from aici_cli.cli.errors import FatalError
from aici_cli.cli.run_options import run_params

# The run options that decide what a run builds: the model and its mode, and the rows.
_OPTIONS = ("model", "device", "dtype", "quantize", "model_impl", "batch_size", "threads",
            "quiet")


@click.command("prepare", params=run_params(*_OPTIONS))
def prepare_command(model: str | None, device: str, dtype: str, quantize: str,
                    model_impl: str, batch_size: int, threads: int | None,
                    quiet: bool) -> None:
    """Make runs of a model start at full speed on this machine: convert it where it is a
    GGUF or a short name, pack its quantised weights, probe its kernels, and build its
    compiled one-token step for a full batch and the smaller row counts a run's last
    lines move down to (1, 2, 4, ...: ~45 s each on 2 cores, once).
    Runs with the same --model, --dtype, --quantize and --batch-size then start compiled
    at the default --compile auto; without this, a run starts eager and a background
    process builds the steps (during the run where that pays, else after it). Prepare
    waits for such a process at work, then builds the rest.

    \b
    Examples:
      aici-batch prepare                               # the default model
      aici-batch prepare --model gemma-3-270m --batch-size 16
    """
    from aici_cli.run.threads import apply

    apply(threads)  # before torch starts its thread pool
    from aici_cli.core.config import EngineConfig, RunConfig
    from aici_cli.core.errors import ModelError, UsageError
    from aici_cli.run.prepare import prepare

    config = RunConfig(input="-", output="-", model=model, device=device, dtype=dtype,
                       quantize=quantize, model_impl=model_impl, threads=threads,
                       engine=EngineConfig(batch_size=batch_size))
    say = (lambda _: None) if quiet else (lambda text: click.echo(f"aici-batch: {text}",
                                                                  err=True))
    try:
        done = prepare(config, say)
    except (ModelError, UsageError) as e:
        raise FatalError(str(e)) from None
    what = f"{done.model} ({done.dtype}, quantize {done.quantize}, {done.device})"
    if done.compiled:
        rows = ", ".join(str(n) for n in done.rows[:-1]) + " and " * (len(done.rows) > 1) + \
            f"{done.rows[-1]} row{'s' * (done.rows[-1] > 1)}" + \
            (", and 1 at --batch-size 1" if batch_size > 1 else "")
        click.echo(f"prepared {what} in {done.load_s + done.build_s:.0f} s: runs with these "
                   f"options start with the compiled one-token step ({rows})")
    else:
        click.echo(f"prepared {what} in {done.load_s + done.build_s:.0f} s; its one-token "
                   f"steps stay eager here: {done.problem or 'not compiled'}")
