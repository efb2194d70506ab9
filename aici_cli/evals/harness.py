"""`aici-batch lm-eval ...`: lm-evaluation-harness's own command line, with this engine's
model registered and made the default.

lm-eval 0.4.13 finds models only in its registry (its registry takes entry points as
placeholders but never reads an entry-point group), so a plain `lm_eval --model
aici-batch` cannot see this backend unless something imports it first; this command does
that, then hands lm-eval its arguments:

    aici-batch lm-eval --tasks hellaswag --model_args model=smollm2-135m-instruct
    aici-batch lm-eval run --tasks mytask --include_path tasks/ --batch_size 16
    aici-batch lm-eval ls tasks

Without a subcommand it is `run` (as `lm-eval` does). Without `--model` the model is
`aici-batch`; without `--device`, `auto` (CUDA where there is one: lm-eval's own default
is cuda:0); without `--batch_size`, the batch size the engine will run at: the one
`--model_args batch_size=N` gives, else this engine's default (lm-eval's own default is 1).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from aici_cli.evals.lm_eval_backend import batch_size_arg

SUBCOMMANDS = ("run", "ls", "validate")


def harness_argv(args: Sequence[str]) -> list[str]:
    """lm-eval's argv (without the program name) for `aici-batch lm-eval ARGS`."""
    args = list(args)
    if args and args[0] in SUBCOMMANDS and args[0] != "run":
        return args
    rest = args[1:] if args and args[0] == "run" else args
    if any(a in ("-h", "--help") for a in rest):
        return ["run", *rest]
    given = {a.split("=", 1)[0] for a in rest if a.startswith("-")}
    defaults: list[str] = []
    if not given & {"--model", "-M"}:
        defaults += ["--model", "aici-batch"]
    elif _option_value(rest, ("--model", "-M")) != "aici-batch":
        return ["run", *rest]  # another backend: lm-eval's defaults are its own
    if "--device" not in given:
        defaults += ["--device", "auto"]  # lm-eval's default is cuda:0, even without CUDA
    if not given & {"--batch_size", "-b"}:
        # As `--batch_size`, not `--model_args`: lm-eval prints and records its own
        # `batch_size` option (1 unless given), whatever size the model runs at.
        size = _engine_batch_size(rest)
        if size is not None:
            defaults += ["--batch_size", str(size)]
    return ["run", *defaults, *rest]


def _engine_batch_size(args: list[str]) -> int | None:
    """The batch size the engine runs at: the last `batch_size` of `--model_args` (which
    win over lm-eval's option, see `AiciBatchLM.create_from_arg_obj`), else the default;
    None for a value the backend refuses (it says why once lm-eval has parsed it)."""
    value: object = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in ("--model_args", "-a"):
            continue
        # `nargs="+"`: the values run to the next option; each is JSON or `k=v,k2=v2`.
        values = [inline] if eq else _values_after(args, i)
        for text in values:
            pairs = _model_args(text)
            if "batch_size" in pairs:
                value = pairs["batch_size"]
    try:
        return batch_size_arg(None if value is None else str(value))
    except ValueError:
        return None


def _values_after(args: list[str], i: int) -> list[str]:
    values = []
    for arg in args[i + 1:]:
        if arg.startswith("-"):
            break
        values.append(arg)
    return values


def _model_args(text: str) -> dict[str, object]:
    """One `--model_args` value as lm-eval reads it: a JSON object or `k=v,k2=v2`."""
    if text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    pairs: dict[str, object] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if eq:
            pairs[key] = value
    return pairs


def _option_value(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of the options `names` in `args` (`--x V` or `--x=V`)."""
    value = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def run_harness(args: Sequence[str]) -> None:
    """Run lm-eval's command line on `args`; it exits as lm-eval does."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv  # lm-eval's parser reads sys.argv itself
    sys.argv = ["aici-batch lm-eval", *harness_argv(args)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
