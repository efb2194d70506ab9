"""The `run` command's options, as Click parses them, made into one `RunConfig`: INPUT or
stdin, the default constraint, `--ray` and its workers, and the combinations of options
that are refused before anything loads (each a one-line usage error).

Light: click and the vocabulary only (Ray is looked for, not imported, and only with
--ray), so that `run --help` and a refused combination cost no heavy import."""

from __future__ import annotations

import re
import sys
from typing import Any

import click

from aici_cli.cli.errors import FatalError
from aici_cli.core.config import (
    EngineConfig,
    JobDefaults,
    RayOptions,
    RunConfig,
    ToolOptions,
    ToolServer,
)
from aici_cli.core.constraint import Constraint
from aici_cli.core.errors import UsageError
from aici_cli.core.sampling import Sampling


def run_config(input: str | None, output: str, model: str | None, device: str, dtype: str,
               quantize: str, model_impl: str, compile_mode: str, batch_size: int,
               max_tokens: int, ignore_eos: bool,
               stop: tuple[str, ...], n: int, input_format: str,
               json_schema: str | None, regex: str | None, choices: str | None,
               grammar: str | None, score: bool, schema_fallback: str, schema_retries: int,
               json_permissive: bool, controller: str | None, plain_http: bool,
               controller_arg: str, controller_timeout_ms: int, max_branches: int,
               mcp: tuple[str, ...], max_tool_rounds: int, tool_timeout: float,
               tool_result_bytes: int, tool_restarts: int, tool_record: str | None,
               tool_replay: str | None, allow_tool: tuple[str, ...],
               no_ff: bool, draft_tokens: int, no_prefix_cache: bool, wide_prefill: bool,
               lookahead: int, ordered: bool, threads: int | None, engine_process: str,
               logprobs: int | None, logprobs_mode: str, close_at_limit: bool,
               loop_guard: bool, deterministic: bool, step_stats: bool,
               stats_out: str | None, trace: str | None,
               resume: bool, resume_mixed: bool, exit_zero_on_line_errors: bool,
               ray_address: str | None,
               workers: int | None, gpus_per_worker: float, cpus_per_worker: float,
               progress_interval: float, quiet: bool, **sampling: Any) -> RunConfig:
    """The run the options ask for (parameters by the names `run_options` declares;
    `sampling`: the sampling options, `--temperature` and the rest of core/sampling.py's
    `RUN_OPTIONS`, by field name); raises FatalError (or click.UsageError: INPUT) for
    options that cannot go together."""
    input = _input_or_stdin(input)
    ray = _ray_options(ray_address, workers, gpus_per_worker, cpus_per_worker, device)
    if ray is not None and (ordered or threads is not None):
        raise FatalError(f"{'--ordered' if ordered else '--threads'} is for a local run; with "
                         "--ray each worker's threads are --cpus-per-worker")
    config = RunConfig(
        input=input, output=output, model=model, device=device, dtype=dtype,
        quantize=quantize, model_impl=model_impl,
        engine=EngineConfig(batch_size=batch_size, compile=compile_mode, fast_forward=not no_ff,
                            draft_tokens=draft_tokens, step_stats=step_stats,
                            prefix_cache=not no_prefix_cache, wide_prefill=wide_prefill,
                            lookahead=lookahead,
                            logprobs_mode=logprobs_mode, close_at_limit=close_at_limit,
                            loop_guard=loop_guard, deterministic=deterministic,
                            schema_retries=schema_retries, max_branches=max_branches,
                            strict_json=not json_permissive),
        defaults=JobDefaults(max_tokens=max_tokens, sampling=Sampling(**sampling),
                             stop=tuple(stop),
                             constraint=_constraint(json_schema, regex, choices, grammar,
                                                    quiet), n=n,
                             score=score, logprobs=logprobs,
                             ignore_eos=ignore_eos, schema_fallback=schema_fallback),
        input_format=input_format, stats_out=stats_out, quiet=quiet, controller=controller,
        controller_arg=controller_arg, controller_call_ms=controller_timeout_ms,
        resume=resume, resume_mixed=resume_mixed,
        exit_zero_on_line_errors=exit_zero_on_line_errors, ray=ray, threads=threads,
        engine_process=engine_process,
        ordered=ordered, progress_interval_s=progress_interval,
        plain_http=plain_http, trace=trace,
        tools=ToolOptions(servers=_tool_servers(mcp), max_rounds=max_tool_rounds,
                          call_timeout_s=tool_timeout, result_bytes=tool_result_bytes,
                          restarts=tool_restarts, record=tool_record, replay=tool_replay,
                          allowed=tuple(dict.fromkeys(allow_tool))),
    )
    _refuse_combinations(config)
    return config


def _refuse_combinations(config: RunConfig) -> None:
    """Options each valid alone that no run can honour together."""
    if config.resume_mixed and not config.resume:
        raise FatalError("--resume-mixed goes with --resume")
    if config.engine.deterministic and config.quantize in ("int8", "int4"):
        raise FatalError("--deterministic runs unquantised weights: drop --quantize "
                         f"{config.quantize}")
    if config.engine.deterministic and config.engine.compile == "on":
        raise FatalError("--deterministic runs eager passes: drop --compile on")
    tools = config.tools
    if tools.replay is not None and (tools.servers or tools.record is not None):
        raise FatalError("--tool-replay answers from its file, with no server: drop "
                         f"{'--mcp' if tools.servers else '--tool-record'}")
    if tools.record is not None and not tools.servers:
        raise FatalError("--tool-record records the calls to --mcp servers: give one")
    if tools.allowed and not tools.active:
        raise FatalError("--allow-tool names tools of --mcp servers (or of a --tool-replay "
                         "file): give one")
    if tools.allowed and config.controller is None:
        raise FatalError("--allow-tool lets a --controller call tools: give one")
    if tools.active and config.ray is not None:
        raise FatalError("--mcp and --tool-replay serve tools to a local run, not on --ray")
    if config.controller is not None and config.defaults.constraint is not None:
        raise FatalError("--controller cannot be combined with "
                         "--json-schema/--regex/--choices/--grammar")


def _tool_servers(specs: tuple[str, ...]) -> tuple[ToolServer, ...]:
    """`--mcp NAME=COMMAND` (or NAME=URL), each name once."""
    servers: dict[str, ToolServer] = {}
    for spec in specs:
        name, sep, target = spec.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not target or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise FatalError(f"--mcp {spec!r}: give NAME=COMMAND or NAME=URL, NAME made of "
                             "letters, digits, '_', '.' and '-'")
        if name in servers:
            raise FatalError(f"--mcp: the name {name!r} is given twice")
        servers[name] = ToolServer(name, target)
    return tuple(servers.values())


def _constraint(json_schema: str | None, regex: str | None, choices: str | None,
                grammar: str | None = None, quiet: bool = False) -> Constraint | None:
    given = [x for x in (json_schema, regex, choices, grammar) if x is not None]
    if len(given) > 1:
        raise FatalError("give at most one of --json-schema, --regex, --choices, --grammar")
    from aici_cli.cli.option_values import choices_option, grammar_option, schema_option

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
    from aici_cli.run.distributed import require_ray

    try:
        require_ray()
    except UsageError as e:
        raise FatalError(str(e)) from None
    if device == "cuda" and gpus == 0:
        raise FatalError("--device cuda on Ray needs --gpus-per-worker (e.g. 1): Ray shows "
                         "a worker only the GPUs it reserves for it")
    return RayOptions(address=address, workers=workers or 1, gpus_per_worker=gpus,
                      cpus_per_worker=cpus)
