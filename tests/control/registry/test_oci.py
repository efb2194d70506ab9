"""Controllers as OCI artifacts, against a real registry (the CNCF distribution registry on
127.0.0.1, tests/support/oci_registry.py): publish, pull, and `run --controller oci://...`
by tag and by digest; a tampered blob, a wrong password, an unreachable registry, a
component whose WIT version this host cannot link; offline reruns from the cache; `--resume`
against a tag that moved. The Python and JavaScript examples go through it too."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import wasmtime
from click.testing import CliRunner
from oci_registry import Registry, free_port
from paths import ROOT
from wat import Guest, component, save, u32s

from aici_cli.cli.main import main
from aici_cli.control.registry import RefError, parse_ref
from aici_cli.control.registry.artifact import (
    CONFIG_MEDIA_TYPE,
    LAYER_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    SDK,
    SOURCE_DIGEST,
    WIT_EXPORT,
    WIT_PACKAGE,
    WIT_VERSION,
)
from aici_cli.formats.schemas import load_schema

ALLOW_5_7 = Guest("(call $sample-allow {allow})", data={"allow": u32s(5, 7)})
ALLOW_9 = Guest("(call $sample-allow {allow})", data={"allow": u32s(9)})
USER, PASSWORD = "ci-bot", "s3cret-pass"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("registry-auth"), users={USER: PASSWORD})
    yield reg
    reg.stop()


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private component cache (pulled artifacts and compiled components)."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))  # no user credentials
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "cache"


def cli(*args: str, input: str | None = None) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), input=input)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stdout, res.stderr


def publish(path: Path, ref: str, *extra: str) -> str:
    code, out, err = cli("publish", str(path), ref, "--plain-http", *extra)
    assert code == 0, err
    return out.strip()


def run(model: Path, controller: str, tmp: Path, *extra: str, lines: int = 2,
        plain: bool = True) -> tuple[int, list[dict[str, Any]], str, dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 4}) + "\n"
                           for i in range(lines)))
    out, stats = tmp / "out.jsonl", tmp / "stats.json"
    code, _, err = cli("run", str(inp), "-o", str(out), "--model", str(model),
                       "--dtype", "float32", "--device", "cpu", "-q", "--controller",
                       controller, "--stats-out", str(stats),
                       *(["--plain-http"] if plain else []), *extra)
    results = ([json.loads(x) for x in out.read_text().splitlines()]
               if out.exists() else [])
    summary = json.loads(stats.read_text()) if stats.exists() else {}
    return code, results, err, summary


def manifest_of(registry: Registry, name: str, reference: str) -> tuple[bytes, dict[str, Any]]:
    r = requests.get(f"http://{registry.host}/v2/{name}/manifests/{reference}",
                     headers={"Accept": MANIFEST_MEDIA_TYPE}, timeout=10)
    r.raise_for_status()
    return r.content, r.json()


def test_references_parse_or_say_why() -> None:
    ref = parse_ref("oci://localhost:5000/team/yes-no:1.0")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (
        "localhost:5000", "team/yes-no", "1.0", None)
    assert parse_ref("ghcr.io/x/y").tag == "latest"
    digest = "sha256:" + "ab" * 32
    pinned = parse_ref(f"oci://ghcr.io/x/y:v2@{digest}")
    assert pinned.digest == digest and pinned.by_digest() == f"oci://ghcr.io/x/y@{digest}"
    for bad, why in (("oci://yes-no:1.0", "no repository"), ("oci://team/yes-no", "registry host"),
                     ("oci://ghcr.io/Team/x", "repository name"),
                     ("oci://ghcr.io/x@sha256:12", "sha256 digest"),
                     ("oci://ghcr.io/x:-bad", "valid tag")):
        with pytest.raises(RefError, match=why):
            parse_ref(bad)


@pytest.mark.subprocess
def test_publish_pull_and_run_by_tag_and_by_digest(
        registry: Registry, cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    wasm = save(tmp_path, component(ALLOW_5_7))
    pinned = publish(wasm, f"{registry.host}/team/allow:v1")
    digest = pinned.rsplit("@", 1)[1]
    assert pinned == f"oci://{registry.host}/team/allow@{digest}"

    # The CNCF wasm layout, as the registry serves it.
    raw, doc = manifest_of(registry, "team/allow", "v1")
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    assert doc["config"]["mediaType"] == CONFIG_MEDIA_TYPE
    assert [layer["mediaType"] for layer in doc["layers"]] == [LAYER_MEDIA_TYPE]
    ann = doc["annotations"]
    assert (ann[WIT_PACKAGE], ann[WIT_VERSION], ann[WIT_EXPORT]) == (
        "aici:controller", "0.1.0", "aici:controller/controller@0.1.0")
    config = requests.get(f"http://{registry.host}/v2/team/allow/blobs/"
                          f"{doc['config']['digest']}", timeout=10).json()
    assert config["component"]["exports"] == ["aici:controller/controller@0.1.0"]
    assert config["layerDigests"] == [doc["layers"][0]["digest"]]

    # Pull by tag: the bytes are the component's.
    code, out, err = cli("pull", f"{registry.host}/team/allow:v1", "--plain-http", "-o",
                         str(tmp_path / "pulled.wasm"))
    assert code == 0, err
    assert out.strip() == pinned
    assert (tmp_path / "pulled.wasm").read_bytes() == bytes(wasmtime.wat2wasm(wasm.read_text()))

    by_tag = run(tiny_model_dir, f"oci://{registry.host}/team/allow:v1", tmp_path / "a")
    by_digest = run(tiny_model_dir, pinned, tmp_path / "b")
    for code, results, err, summary in (by_tag, by_digest):
        assert code == 0, err
        assert len(results) == 2
        for r in results:
            assert r["made_with"]["controller"] == pinned
        assert summary["controller"]["digest"] == digest
    assert [r["text"] for r in by_tag[1]] == [r["text"] for r in by_digest[1]]
    code, from_file, err, _ = run(tiny_model_dir, str(wasm), tmp_path / "file")
    assert code == 0, err
    assert [r["text"] for r in from_file] == [r["text"] for r in by_tag[1]]
    for _, results, _, summary in (by_tag, by_digest):
        jsonschema.validate(summary, load_schema("stats"))
        for r in results:
            jsonschema.validate(r, load_schema("result-line"))
    assert by_tag[3]["controller"]["source"] == f"oci://{registry.host}/team/allow:v1@{digest}"


@pytest.mark.subprocess
def test_later_runs_by_digest_work_offline_and_a_tag_says_which_digest_would(
        tmp_path_factory: pytest.TempPathFactory, cache: Path, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    reg = Registry(tmp_path_factory.mktemp("registry-offline"))
    try:
        pinned = publish(save(tmp_path, component(ALLOW_5_7)), f"{reg.host}/x/allow:v1")
        code, _, err, _ = run(tiny_model_dir, f"oci://{reg.host}/x/allow:v1", tmp_path / "a")
        assert code == 0, err
    finally:
        reg.stop()
    code, results, err, _ = run(tiny_model_dir, pinned, tmp_path / "b")
    assert code == 0, err
    assert all(r["made_with"]["controller"] == pinned for r in results)
    code, results, err, _ = run(tiny_model_dir, f"oci://{reg.host}/x/allow:v1", tmp_path / "c")
    assert code == 2 and results == []
    line = err.strip().splitlines()[-1]
    assert "cannot reach the registry" in line and f"--controller {pinned} runs offline" in line


@pytest.mark.subprocess
def test_a_tampered_blob_is_a_digest_mismatch_and_nothing_is_kept(
        registry: Registry, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wasm = save(tmp_path, component(ALLOW_9))
    publish(wasm, f"{registry.host}/team/tampered:v1")
    _, doc = manifest_of(registry, "team/tampered", "v1")
    blob = registry.blob_file(doc["layers"][0]["digest"])
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    blob.write_bytes(bytes(data))
    # A machine that never had it: only the registry's copy.
    (tmp_path / "other").mkdir()
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path / "other"))
    code, out, err = cli("pull", f"{registry.host}/team/tampered:v1", "--plain-http")
    assert code == 2 and out == ""
    assert "digest mismatch" in err and "tampered" in err
    assert len(err.strip().splitlines()) == 1
    assert not [p for p in (tmp_path / "other").rglob("*") if p.is_file()
                and p.stat().st_size == len(data)]


@pytest.mark.subprocess
def test_credentials_come_from_stdin_or_the_docker_config_and_a_wrong_one_is_refused(
        auth_registry: Registry, cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    wasm = save(tmp_path, component(ALLOW_5_7))
    ref = f"{auth_registry.host}/private/allow:v1"
    code, _, err = cli("publish", str(wasm), ref, "--plain-http")
    assert code == 2 and "asks for credentials" in err
    code, _, err = cli("publish", str(wasm), ref, "--plain-http", "--username", USER,
                       "--password-stdin", input="wrong\n")
    assert code == 2 and "refused the credentials" in err and "wrong" not in err
    code, _, err = cli("publish", str(wasm), ref, "--plain-http", "--username", USER)
    assert code == 2 and "never taken from the command line" in err
    code, out, err = cli("publish", str(wasm), ref, "--plain-http", "--username", USER,
                         "--password-stdin", input=PASSWORD + "\n")
    assert code == 0, err
    pinned = out.strip()
    # A run reads the Docker config ($DOCKER_CONFIG/config.json), as `docker login` writes it.
    docker = tmp_path / "docker"
    docker.mkdir(exist_ok=True)
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (docker / "config.json").write_text(json.dumps({"auths": {auth_registry.host: {
        "auth": token}}}))
    shutil.rmtree(cache, ignore_errors=True)  # nothing cached: the registry must answer
    code, results, err, _ = run(tiny_model_dir, f"oci://{ref}", tmp_path / "r")
    assert code == 0, err
    assert all(r["made_with"]["controller"] == pinned for r in results)
    (docker / "config.json").write_text(json.dumps({"auths": {auth_registry.host: {
        "auth": base64.b64encode(f"{USER}:nope".encode()).decode()}}}))
    code, _, err = cli("pull", ref, "--plain-http")
    assert code == 2 and "refused the credentials" in err


@pytest.mark.subprocess
def test_a_component_this_host_cannot_link_is_refused_at_pull_and_at_run(
        registry: Registry, cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Pushed by another tool (no `publish` check): a contract version from the future."""
    from aici_cli.control.registry.artifact import canonical, descriptor
    from aici_cli.control.registry.client import RegistryClient

    text = component(ALLOW_5_7).replace("@0.1.0", "@9.9.0")
    wasm = bytes(wasmtime.wat2wasm(text))
    config = canonical({"architecture": "wasm", "os": "wasip2", "component": {
        "exports": ["aici:controller/controller@9.9.0"], "imports": []}})
    ref = parse_ref(f"{registry.host}/team/future:v1")
    client = RegistryClient(registry.host, plain_http=True)
    client.push_blob(ref, wasm, LAYER_MEDIA_TYPE)
    client.push_blob(ref, config, CONFIG_MEDIA_TYPE)
    raw = canonical({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                     "config": descriptor(CONFIG_MEDIA_TYPE, config),
                     "layers": [descriptor(LAYER_MEDIA_TYPE, wasm)]})
    client.push_manifest(ref, raw, MANIFEST_MEDIA_TYPE)
    code, _, err = cli("pull", str(ref), "--plain-http")
    assert code == 2 and "aici:controller/controller@9.9.0" in err and "cannot link" in err
    code, results, err, _ = run(tiny_model_dir, str(ref), tmp_path / "r")
    assert code == 2 and results == [] and "cannot link" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.subprocess
