"""The `aici-batch` command line: parse options into a `RunConfig`, call the library."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from aici_cli import __version__
from aici_cli.cli_errors import FatalError
from aici_cli.cli_registry import publish, pull
from aici_cli.vocabulary.config import EngineConfig, JobDefaults, RayOptions
from aici_cli.vocabulary.constraint import Constraint
from aici_cli.vocabulary.errors import ClusterError, ModelError, UsageError


def _constraint(json_schema: str | None, regex: str | None, choices: str | None,
                grammar: str | None = None, quiet: bool = False) -> Constraint | None:
    given = [x for x in (json_schema, regex, choices, grammar) if x is not None]
    if len(given) > 1:
        raise FatalError("give at most one of --json-schema, --regex, --choices, --grammar")
    from aici_cli.option_values import choices_option, grammar_option, schema_option

    try:
        if json_schema is not None:
            schema, note = schema_option(json_schema)
            if note is not None and not quiet:
                click.echo(f"aici-batch: {note}", err=True)
            return Constraint("json_schema", schema)
        if regex is not None:
            return Constraint("regex", regex)
        if choices is not None:
            return Constraint("choice", choices_option(choices))
        if grammar is not None:
            return Constraint("lark", grammar_option(grammar))
    except UsageError as e:
        raise FatalError(str(e)) from None
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aici-batch")
def main() -> None:
    """Batch constrained generation with local language models."""


@main.command()
@click.argument("input", metavar="[INPUT]", required=False)
@click.option("-o", "--output", default="-", show_default=True,
              help="Result JSONL file; '-' is stdout.")
@click.option("--model", default=None,
              help="Hugging Face model directory, .gguf file, hub id in the local hub cache "
                   "(org/name[@revision]), or a short name: 'smollm2-135m-instruct' (the "
                   "default) or 'gemma-3-270m'. `aici-batch models` lists what is here.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True)
@click.option("--quantize", type=click.Choice(["auto", "none", "int8", "int4"]),
              default="auto", show_default=True,
              help="Weight-only quantisation of the linear layers (docs/speed.md). auto: a "
                   "GGUF model runs at its own precision (the default model: int4) in a "
                   "16-bit run; float32, --deterministic and float models run unquantised.")
@click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]),
              default="auto", show_default=True,
              help="torch.compile the one-token decode step (a C compiler needed on CPU; "
                   "compiled once per model and row bucket, cached on disk). auto: on "
                   "where the run is long enough to pay for it; never with --deterministic.")
@click.option("--batch-size", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Sequences decoded together; finished rows are refilled at once.")
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0,
              show_default=True)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Default per-line sampling seed.")
@click.option("--top-k", type=click.IntRange(-1), default=0, show_default=True,
              help="With a temperature, sample among the K most likely tokens; 0 or -1: off.")
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="With a temperature, drop tokens less likely than P times the most "
                   "likely one; 0: off.")
@click.option("--frequency-penalty", type=click.FloatRange(-2.0, 2.0), default=0.0,
              show_default=True,
              help="Subtracted from a token's logit per time it occurs in the output.")
@click.option("--presence-penalty", type=click.FloatRange(-2.0, 2.0), default=0.0,
              show_default=True,
              help="Subtracted from the logit of every token the output holds.")
@click.option("--repetition-penalty", type=click.FloatRange(0.0, min_open=True), default=1.0,
              show_default=True,
              help="Divides positive logits and multiplies negative ones of the tokens in the "
                   "prompt or output; 1: off.")
@click.option("--min-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Tokens generated before end-of-sequence, a stop token id or a stop "
                   "string may end a line.")
@click.option("--ignore-eos", is_flag=True,
              help="Generate past end-of-sequence up to max_tokens (a constraint's end still "
                   "ends a line).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--n", "n", type=click.IntRange(1, 128), default=1, show_default=True,
              help="Samples per line (lines may set their own `n`); they share the "
                   "prompt's prefill and land in the result's `choices`.")
@click.option("--format", "input_format", type=click.Choice(["auto", "aici", "openai"]),
              default="auto", show_default=True,
              help="Input line format: aici-batch's own, or OpenAI batch requests "
                   "({custom_id, method, url, body}, as `vllm run-batch` reads), answered "
                   "in the OpenAI batch output format. auto: decided by the first line "
                   "shaped like either; a line in the other format is that line's error.")
@click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False), default=None,
              help="JSON Schema file enforced on every line without its own constraint.")
@click.option("--regex", default=None, help="Regular expression enforced on every line.")
@click.option("--choices", default=None,
              help="Choices, comma-separated ('yes, no': spaces around commas are trimmed) "
                   "or a JSON array ('[\"a, b\", \" c\"]', kept exactly); each must differ.")
@click.option("--grammar", "grammar", type=click.Path(dir_okay=False), default=None,
              help="Grammar file (Lark, or GBNF as llama.cpp writes it) enforced on every "
                   "line without its own constraint.")
@click.option("--score", is_flag=True,
              help="Rank each line's choices by the log-probability the model gives them "
                   "after the prompt instead of generating (multiple-choice evals): `text` "
                   "is the best choice, `scores` has them all.")
@click.option("--schema-fallback", type=click.Choice(["off", "relax"]), default="off",
              show_default=True,
              help="When the grammar engine cannot enforce a line's JSON schema: off, the line "
                   "is an `unsupported_schema` error; relax, generate with the closest schema "
                   "it can enforce (`relaxed` lists what was dropped), validate the output "
                   "against the original (`valid`) and retry when it does not validate. "
                   "Lines may set `schema_fallback` themselves.")
@click.option("--schema-retries", type=click.IntRange(0, 100), default=2, show_default=True,
              help="With relax: times a line is generated again, with the next seed (sampled "
                   "at 0.7 if the line is greedy), while its output does not validate.")
@click.option("--json-permissive", is_flag=True,
              help="Let objects carry keys their schema does not declare (JSON Schema's own "
                   "default). By default undeclared keys are disallowed where a schema is "
                   "silent about them.")
@click.option("--controller", type=click.Path(dir_okay=False), default=None,
              help="A controller component run for every line: a .wasm file (see `aici-batch "
                   "build`) or an OCI artifact, oci://REGISTRY/NAME:TAG or "
                   "oci://REGISTRY/NAME@sha256:... (see `aici-batch publish`), pulled once "
                   "into the component cache; a tag resolves to one digest for the run.")
@click.option("--plain-http", is_flag=True,
              help="Pull an oci:// --controller over plain HTTP (a registry without TLS).")
@click.option("--controller-arg", default="",
              help="Argument passed to the controller for lines without `controller_arg`.")
@click.option("--controller-timeout-ms", type=click.IntRange(1), default=50, show_default=True,
              help="Wall-clock deadline of each controller call.")
@click.option("--max-branches", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Sequences a line may run in all when its controller forks (its samples "
                   "and every fork's branches); a fork past it ends the line (bad_action).")
@click.option("--no-ff", is_flag=True, help="Sample forced tokens one by one (no fast-forward).")
@click.option("--draft-tokens", type=click.IntRange(0, 64), default=4, show_default=True,
              help="Prompt-lookup draft length for greedy lines: tokens guessed from the "
                   "line's own history and kept where the model agrees (outputs unchanged, "
                   "fewer passes). 0 turns drafts off.")
@click.option("--no-prefix-cache", is_flag=True,
              help="Prefill every prompt in full, even where a row already holds the keys of "
                   "its start (a shared few-shot prefix or system prompt). For comparison: "
                   "outputs are the same either way.")
@click.option("--lookahead", type=click.IntRange(1, 100_000), default=64, show_default=True,
              help="Lines read ahead of admission, so that lines whose prefix is cached run "
                   "first (results are written as lines finish; `index` keeps each line's "
                   "number). 1 admits in input order.")
@click.option("--ordered", is_flag=True,
              help="Write results in input order (admits in input order, holds at most "
                   "1,024 finished results for an earlier line; see docs/running.md).")
@click.option("--threads", type=click.IntRange(1, 4096), default=None,
              help="CPU threads for the model's work. Default: the CPUs this process may "
                   "use (affinity and cgroup quota), or OMP_NUM_THREADS. Lower it when "
                   "other jobs share the CPU.")
@click.option("--logprobs", "logprobs", type=click.IntRange(0, 20), default=None,
              help="Give every generated token its log-probability and its K most likely "
                   "alternatives (lines may set `logprobs`/`top_logprobs` themselves).")
@click.option("--logprobs-mode", type=click.Choice(["raw", "masked"]), default="raw",
              show_default=True,
              help="raw: the model's own distribution (as OpenAI and vLLM report); masked: "
                   "the distribution the line's penalties, logit_bias and constraint leave, "
                   "renormalized over the allowed tokens (a fast-forwarded token then has "
                   "logprob 0).")
@click.option("--close-at-limit/--no-close-at-limit", default=True, show_default=True,
              help="Finish a JSON-schema, grammar or tool-call line before max_tokens cuts "
                   "it off, with a completion its constraint allows (`stats.closed_early`, "
                   "`close_reason: limit`).")
@click.option("--loop-guard/--no-loop-guard", default=True, show_default=True,
              help="Finish such a line's value at once when its text loops (a unit of any "
                   "length repeated; `close_reason: loop`).")
@click.option("--deterministic", is_flag=True,
              help="Batch-invariant passes: a line's tokens are the same whatever its batch "
                   "size, neighbours, row, drafts, prefix-cache hits or --resume (costs "
                   "throughput; see README).")
@click.option("--step-stats", is_flag=True, help="Add per-step records to each result line.")
@click.option("--stats-out", type=click.Path(dir_okay=False), default=None,
              help="Write the run summary (JSON) here.")
@click.option("--trace", "trace", type=click.Path(dir_okay=False), default=None,
              help="Write OpenTelemetry spans (OTLP JSON lines) here: the run, each line, "
                   "each engine step, each controller call. With OTEL_EXPORTER_OTLP_ENDPOINT "
                   "set, spans go to that collector (see docs/tracing.md).")
@click.option("--resume", is_flag=True,
              help="Skip the lines whose result is already in the -o file and append the "
                   "rest (after an interrupted or killed run). A torn last line is cut off; "
                   "results from a different input, or made with another --model or other "
                   "line options (--max-tokens, a constraint, --controller, ...), are "
                   "refused.")
@click.option("--resume-mixed", is_flag=True,
              help="With --resume: keep results made with another model or other options "
                   "and add this run's beside them (each result's `made_with` says which).")
@click.option("--exit-zero-on-line-errors", is_flag=True,
              help="Exit 0 even when some lines ended in an error (each has its error result "
                   "in the output), as `vllm run-batch` does: for pipelines that read errors "
                   "from the output file. A run that cannot start still exits 2.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run on a Ray cluster: 'auto' (RAY_ADDRESS, a running cluster, or a "
                   "new local instance), 'ray://HOST:PORT' (Ray Client) or 'HOST:PORT'. "
                   "Each worker is an actor with its own model; output, --resume and "
                   "per-line errors are those of a local run. Needs "
                   "`pip install 'aici-batch[ray]'`.")
@click.option("--workers", type=click.IntRange(1, 4096), default=None,
              help="Ray workers (actors), each loading the model once.  [default: 1]")
@click.option("--gpus-per-worker", type=click.FloatRange(0.0), default=0.0,
              show_default=True,
              help="GPUs Ray gives each worker (1: one GPU each; 0.5: two per GPU).")
@click.option("--cpus-per-worker", type=click.FloatRange(0.0, min_open=True), default=1.0,
              show_default=True,
              help="CPUs Ray reserves for each worker; also its torch threads.")
@click.option("--progress-interval", type=click.FloatRange(0.0), default=10.0,
              show_default=True, metavar="SECONDS",
              help="Off a terminal (a CI log, a pipe): one progress line every SECONDS "
                   "(lines done/total, tok/s, errors); 0: none.")
@click.option("-q", "--quiet", is_flag=True,
              help="Nothing on stderr but errors (and the one line that counts failed lines).")
def run(input: str, output: str, model: str | None, device: str, dtype: str, quantize: str,
        compile_mode: str, batch_size: int,
        max_tokens: int, temperature: float, top_p: float, seed: int, top_k: int, min_p: float,
        frequency_penalty: float, presence_penalty: float, repetition_penalty: float,
        min_tokens: int, ignore_eos: bool, stop: tuple[str, ...], n: int, input_format: str,
        json_schema: str | None, regex: str | None, choices: str | None, grammar: str | None,
        score: bool, schema_fallback: str, schema_retries: int,
        json_permissive: bool, controller: str | None, plain_http: bool, controller_arg: str,
        controller_timeout_ms: int, max_branches: int, no_ff: bool, draft_tokens: int,
        no_prefix_cache: bool,
        lookahead: int, ordered: bool, threads: int | None, logprobs: int | None,
        logprobs_mode: str, close_at_limit: bool,
        loop_guard: bool, deterministic: bool, step_stats: bool,
        stats_out: str | None, trace: str | None,
        resume: bool, resume_mixed: bool, exit_zero_on_line_errors: bool,
        ray_address: str | None,
        workers: int | None, gpus_per_worker: float, cpus_per_worker: float,
        progress_interval: float, quiet: bool) -> None:
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
    results are still written; 0 with --exit-zero-on-line-errors), 2 when the run could
    not start, 3 when every line ran but the --stats-out summary could not be written,
    130 (Ctrl-C) or 143 (SIGTERM) when interrupted before every line ran.
    """
    # (Long because this docstring is the --help text; the body only builds the config.)
    t0 = time.perf_counter()  # start-up in the summary counts the imports below
    input = _input_or_stdin(input)
    ray = _ray_options(ray_address, workers, gpus_per_worker, cpus_per_worker, device)
    if ray is not None and (ordered or threads is not None):
        raise FatalError(f"{'--ordered' if ordered else '--threads'} is for a local run; with "
                         "--ray each worker's threads are --cpus-per-worker")
    from aici_cli.vocabulary.config import RunConfig

    config = RunConfig(
        input=input, output=output, model=model, device=device, dtype=dtype,
        quantize=quantize,
        engine=EngineConfig(batch_size=batch_size, compile=compile_mode, fast_forward=not no_ff,
                            draft_tokens=draft_tokens, step_stats=step_stats,
                            prefix_cache=not no_prefix_cache, lookahead=lookahead,
                            logprobs_mode=logprobs_mode, close_at_limit=close_at_limit,
                            loop_guard=loop_guard, deterministic=deterministic,
                            schema_retries=schema_retries, max_branches=max_branches,
                            strict_json=not json_permissive),
        defaults=JobDefaults(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=seed, stop=tuple(stop),
                             constraint=_constraint(json_schema, regex, choices, grammar,
                                                    quiet), n=n,
                             score=score, logprobs=logprobs, top_k=top_k, min_p=min_p,
                             frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty,
                             repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                             ignore_eos=ignore_eos, schema_fallback=schema_fallback),
        input_format=input_format, stats_out=stats_out, quiet=quiet, controller=controller,
        controller_arg=controller_arg, controller_call_ms=controller_timeout_ms,
        resume=resume, resume_mixed=resume_mixed,
        exit_zero_on_line_errors=exit_zero_on_line_errors, ray=ray, threads=threads,
        ordered=ordered, progress_interval_s=progress_interval,
        plain_http=plain_http, trace=trace,
    )
    if resume_mixed and not resume:
        raise FatalError("--resume-mixed goes with --resume")
    if deterministic and quantize in ("int8", "int4"):
        raise FatalError(f"--deterministic runs unquantised weights: drop --quantize {quantize}")
    if deterministic and compile_mode == "on":
        raise FatalError("--deterministic runs eager passes: drop --compile on")
    if controller is not None and config.defaults.constraint is not None:
        raise FatalError("--controller cannot be combined with "
                         "--json-schema/--regex/--choices/--grammar")
    try:
        # Before anything loads: a bad default would be every line's error otherwise, and
        # a file that cannot be written would fail only after the whole run.
        from aici_cli.jobs.defaults import defaults_problem
        from aici_cli.out_paths import check_writable, run_outputs

        if ray is None:
            from aici_cli.threads import apply as apply_threads

            apply_threads(threads)  # before torch loads: its thread pool reads OMP_NUM_THREADS
        problem = defaults_problem(config.defaults, config.engine.strict_json, json_schema)
        if problem is not None:
            raise FatalError(problem)
        check_writable(run_outputs(config))
        loading = _start_up(config)
        from aici_cli.runner import run_batch  # heavy imports (torch) only here
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


