"""Every `aici-batch` command in the documentation's shell blocks runs, as written.

The commands are read from the ```sh blocks of README.md and of every page in docs/ (a line
continued with `\\` is one command), so this stays true as the pages change: a file a
command names must exist, its options must parse, and it must run to exit 0 or 1 (1: some
lines ended in an error, which the examples may show) without a traceback. Each block runs
in a directory of its own holding a copy of `examples/` and the repository's
`controllers/`, in order (a `report` reads what the `run` before it wrote), on the tiny
model (`AICI_BATCH_MODEL`; a `--model` in a command is dropped, since the documented models
are not all on this machine), with a small `--max-tokens` default. Commands run through
Click in this process (a process each would cost seconds of imports); the shell around them
is the shapes the pages use, `cat FILE | `, `echo 'TEXT' | ` and `> FILE`, and any other is
this test's failure, to be taught here. An `--mcp` server's `python` is this interpreter.

What does not run here, and why: `aici-batch build` is replaced by the session's build of
the same example (`built`, `built_js`: the component `aici-batch build` makes, tested in
test_build.py), and a `--ray`, `publish`, `pull` or `oci://` command (and what follows it
in its block) is only parsed: it needs a cluster or a registry, and test_ray.py and
test_oci.py run those paths. So is `lm-eval` (its tasks download their data sets;
test_lm_eval.py runs local tasks) and a `report --baseline` (its baseline is the results of
an earlier run, a CI cache's; test_ci_examples.py and test_report_ci.py run it).
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from paths import ROOT

from aici_cli.cli.main import main

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


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


def page_blocks(page: Path) -> list[tuple[str, int, list[str]]]:
    """(page, line number, commands) of each of the page's ```sh blocks that runs aici-batch."""
    name = page.relative_to(ROOT).as_posix()
    return [(name, line, commands)
            for line, commands in shell_blocks(page.read_text(encoding="utf-8"))]


BLOCKS = [block for page in PAGES for block in page_blocks(page)]


class Shell:
    """A command split as the pages write them: what feeds stdin, the aici-batch
    arguments, where stdout goes."""

    def __init__(self, command: str) -> None:
        words = shlex.split(command, comments=True)
        self.stdin: str | None = None
        self.stdout_to: str | None = None
        if "|" in words:
            cut = words.index("|")
            feeder, words = words[:cut], words[cut + 1:]
            if feeder[0] == "echo" and len(feeder) == 2:
                self.stdin = feeder[1] + "\n"
            elif feeder[0] == "cat" and len(feeder) == 2:
                self.stdin = f"@{feeder[1]}"  # read in the block's directory
            else:
                raise AssertionError(f"teach this test the shell of: {command}")
        if ">" in words:
            cut = words.index(">")
            words, self.stdout_to = words[:cut], words[cut + 1]
        if words[0] != "aici-batch" or any(w in ("|", ">", "<", "&&", ";") for w in words):
            raise AssertionError(f"teach this test the shell of: {command}")
        self.args = words[1:]


