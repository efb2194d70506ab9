"""Controllers as OCI artifacts: `aici-batch publish`, `aici-batch pull`, and
`--controller oci://REGISTRY/NAME:TAG` (or `@sha256:...`).

The modules, in the order an artifact meets them:
- `refs`: parsing `oci://` references (`OciRef`).
- `artifact`: the CNCF wasm artifact layout (config, one `application/wasm` layer,
  annotations), and checking a pulled manifest against it.
- `client`: the registry over HTTP(S) through oras-py: credentials from the Docker config
  or the command line, no retries, one-line `RegistryError`s.
- `store`: pulled artifacts in the component cache, keyed by digest (offline reruns).
- `operations`: `publish`, `pull`, and pinning a run's `--controller` to one digest
  (`aici_cli/run/controller_pin.py` asks it for a run, and records the digest).

Torch-free; wasmtime is imported only to check a component (publish, and a pull's
contract check).
"""

from aici_cli.control.registry.client import Credentials, RegistryError
from aici_cli.control.registry.operations import Published, Pulled, publish, pull
from aici_cli.control.registry.refs import OciRef, RefError, is_oci, parse_ref

__all__ = [
    "Credentials",
    "OciRef",
    "Published",
    "Pulled",
    "RefError",
    "RegistryError",
    "is_oci",
    "parse_ref",
    "publish",
    "pull",
]
