"""References that cannot go stale: every module a docstring or a document names in
backticks is a file of the tree, every `module.Name` it names is defined there, and every
package index (an `__init__.py` docstring's list of modules, ARCHITECTURE.md's map) lists
exactly the files and sub-packages there are.

A backticked reference is checked when it looks like one:
- `name.py`, `dir/name.py`, `name.cpp` (also with `: Name` after it): the file exists;
- `aici_cli.dotted.path`: the module (or a name in it) exists;
- `module.Name` whose first part is snake_case: `module` is a module of aici_cli (any
  package) that defines `Name`, an importable top-level module, or one of `NOT_MODULES`,
  the words of the docs that read like a module but are something else (a JSON field,
  an attribute of an object, another project's module).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

PACKAGE = ROOT / "aici_cli"
SOURCE_DIRS = ("aici_cli", "controllers", "tests", "bench", "schemas", "wit", "examples")
DOCS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "ARCHITECTURE.md", ROOT / "README.md")

# `x.y` in the docs where x is not a module: fields of results and stats, attributes of
# objects, other projects' modules, OpenTelemetry and WIT names.
NOT_MODULES = frozenset({
    "aici", "stats", "gen_ai", "structured_outputs", "info", "component", "js", "error",
    "yes_no", "vote", "state", "host", "model", "controller", "config", "profile",
    "storage", "python", "signatures", "lm", "self", "cls", "args", "line", "result",
    "results", "step", "summary", "usage", "response", "request", "body", "choices",
    "message", "tool_calls", "nn", "cpu", "ops", "backends", "cuda", "np", "layer",
    "made_with", "stats_out", "options", "run", "engine", "generation", "branch", "fork",
    "x", "y", "out", "wasi", "aici_controller", "job", "spec", "verdict", "mode", "shapes",
    "chunk", "worker", "ray", "tokenizer", "seq", "runner", "sampling", "output",
    "logprobs", "custom", "top_logprobs", "matcher", "schema", "lark", "guest", "trace",
    "span", "meta", "ci", "gate", "baseline", "report", "junit", "markdown", "cache",
    "tokenizer_config", "gguf", "wit_world", "str", "segment",
    "memory", "table", "inputs", "plan", "vocabulary", "console", "prompt_tokens_details",
    "org", "libllama", "session", "testing", "content",
})

REFERENCE = re.compile(r"`([^`\n]+)`")
FILE_REF = re.compile(r"([\w./-]*\w\.(?:py|cpp|c|h))(?:\s*:\s*\w[\w.]*)?")
DOTTED_REF = re.compile(r"([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?:\.\w+)*(?:\(\))?")


def _docstrings(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _texts() -> Iterator[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        for doc in _docstrings(path):
            yield str(path.relative_to(ROOT)), doc
    for path in DOCS:
        yield str(path.relative_to(ROOT)), path.read_text()


@cache
def _files() -> frozenset[str]:
    found = set()
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".cpp", ".c", ".h") and "node_modules" not in path.parts:
                found.add(str(path.relative_to(ROOT)))
    return frozenset(found)


@cache
def _modules() -> dict[str, list[Path]]:
    """Module basename -> its files (a package by its folder's name, as `engine`)."""
    found: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.parent.name if path.name == "__init__.py" else path.stem
        found.setdefault(name, []).append(path)
    return found


@cache
def _defines(path: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level, and its classes' members
    (so `module.Class.method` and a re-exported name resolve too)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")}
        names |= {p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()}
    return frozenset(names)


def _file_problem(ref: str) -> str | None:
    name = ref.lstrip("./")
    if any(f == name or f.endswith("/" + name) for f in _files()):
        return None
    return "no such file"


def _dotted_problem(ref: str) -> str | None:
    if ref.startswith("aici_cli."):
        parts = ref.removesuffix("()").split(".")
        for cut in range(len(parts), 0, -1):
            path = PACKAGE.parent.joinpath(*parts[:cut])
            origin = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            if origin.is_file():
                rest = parts[cut:]
                return None if not rest or rest[0] in _defines(origin) else "no such name"
        return "no such module"
    match = DOTTED_REF.fullmatch(ref)
    if match is None:
        return None
    module, name = match.group(1), match.group(2)
    if module in _modules():
        if any(name in _defines(path) for path in _modules()[module]) \
                or module in NOT_MODULES:
            return None
        return f"{module} defines no {name}"
    if module in NOT_MODULES or _importable(module):
        return None
    return f"no module named {module}"


@cache
def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def stale_references() -> list[str]:
    problems = []
    for where, text in _texts():
        for ref in REFERENCE.findall(text):
            ref = ref.strip()
            file_ref = FILE_REF.fullmatch(ref)
            problem = _file_problem(file_ref.group(1)) if file_ref else _dotted_problem(ref)
            if problem:
                problems.append(f"{where}: `{ref}`: {problem}")
    return problems


def test_every_reference_in_docstrings_and_docs_resolves() -> None:
    assert stale_references() == []


def test_a_renamed_module_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: the same text naming a module that is not there fails."""
    monkeypatch.setattr("test_references._texts", lambda: iter([
        ("x.py", "see `kernels/int_mm.py` and `int_mm.unusable`"),
        ("y.py", "see `models/vnni_kernels.py`, `vnni_kernels.unusable`, `int_mm.nothing`"),
    ]))
    assert stale_references() == [
        "y.py: `models/vnni_kernels.py`: no such file",
        "y.py: `vnni_kernels.unusable`: no module named vnni_kernels",
        "y.py: `int_mm.nothing`: int_mm defines no nothing",
    ]


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
