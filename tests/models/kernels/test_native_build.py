"""The int kernels' library built in the background (`models/kernels/native_build.py`,
`int_mm.start_build`): a load starts it while the model resolves, `int_mm._load` waits for
it, and together they build it once; its files compile at once; a failing compiler
gives the same one-line reason whichever of them built. And a load's two kernel probes
run side by side (`models/load.py`). No test here compiles for real: a fake compiler
stands in (the real build is the session's first step, tests/conftest.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from aici_cli.core.errors import ModelError
from aici_cli.models import load as model_load
from aici_cli.models.kernels import int_mm, native_build
from aici_cli.models.kernels import probe as kernel_probe

VARIANT = int_mm.X86_VARIANTS[-1]  # any variant: the compiler is a fake


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder, and a process that has found no library yet (this
    process's own findings come back after the test)."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(int_mm.ENV, raising=False)
    monkeypatch.setattr(native_build, "_FOUND", {})
    monkeypatch.setattr(int_mm, "_load", functools.cache(int_mm._load.__wrapped__))
    monkeypatch.setattr(int_mm, "variant", lambda: VARIANT)
    return tmp_path / "cache"


def _wait_for_background_builds() -> None:
    for thread in threading.enumerate():
        if thread.name == "native-build":
            thread.join(30)


def test_a_build_in_the_background_and_load_build_the_library_once(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "fake-cc")
    monkeypatch.setenv("CXX", "fake-c++")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 0, stdout="fake 1.0\n"))  # the compilers' --version
    started, release = threading.Event(), threading.Event()
    built: list[tuple[Path, str]] = []

    def compile_library(path: Path, *args: object) -> str | None:
        built.append((path, threading.current_thread().name))
        started.set()
        assert release.wait(10)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        return None

    loaded: list[str] = []
    monkeypatch.setattr(native_build, "compile_library", compile_library)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(int_mm, "_register_fakes", lambda: loaded.append("fakes"))

    int_mm.start_build()
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    assert int_mm._load(VARIANT) is None  # waits for the build under way
    [(path, builder)] = built
    assert builder == "native-build" and path.parent == fresh / "kernels" and path.is_file()
    assert loaded == [str(path), "fakes"]

    int_mm.start_build()  # found already: nothing more
    _wait_for_background_builds()
    assert int_mm.unusable() is None and len(built) == 1 and len(loaded) == 2
    native_build._FOUND.clear()  # as another process: the cache's library, not built
    assert int_mm._library(VARIANT) == path and len(built) == 1


def test_no_build_starts_where_the_kernels_are_off_or_the_cpu_runs_none(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[object] = []
    monkeypatch.setattr(native_build, "in_background", lambda *a: started.append(a))
    monkeypatch.setenv(int_mm.ENV, "off")
    int_mm.start_build()
    monkeypatch.delenv(int_mm.ENV)
    monkeypatch.setattr(int_mm, "variant", lambda: "the CPU lacks avx2")
    int_mm.start_build()
    assert started == []


def test_a_load_starts_the_build_only_for_a_quantised_cpu_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    starts: list[None] = []
    monkeypatch.setattr(int_mm, "start_build", lambda: starts.append(None))
    missing = str(tmp_path / "no-such-model")
    for quantize, wanted in (("none", 0), ("int4", 1), ("auto", 2)):
        with pytest.raises(ModelError):  # after the start, before any conversion
            model_load.load_model(missing, "cpu", "float32", quantize)
        assert len(starts) == wanted


# A compiler that compiles nothing: `--version` answers; each compile (-c) waits until
# every file of the build has started (so it fails when they run one after another),
# then fails where $FAKE_FAIL says so, naming its file, or writes its object; the link
# writes the library.
FAKE_COMPILER = """\
import os, pathlib, sys, time
args = sys.argv[1:]
if args == ["--version"]:
    print("fake 1.0")
    sys.exit(0)
out = pathlib.Path(args[args.index("-o") + 1])
if "-c" in args:
    source = pathlib.Path(args[args.index("-c") + 1])
    marks = pathlib.Path(os.environ["FAKE_MARKS"])
    (marks / source.name).touch()
    deadline = time.monotonic() + 20
    while len(list(marks.iterdir())) < int(os.environ["FAKE_COMPILES"]):
        if time.monotonic() > deadline:
            sys.exit("error: the files compiled one after another")
        time.sleep(0.02)
    if os.environ.get("FAKE_FAIL"):
        sys.exit(f"note: a line before\\nerror: {source.name} failed")