def _start_up(config: Any) -> Any:
    """A model spec that names nothing is refused before the heavy imports (one line, at
    once); then the start-up note starts, so that the seconds of imports and loading are
    said on stderr (`ui.ModelLoading`)."""
    from aici_cli.models.resolve import spec_problem
    from aici_cli.ui import ModelLoading, loading_what

    if config.ray is None:
        problem = spec_problem(config.model)
        if problem is not None:
            raise FatalError(problem)
    return ModelLoading(sys.stderr, config.quiet, loading_what(config.model)).start()


def _input_or_stdin(input: str | None) -> str:
    """INPUT, or "-" when it is left out and stdin is not a terminal (`cat x | aici-batch
    run`); a terminal's stdin would wait for typing, so it needs INPUT or '-'."""
    if input is not None:
        return input
    if sys.stdin is None or not sys.stdin.isatty():
        return "-"
    raise click.UsageError("missing INPUT: give a JSONL file, or pipe the lines in "
                           "(stdin is a terminal here; '-' reads it anyway)")


def _ray_options(address: str | None, workers: int | None, gpus: float, cpus: float,
                 device: str) -> RayOptions | None:
    """`--ray` and its worker options; a one-line usage error where Ray is missing."""
    if address is None:
        if workers is not None:
            raise FatalError("--workers needs --ray (auto, ray://HOST:PORT or HOST:PORT)")
        return None
    from aici_cli.distributed import require_ray

    try:
        require_ray()
    except UsageError as e:
        raise FatalError(str(e)) from None
    if device == "cuda" and gpus == 0:
        raise FatalError("--device cuda on Ray needs --gpus-per-worker (e.g. 1): Ray shows "
                         "a worker only the GPUs it reserves for it")
    return RayOptions(address=address, workers=workers or 1, gpus_per_worker=gpus,
                      cpus_per_worker=cpus)