def test_an_unreachable_registry_or_missing_tls_is_one_line_at_once(
        registry: Registry, cache: Path, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.monotonic()
    code, _, err = cli("pull", f"127.0.0.1:{free_port()}/x/y:v1", "--plain-http")
    assert code == 2 and "cannot reach the registry" in err and "refused" in err
    assert time.monotonic() - t0 < 10  # no retries with sleeps
    code, results, err, _ = run(tiny_model_dir, f"oci://{registry.host}/team/allow:nope",
                                tmp_path / "r", plain=False)
    assert code == 2 and results == []
    assert "--plain-http" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("AICI_BATCH_PLAIN_HTTP", "1")  # as oras and helm spell it
    code, _, err = cli("pull", f"{registry.host}/team/never:v1")
    assert code == 2 and "no such artifact" in err  # reached, over HTTP


@pytest.mark.subprocess
def test_resume_refuses_results_of_another_digest_behind_the_same_tag(
        registry: Registry, cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    ref = f"oci://{registry.host}/team/moving:stable"
    first = publish(save(tmp_path, component(ALLOW_5_7)), ref)
    work = tmp_path / "w"
    code, results, err, _ = run(tiny_model_dir, ref, work, lines=3)
    assert code == 0, err
    out = work / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in results[:1]))  # one line done
    second = publish(save(tmp_path, component(ALLOW_9)), ref)  # the tag moves
    assert second != first
    code, _, err, _ = run(tiny_model_dir, ref, work, "--resume", lines=3)
    assert code == 2
    assert first.split("@")[1] in err and second.split("@")[1] in err
    code, results, err, _ = run(tiny_model_dir, first, work, "--resume", lines=3)
    assert code == 0, err  # pinned to the first digest: the results agree
    assert len(results) == 3 and {r["made_with"]["controller"] for r in results} == {first}


