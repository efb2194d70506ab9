"""The shape ARCHITECTURE.md promises a reader: every module of `aici_cli` sits in one of
the layers import-linter enforces (pyproject.toml), and no module, class or function
outgrows what a newcomer can hold.

Limits: a module at most 450 lines, a class at most 300, a function at most 60 unless a
comment in the lines just above its `def` (or its decorators) starts with `# Long:` and
says why."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from paths import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PACKAGE = ROOT / "aici_cli"
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 450, 300, 60


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layers(container: str | None = None) -> list[set[str]]:
    """The layers of the contract over `container` (None: the package's own, which names
    whole modules), each a set of names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"
                 and c.get("containers", [None]) == [container]]
    return [{name.strip() for part in layer.split("|") for name in part.split(":")}
            for layer in layers]


def test_every_module_is_in_one_layer() -> None:
    tops = {("aici_cli." + p.relative_to(PACKAGE).parts[0]).removesuffix(".py")
            for p in _sources() if p.parent != PACKAGE or p.name != "__init__.py"}
    named = [name for layer in _layers() for name in layer]
    assert sorted(n for n in set(named) if named.count(n) > 1) == []
    assert sorted(tops - set(named)) == [], "modules in no layer of pyproject.toml"
    assert sorted(set(named) - tops) == [], "layers name modules that do not exist"


def test_the_top_level_is_a_handful_of_packages() -> None:
    """At most 12 entries at the package's top level (ARCHITECTURE.md's table), and the
    engine's pass and logits each a sub-package of it."""
    entries = [p for p in PACKAGE.iterdir()
               if p.suffix == ".py" or (p / "__init__.py").is_file()]
    assert len(entries) <= 12, sorted(p.name for p in entries)
    assert all((PACKAGE / "engine" / sub / "__init__.py").is_file()
               for sub in ("forward", "logits"))


def test_the_models_layer_is_rooms() -> None:
    """`aici_cli/models/` keeps at most 8 modules at its top level; every entry sits in one
    layer of its contract, and every sub-package says in its docstring what it owns."""
    models = PACKAGE / "models"
    modules = [p for p in models.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 8, sorted(p.name for p in modules)
    subs = [p for p in models.iterdir() if (p / "__init__.py").is_file()]
    entries = {p.stem for p in modules} | {p.name for p in subs}
    named = [name for layer in _layers("aici_cli.models") for name in layer]
    assert sorted(n for n in set(named) if named.count(n) > 1) == []
    assert sorted(entries - set(named)) == [], "entries of models/ in no layer"
    assert sorted(set(named) - entries) == [], "layers name entries that do not exist"
    for sub in subs:
        doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text())) or ""
        assert len(doc.split()) >= 25, f"models/{sub.name}/__init__.py: say what it owns"


def _why_long(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    above = lines[max(0, first - 4) : first - 1]
    return any(line.strip().startswith("# Long:") for line in above)


def test_no_module_class_or_function_too_long() -> None:
    problems = []
    for path in _sources():
        src = path.read_text()
        lines = src.splitlines()
        where = path.relative_to(ROOT)
        if len(lines) > MODULE_LINES:
            problems.append(f"{where}: {len(lines)} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > CLASS_LINES:
                    problems.append(f"{where}: class {node.name}: {size} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > FUNCTION_LINES and not _why_long(lines, node):
                    problems.append(f"{where}: {node.name}(): {size} lines, no '# Long:' why")
    assert problems == []


def test_a_sampling_option_is_named_in_few_modules() -> None:
    """One definition per per-line option: core/sampling.py declares each sampling option
    (default, range, help, request name) and the CLI, the line formats, `made_with` and
    lm-eval derive from it, so adding one touches the definition, the sampler and a test.
    `min_p` stands for them all: at most two modules besides those two name it."""
    naming = sorted(str(p.relative_to(PACKAGE)) for p in _sources() if "min_p" in p.read_text())
    assert {"core/sampling.py", "engine/logits/sampler.py"} <= set(naming)
    assert len(naming) <= 4, naming