def _exit_interrupted(signum: int) -> NoReturn:
    click.echo(f"aici-batch: {signal.Signals(signum).name}, stopped before any line ran",
               err=True)
    sys.exit(128 + signum)


@main.command()
@click.option("--dir", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write the contract's files here (controller.wit, "
                   "deps/storage/storage.wit), the layout componentize-py and jco read.")
def wit(out_dir: str | None) -> None:
    """Print the WIT contract that controller components implement: aici:controller@0.2.0
    (wit/controller.wit) and the storage interface it imports, aici:storage@0.1.0
    (wit/deps/storage/storage.wit), each after a `// path` line.

    \b
    Examples:
      aici-batch wit
      aici-batch wit --dir my-controller/wit
    """
    from aici_cli.control.build import wit_text, write_wit

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
    from aici_cli.control.build import BuildError, build_controller

    out = Path(output) if output else Path(source).with_suffix(".wasm")
    try:
        result = build_controller(Path(source), out)
    except BuildError as e:
        raise FatalError(str(e)) from None
    click.echo(f"built {result.out} ({result.size / 1e6:.1f} MB, {result.seconds:.1f} s)",
               err=True)


@main.command()
@click.argument("results", metavar="RESULTS")
@click.option("--stats", "stats_file", type=click.Path(dir_okay=False), default=None,
              help="The run's --stats-out file, for run-level figures (wall time, tokens/s).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="Draw the per-step time split and step-time distribution (needs "
                   "matplotlib).")
@click.option("--timeline", "timeline_file", type=click.Path(dir_okay=False), default=None,
              help="Draw the run's lines as bars over wall time, coloured by finish reason, "
                   "with its engine steps underneath (from --trace's file when given; from "
                   "the results alone otherwise, without steps). Needs matplotlib.")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="The run's `run --trace` file, for --timeline.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead.")
