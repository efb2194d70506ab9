"""Shared fixtures: one tiny random model per test session; the example controllers built
once per session; the JavaScript toolchain's presence; the `real_model` and `ray` markers;
the marks of the fast loop (`slow`, `build`, `subprocess`, `heavy`), and the check that
keeps `subprocess` exact."""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tiny_model import build_tiny_model

from aici_cli.core.cache_paths import cache_dir

if TYPE_CHECKING:
    from aici_cli.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
# `aici-batch run` in the tests (CliRunner in this process, and the runs they start as
# processes, which inherit it) runs its engine inline, in the run's own process: fast, and
# monkeypatches reach it. tests/run/backends/test_engine_process.py runs the engine process
# itself.
os.environ.setdefault("AICI_BATCH_ENGINE_PROCESS", "inline")
# Loads in the tests skip the kernel probe (a child process per mode and cache folder,
# and many tests use a cache folder of their own); tests/models/kernels/test_kernel_probe.py
# and the kernel-path matrix (tests/models/kernels/test_kernel_matrix.py) run it.
os.environ.setdefault("AICI_BATCH_KERNEL_PROBE", "off")
# A `--compile auto` run starts no builder process of the compiled steps it lacks (one
# would outlive its test); tests/engine/forward/test_step_builds.py starts them.
os.environ.setdefault("AICI_BATCH_STEP_BUILDS", "off")
# Set by .ci/run (after `make setup` installed the JavaScript toolchain): there the
# JavaScript tests fail instead of skipping when node or componentize-js is missing.
REQUIRE_JS = "AICI_REQUIRE_JS"


def pytest_sessionstart(session: pytest.Session) -> None:
    """The project's int kernels (models/kernels/int_mm.py) built where the cache lacks
    them (~6 s, once per machine and source) and loaded, before any test: a test that
    loads a quantised model then starts no compiler (its process's reading is cached)."""
    from aici_cli.models.kernels import int_mm

    int_mm.unusable()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_model: uses the default SmolLM2 model (first run converts its GGUF, ~25 s)",
    )
    config.addinivalue_line(
        "markers",
        "ray: starts a local Ray instance (the `ray` extra); `pytest -m ray` runs these alone",
    )