def without_model(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
        elif word == "--model":
            skip = True
        else:
            out.append(word)
    return out


def this_python(args: list[str]) -> list[str]:
    """An `--mcp NAME=python ...` server started by this interpreter (the one with the
    `mcp` package), not the `python` first on PATH."""
    return [re.sub(r"^(\w[\w.-]*)=python(?= )", lambda m: f"{m[1]}={shlex.quote(sys.executable)}",
                   word) if before == "--mcp" else word
            for before, word in zip(["", *args], args)]


def commands_of(name: str) -> list[str]:
    return [c for page, _, block in BLOCKS if page == name for c in block]


def test_the_readme_has_the_commands_it_should() -> None:
    commands = commands_of("README.md")
    assert len(commands) >= 12
    assert any("examples/openai_batch.jsonl" in c for c in commands)
    assert any("--json-schema examples/person.schema.json" in c for c in commands)
    assert any("--plot" in c for c in commands)
    assert any("--resume" in c for c in commands)
    assert any("--score" in c for c in commands)
    assert any(c.startswith("aici-batch build ") for c in commands)


def test_the_docs_pages_have_the_commands_they_should() -> None:
    """The examples that moved from the README into docs/ are still there, and run."""
    assert any("examples/openai_batch.jsonl" in c for c in commands_of("docs/formats.md"))
    controllers = commands_of("docs/controllers.md")
    for example in ("examples/yes_no.py", "examples/three_ways.py", "examples/vote.py",
                    "js/examples/yes_no.js"):
        assert any(f"controllers/{example}" in c for c in controllers), example
    assert any("controllers/examples/calculator.py" in c for c in commands_of("docs/tools.md"))
    assert any("--ray" in c for c in commands_of("docs/ray.md"))
    assert any("--score" in c for c in commands_of("docs/evaluations.md"))


@pytest.fixture(scope="module")
def pages_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pages' own cache: what a page's command builds (`aici-batch prepare`'s
    compiled steps for the tiny model) must not reach the rest of the suite, where a
    ready package would make a later `--compile auto` run compiled."""
    return tmp_path_factory.mktemp("pages-cache")


@pytest.mark.subprocess
@pytest.mark.parametrize(("page", "line", "commands"), BLOCKS,
                         ids=[f"{page}:line{n}" for page, n, _ in BLOCKS])
def test_each_documented_command_runs(page: str, line: int, commands: list[str], tmp_path: Path,
                                  tiny_model_dir: Path, request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch, pages_cache: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "controllers").symlink_to(ROOT / "controllers")
    monkeypatch.chdir(tmp_path)
    env = {"AICI_BATCH_MODEL": str(tiny_model_dir), "AICI_BATCH_MAX_TOKENS": "16",
           "AICI_BATCH_PROGRESS_INTERVAL": "0", "AICI_BATCH_CACHE": str(pages_cache)}
    after_remote = False  # what follows a remote command in its block works on its output
    for command in commands:
        shell = Shell(command)
        args = shell.args
        # Options and arguments parse as the CLI reads them, before anything runs.
        sub = main.get_command(click.Context(main), args[0])
        assert isinstance(sub, click.Command), command
        sub.make_context(args[0], list(args[1:]))
        if args[0] == "build":
            source = ROOT / args[1]
            assert source.is_file(), f"{page} line {line}: {args[1]} does not exist"
            fixture = "built_js" if source.suffix in (".js", ".mjs") else "built"
            component = request.getfixturevalue(fixture)[source.stem]
            shutil.copy(component, tmp_path / args[args.index("-o") + 1])
            continue
        # A command that reaches a cluster or a remote registry is only parsed
        # (test_ray.py and test_oci.py run them against real local ones), and so are
        # lm-eval, whose tasks download their data (test_lm_eval.py runs local ones), and a
        # report against an earlier run's results (test_ci_examples.py runs one).
        remote = after_remote or "--ray" in args or args[0] in ("publish", "pull", "lm-eval") \
            or any(w.startswith("oci://") for w in args) \
            or (args[0] == "report" and "--baseline" in args)
        after_remote = remote
        for word in (w for arg in args[1:] for w in arg.split()):  # --mcp's command too
            local = word.endswith(".wasm") and not remote  # built by its block
            if word.startswith(("examples/", "controllers/")) or local:
                assert (tmp_path / word).exists(), f"{page} line {line}: {word} does not exist"
        if remote:
            continue
        stdin = shell.stdin
        if stdin is not None and stdin.startswith("@"):
            stdin = (tmp_path / stdin[1:]).read_text(encoding="utf-8")
        res = CliRunner(env=env).invoke(main, this_python(without_model(args)), input=stdin)
        assert res.exit_code in (0, 1), (command, res.output[-2000:], res.exception)
        assert "Traceback" not in res.stderr, (command, res.stderr[-2000:])
        if shell.stdout_to is not None:
            (tmp_path / shell.stdout_to).write_text(res.stdout)
