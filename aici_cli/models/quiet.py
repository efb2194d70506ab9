"""Silencing transformers while it loads or converts a model.

stderr is for the CLI's own one-line messages. Loading draws a progress bar, a checkpoint
that lacks tensors gets a multi-line "LOAD REPORT" warning (`load` turns that into a
ModelError itself), and a GGUF conversion warns about metadata users cannot act on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off and its logging at error level, restored after.

    Imports `transformers.utils.logging` only, which does not import torch.
    """
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
