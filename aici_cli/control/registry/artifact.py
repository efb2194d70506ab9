"""The CNCF wasm OCI artifact layout, for a controller component.

An OCI image manifest with a config of media type `application/vnd.wasm.config.v0+json`
and one `application/wasm` layer, the component's bytes. The config says what the
component exports and imports (`component.exports`/`imports`, `os: wasip2` as the
layout asks of components, `layerDigests`); the manifest's annotations say what a team
needs to know before running it: the WIT package and version it exports, the language,
SDK and toolchain that built it, and the digest of its source (from the section
`aici-batch build` leaves in it, `control/componentize/info.py`).

Torch-free; `describe` loads the component with wasmtime (the compile cache makes that
~30 ms after the first time).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.wasm.config.v0+json"
LAYER_MEDIA_TYPE = "application/wasm"

# Annotation keys: the OCI image spec's where one exists, else this project's namespace.
CREATED = "org.opencontainers.image.created"
TITLE = "org.opencontainers.image.title"
VERSION = "org.opencontainers.image.version"
PREFIX = "dev.aici-batch."
WIT_PACKAGE = PREFIX + "wit.package"  # "aici:controller"
WIT_VERSION = PREFIX + "wit.version"  # "0.2.0"
WIT_EXPORT = PREFIX + "wit.export"  # "aici:controller/controller@0.2.0"
LANGUAGE = PREFIX + "language"  # "python" | "javascript" | "unknown"
SDK = PREFIX + "sdk"  # "aici_controller 0.1.0"
TOOLCHAIN = PREFIX + "toolchain"  # "componentize-py 0.25.1"
SOURCE = PREFIX + "source"  # the source file's name
SOURCE_DIGEST = PREFIX + "source.digest"  # "sha256:<64 hex>"

MAX_MANIFEST_BYTES = 4 * 1024 * 1024  # the distribution spec's limit registries apply
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_COMPONENT_BYTES = 1 << 30


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Described:
    """A component ready to publish: its bytes, the config blob, the manifest annotations."""

    wasm: bytes
    config: bytes
    annotations: dict[str, str]
    export: str  # the contract interface it exports


def describe(component: Path, tag: str | None, created: datetime | None = None) -> Described:
    """Check that `component` is a controller this host runs (raises ComponentError, one
    line, otherwise) and lay out its config and annotations."""
    from aici_cli.control.componentize.info import read_build_info
    from aici_cli.control.wasm import ControllerComponent
    from aici_cli.control.wasm.component_file import read_wasm

    wasm = read_wasm(component)
    loaded = ControllerComponent.from_bytes(component, wasm)
    exports, imports = loaded.interfaces()
    export = loaded.contract.controller
    package, version = export.split("/", 1)[0], loaded.contract.version
    stamp = (created or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = {
        "created": stamp,
        "architecture": "wasm",
        "os": "wasip2",
        "layerDigests": [sha256_digest(wasm)],
        "component": {
            "exports": exports,
            "imports": imports,
            "target": f"{package}/controller-world@{version}",
        },
    }
    built = read_build_info(wasm) or {}
    annotations = {
        CREATED: stamp,
        WIT_PACKAGE: package,
        WIT_VERSION: version,
        WIT_EXPORT: export,
        LANGUAGE: str(built.get("language", "unknown")),
        TITLE: component.with_suffix(".wasm").name,
    }
    if tag is not None:
        annotations[VERSION] = tag
    if "sdk" in built:
        annotations[SDK] = f"{built['sdk']} {built.get('sdk_version', '')}".strip()
    for key, field in ((TOOLCHAIN, "toolchain"), (SOURCE, "source"),
                       (SOURCE_DIGEST, "source_digest")):
        if field in built:
            annotations[key] = str(built[field])
    return Described(wasm, canonical(config), annotations, export)


def canonical(obj: Any) -> bytes:
    """The bytes of a JSON blob or manifest as pushed (its digest is of these bytes)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def descriptor(media_type: str, data: bytes, annotations: dict[str, str] | None = None
               ) -> dict[str, Any]:
    d: dict[str, Any] = {"mediaType": media_type, "digest": sha256_digest(data),
                         "size": len(data)}
    if annotations:
        d["annotations"] = annotations
    return d


def manifest(described: Described) -> bytes:
    return canonical({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": descriptor(CONFIG_MEDIA_TYPE, described.config),
        "layers": [descriptor(LAYER_MEDIA_TYPE, described.wasm,
                              {TITLE: described.annotations[TITLE]})],
        "annotations": described.annotations,
    })


@dataclass(frozen=True)
class Layout:
    """What a pulled manifest points at, checked against the layout."""

    config: dict[str, Any]  # descriptor
    layer: dict[str, Any]  # descriptor of the component
    annotations: dict[str, str]


def read_manifest(raw: bytes, where: str) -> Layout:
    """The config and component descriptors of a manifest, or ValueError saying how it
    departs from the wasm artifact layout (`where` names it in the message)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise ValueError(f"{where}: the manifest is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: the manifest is not a JSON object")
    media = doc.get("mediaType", MANIFEST_MEDIA_TYPE)
    if media != MANIFEST_MEDIA_TYPE:
        raise ValueError(f"{where} is a {media}, not an OCI image manifest of a wasm "
                         "component")
    config = doc.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != CONFIG_MEDIA_TYPE:
        found = config.get("mediaType") if isinstance(config, dict) else None
        raise ValueError(f"{where} is not a wasm component artifact: its config is "
                         f"{found or 'missing'}, not {CONFIG_MEDIA_TYPE}")
    layers = doc.get("layers")
    wasm_layers = [x for x in layers if isinstance(x, dict)
                   and x.get("mediaType") == LAYER_MEDIA_TYPE] if isinstance(layers, list) else []
    if len(wasm_layers) != 1 or len(layers or []) != 1:
        raise ValueError(f"{where} is not a wasm component artifact: it has "
                         f"{len(layers or [])} layers, {len(wasm_layers)} of them "
                         f"{LAYER_MEDIA_TYPE} (the layout has exactly one)")
    for d in (config, wasm_layers[0]):
        if not isinstance(d.get("digest"), str) or not isinstance(d.get("size"), int):
            raise ValueError(f"{where}: a descriptor lacks its digest or size")
    annotations = doc.get("annotations") or {}
    if not isinstance(annotations, dict):
        annotations = {}
    return Layout(config, wasm_layers[0], {str(k): str(v) for k, v in annotations.items()})