@click.option("--fail-under", "fail_under", multiple=True, metavar="METRIC=VALUE",
              help="Exit 3 when METRIC is below VALUE (error_rate: above it): accuracy, "
                   "compliance, compliance_ran, error_rate, tokens_per_s (needs --stats). "
                   "Repeatable; VALUE may be a percentage (70%).")
@click.option("--baseline", type=click.Path(dir_okay=False), default=None,
              help="The last run's results: lines matched by id and input digest, changed "
                   "answers each way, the accuracy delta with a paired bootstrap 95% "
                   "interval and McNemar's p-value.")
@click.option("--fail-on-regression", is_flag=True,
              help="With --baseline: exit 3 when accuracy fell and McNemar's p is below "
                   "--alpha.")
@click.option("--alpha", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
              default=0.05, show_default=True,
              help="The significance level of --fail-on-regression.")
@click.option("--junit", "junit_file", type=click.Path(dir_okay=False), default=None,
              help="Write JUnit XML: one test case per line, failed when wrong, invalid or "
                   "an error.")
@click.option("--markdown", "markdown_file", type=click.Path(dir_okay=False), default=None,
              help="Write the report as Markdown; without it, appended to "
                   "$GITHUB_STEP_SUMMARY when that is set.")
def report(results: str, stats_file: str | None, plot_file: str | None,
           timeline_file: str | None, trace_file: str | None, as_json: bool,
           fail_under: tuple[str, ...], baseline: str | None, fail_on_regression: bool,
           alpha: float, junit_file: str | None, markdown_file: str | None) -> None:
    """Summarize a finished run from its RESULTS file ('-' for stdin): lines, errors,
    compliance where schemas applied, tokens/s, forward passes per token, step timings;
    in CI, gate on it, compare it with the last run, write JUnit and Markdown.

    \b
    Examples:
      aici-batch report results.jsonl
      aici-batch report results.jsonl --stats stats.json --plot steps.png
      aici-batch report results.jsonl --trace trace.jsonl --timeline timeline.png
      aici-batch report results.jsonl --fail-under accuracy=0.7 --junit junit.xml
      aici-batch report results.jsonl --baseline prev.jsonl --fail-on-regression

    \b
    Exit status: 0 when every gate passed, 2 when the report could not be made (bad
    option, unreadable file, a line that is not a result), 3 when a gate failed (one line
    per failed gate on stderr; the JUnit and Markdown files are still written).
    """
    from rich.console import Console

    from aici_cli.out_paths import check_writable
    from aici_cli.report import report_table
    from aici_cli.report_checks import CiOptions, ci_report
    from aici_cli.report_gate import parse_gate
    from aici_cli.report_markdown import comparison_lines
    from aici_cli.vocabulary.errors import ReportError

    if trace_file is not None and timeline_file is None:
        raise FatalError("--trace goes with --timeline")
    try:
        check_writable([("--plot", plot_file), ("--timeline", timeline_file),
                        ("--junit", junit_file), ("--markdown", markdown_file)])
        options = CiOptions(gates=tuple(parse_gate(g) for g in fail_under), baseline=baseline,
                            fail_on_regression=fail_on_regression, alpha=alpha,
                            junit=junit_file, markdown=markdown_file)
        out = ci_report(results, stats_file, Path(plot_file) if plot_file else None, options)
        if timeline_file is not None:
            from aici_cli.report_timeline import draw_timeline

            draw_timeline(results, Path(timeline_file), trace_file)
    except (ReportError, UsageError) as e:
        raise FatalError(str(e)) from None
    except OSError as e:
        verb = "write" if plot_file is not None and e.filename == plot_file else "read"
        raise FatalError(f"cannot {verb} {e.filename}: {e.strerror}") from None
    if as_json:
        click.echo(json.dumps(out.summary, indent=2))
    else:
        console = Console()
        console.print(report_table(out.summary))
        for line in comparison_lines(out.comparison) if out.comparison else []:
            console.print(f"baseline: {line}", markup=False, highlight=False)
        for gate in out.gates:
            console.print(f"gate: {gate.reason}", markup=False, highlight=False)
    for reason in out.failures:
        click.echo(f"aici-batch report: gate failed: {reason}", err=True)
    sys.exit(out.exit_code)


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
    from aici_cli.evals.requests import RequestError

    try:
        run_harness(args)
    except (RequestError, ModelError, UsageError) as e:
        raise FatalError(str(e)) from None


