"""What the Python and JavaScript builders share: the error and result types, the WIT
contract's files and version, and running a componentizer.

A leaf of `componentize/`: it imports neither builder. Standard library only, so importing it
costs nothing (`aici-batch wit` reads the contract through it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORLD = "controller-world"

_CONTRACT = re.compile(r"^\s*package\s+aici:controller@(\d+\.\d+\.\d+)\s*;", re.MULTILINE)
# aici_cli/control/componentize/toolchain.py: parents[2] is aici_cli, parents[3] the checkout.
_PACKAGE_DIR = Path(__file__).resolve().parents[2]
REPO_DIR = _PACKAGE_DIR.parent


class BuildError(Exception):
    """A usage-level build failure with a message that says what to fix."""


@dataclass(frozen=True)
class BuildResult:
    out: Path
    size: int  # bytes
    seconds: float  # wall time of the whole build


def find_wit_dir() -> Path:
    """The WIT contract: the repository's `wit/`, else package data `aici_cli/wit`."""
    for candidate in (REPO_DIR / "wit", _PACKAGE_DIR / "wit"):
        if any(candidate.glob("*.wit")):
            return candidate
    raise BuildError("the WIT contract was not found (expected wit/controller.wit)")


def checked_wit_dir(given: Path | None) -> Path:
    """`given` when it holds .wit files, the contract when None; else a BuildError."""
    if given is None:
        return find_wit_dir()
    given = Path(given)
    if not any(given.glob("*.wit")):
        raise BuildError(f"{given}: no .wit files (expected the aici:controller contract)")
    return given


def wit_files(wit_dir: Path | None = None) -> list[Path]:
    """The contract's files, relative to `wit/`: `controller.wit` (package
    aici:controller), then each dependency under `deps/` (aici:storage, aici:tools), in
    name order."""
    root = wit_dir if wit_dir is not None else find_wit_dir()
    own = sorted(root.glob("*.wit"))
    deps = sorted(root.glob("deps/*/*.wit"))
    return [p.relative_to(root) for p in own + deps]


def wit_text() -> str:
    """The contract's text: every file of `wit_files`, each after a `// path` line."""
    root = find_wit_dir()
    return "\n".join(f"// wit/{rel.as_posix()}\n" + (root / rel).read_text(encoding="utf-8")
                     for rel in wit_files(root))


def write_wit(out_dir: Path) -> list[Path]:
    """Copy the contract to `out_dir` in the layout componentize-py and wit-parser read
    (`controller.wit`, `deps/storage/storage.wit`, `deps/tools/tools.wit`); returns the
    files written."""
    root = find_wit_dir()
    written = []
    for rel in wit_files(root):
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((root / rel).read_text(encoding="utf-8"), encoding="utf-8")
        written.append(target)
    return written


def contract_version(wit: Path) -> str:
    """The `aici:controller` version the WIT directory defines ("0.1.0")."""
    for path in sorted(wit.glob("*.wit")):
        m = _CONTRACT.search(path.read_text(encoding="utf-8"))
        if m:
            return m.group(1)
    raise BuildError(f"{wit}: no `package aici:controller@...` in its .wit files")


def run_toolchain(cmd: list[str], tool: str, explain: Callable[[str], str], src: Path,
                  built: Path, out: Path, timeout: float, cwd: Path | None = None) -> None:
    """Run a componentizer's command line and move the component it built to `out`; a
    failure is a BuildError with the tool's output cut to what says why (`explain`)."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{tool} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0 or not built.is_file():
        detail = explain(proc.stdout + "\n" + proc.stderr)
        raise BuildError(f"building {src} failed:\n{detail}")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built), str(out))
