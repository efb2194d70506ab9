"""References that cannot go stale: every file, folder, module, `module.Name` and name of
the tree that a docstring, a comment, a document or pyproject.toml names exists
(tests/support/reference_check.py says how each kind is read), and every package index (an
`__init__.py` docstring's list of modules, ARCHITECTURE.md's map) lists exactly the files
and sub-packages there are.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import ROOT
from reference_check import (
    ALL_CHECKS,
    PACKAGE,
    Text,
    needless_not_names,
    stale_references,
    texts,
)


def test_every_reference_in_docstrings_comments_docs_and_pyproject_resolves() -> None:
    assert stale_references() == []


def test_every_word_the_checker_lets_pass_is_one_a_text_needs() -> None:
    assert needless_not_names() == []


def test_a_renamed_module_is_caught() -> None:
    """The check has teeth: the same text naming a module that is not there fails."""
    assert stale_references([
        Text("x.py", "see `kernels/int_mm.py` and `int_mm.unusable`", ALL_CHECKS),
        Text("y.py", "see `models/vnni_kernels.py`, `vnni_kernels.unusable`, `int_mm.nothing`",
             ALL_CHECKS),
    ]) == [
        "y.py: `models/vnni_kernels.py`: no such file",
        "y.py: `vnni_kernels.unusable`: no module named vnni_kernels",
        "y.py: `int_mm.nothing`: int_mm defines no nothing",
    ]


# Each kind of stale name, in the text where it was found: (the file, what the text says
# now, what it said when the name was stale, the report).
STALE = [
    # a path in a comment, not backticked
    ("aici_cli/core/config.py", "(engine/forward/compiled.py)", "(engine/compiled.py)",
     "`engine/compiled.py`: no such file"),
    # a module's old name, backticked, as the subject of a verb and alone in parentheses
    ("aici_cli/models/load.py", "errors `model_files` rewords", "errors `files` rewords",
     "`files`: no module or name of that name"),
    ("aici_cli/models/load.py", "files (`model_files`) to say", "files (`files`) to say",
     "`files`: no module or name of that name"),
    ("aici_cli/cli/run_config.py", "`run_options` declares", "`cli_run_options` declares",
     "`cli_run_options`: no module or name of that name"),
    # old module names alone in a comment's parentheses
    ("aici_cli/models/kernels/int_mm.py", "(checks/probe_child.py)", "(kernel_run)",
     "`kernel_run`: no module or name of that name"),
    ("aici_cli/models/kernels/int_mm.py", "(cache/packed_layers.py)", "(vnni_layers)",
     "`vnni_layers`: no module or name of that name"),
    # pyproject.toml: a file, a folder of the checkout, a package's folder, a module
    ("pyproject.toml", "formats/schemas.py the schemas", "formats.py the schemas",
     "`formats.py`: no such file"),
    ("pyproject.toml", "(aici_cli/control/registry)", "(aici_cli/run/registry)",
     "`aici_cli/run/registry`: no such path"),
    ("pyproject.toml", "control/componentize/toolchain.py the WIT", "control/build the WIT",
     "`control/build`: no such path"),
    ("pyproject.toml", '"aici_cli.engine.generation"', '"aici_cli.engine.generations"',
     "`aici_cli.engine.generations`: no such name"),
    # the map, backticked
    ("ARCHITECTURE.md", "| | `control/registry/` |", "| | `run/registry/` |",
     "`run/registry/`: no such path"),
    # a folder by its name alone
    ("aici_cli/control/componentize/toolchain.py", "A leaf of `componentize/`",
     "A leaf of `build/`", "`build/`: no such folder"),
]


def _texts_of(where: str) -> list[Text]:
    return [text for text in texts() if text.where == where]


@pytest.mark.parametrize(("where", "now", "stale", "report"), STALE,
                         ids=[f"{case[0]}:{case[2]}" for case in STALE])
def test_each_kind_of_stale_name_is_caught(where: str, now: str, stale: str,
                                           report: str) -> None:
    """The file's own texts with the stale name put back fail with it alone; as they are,
    they pass."""
    own = _texts_of(where)
    assert any(now in text.text for text in own), f"{where} no longer says {now!r}"
    assert stale_references(own) == []
    with_stale = [Text(t.where, t.text.replace(now, stale), t.checks, t.local) for t in own]
    assert stale_references(with_stale) == [f"{where}: {report}"]


MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "__init__.py")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODULES), st.sampled_from(["# see {}", "(`{}`)", "`aici_cli/{}`"]))
def test_any_module_path_resolves_and_any_other_does_not(module: str, form: str) -> None:
    """Every module of aici_cli, named as a path in a comment, a docstring or pyproject.toml,
    resolves; the same path with its file renamed does not."""
    gone = re.sub(r"(\w+)\.py$", r"\1_gone.py", module)
    assert stale_references([Text("x.py", form.format(module), ALL_CHECKS)]) == []
    (problem,) = stale_references([Text("x.py", form.format(gone), ALL_CHECKS)])
    assert problem.startswith("x.py: `") and gone in problem


# ------------------------------------------------------------------------ the indexes
INDEX_LINE = re.compile(r"^ {4}(\w+(?:\.py|\.cpp|/))(?: \*)?\s", re.M)


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def _index(package: Path) -> set[str] | None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    listed = set(INDEX_LINE.findall(doc))
    return listed or None


def _entries(package: Path) -> set[str]:
    files = {p.name for p in package.iterdir() if p.suffix in (".py", ".cpp")}
    subs = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    return (files | subs) - {"__init__.py"}


def test_every_package_index_lists_its_files() -> None:
    """A package whose docstring lists its modules lists each one, and no other; the
    packages of aici_cli/models and aici_cli/engine all keep such a list."""
    must = [p for p in _packages() if p.relative_to(PACKAGE).parts[:1] in (("models",),)]
    problems = []
    for package in _packages():
        listed = _index(package)
        where = package.relative_to(ROOT)
        if listed is None:
            if package in must:
                problems.append(f"{where}: no index of its modules in its docstring")
            continue
        if listed != _entries(package):
            problems.append(f"{where}: lists {sorted(listed - _entries(package))} that are "
                            f"not there, misses {sorted(_entries(package) - listed)}")
    assert problems == []


def test_architecture_names_every_sub_package() -> None:
    """ARCHITECTURE.md is the map: it names every package and sub-package of aici_cli (as
    `name/` or `parent/name/`) and fits on two screens."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(PACKAGE)) for p in _packages() if p != PACKAGE
               and f"`{p.relative_to(PACKAGE)}/`" not in text and f"`{p.name}/`" not in text]
    assert missing == []
    assert len(text.splitlines()) <= 150
