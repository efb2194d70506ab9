"""A run's `--controller` as the run records it: pinned to one digest before anything
loads, and that digest for `made_with` and the run summary.

A file controller is named by the digest of its bytes (`made_with.digest`); an `oci://`
one by the artifact's digest, which `pin` fixes once per run (a tag asks the registry
once, through `aici_cli.control.registry`), so every line, on every worker, uses the same
component. Torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from aici_cli.control.registry.refs import is_oci, parse_ref
from aici_cli.core.config import RunConfig
from aici_cli.run.made_with import digest


def pin(config: RunConfig) -> RunConfig:
    """`config` with an `oci://` `--controller` resolved to one digest and pulled into the
    component cache; any other `config` as it is."""
    if not is_oci(config.controller):
        return config
    from aici_cli.control.registry.operations import pin_controller

    assert config.controller is not None
    return replace(config, controller=str(pin_controller(config.controller,
                                                         config.plain_http).ref))


def controller_digest(config: RunConfig) -> str | None:
    """What `made_with` records of the `--controller`: the digest of its file, or for a
    (pinned) `oci://` one the artifact by digest (None: no controller, or a file that
    cannot be read, which loading it reports)."""
    if config.controller is None:
        return None
    if is_oci(config.controller):
        return parse_ref(config.controller).by_digest()
    try:
        return digest(Path(config.controller).read_bytes())
    except OSError:
        return None


def controller_summary(config: RunConfig) -> dict[str, str | None]:
    """The summary's `controller`: what --controller named (an oci:// one pinned to the
    digest the run used), and that digest (a file's: as `made_with` records it)."""
    assert config.controller is not None
    pinned = (parse_ref(config.controller).digest if is_oci(config.controller)
              else controller_digest(config))
    return {"source": config.controller, "digest": pinned}