@main.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON instead.")
@click.option("--prune", is_flag=True,
              help="Remove the converted models nothing uses any more (older copies made "
                   "per path, conversions for another transformers version, of files that "
                   "are gone or changed, or left by a conversion that died), saying why.")
@click.option("--dry-run", is_flag=True,
              help="With --prune: list what would be removed, and remove nothing.")
def models_command(as_json: bool, prune: bool, dry_run: bool) -> None:
    """List the models --model can name on this machine: the short names of models that
    pip packages ship (installed or not, and the default), the GGUF conversions in
    aici-batch's cache (with their sizes), and the models in the Hugging Face hub cache.
    Nothing is downloaded or converted.

    \b
    Examples:
      aici-batch models
      aici-batch models --json
      aici-batch models --prune --dry-run     # what --prune would remove
      aici-batch run prompts.jsonl --model gemma-3-270m
      aici-batch run prompts.jsonl --model HuggingFaceTB/SmolLM2-360M-Instruct
    """
    if dry_run and not prune:
        raise FatalError("--dry-run goes with --prune")
    if prune:
        _prune(as_json, dry_run)
        return
    from aici_cli.models.listing import available_models

    listing = available_models()
    if as_json:
        click.echo(json.dumps(listing, indent=2))
        return
    for line in _models_text(listing):
        click.echo(line)


