"""`aici-batch doctor`: what runs on this machine, to read or to paste into a bug report
(thin: the work is in `aici_cli.models.checks.doctor`, imported on use)."""

from __future__ import annotations

import json
from typing import Any

import click

from aici_cli.cli.errors import FatalError


@click.command("doctor")
@click.option("--model", "-m", default=None, envvar="AICI_BATCH_MODEL",
              help="The model whose shapes the kernels are probed with (default: the "
                   "default model).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--all-capabilities", is_flag=True,
              help="Probe every CPU capability this CPU supports (ATEN_CPU_CAPABILITY: "
                   "default, avx2, avx512), not only the one torch chose.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--cache-key", is_flag=True,
              help="Print only the key to keep the cache folder under in CI (this CPU, "
                   "aici-batch's and torch's versions, the model's content) and exit.")
def doctor_command(model: str | None, device: str, all_capabilities: bool,
                   as_json: bool, cache_key: bool) -> None:
    """Show this machine's fingerprint, the kernel probe's verdict on every mode (dtype x
    quantization) with the time of one decode step's linear kernels, and the mode
    `--dtype auto --quantize auto` picks. A mode is probed once per machine, in a child
    process (a few seconds); its verdict is cached, so a second doctor is instant.

    \b
    Examples:
      aici-batch doctor
      aici-batch doctor --all-capabilities --json > doctor.json
      aici-batch doctor --cache-key    # e.g. the key of a CI job's actions/cache
    """
    from aici_cli.core.errors import ModelError

    if cache_key:
        from aici_cli.models.checks.cache_key import cache_key as key

        try:
            click.echo(key(model))
        except ModelError as e:
            raise FatalError(str(e)) from None
        return
    from aici_cli.models.checks.doctor import doctor_report

    try:
        report = doctor_report(model, device, all_capabilities)
    except ModelError as e:
        raise FatalError(str(e)) from None
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    click.echo(_text(report))


def _text(report: dict[str, Any]) -> str:
    shapes = report["shapes"]
    lines = [
        f"machine     {report['machine']}",
        f"torch       {report['torch']}, CPU capability {report['capability']}"
        + ("" if report["native_bf16"] is None
           else f", native bf16: {'yes' if report['native_bf16'] else 'no'}"),
        f"model       {report['model']} (hidden {shapes['hidden']}, intermediate "
        f"{shapes['intermediate']}, vocab {shapes['vocab']}, {shapes['layers']} layers)",
        "",
        f"{'mode':<18}{'capability':<12}{'verdict':<9}{'step ms':>9}  why",
    ]
    for mode in report["modes"]:
        step = f"{mode['step_ms']:.1f}" if mode["step_ms"] is not None else "-"
        why = mode["reason"] or ""
        lines.append(f"{mode['label']:<18}{mode['capability']:<12}"
                     f"{'ok' if mode['ok'] else 'REJECTED':<9}{step:>9}  {why}")
    auto = report["auto"]
    lines += ["", f"auto picks  {auto['dtype']}+{auto['quantize']}"]
    lines += [f"            (rejected {label}: {reason})" for label, reason in auto["rejected"]]
    vnni = report["vnni"]
    forced = f" (forced: AICI_BATCH_ISA={report['isa_forced']})" if report["isa_forced"] else ""
    lines.append("int kernels " + (f"{vnni['variant']}: quantised passes run them{forced}"
                                   if vnni["used"] else f"off: {vnni['why_not']}{forced}"))
    lines.append("step ms: one decode step's linear kernels at 1 row on 1 thread, weights "
                 "in cache")
    return "\n".join(lines)
