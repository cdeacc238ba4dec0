"""The cpu backend's start-up errors: a configured kernel that cannot run here."""

from __future__ import annotations

from spyre_server.model.loading import ModelLoadError


class KernelUnavailableError(ModelLoadError):
    """A configured cpu kernel cannot run here (this CPU, this torch build, the model's dtype or
    head size, or the native kernels' build); the message says why and which setting to
    change."""


class LinearKernelError(KernelUnavailableError):
    """``model.linear_kernel`` names a kernel that cannot run here."""


class AttentionKernelError(KernelUnavailableError):
    """``model.attention_kernel`` names a kernel that cannot run here."""