def _prune(as_json: bool, dry_run: bool) -> None:
    """`aici-batch models --prune [--dry-run]`."""
    from aici_cli.models.cache_entries import prune

    removed = prune(dry_run=dry_run)
    freed = sum(e.size_bytes for e in removed)
    if as_json:
        click.echo(json.dumps({
            "dry_run": dry_run, "bytes": freed,
            "entries": [{"name": e.path.name, "path": str(e.path), "size_bytes": e.size_bytes,
                         "unused": e.unused} for e in removed],
        }, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    width = max((len(e.path.name) for e in removed), default=0)
    for e in removed:
        click.echo(f"{verb} {e.path.name:<{width}}  {_size(e.size_bytes):>8}  ({e.unused})")
    total = f"{len(removed)} {'entry' if len(removed) == 1 else 'entries'}, {_size(freed)}"
    click.echo(f"{'would free' if dry_run else 'freed'} {total}" if removed
               else "nothing to prune: every converted model is in use")


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _models_text(listing: dict[str, Any]) -> list[str]:
    """The `aici-batch models` listing as aligned text, one section per source."""
    names = listing["short_names"]
    rows = [
        (("* " if m["default"] else "  ") + m["name"],
         "ready" if m["converted"] else "installed" if m["installed"] else "missing",
         m["package"], m["description"])
        for m in names
    ]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    lines = ["Short names (--model NAME; * the default):"]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + "  " + r[3] for r in rows]
    lines.append("  (ready: converted; installed: converts on first use; "
                 "missing: pip install the package)")

    converted = listing["converted"]
    lines += ["", f"Converted GGUF models in {converted['cache_dir']} "
                  f"({_size(converted['total_bytes'])}):"]
    width = max((len(m["name"]) for m in converted["models"]), default=0)
    for m in converted["models"]:
        serves = f"  ({m['short_name']})" if m["short_name"] else ""
        if m["unused"]:
            serves += f"  unused: {m['unused']}"
        elif m["origin"] and m["origin"] != "file":
            serves += f"  from {m['origin']}"
        lines.append(f"  {m['name']:<{width}}  {_size(m['size_bytes']):>8}{serves}")
    if not converted["models"]:
        lines.append("  none")
    elif any(m["unused"] for m in converted["models"]):
        lines.append("  (`aici-batch models --prune` removes the unused ones; "
                     "--dry-run lists them first)")

    hub = listing["hub"]
    lines += ["", f"Hugging Face hub cache {hub['cache_dir']} (--model ORG/NAME[@REVISION]):"]
    width = max((len(m["name"]) for m in hub["models"]), default=0)
    for m in hub["models"]:
        usable = "" if m["loadable"] else "  (no config.json or .gguf in its main snapshot)"
        lines.append(f"  {m['name']:<{width}}  {_size(m['size_bytes']):>8}{usable}")
    if not hub["models"]:
        lines.append("  none (`hf download ORG/NAME` fetches one where there is network)")
    return lines


def _options_from_environment(command: click.Command, prefix: str = "AICI_BATCH_") -> None:
    """Let every option of `command` also come from AICI_BATCH_<LONG_NAME> (e.g.
    AICI_BATCH_MODEL, AICI_BATCH_BATCH_SIZE), for CI jobs that set options once; a flag
    given on the command line wins. Shown in --help beside each option."""
    for param in command.params:
        if not isinstance(param, click.Option) or param.envvar is not None:
            continue
        long_names = [o for o in param.opts if o.startswith("--")]
        if not long_names:
            continue
        param.envvar = prefix + long_names[0][2:].replace("-", "_").upper()
        param.show_envvar = True


_options_from_environment(run)
main.add_command(publish)
main.add_command(pull)


def _silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def entry() -> Any:
    return main()