out.write_bytes(b"")
"""


@pytest.mark.subprocess  # a fake compiler's processes
def test_the_files_compile_at_once_and_a_failure_reads_the_same_from_either_path(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compiler = tmp_path / "fake-cc"
    compiler.write_text(f"#!{sys.executable}\n{FAKE_COMPILER}")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("FAKE_COMPILES", str(len(int_mm._objects(VARIANT)) + 1))  # + C++

    def marks(name: str) -> None:
        (tmp_path / name).mkdir()
        monkeypatch.setenv("FAKE_MARKS", str(tmp_path / name))

    marks("ok")
    took = time.monotonic()
    path = int_mm._library(VARIANT)
    assert isinstance(path, Path) and path.is_file(), path
    assert time.monotonic() - took < 15
    assert not list(path.parent.glob(".int-*"))  # the temporary folder is gone

    monkeypatch.setenv("FAKE_FAIL", "1")
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "other-cache"))
    reasons = []
    for background in (True, False):
        native_build._FOUND.clear()
        int_mm._load.cache_clear()  # type: ignore[attr-defined]
        marks(f"failing-{background}")
        if background:
            int_mm.start_build()
        reasons.append(int_mm.unusable())
    # Every file failed; the reason is the first file's, as when they ran in order.
    assert reasons == ["building its library failed (error: generic.c failed)"] * 2


def test_the_int_kernels_probe_runs_beside_the_kernel_choice(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_load, "check_machine", lambda: None)
    monkeypatch.setattr(kernel_probe, "enabled", lambda: True)
    monkeypatch.setattr(int_mm, "unusable", lambda: None)
    in_probe, seen = threading.Event(), []

    def probed(shapes: kernel_probe.Shapes, dtype: str) -> kernel_probe.Verdict:
        in_probe.set()
        seen.append(dtype)
        return kernel_probe.Verdict(True)

    def choose(*args: object) -> kernel_probe.KernelChoice:
        assert in_probe.wait(10)  # the other probe started before this one ended
        return kernel_probe.KernelChoice("float32", "int4")

    monkeypatch.setattr(int_mm, "probed", probed)
    monkeypatch.setattr(model_load, "choose_kernels", choose)
    cpu = torch.device("cpu")
    choice = model_load._probed(tmp_path, cpu, "auto", "auto", torch.float32, "int4")
    assert (choice.dtype, choice.quantize) == ("float32", "int4") and seen == ["float32"]

    seen.clear()  # not for an unquantised run: its layers never ask it
    monkeypatch.setattr(model_load, "choose_kernels",
                        lambda *a: kernel_probe.KernelChoice("float32", "none"))
    model_load._probed(tmp_path, cpu, "auto", "none", torch.float32, "none")
    assert seen == []


@pytest.mark.subprocess
def test_a_build_folder_left_by_a_killed_process_is_swept_by_the_next_build(
        tmp_path: Path) -> None:
    """A process killed while its build ran leaves its temporary folder (no cleanup runs);
    the next build removes it once no build can still be using it, and keeps a folder a
    build may be using now."""
    slow = tmp_path / "slow-cc"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    fails = tmp_path / "failing-cc"
    fails.write_text("#!/bin/sh\necho 'no such flag' >&2\nexit 1\n")
    fails.chmod(0o755)
    folder = tmp_path / "kernels"
    built = folder / "libx.so"
    source = tmp_path / "x.c"
    source.write_text("int x;\n")
    code = ("import sys; from pathlib import Path; "
            "from aici_cli.models.kernels.native_build import compile_library; "
            f"compile_library(Path({str(built)!r}), {str(slow)!r}, [(Path({str(source)!r}), [])],"
            f" [], {str(slow)!r}, Path({str(source)!r}), [], [])")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not list(folder.glob(f"{native_build.TEMP_PREFIX}*")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    [left] = folder.glob(f"{native_build.TEMP_PREFIX}*")
    old = time.time() - native_build.STALE_S - 60
    os.utime(left, (old, old))
    running = folder / f"{native_build.TEMP_PREFIX}running"  # a build of now
    running.mkdir()
    problem = native_build.compile_library(built, str(fails), [(source, [])], [], str(fails),
                                           source, [], [])
    assert problem is not None and "no such flag" in problem
    assert not left.exists() and running.exists()
    assert not built.exists()
