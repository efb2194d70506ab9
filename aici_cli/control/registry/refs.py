"""OCI references: `oci://REGISTRY/NAME:TAG`, `oci://REGISTRY/NAME@sha256:...`.

The grammar is the distribution spec's: a repository name of lower-case path components,
a tag of up to 128 characters, a sha256 digest. The registry host is required (there is
no default registry): a first component with a dot or a port, or `localhost`.

Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from aici_cli.core.errors import UsageError

SCHEME = "oci://"
DEFAULT_TAG = "latest"

_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


class RefError(UsageError):
    """A reference that does not parse; the message says which part and why."""


@dataclass(frozen=True)
class OciRef:
    registry: str  # host[:port]
    repository: str  # "team/yes-no"
    tag: str | None = None
    digest: str | None = None  # "sha256:<64 hex>": when set, it names the artifact

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def reference(self) -> str:
        """What the registry's manifest endpoint is asked for: the digest, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def pinned(self, digest: str) -> OciRef:
        return replace(self, digest=digest)

    def by_digest(self) -> str:
        """`oci://REGISTRY/NAME@sha256:...`: the artifact itself, whatever tag named it."""
        assert self.digest is not None
        return f"{SCHEME}{self.name}@{self.digest}"

    def __str__(self) -> str:
        text = f"{SCHEME}{self.name}"
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text


def is_oci(spec: str | None) -> bool:
    return spec is not None and spec.startswith(SCHEME)


def parse_ref(text: str, scheme_required: bool = False) -> OciRef:
    """Parse `[oci://]REGISTRY/NAME[:TAG][@sha256:HEX]` (no tag and no digest: `latest`).
    Raises RefError with a one-line reason."""
    spec = text
    if spec.startswith(SCHEME):
        spec = spec[len(SCHEME):]
    elif scheme_required:
        raise RefError(f"{text!r} is not an OCI reference (oci://REGISTRY/NAME:TAG)")
    host, slash, rest = spec.partition("/")
    if not slash or not rest:
        raise RefError(f"{text!r} names no repository: give oci://REGISTRY/NAME:TAG")
    if not _HOST.fullmatch(host) or not ("." in host or ":" in host or host == "localhost"):
        raise RefError(
            f"{text!r}: {host!r} is not a registry host; the reference starts with the "
            "registry, e.g. oci://ghcr.io/team/yes-no:1.0 or oci://localhost:5000/yes-no:1.0"
        )
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise RefError(f"{text!r}: {digest!r} is not a sha256 digest "
                           "(sha256: and 64 lower-case hex digits)")
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise RefError(f"{text!r}: {tag!r} is not a valid tag (letters, digits, '_', "
                           "'.', '-'; at most 128; not starting with '.' or '-')")
    if not _REPOSITORY.fullmatch(rest):
        raise RefError(f"{text!r}: {rest!r} is not a valid repository name (lower-case "
                       "letters and digits, separated by '.', '_', '-' or '/')")
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return OciRef(host, rest, tag, digest)
