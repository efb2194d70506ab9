"""`aici-batch models`: the models `--model` can name on this machine, and `--prune` of the
converted ones nothing uses (thin: the work is in `aici_cli.models.sources.listing` and
`aici_cli.models.cache.entries`, imported on use; neither loads torch)."""

from __future__ import annotations

import json
from typing import Any

import click

from aici_cli.cli.errors import FatalError


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON instead.")
@click.option("--prune", is_flag=True,
              help="Remove what nothing uses, saying why: converted models no run looks up "
                   "any more (older copies made per path, conversions for another "
                   "transformers version or converter, of files that are gone or changed, "
                   "or left by a conversion that died), and in the others the files other "
                   "modes than the default built on their first run (the unquantised copy "
                   "of --quantize none and --dtype float32 runs, --quantize int8's layers, "
                   "int4 layers in another CPU's kernel layout). The default mode is every "
                   "choice left at auto; its runs note the files they read. A mode pruned "
                   "away builds its file again when it next runs.")
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
    from aici_cli.models.sources.listing import available_models

    listing = available_models()
    if as_json:
        click.echo(json.dumps(listing, indent=2))
        return
    for line in _models_text(listing):
        click.echo(line)


def _prune(as_json: bool, dry_run: bool) -> None:
    """`aici-batch models --prune [--dry-run]`."""
    from aici_cli.models.cache.entries import prune

    entries, files = prune(dry_run=dry_run)
    freed = sum(e.size_bytes for e in entries) + sum(f.size_bytes for _, f in files)
    if as_json:
        click.echo(json.dumps({
            "dry_run": dry_run, "bytes": freed,
            "entries": [{"name": e.path.name, "path": str(e.path), "size_bytes": e.size_bytes,
                         "unused": e.unused} for e in entries],
            "files": [{"entry": e.path.name, "name": f.path.name, "path": str(f.path),
                       "size_bytes": f.size_bytes, "unused": f.unused} for e, f in files],
        }, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    rows = [(e.path.name, e.size_bytes, e.unused) for e in entries]
    rows += [(f"{e.path.name}/{f.path.name}", f.size_bytes, f.unused) for e, f in files]
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, size, why in rows:
        click.echo(f"{verb} {name:<{width}}  {_size(size):>8}  ({why})")
    counts = [_count(len(entries), "entry", "entries"), _count(len(files), "file", "files")]
    total = " and ".join(c for c in counts if c) + f", {_size(freed)}"
    click.echo(f"{'would free' if dry_run else 'freed'} {total}" if rows
               else "nothing to prune: every converted model, and every file in them, "
                    "is in use")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}" if n else ""


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
        if m["other_modes"]:
            serves += (f"  ({_size(sum(f['size_bytes'] for f in m['other_modes']))} "
                       "of it other modes' files)")
        lines.append(f"  {m['name']:<{width}}  {_size(m['size_bytes']):>8}{serves}")
    if not converted["models"]:
        lines.append("  none")
    elif any(m["unused"] or m["other_modes"] for m in converted["models"]):
        lines.append("  (`aici-batch models --prune` removes the unused ones and other modes' "
                     "files; --dry-run lists them first)")

    hub = listing["hub"]
    lines += ["", f"Hugging Face hub cache {hub['cache_dir']} (--model ORG/NAME[@REVISION]):"]
    width = max((len(m["name"]) for m in hub["models"]), default=0)
    for m in hub["models"]:
        usable = "" if m["loadable"] else "  (no config.json or .gguf in its main snapshot)"
        lines.append(f"  {m['name']:<{width}}  {_size(m['size_bytes']):>8}{usable}")
    if not hub["models"]:
        lines.append("  none (`hf download ORG/NAME` fetches one where there is network)")
    return lines

