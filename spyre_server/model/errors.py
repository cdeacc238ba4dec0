"""The model layer's start-up error."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The configured model cannot be served; the message says why."""
