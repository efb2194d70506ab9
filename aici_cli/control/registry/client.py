"""Talking to an OCI registry, through oras-py, with one-line errors.

oras-py does the HTTP: its session, the distribution API's URLs, blob uploads, and the
credentials of the Docker config (`~/.docker/config.json`, or `$DOCKER_CONFIG/config.json`,
credential helpers included). Three things are adjusted here:
- no retries: oras retries a failed request 5 times with sleeps of 3 to 83 s; an
  unreachable registry is one clear error at once instead;
- the challenge decides the scheme: a registry that answers `WWW-Authenticate: Basic`
  (the distribution registry with htpasswd) gets HTTP basic auth, one that answers
  `Bearer` (ghcr.io, Docker Hub, Harbor) gets oras's token exchange;
- every failure is a `RegistryError` whose message says what to do.

TLS is verified; `plain_http` (`--plain-http`, as oras and helm spell it) speaks HTTP
instead, for a local or in-cluster registry, and is never the default.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aici_cli.control.registry.refs import OciRef
from aici_cli.core.errors import UsageError

TIMEOUT_S = 30.0  # per request: connect and each read


class RegistryError(UsageError):
    """A registry operation failed: unreachable, refused credentials, no such artifact,
    a digest that does not match. One line; the CLI exits 2."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = ""

    def __repr__(self) -> str:  # never print a password
        return f"Credentials(username={self.username!r})"


def docker_configs() -> list[str]:
    """Docker config files to read credentials from besides `~/.docker/config.json`,
    which oras always reads: `$DOCKER_CONFIG/config.json` (Docker's own variable)."""
    folder = os.environ.get("DOCKER_CONFIG")
    if folder and Path(folder, "config.json").is_file():
        return [str(Path(folder, "config.json"))]
    return []


def _oras() -> Any:
    try:
        import oras.provider
    except ImportError:
        raise RegistryError("OCI registries need oras: pip install 'aici-batch[oci]'") from None
    logging.getLogger("oras.logger").setLevel(logging.CRITICAL)  # errors are ours to say
    return oras


def _registry_class() -> Any:
    """oras's `Registry` with the adjustments of the module docstring."""
    oras = _oras()
    from oras.auth.token import TokenAuth

    class ChallengeAuth(TokenAuth):  # type: ignore[misc]
        def authenticate_request(self, original: Any, headers: dict[str, str],
                                 refresh: bool = False) -> tuple[dict[str, str], bool]:
            challenge = original.headers.get("Www-Authenticate", "")
            if challenge.lower().startswith("basic"):
                basic = getattr(self, "_basic_auth", None)
                if not basic:
                    return headers, False
                self.basic = True  # later requests send it at once (no 401 round trip)
                return {**(headers or {}), "Authorization": f"Basic {basic}"}, True
            return super().authenticate_request(original, headers, refresh)  # type: ignore[no-any-return]

    base = oras.provider.Registry
    unretried = base.do_request.__wrapped__  # functools.wraps keeps the undecorated one

    class Registry(base):  # type: ignore[misc, valid-type]
        def __init__(self, plain_http: bool) -> None:
            super().__init__(insecure=plain_http)
            auth = ChallengeAuth()
            auth.session, auth.prefix, auth._tls_verify = self.session, self.prefix, True
            self.auth = auth
            self.session.request = _with_timeout(self.session.request)

        def do_request(self, url: str, method: str = "GET", **kwargs: Any) -> Any:
            if getattr(self.auth, "basic", False):
                kwargs["headers"] = {**(kwargs.get("headers") or {}),
                                     "Authorization": f"Basic {self.auth._basic_auth}"}
            return unretried(self, url, method, **kwargs)

    return Registry


