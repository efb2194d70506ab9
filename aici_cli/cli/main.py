"""The `aici-batch` command line: the group, the `run` command and the small commands;
`report`, `models`, `publish` and `pull` live in `cli_*` modules of their own and are
registered here. Nothing here imports torch: `run` reaches the engine through `run/batch.py`
only once its options are checked."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from aici_cli import __version__
from aici_cli.cli.doctor import doctor_command
from aici_cli.cli.errors import FatalError
from aici_cli.cli.models import models_command
from aici_cli.cli.prepare import prepare_command
from aici_cli.cli.registry import publish, pull
from aici_cli.cli.report import report
from aici_cli.cli.run_config import run_config
from aici_cli.cli.run_options import options_from_environment, run_options
from aici_cli.core.errors import ClusterError, ModelError, UsageError

if TYPE_CHECKING:
    from aici_cli.core.config import RunConfig
    from aici_cli.run.ui import ModelLoading


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aici-batch")
def main() -> None:
    """Batch constrained generation with local language models."""


@main.command()
@run_options
def run(**options: Any) -> None:
    """Run every line of INPUT (a JSONL file, or '-' for stdin; without INPUT, stdin when
    it is not a terminal) and write one result line per input line.

    \b
    Examples:
      aici-batch run examples/prompts.jsonl -o results.jsonl \\
          --json-schema examples/person.schema.json
      cat prompts.jsonl | aici-batch run > results.jsonl
      aici-batch run prompts.jsonl -o results.jsonl --ordered --threads 1   # a shared CI box
      aici-batch run prompts.jsonl --model ./my-hf-model --batch-size 16 --stats-out s.json
      aici-batch run prompts.jsonl --controller yes_no.wasm --controller-arg '{"n": 3}'
      aici-batch run prompts.jsonl -o results.jsonl --resume   # after Ctrl-C or a crash
      aici-batch run openai-batch.jsonl -o openai-out.jsonl    # OpenAI batch format
      aici-batch run prompts.jsonl --n 4 --temperature 0.8      # 4 samples per line
      aici-batch run prompts.jsonl -o results.jsonl --ray auto --workers 4

    Ctrl-C or SIGTERM starts no new lines, finishes those in flight, writes their
    results and the summary; a second one stops at once. Either way `--resume` runs the
    rest.

    Exit status: 0 when every line succeeded, 1 when some lines ended in an error (all
    results are still written; 0 with --exit-zero-on-line-errors) or the engine process
    died and its lines ran again, 2 when the run could not start, 3 when every line ran
    but the --stats-out summary could not be written, 130 (Ctrl-C) or 143 (SIGTERM) when
    interrupted before every line ran.
    """
    t0 = time.perf_counter()  # start-up in the summary counts the imports below
    _start_and_run(run_config(**options), options["json_schema"], t0)


def _start_and_run(config: RunConfig, json_schema: str | None, t0: float) -> NoReturn:
    """Checks what can be checked before anything loads, loads, runs, and exits with the
    run's status; `json_schema` is --json-schema's file, named in a problem with it."""
    try:
        # Before anything loads: a bad default would be every line's error otherwise, and
        # a file that cannot be written would fail only after the whole run.
        from aici_cli.formats.jobs.defaults import defaults_problem
        from aici_cli.run.out_paths import check_writable, run_outputs

        if config.ray is None:
            from aici_cli.run.threads import apply as apply_threads

            # Before torch loads: its thread pool reads OMP_NUM_THREADS.
            apply_threads(config.threads)
        problem = defaults_problem(config.defaults, config.engine.strict_json, json_schema)
        if problem is not None:
            raise FatalError(problem)
        check_writable(run_outputs(config))
        loading = _start_up(config)
        from aici_cli.run.batch import run_batch  # heavy imports (torch) only here
    except KeyboardInterrupt:
        _exit_interrupted(signal.SIGINT)
    except UsageError as e:
        raise FatalError(str(e)) from None

    try:
        outcome = run_batch(config, handle_signals=True, t0=t0, loading=loading)
    except (UsageError, ModelError, ClusterError) as e:
        raise FatalError(str(e)) from None
    except BrokenPipeError:
        # The reader went away (e.g. `| head -1`): stop quietly, as shell tools do.
        _silence_stdout()
        sys.exit(0)
    except KeyboardInterrupt as e:  # before any line ran: nothing to finish or flush
        _exit_interrupted(getattr(e, "signum", signal.SIGINT))
    finally:
        loading.finish(ok=False)  # stopped where the run stopped before its model was ready
    if outcome.summary_error is not None:
        click.echo(f"Error: {outcome.summary_error}", err=True)
    sys.exit(outcome.exit_code)


def _start_up(config: RunConfig) -> ModelLoading:
    """A model spec that names nothing is refused before the heavy imports (one line, at
    once); then the start-up note starts, so that the seconds of imports and loading are
    said on stderr (`ui.ModelLoading`)."""
    from aici_cli.models.sources.resolve import spec_problem
    from aici_cli.run.ui import ModelLoading, loading_what

    if config.ray is None:
        problem = spec_problem(config.model)
        if problem is not None:
            raise FatalError(problem)
    return ModelLoading(sys.stderr, config.quiet, loading_what(config.model)).start()


def _exit_interrupted(signum: int) -> NoReturn:
    click.echo(f"aici-batch: {signal.Signals(signum).name}, stopped before any line ran",
               err=True)
    sys.exit(128 + signum)


def _silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


@main.command()
@click.option("--dir", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write the contract's files here (controller.wit, "
                   "deps/storage/storage.wit, deps/tools/tools.wit), the layout "
                   "componentize-py and jco read.")
def wit(out_dir: str | None) -> None:
    """Print the WIT contract that controller components implement: aici:controller@0.2.0
    (wit/controller.wit) and the interfaces it imports, aici:storage@0.1.0
    (wit/deps/storage/storage.wit) and aici:tools@0.1.0 (wit/deps/tools/tools.wit), each
    after a `// path` line.

    \b
    Examples:
      aici-batch wit
      aici-batch wit --dir my-controller/wit
    """
    from aici_cli.control.componentize import wit_text, write_wit

    if out_dir is None:
        click.echo(wit_text(), nl=False)
        return
    for path in write_wit(Path(out_dir)):
        click.echo(str(path))


@main.command()
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Output .wasm (default: SOURCE with a .wasm suffix).")
def build(source: str, output: str | None) -> None:
    """Build a controller into a .wasm component, by the file's extension.

    A Python module (.py) with one @controller builds with componentize-py; a JavaScript
    module (.js, .mjs) whose default export is the controller builds with componentize-js
    (install it with `make setup` or `npm ci --prefix controllers/js`).

    \b
    Example:
      aici-batch build controllers/examples/yes_no.py -o yes_no.wasm
      aici-batch build controllers/js/examples/yes_no.js -o yes_no_js.wasm
      aici-batch run prompts.jsonl --controller yes_no.wasm
    """
    from aici_cli.control.componentize import BuildError, build_controller

    out = Path(output) if output else Path(source).with_suffix(".wasm")
    try:
        result = build_controller(Path(source), out)
    except BuildError as e:
        raise FatalError(str(e)) from None
    click.echo(f"built {result.out} ({result.size / 1e6:.1f} MB, {result.seconds:.1f} s)",
               err=True)


@main.command("lm-eval", context_settings={"ignore_unknown_options": True,
                                           "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def lm_eval_command(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Run lm-evaluation-harness tasks on this engine: lm-eval's own options (listed
    below this help), with `--model aici-batch`, `--device auto` and this engine's batch
    size unless given (needs the `lm-eval` extra); see docs/lm-eval.md.

    \b
    Examples:
      aici-batch lm-eval --tasks hellaswag --model_args model=smollm2-135m-instruct
      aici-batch lm-eval --tasks mytask --include_path tasks/ --output_path out/
    """
    from aici_cli.evals import harness_problem

    problem = harness_problem()
    if args[:1] in (("-h",), ("--help",)):
        click.echo(ctx.get_help())
        if problem is not None:
            return
        click.echo("\nlm-eval's own options:\n")
        args = ("run", "--help")
    if problem is not None:
        raise FatalError(problem)
    from aici_cli.evals.harness import run_harness
    from aici_cli.evals.requests import EvalRequestError

    try:
        run_harness(args)
    except (EvalRequestError, ModelError, UsageError) as e:
        raise FatalError(str(e)) from None


options_from_environment(run)
main.add_command(report)
main.add_command(models_command)
options_from_environment(prepare_command)
main.add_command(prepare_command)
main.add_command(doctor_command)
main.add_command(publish)
main.add_command(pull)