@pytest.mark.subprocess
@pytest.mark.parametrize("language", ["python", "javascript"])
def test_the_example_controllers_publish_and_run_by_digest_as_from_their_file(
        language: str, registry: Registry, tiny_model_dir: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """Built by `aici-batch build` (which records language, SDK and source digest), pushed,
    pulled and run: the same results as the local file. The default cache, so that the
    session's compiled examples are reused (the artifacts are keyed by digest)."""
    builds = request.getfixturevalue("built" if language == "python" else "built_js")
    wasm = builds["yes_no"]
    source = (ROOT / "controllers" / "examples" / "yes_no.py" if language == "python"
              else ROOT / "controllers" / "js" / "examples" / "yes_no.js")
    pinned = publish(wasm, f"{registry.host}/examples/yes-no-{language}:1.0")
    _, doc = manifest_of(registry, f"examples/yes-no-{language}", "1.0")
    ann = doc["annotations"]
    assert ann["dev.aici-batch.language"] == language
    assert ann[SOURCE_DIGEST] == "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()
    assert ann[SDK].startswith("aici_controller " if language == "python" else "aici-controller ")
    assert ann[WIT_EXPORT] == "aici:controller/controller@0.2.0"
    code, from_oci, err, _ = run(tiny_model_dir, pinned, tmp_path / "oci")
    assert code == 0, err
    code, from_file, err, _ = run(tiny_model_dir, str(wasm), tmp_path / "file")
    assert code == 0, err
    assert [(r["text"], r.get("outputs")) for r in from_oci] == [
        (r["text"], r.get("outputs")) for r in from_file]