def _with_timeout(request: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", TIMEOUT_S)
        return request(*args, **kwargs)

    return timed


class RegistryClient:
    """One registry, for one command: manifests and blobs by digest, pushed and pulled."""

    def __init__(self, registry: str, plain_http: bool = False,
                 credentials: Credentials | None = None) -> None:
        self.registry = registry
        self.plain_http = plain_http
        self._oras = _registry_class()(plain_http)
        if credentials is not None:
            self._oras.auth.set_basic_auth(credentials.username, credentials.password)
        self._credentials = credentials
        self._configs_loaded = False

    # --- reading ------------------------------------------------------------------------

    def manifest(self, ref: OciRef, accept: str) -> bytes:
        """The raw bytes of the manifest `ref` names (by digest or tag)."""
        url = f"{self._base(ref)}/manifests/{ref.reference}"
        response = self._request(ref, url, "GET", headers={"Accept": accept})
        if response.status_code == 404:
            raise RegistryError(f"{ref}: no such artifact in {self.registry} "
                                f"({ref.repository} has no {ref.reference!r})")
        self._check(ref, response, "reading the manifest")
        return bytes(response.content)

    def blob_to_file(self, ref: OciRef, digest: str, size: int, limit: int,
                     folder: Path) -> Path:
        """Download the blob `digest` into a new file in `folder`; its bytes must hash to
        `digest` and number `size` (at most `limit`), else RegistryError and no file."""
        if size > limit:
            raise RegistryError(f"{ref}: the blob {digest} is {size:,} bytes, over the "
                                f"{limit:,} this host accepts")
        url = f"{self._base(ref)}/blobs/{digest}"
        response = self._request(ref, url, "GET", stream=True)
        self._check(ref, response, f"reading the blob {digest}")
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pull-", suffix=".tmp")
        hasher = hashlib.sha256()
        got = 0
        try:
            with os.fdopen(fd, "wb") as f, response:
                for chunk in self._chunks(ref, response):
                    got += len(chunk)
                    if got > size:
                        break
                    hasher.update(chunk)
                    f.write(chunk)
            actual = "sha256:" + hasher.hexdigest()
            if got != size or actual != digest:
                raise RegistryError(
                    f"{ref}: digest mismatch: the blob {digest} the manifest names came "
                    f"back as {actual if got == size else f'{got:,}+ bytes, not {size:,}'}; "
                    "the registry's copy is damaged or was tampered with (nothing was kept)")
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp)

    # --- writing ------------------------------------------------------------------------

    def push_blob(self, ref: OciRef, data: bytes, media_type: str) -> None:
        """Upload a blob unless the repository has it already (monolithic upload)."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        head = self._request(ref, f"{self._base(ref)}/blobs/{digest}", "HEAD")
        if head.status_code == 200:
            return
        start = self._request(ref, f"{self._base(ref)}/blobs/uploads/", "POST",
                              headers={"Content-Type": "application/octet-stream",
                                       "Content-Length": "0"})
        self._check(ref, start, "starting a blob upload")
        location = start.headers.get("Location", "")
        if not location:
            raise RegistryError(f"{ref}: {self.registry} started an upload without a "
                                "Location to send it to")
        if not location.startswith("http"):
            location = f"{self._scheme()}://{self.registry}{location}"
        sep = "&" if "?" in location else "?"
        put = self._request(ref, f"{location}{sep}digest={digest}", "PUT", data=data,
                            headers={"Content-Type": "application/octet-stream",
                                     "Content-Length": str(len(data))})
        self._check(ref, put, f"uploading the {media_type} blob")

    def push_manifest(self, ref: OciRef, raw: bytes, media_type: str) -> str:
        """PUT the manifest under `ref`'s tag; returns its digest (checked against the one
        the registry reports)."""
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        url = f"{self._base(ref)}/manifests/{ref.tag}"
        response = self._request(ref, url, "PUT", data=raw,
                                 headers={"Content-Type": media_type})
        self._check(ref, response, "uploading the manifest")
        reported = response.headers.get("Docker-Content-Digest")
        if reported and reported != digest:
            raise RegistryError(f"{ref}: digest mismatch: {self.registry} stored the "
                                f"manifest as {reported}, not {digest}")
        return digest

    # --- plumbing -----------------------------------------------------------------------

    def _scheme(self) -> str:
        return "http" if self.plain_http else "https"

    def _base(self, ref: OciRef) -> str:
        return f"{self._scheme()}://{ref.registry}/v2/{ref.repository}"

    def _load_configs(self, ref: OciRef) -> None:
        """Credentials from the Docker config, unless given on the command line."""
        if self._configs_loaded or self._credentials is not None:
            return
        self._configs_loaded = True
        from oras.container import Container

        try:
            self._oras.auth.load_configs(Container(ref.repository, registry=ref.registry),
                                         configs=docker_configs())
        except (OSError, ValueError) as e:
            raise RegistryError(f"cannot read the Docker config for {ref.registry}'s "
                                f"credentials: {e}") from None

    def _request(self, ref: OciRef, url: str, method: str, **kwargs: Any) -> Any:
        import requests

        self._load_configs(ref)
        try:
            return self._oras.do_request(url, method, **kwargs)
        except requests.exceptions.SSLError:
            raise RegistryError(
                f"cannot reach {self.registry} over TLS (certificate or protocol error); a "
                "registry that serves plain HTTP needs --plain-http (or "
                "AICI_BATCH_PLAIN_HTTP=1)") from None
        except requests.exceptions.ConnectionError as e:
            hint = "" if self.plain_http else (
                "; a local registry without TLS needs --plain-http")
            raise RegistryError(f"cannot reach the registry {self.registry}: "
                                f"{_reason(e)}{hint}") from None
        except requests.exceptions.Timeout:
            raise RegistryError(f"the registry {self.registry} did not answer within "
                                f"{TIMEOUT_S:.0f} s") from None
        except requests.exceptions.RequestException as e:
            raise RegistryError(f"talking to {self.registry} failed: {_reason(e)}") from None
        except ValueError as e:  # oras: a challenge it cannot answer (no credentials)
            if "authentication" in str(e):
                raise RegistryError(self._needs_credentials(ref)) from None
            raise RegistryError(f"talking to {self.registry} failed: {e}") from None

    def _chunks(self, ref: OciRef, response: Any) -> Iterator[bytes]:
        import requests

        try:
            yield from response.iter_content(chunk_size=1 << 20)
        except requests.exceptions.RequestException as e:
            raise RegistryError(f"{ref}: the download from {self.registry} broke off: "
                                f"{_reason(e)}") from None

    def _needs_credentials(self, ref: OciRef) -> str:
        return (f"{self.registry} asks for credentials to access {ref.repository}: give "
                "--username and --password-stdin, or log in with `docker login "
                f"{self.registry}` (credentials are read from the Docker config)")

    def _check(self, ref: OciRef, response: Any, doing: str) -> None:
        code = response.status_code
        if code in (200, 201, 202):
            return
        if code == 401:
            if self._credentials is None and not getattr(self._oras.auth, "_basic_auth", None):
                raise RegistryError(self._needs_credentials(ref))
            raise RegistryError(f"{self.registry} refused the credentials for "
                                f"{ref.repository} (HTTP 401): check the username and "
                                "password")
        if code == 403:
            raise RegistryError(f"{self.registry} denies access to {ref.repository} "
                                f"(HTTP 403) while {doing}")
        detail = _registry_message(response)
        raise RegistryError(f"{ref}: {self.registry} answered HTTP {code} while {doing}"
                            + (f": {detail}" if detail else ""))


def _registry_message(response: Any) -> str:
    """The first message of a distribution-spec error body, if any."""
    try:
        errors = response.json().get("errors") or []
        return str(errors[0].get("message", ""))[:200] if errors else ""
    except Exception:
        return ""


def _reason(e: Exception) -> str:
    """The innermost reason of a requests error ("Connection refused"), short."""
    text = str(e)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    return text.split("\n")[0][:200]
