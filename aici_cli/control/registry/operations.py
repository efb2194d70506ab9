"""`publish`, `pull`, and the `--controller oci://...` of a run.

Pulling by digest needs no network once the artifact is cached; pulling by tag asks the
registry which digest the tag names now (one manifest request) and downloads only what
the cache lacks. Every byte is checked against the digest that names it: the manifest
against the reference's digest, each blob against the manifest's descriptor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aici_cli.control.registry.artifact import (
    CONFIG_MEDIA_TYPE,
    LAYER_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    MAX_COMPONENT_BYTES,
    MAX_CONFIG_BYTES,
    Layout,
    describe,
    manifest,
    read_manifest,
    sha256_digest,
)
from aici_cli.control.registry.client import Credentials, RegistryClient, RegistryError
from aici_cli.control.registry.refs import OciRef, parse_ref
from aici_cli.control.registry.store import ArtifactStore


@dataclass(frozen=True)
class Published:
    ref: OciRef  # pinned: its digest is the manifest's
    size: int  # the component's bytes
    annotations: dict[str, str]


@dataclass(frozen=True)
class Pulled:
    ref: OciRef  # pinned (the tag, if one named it, kept for display)
    wasm: Path  # the component in the cache
    annotations: dict[str, str]
    config: dict[str, Any]
    downloaded: bool  # False: the registry was not asked at all, or only for the tag


def publish(component: Path, ref: OciRef, plain_http: bool = False,
            credentials: Credentials | None = None,
            store: ArtifactStore | None = None) -> Published:
    """Push `component` (checked first: it must be a controller this host runs) to `ref`'s
    tag, in the wasm artifact layout; the artifact is cached here too."""
    if ref.digest is not None:
        raise RegistryError(f"{ref}: publish to a tag (oci://REGISTRY/NAME:TAG); the "
                            "digest is what the registry gives back")
    described = describe(component, ref.tag)
    client = RegistryClient(ref.registry, plain_http, credentials)
    client.push_blob(ref, described.wasm, LAYER_MEDIA_TYPE)
    client.push_blob(ref, described.config, CONFIG_MEDIA_TYPE)
    raw = manifest(described)
    digest = client.push_manifest(ref, raw, MANIFEST_MEDIA_TYPE)
    _cache(store or ArtifactStore(), ref.pinned(digest), raw,
           {sha256_digest(described.wasm): described.wasm,
            sha256_digest(described.config): described.config})
    return Published(ref.pinned(digest), len(described.wasm), described.annotations)


def _cache(store: ArtifactStore, ref: OciRef, raw: bytes, blobs: dict[str, bytes]) -> None:
    import tempfile

    for digest, data in blobs.items():
        if store.blob(digest) is None:
            store.incoming.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=store.incoming, delete=False,
                                             prefix=".push-") as f:
                f.write(data)
            store.add_blob(digest, Path(f.name))
    assert ref.digest is not None
    store.add_manifest(ref.digest, raw)
    store.remember_tag(ref, ref.digest)


def pull(ref: OciRef, plain_http: bool = False, credentials: Credentials | None = None,
         store: ArtifactStore | None = None) -> Pulled:
    """The artifact `ref` names, in the cache. By digest and cached: no network at all."""
    store = store or ArtifactStore()
    if ref.digest is not None:
        cached = _from_cache(store, ref)
        if cached is not None:
            return cached
    client = RegistryClient(ref.registry, plain_http, credentials)
    try:
        raw = client.manifest(ref, MANIFEST_MEDIA_TYPE)
    except RegistryError as e:
        raise RegistryError(str(e) + _offline_hint(store, ref)) from None
    digest = sha256_digest(raw)
    if ref.digest is not None and digest != ref.digest:
        raise RegistryError(f"{ref}: digest mismatch: the registry served a manifest whose "
                            f"digest is {digest}; nothing was kept")
    pinned = ref.pinned(digest)
    layout = _layout(raw, pinned)
    config_digest, wasm_digest = layout.config["digest"], layout.layer["digest"]
    fetched = False
    config_path = store.blob(config_digest)
    if config_path is None:
        config_path = store.add_blob(config_digest, client.blob_to_file(
            pinned, config_digest, layout.config["size"], MAX_CONFIG_BYTES, store.incoming))
        fetched = True
    config = _config(config_path, pinned, wasm_digest)
    wasm = store.blob(wasm_digest)
    if wasm is None:
        wasm = store.add_blob(wasm_digest, client.blob_to_file(
            pinned, wasm_digest, layout.layer["size"], MAX_COMPONENT_BYTES, store.incoming))
        fetched = True
    store.add_manifest(digest, raw)
    store.remember_tag(ref, digest)
    return Pulled(pinned, wasm, layout.annotations, config, fetched)


def _from_cache(store: ArtifactStore, ref: OciRef) -> Pulled | None:
    assert ref.digest is not None
    raw = store.manifest(ref.digest)
    if raw is None:
        return None
    layout = _layout(raw, ref)
    config_path = store.blob(layout.config["digest"])
    wasm = store.blob(layout.layer["digest"])
    if config_path is None or wasm is None:
        return None
    return Pulled(ref, wasm, layout.annotations, _config(config_path, ref,
                                                         layout.layer["digest"]), False)


def _layout(raw: bytes, ref: OciRef) -> Layout:
    try:
        return read_manifest(raw, str(ref))
    except ValueError as e:
        raise RegistryError(str(e)) from None


def _config(path: Path, ref: OciRef, wasm_digest: str) -> dict[str, Any]:
    """The artifact's config, checked: it names this layer, and the component exports a
    contract version this host links."""
    try:
        config = json.loads(path.read_bytes())
    except ValueError:
        raise RegistryError(f"{ref}: the artifact's config is not JSON") from None
    if not isinstance(config, dict):
        raise RegistryError(f"{ref}: the artifact's config is not a JSON object")
    listed = config.get("layerDigests")
    if isinstance(listed, list) and listed and listed != [wasm_digest]:
        raise RegistryError(f"{ref}: the artifact's config lists the layers {listed}, "
                            f"but its manifest has {wasm_digest}")
    component = config.get("component")
    exports = component.get("exports") if isinstance(component, dict) else None
    if isinstance(exports, list):
        _check_contract(ref, [str(e) for e in exports])
    return config


def _check_contract(ref: OciRef, exports: list[str]) -> None:
    from aici_cli.control.wasm.signatures import CONTRACTS

    known = [c.controller for c in CONTRACTS]
    if any(e in known for e in exports):
        return
    mine = [e for e in exports if e.startswith("aici:controller/")]
    what = (f"it exports {', '.join(mine)}" if mine
            else f"it exports {', '.join(exports) or 'nothing'}, no aici:controller")
    raise RegistryError(f"{ref}: {what}, which this host cannot link (it links "
                        f"{' and '.join(known)}); rebuild it against this aici-batch's "
                        "`aici-batch wit`")


def _offline_hint(store: ArtifactStore, ref: OciRef) -> str:
    last = store.last_digest(ref)
    if ref.digest is None and last is not None and store.manifest(last) is not None:
        return (f"; this tag named {last} when last pulled here, which is cached: "
                f"--controller {ref.pinned(last).by_digest()} runs offline")
    return ""


# --- a run's --controller ---------------------------------------------------------------

def pin_controller(spec: str, plain_http: bool = False) -> Pulled:
    """The `--controller oci://...` of a run, resolved once at its start (a tag to the
    digest it names now) and pulled into the cache: every line of the run uses it."""
    return pull(parse_ref(spec, scheme_required=True), plain_http)


def controller_file(spec: str) -> Path:
    """The file of a run's `--controller`: the path itself, or the cached component of a
    pinned `oci://` reference (see `pin_controller`)."""
    from aici_cli.control.registry.refs import is_oci

    return cached_component(spec) if is_oci(spec) else Path(spec)


def cached_component(spec: str) -> Path:
    """The cached component of a pinned `oci://...@sha256:...` reference (no network)."""
    ref = parse_ref(spec, scheme_required=True)
    if ref.digest is None:
        raise RegistryError(f"{spec}: not pinned to a digest")
    pulled = _from_cache(ArtifactStore(), ref)
    if pulled is None:
        raise RegistryError(f"{spec} is not in the component cache")
    return pulled.wasm
