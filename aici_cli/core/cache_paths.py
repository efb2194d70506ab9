"""Where aici-batch keeps what it makes once and reuses: converted models, compiled
components, the `--deterministic` machine check. A leaf module (no imports from the
package), so every layer can ask it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$AICI_BATCH_CACHE`, else `$XDG_CACHE_HOME/aici-batch`, else `~/.cache/aici-batch`.

    Not created here; callers that write create what they need.
    """
    explicit = os.environ.get("AICI_BATCH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "aici-batch"
    return Path.home() / ".cache" / "aici-batch"