# ------------------------------------------------------------------------ the fast loop
# `pytest -m "not slow"` is the loop to run while developing, and `make test-fast` runs
# it (docs/testing.md). A test is `slow` when it is marked `real_model`, `ray`, `cuda`,
# `build`, `subprocess` or `heavy`; nothing is marked `slow` by hand. The marks are the
# test files' own (`@pytest.mark.subprocess` above the test), except `build`, given here
# at collection:
#   - `build`: the test uses a fixture of BUILD_FIXTURES (directly or through another
#     fixture): it needs the example controllers built from source (componentize-py or
#     componentize-js, 10-15 s each, and wasmtime's first compile of a JavaScript one ~30 s
#     more) or the JavaScript toolchain;
#   - `subprocess`: the test starts a process (`aici-batch` or a Python child, the engine
#     child, a registry server, bash, node, a componentizer, a C compiler, or the C++
#     compiler through torch.compile), or reads a build through `request.getfixturevalue`.
#     The mark is kept exact by `_starts_no_process`: a test that is not `slow` and starts
#     a process, or reads a build, fails and says to mark it;
#   - `heavy`: one of the tests that take 2 s or more (all their parameters together) on a
#     quiet 2-core machine (`pytest -m "not slow" --durations=0`): the exhaustive
#     cross-checks (every architecture, batch order or file layout against a reference)
#     and the whole runs they repeat; each of their modules keeps its quicker tests in the
#     loop.
BUILD_FIXTURES = frozenset({"built", "built_js", "js_toolchain", "node"})
SLOW_MARKERS = ("real_model", "ray", "cuda", "build", "subprocess", "heavy")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast loop's `build` and `slow` marks (above); then the `ray` tests last: a Ray
    driver in this process installs native fault handlers (SIGILL among them) over
    wasmtime's, so a wasm trap after it would kill the process. (`make test` runs them in a
    process of their own.) The sort is stable: the order within each group stays."""
    for item in items:
        if BUILD_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker("build")
        if any(item.get_closest_marker(mark) for mark in SLOW_MARKERS):
            item.add_marker("slow")
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)


class _ProcessStarts:
    """What the running test did that a test outside `slow` must not: processes it
    started (and builds it read), noted by the wrappers `_watch` installs."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.seen: list[str] = []

    def note(self, what: str) -> None:
        # matplotlib's first import on a machine builds its font cache with `fc-list`:
        # a one-time step of the machine, not the test's.
        if os.getpid() == self.pid and "'fc-list'" not in what:  # not in a forked child
            self.seen.append(what[:160])

    def wrap(self, owner: Any, name: str, describe: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def noting(*args: Any, **kwargs: Any) -> Any:
            self.note(describe(*args, **kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, noting)


PROCESS_STARTS = _ProcessStarts()


def _watch(starts: _ProcessStarts) -> None:
    """Every way a test starts a process: subprocess (run, check_output and asyncio's go
    through Popen), multiprocessing, and the os calls beneath them."""
    starts.wrap(subprocess.Popen, "__init__",
                lambda *args, **kwargs: repr(kwargs.get("args", args[1:2])))
    starts.wrap(multiprocessing.process.BaseProcess, "start",
                lambda *args, **_: f"multiprocessing {args[:1]!r}")
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        starts.wrap(os, name, lambda *args, _name=name, **_: f"os.{_name}{args[:1]!r}")


_watch(PROCESS_STARTS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    PROCESS_STARTS.seen.clear()  # from here on, the test's: its fixtures, then the test
    yield


@pytest.fixture(autouse=True)
def _starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test outside `slow` starts no process: if it did, it fails here, naming what."""
    yield
    if PROCESS_STARTS.seen and not request.node.get_closest_marker("slow"):
        seen = "; ".join(dict.fromkeys(PROCESS_STARTS.seen))
        pytest.fail(f"this test is not marked slow but started a process or read a build "
                    f"({seen}): mark it @pytest.mark.subprocess in "
                    f"{request.node.path.name}", pytrace=False)


# What every test shares of the cache folder: what a run makes once and that changes no
# run's output (converted models, compiled components and kernels, the machine checks'
# verdicts and the dense copies' trial, OCI pulls, their locks). The compiled steps are
# each test's own: a package one test built makes a later test's `--compile auto` run
# start compiled (and the draft gate choose otherwise), so a suite's outcome would hang
# on its order and on what `make demo` (`aici-batch prepare`) left in the cache before it.
SHARED_CACHE = cache_dir()
SHARED_CACHE_ENTRIES = ("models", "components", "kernel-probe", "kernels", "invariance", "oci",
                        "dense-trials", "locks")


@pytest.fixture(autouse=True)
def _own_compiled_steps(monkeypatch: pytest.MonkeyPatch,
                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`$AICI_BATCH_CACHE` for this test (its processes inherit it): the shared entries
    linked in, an empty `compiled-steps` of its own."""
    own = tmp_path_factory.mktemp("cache", numbered=True)
    for name in SHARED_CACHE_ENTRIES:
        (SHARED_CACHE / name).mkdir(parents=True, exist_ok=True)
        (own / name).symlink_to(SHARED_CACHE / name, target_is_directory=True)
    monkeypatch.setenv("AICI_BATCH_CACHE", str(own))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + byte-level BPE tokenizer with a chat template (~0.1 s to build).

    Session-scoped and shared: tests must not modify its files (copy it first).
    """
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def lm(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model loaded once for the session (fp32, cpu, ~1 s). Shared: tests must not
    change its weights or settings."""
    from aici_cli.models import load_model

    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture
def stub_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """A private conversion cache (`tmp_path/cache`), and the ~20 s GGUF conversion
    replaced by writing a stub config; returns the GGUF files converted."""
    from aici_cli.models.gguf import convert as gguf_convert

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    return calls


def require_js(problem: str | None) -> None:
    """Skip (or, with AICI_REQUIRE_JS set, fail) a JavaScript test that cannot run here."""
    if problem is None:
        return
    if os.environ.get(REQUIRE_JS):
        pytest.fail(f"{problem} ({REQUIRE_JS} is set: the JavaScript tests must run)")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def node() -> str:
    """The node executable (the JavaScript SDK's unit tests need nothing else)."""
    found = shutil.which("node")
    require_js(None if found else "node not found: the JavaScript SDK's tests need node >= 18")
    assert found is not None
    return found


@pytest.fixture(scope="session")
def js_toolchain() -> None:
    """node and the pinned componentize-js (`make setup` / `npm ci --prefix controllers/js`)."""
    from aici_cli.control.componentize.js import toolchain_problem

    require_js(toolchain_problem())


class Builds(Mapping[str, Path]):
    """Example components by name, each built on first use (a test that needs one example
    does not wait for the others)."""

    def __init__(self, src_dir: Path, suffix: str, out_dir: Path) -> None:
        self._src_dir, self._suffix, self._out_dir = src_dir, suffix, out_dir
        self._names = tuple(sorted(p.stem for p in src_dir.glob(f"*{suffix}")))
        self._done: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self._names:
            raise KeyError(name)
        PROCESS_STARTS.note(f"the example {name}{self._suffix} built")
        if name not in self._done:
            from aici_cli.control.componentize import build_controller

            src = self._src_dir / f"{name}{self._suffix}"
            self._done[name] = build_controller(src, self._out_dir / f"{name}.wasm").out
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """The Python examples (controllers/examples), built once per session (~10 s each)."""
    return Builds(ROOT / "controllers" / "examples", ".py", tmp_path_factory.mktemp("wasm"))


@pytest.fixture(scope="session")
def built_js(tmp_path_factory: pytest.TempPathFactory, js_toolchain: None) -> Builds:
    """The JavaScript examples (controllers/js/examples), built once per session (~15 s
    each; wasmtime's first compile of each takes ~30 s more: builds differ byte for byte,
    so each is compiled afresh)."""
    return Builds(ROOT / "controllers" / "js" / "examples", ".js",
                  tmp_path_factory.mktemp("wasm-js"))
