"""aici-batch: batch constrained generation with local language models."""

__version__ = "0.1.0"

__all__ = ["__version__"]
