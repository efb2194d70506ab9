"""The `run` command's parameters: INPUT and its ~60 options, declared once, in the order
`aici-batch run --help` lists them, and applied to the command as one decorator
(`run_options`); `options_from_environment` lets each option also come from
AICI_BATCH_<LONG_NAME>. The sampling options (`--temperature` to `--min-tokens`) are made
from their one declaration, core/sampling.py.

Declaring them here keeps `cli/main.py` about what a run does; what each option means for the
run is `run_config.run_config`, which takes them by these names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from aici_cli.core.config import EXACT_OPTIONS
from aici_cli.core.sampling import RUN_OPTIONS, Option

F = TypeVar("F", bound=Callable[..., Any])


def _sampling_option(option: Option) -> Callable[[Any], Any]:
    """The `run` option of a sampling option, made from its declaration (core/sampling.py):
    its range is the option's type, its default is shown; a `cap` is checked with the
    run's defaults as a line's value would be (jobs/defaults.py)."""
    assert option.range is not None, f"{option.name}: a run option needs a range"
    low, high = (None if end is None else option.kind(end)
                 for end in (option.range.low, option.range.high))
    number = click.IntRange if option.kind is int else click.FloatRange
    return click.option(option.flag, type=number(low, high, min_open=option.range.low_open),
                        default=option.default, show_default=True, help=option.help)


# In --help order: a decorator stack applies bottom-up, so `run_options` applies these last
# first, as `@click.option` lines written above the function in this order would be.
RUN_PARAMS: tuple[Callable[[Any], Any], ...] = (
    click.argument("input", metavar="[INPUT]", required=False),
    click.option("-o", "--output", default="-", show_default=True,
                 help="Result JSONL file; '-' is stdout."),
    click.option("--model", default=None,
                 help="Hugging Face model directory, .gguf file, hub id in the local hub cache "
                      "(org/name[@revision]), or a short name: 'smollm2-135m-instruct' (the "
                      "default) or 'gemma-3-270m'. `aici-batch models` lists what is here."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                 show_default=True),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                 default="auto", show_default=True),
    click.option("--quantize", type=click.Choice(["auto", "none", "int8", "int4"]),
                 default="auto", show_default=True,
                 help="Weight-only quantisation of the linear layers (docs/speed.md). auto: a "
                      "GGUF model runs at its own precision (the default model: int4), in a "
                      "16-bit run and in the float32 run --dtype auto picks on a CPU without "
                      "bf16 (the int kernels); " + ", ".join(EXACT_OPTIONS) + ", GPUs "
                      "and float models run unquantised (the model's own numbers)."),
    click.option("--model-impl", type=click.Choice(["auto", "transformers"]), default="auto",
                 show_default=True,
                 help="auto: a Llama, Mistral, Qwen 2/3 or Gemma 3 model runs as "
                      "aici-batch's own module "
                      "(transformers' logits bit for bit, ~1.5 s faster to start), any other "
                      "through transformers; transformers: always through transformers."),
    click.option("--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]),
                 default="auto", show_default=True,
                 help="torch.compile the one-token decode step (a C compiler needed on CPU; "
                      "compiled once per model and row bucket, cached on disk). auto: "
                      "compiled where the step is built (aici-batch prepare, or an earlier "
                      "run), else eager while a background process builds it; never with "
                      "--deterministic."),
    click.option("--batch-size", type=click.IntRange(1, 1024), default=8, show_default=True,
                 help="Sequences decoded together; finished rows are refilled at once."),
    click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True),
    *(_sampling_option(option) for option in RUN_OPTIONS),
    click.option("--ignore-eos", is_flag=True,
                 help="Generate past end-of-sequence up to max_tokens (a constraint's end still "
                      "ends a line)."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--n", "n", type=click.IntRange(1, 128), default=1, show_default=True,
                 help="Samples per line (lines may set their own `n`); they share the "
                      "prompt's prefill and land in the result's `choices`."),
    click.option("--format", "input_format", type=click.Choice(["auto", "aici", "openai"]),
                 default="auto", show_default=True,
                 help="Input line format: aici-batch's own, or OpenAI batch requests "
                      "({custom_id, method, url, body}, as `vllm run-batch` reads), answered "
                      "in the OpenAI batch output format. auto: decided by the first line "
                      "shaped like either; a line in the other format is that line's error."),
    click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False), default=None,
                 help="JSON Schema file enforced on every line without its own constraint."),
    click.option("--regex", default=None, help="Regular expression enforced on every line."),
    click.option("--choices", default=None,
                 help="Choices, comma-separated ('yes, no': spaces around commas are trimmed) "
                      "or a JSON array ('[\"a, b\", \" c\"]', kept exactly); each must differ."),
    click.option("--grammar", "grammar", type=click.Path(dir_okay=False), default=None,
                 help="Grammar file (Lark, or GBNF as llama.cpp writes it) enforced on every "
                      "line without its own constraint."),
    click.option("--score", is_flag=True,
                 help="Rank each line's choices by the log-probability the model gives them "
                      "after the prompt instead of generating (multiple-choice evals): `text` "
                      "is the best choice, `scores` has them all."),
    click.option("--schema-fallback", type=click.Choice(["off", "relax"]), default="off",
                 show_default=True,
                 help="When the grammar engine cannot enforce a line's JSON schema: off, the line "
                      "is an `unsupported_schema` error; relax, generate with the closest schema "
                      "it can enforce (`relaxed` lists what was dropped), validate the output "
                      "against the original (`valid`) and retry when it does not validate. "
                      "Lines may set `schema_fallback` themselves."),
    click.option("--schema-retries", type=click.IntRange(0, 100), default=2, show_default=True,
                 help="With relax: times a line is generated again, with the next seed (sampled "
                      "at 0.7 if the line is greedy), while its output does not validate."),
    click.option("--json-permissive", is_flag=True,
                 help="Let objects carry keys their schema does not declare (JSON Schema's own "
                      "default). By default undeclared keys are disallowed where a schema is "
                      "silent about them."),
    click.option("--controller", type=click.Path(dir_okay=False), default=None,
                 help="A controller component run for every line: a .wasm file (see `aici-batch "
                      "build`) or an OCI artifact, oci://REGISTRY/NAME:TAG or "
                      "oci://REGISTRY/NAME@sha256:... (see `aici-batch publish`), pulled once "
                      "into the component cache; a tag resolves to one digest for the run."),
    click.option("--plain-http", is_flag=True,
                 help="Pull an oci:// --controller over plain HTTP (a registry without TLS)."),
    click.option("--controller-arg", default="",
                 help="Argument passed to the controller for lines without `controller_arg`."),
    click.option("--controller-timeout-ms", type=click.IntRange(1), default=50, show_default=True,
                 help="Deadline of each controller call, in the CPU time its guest "
                      "spends (host functions excluded)."),
    click.option("--max-branches", type=click.IntRange(1, 4096), default=16, show_default=True,
                 help="Sequences a line may run in all when its controller forks (its samples "
                      "and every fork's branches); a fork past it ends the line (bad_action)."),
    # Not from an environment variable: click splits one for a repeatable option at every
    # space, which would cut a command line into pieces.
    click.option("--mcp", "mcp", multiple=True, metavar="NAME=COMMAND", allow_from_autoenv=False,
                 help="An MCP server whose tools lines may call (repeatable): COMMAND is "
                      "started and spoken to over stdio; an http:// or https:// URL is a "
                      "streamable-HTTP server. A line whose `tools` name a served tool has its "
                      "calls run here, round after round, and its result holds the transcript "
                      "(docs/tools.md)."),
    click.option("--max-tool-rounds", type=click.IntRange(1, 1000), default=8,
                 show_default=True,
                 help="Rounds of calls run for a line; calls after them are handed back unrun."),
    click.option("--tool-timeout", type=click.FloatRange(0.0, min_open=True), default=30.0,
                 show_default=True, metavar="SECONDS",
                 help="Deadline of each tool call; a call past it is its line's error "
                      "(tool_timeout)."),
    click.option("--tool-result-bytes", type=click.IntRange(1), default=64 * 1024,
                 show_default=True,
                 help="Largest tool answer, in UTF-8 bytes; a larger one is its line's error "
                      "(tool_result_too_large)."),
    click.option("--tool-restarts", type=click.IntRange(0), default=16, show_default=True,
                 help="Times each --mcp server is started again after a crash, this run; a "
                      "call a crash caught is retried alone, and only one that crashes it "
                      "twice fails (tool_server_crashed). Past them its calls fail at once "
                      "(tool_server_down)."),
    click.option("--tool-record", type=click.Path(dir_okay=False), default=None,
                 help="Write every tool call and its answer here (JSON lines), for "
                      "--tool-replay."),
    click.option("--tool-replay", type=click.Path(dir_okay=False), default=None,
                 help="Answer tool calls from a --tool-record file, with no server; a call it "
                      "lacks is its line's error (tool_not_recorded)."),
    click.option("--allow-tool", "allow_tool", multiple=True, metavar="NAME",
                 help="A served tool the --controller may call (repeatable), through "
                      "aici:tools; its calls to any other are refused (docs/tools.md)."),
    click.option("--no-ff", is_flag=True,
                 help="Sample forced tokens one by one (no fast-forward)."),
    click.option("--draft-tokens", type=click.IntRange(0, 64), default=4, show_default=True,
                 help="Prompt-lookup draft length for greedy lines: tokens guessed from the "
                      "line's own history and kept where the model agrees (outputs unchanged, "
                      "fewer passes). 0 turns drafts off."),
    click.option("--no-prefix-cache", is_flag=True,
                 help="Prefill every prompt in full, even where a row already holds the keys of "
                      "its start (a shared few-shot prefix or system prompt). For comparison: "
                      "outputs are the same either way."),
    click.option("--wide-prefill", is_flag=True,
                 help="Run a 16-bit run's prompt tokens on the dense copies in one GEMM a pass "
                      "instead of tiles of 128 rows: ~1.5x faster prefill of long prompts on "
                      "CPUs with AMX, but a line's text may then depend on the lines beside it "
                      "(made_with.batch_variant names it; docs/speed.md)."),
    click.option("--lookahead", type=click.IntRange(1, 100_000), default=64, show_default=True,
                 help="Lines read ahead of admission, so that lines whose prefix is cached run "
                      "first (results are written as lines finish; `index` keeps each line's "
                      "number). 1 admits in input order."),
    click.option("--ordered", is_flag=True,
                 help="Write results in input order (admits in input order, holds at most "
                      "1,024 finished results for an earlier line; see docs/running.md)."),
    click.option("--threads", type=click.IntRange(1, 4096), default=None,
                 help="CPU threads for the model's work. Default: the CPUs this process may "
                      "use (affinity and cgroup quota), or OMP_NUM_THREADS. Lower it when "
                      "other jobs share the CPU."),
    click.option("--engine-process", type=click.Choice(["child", "inline"]), default="child",
                 show_default=True,
                 help="Where a local run's engine runs. child: a process of its own, so that a "
                      "native crash or the OOM killer costs only the lines in flight, which "
                      "run again in a new one (docs/reliability.md); inline: this process "
                      "(no start-up of a second interpreter; a crash ends the run). A traced "
                      "run (--trace) runs inline."),
    click.option("--logprobs", "logprobs", type=click.IntRange(0, 20), default=None,
                 help="Give every generated token its log-probability and its K most likely "
                      "alternatives (lines may set `logprobs`/`top_logprobs` themselves)."),
    click.option("--logprobs-mode", type=click.Choice(["raw", "masked"]), default="raw",
                 show_default=True,
                 help="raw: the model's own distribution (as OpenAI and vLLM report); masked: "
                      "the distribution the line's penalties, logit_bias and constraint leave, "
                      "renormalized over the allowed tokens (a fast-forwarded token then has "
                      "logprob 0)."),
    click.option("--close-at-limit/--no-close-at-limit", default=True, show_default=True,
                 help="Finish a JSON-schema, grammar or tool-call line before max_tokens cuts "
                      "it off, with a completion its constraint allows (`stats.closed_early`, "
                      "`close_reason: limit`)."),
    click.option("--loop-guard/--no-loop-guard", default=True, show_default=True,
                 help="When such a line's text loops (a unit of any length repeated), take the "
                      "loop back once and bar the token that began it (`loops_undone`); a "
                      "loop after that is closed from where it began (`close_reason: loop`); "
                      "where nothing can close it, the output is cut where the loop began "
                      "(`loop_unclosable`)."),
    click.option("--deterministic", is_flag=True,
                 help="Batch-invariant passes: a line's tokens are the same whatever its batch "
                      "size, neighbours, row, drafts, prefix-cache hits or --resume (costs "
                      "throughput; see docs/reliability.md)."),
    click.option("--step-stats", is_flag=True, help="Add per-step records to each result line."),
    click.option("--stats-out", type=click.Path(dir_okay=False), default=None,
                 help="Write the run summary (JSON) here."),
    click.option("--trace", "trace", type=click.Path(dir_okay=False), default=None,
                 help="Write OpenTelemetry spans (OTLP JSON lines) here: the run, each line, "
                      "each engine step, each controller call. With OTEL_EXPORTER_OTLP_ENDPOINT "
                      "set, spans go to that collector (see docs/tracing.md)."),
    click.option("--resume", is_flag=True,
                 help="Skip the lines whose result is already in the -o file and append the "
                      "rest (after an interrupted or killed run). A torn last line is cut off; "
                      "results from a different input, or made with another --model or other "
                      "line options (--max-tokens, a constraint, --controller, ...), are "
                      "refused."),
    click.option("--resume-mixed", is_flag=True,
                 help="With --resume: keep results made with another model or other options "
                      "and add this run's beside them (each result's `made_with` says which)."),
    click.option("--exit-zero-on-line-errors", is_flag=True,
                 help="Exit 0 even when some lines ended in an error (each has its error result "
                      "in the output), as `vllm run-batch` does: for pipelines that read errors "
                      "from the output file. A run that cannot start still exits 2."),
    click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
                 help="Run on a Ray cluster: 'auto' (RAY_ADDRESS, a running cluster, or a "
                      "new local instance), 'ray://HOST:PORT' (Ray Client) or 'HOST:PORT'. "
                      "Each worker is an actor with its own model; output, --resume and "
                      "per-line errors are those of a local run. Needs "
                      "`pip install 'aici-batch[ray]'`."),
    click.option("--workers", type=click.IntRange(1, 4096), default=None,
                 help="Ray workers (actors), each loading the model once.  [default: 1]"),
    click.option("--gpus-per-worker", type=click.FloatRange(0.0), default=0.0,
                 show_default=True,
                 help="GPUs Ray gives each worker (1: one GPU each; 0.5: two per GPU)."),
    click.option("--cpus-per-worker", type=click.FloatRange(0.0, min_open=True), default=1.0,
                 show_default=True,
                 help="CPUs Ray reserves for each worker; also its torch threads."),
    click.option("--progress-interval", type=click.FloatRange(0.0), default=10.0,
                 show_default=True, metavar="SECONDS",
                 help="Off a terminal (a CI log, a pipe): one progress line every SECONDS "
                      "(lines done/total, tok/s, errors); 0: none."),
    click.option("-q", "--quiet", is_flag=True,
                 help="Nothing on stderr but errors (and the one line that counts failed lines)."),
)


def run_options(command: F) -> F:
    """Applies INPUT and every run option to `command` (a function Click will make the
    `run` command of)."""
    for param in reversed(RUN_PARAMS):
        command = param(command)
    return command


def options_from_environment(command: click.Command, prefix: str = "AICI_BATCH_") -> None:
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


def run_params(*names: str) -> list[click.Parameter]:
    """`run`'s own declarations of the options `names` (Python names), for a command that
    takes a few of them (`prepare`): one definition, the same help and defaults."""
    command = click.command()(run_options(lambda **_: None))
    params = [p for p in command.params if p.name in names]
    assert len(params) == len(names), f"not run options: {names}"
    return params
