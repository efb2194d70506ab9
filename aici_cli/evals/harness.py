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
is cuda:0); without `--batch_size`, this engine's default batch size (lm-eval's own
default is 1), which `--model_args batch_size=N` overrides.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from aici_cli.evals.lm_eval_backend import DEFAULT_BATCH_SIZE

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
        # First: a later --model_args batch_size=N replaces it (lm-eval merges them in order).
        defaults += ["--model_args", f"batch_size={DEFAULT_BATCH_SIZE}"]
    return ["run", *defaults, *rest]


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
