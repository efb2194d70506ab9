"""Every `aici-batch` command in the README's shell blocks runs, as written.

The commands are read from README.md's ```sh blocks (a line continued with `\\` is one
command), so this stays true as the README changes: a file a command names must exist, its
options must parse, and it must run to exit 0 or 1 (1: some lines ended in an error, which
the README's examples may show) without a traceback. Each block runs in a directory of its
own holding a copy of `examples/` and the repository's `controllers/`, in order (a
`report` reads what the `run` before it wrote), on the tiny model (`AICI_BATCH_MODEL`; a
`--model` in a command is dropped, since the README's models are not all on this machine),
with a small `--max-tokens` default.

What does not run here, and why: `aici-batch build` is replaced by the session's build of
the same example (`built`, `built_js`, the component `aici-batch build` makes, tested in
test_build.py), and a `--ray` command is only parsed (it needs a Ray cluster; test_ray.py
runs those paths).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from aici_cli.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line number, commands) of each ```sh block that runs aici-batch."""
    blocks = []
    for match in re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M):
        line = text[: match.start()].count("\n") + 1
        commands: list[str] = []
        pending = ""
        for raw in match.group(1).splitlines():
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            command = (pending + raw).strip()
            pending = ""
            if re.search(r"(^|\| *)aici-batch ", command):
                commands.append(command)
        if commands:
            blocks.append((line, commands))
    return blocks


BLOCKS = shell_blocks(README.read_text(encoding="utf-8"))


def aici_args(command: str) -> list[str]:
    """The arguments of the command's `aici-batch` call (without redirections)."""
    words = shlex.split(command, comments=True)
    start = len(words) - 1 - words[::-1].index("aici-batch")
    args = []
    for word in words[start + 1:]:
        if word in ("|", ">", "<", "&&", ";"):
            break
        args.append(word)
    return args


def without_model(command: str) -> str:
    return re.sub(r" --model [^ ]+", "", command)


def test_the_readme_has_the_commands_it_should() -> None:
    commands = [c for _, block in BLOCKS for c in block]
    assert len(commands) >= 12
    assert any("examples/openai_batch.jsonl" in c for c in commands)
    assert any("--json-schema examples/person.schema.json" in c for c in commands)
    assert any("--plot" in c for c in commands)


@pytest.mark.parametrize(("line", "commands"), BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_each_readme_command_runs(line: int, commands: list[str], tmp_path: Path,
                                  tiny_model_dir: Path, request: pytest.FixtureRequest) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "controllers").symlink_to(ROOT / "controllers")
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
           "AICI_BATCH_MODEL": str(tiny_model_dir), "AICI_BATCH_MAX_TOKENS": "16",
           "AICI_BATCH_PROGRESS_INTERVAL": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "controllers"),
                                          os.environ.get("PYTHONPATH", "")])}
    for command in commands:
        args = aici_args(command)
        # Options and arguments parse as the CLI reads them (before anything runs).
        ctx = main.make_context("aici-batch", list(args), resilient_parsing=False)
        with ctx:
            sub = main.get_command(ctx, args[0])
            assert isinstance(sub, click.Command), command
            sub.make_context(args[0], list(args[1:]), parent=ctx)
        if args[0] == "build":
            source = ROOT / args[1]
            assert source.is_file(), f"README line {line}: {args[1]} does not exist"
            fixture = "built_js" if source.suffix in (".js", ".mjs") else "built"
            component = request.getfixturevalue(fixture)[source.stem]
            shutil.copy(component, tmp_path / args[args.index("-o") + 1])
            continue
        for word in args[1:]:
            if word.startswith(("examples/", "controllers/")) or word.endswith(".wasm"):
                assert (tmp_path / word).exists(), f"README line {line}: {word} does not exist"
        if "--ray" in args:
            continue
        done = subprocess.run(["bash", "-o", "pipefail", "-c", without_model(command)],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode in (0, 1), (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (command, done.stderr[-2000:])
