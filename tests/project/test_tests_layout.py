"""The tests mirror the package (docs/testing.md): a test of `aici_cli/X/Y` sits in
tests/X/Y/ (or in tests/X/ where a folder of its own would hold one file), the guest
SDK's tests in tests/sdk/, the checks of the whole project in tests/project/. Every helper
module sits in tests/support/ (on pytest's `pythonpath`: `from tiny_model import ...`),
tests/conftest.py alone at the top; tests/data and tests/guests hold fixtures and guest
sources."""

from __future__ import annotations

from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

import pytest
from paths import ROOT, SUPPORT, TESTS

PACKAGE = ROOT / "aici_cli"
OWN_FOLDERS = ("sdk", "project")  # test folders that are not packages of aici_cli
NOT_TESTS = ("support", "data", "guests")  # helpers, fixtures, guest sources


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.relative_to(TESTS).parts[0]
                  not in ("data", "guests"))


def _test_files() -> list[Path]:
    return [p for p in _python_files() if p.name.startswith("test_")]


def test_every_test_sits_in_the_folder_of_what_it_tests() -> None:
    misplaced = []
    for path in _test_files():
        parts = path.parent.relative_to(TESTS).parts
        if parts[:1] in ((name,) for name in OWN_FOLDERS):
            continue
        if not parts or parts[0] in NOT_TESTS \
                or not (PACKAGE.joinpath(*parts) / "__init__.py").is_file():
            misplaced.append(str(path.relative_to(TESTS)))
    assert misplaced == [], "test files outside a folder named for a package of aici_cli"


def test_every_helper_sits_in_support() -> None:
    helpers = [p for p in _python_files() if not p.name.startswith("test_")
               and p != TESTS / "conftest.py" and p.parent != SUPPORT]
    assert [str(p.relative_to(TESTS)) for p in helpers] == []
    assert [p.name for p in SUPPORT.glob("test_*.py")] == []
    # pytest's default import mode: each test module imported by its file name, so no
    # package markers, and no two test files (or a test and a helper) of one name.
    assert [str(p.relative_to(ROOT)) for p in TESTS.rglob("__init__.py")] == []
    names = Counter(p.name for p in _python_files() if p.name != "conftest.py")
    assert sorted(name for name, n in names.items() if n > 1) == []


def test_no_test_folder_is_left_out_of_collection(pytestconfig: pytest.Config) -> None:
    """A folder pytest does not recurse into (`norecursedirs`: `build`, `dist`, `venv`,
    ...) would drop its tests silently."""
    patterns = pytestconfig.getini("norecursedirs")
    folders = {p.parent.relative_to(TESTS) for p in _test_files()}
    skipped = sorted(str(folder) for folder in folders
                     if any(fnmatch(part, pattern) for part in folder.parts
                            for pattern in patterns))
    assert skipped == []
