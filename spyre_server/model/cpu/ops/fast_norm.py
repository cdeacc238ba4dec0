"""fms's RMS norm as one aten op.

fms's ``LayerNormParameterized`` normalizes with seven tensor ops from Python (upcast, pow,
mean, add, rsqrt, two products); a step runs two norms per layer and one more, and each op has a
fixed cost whatever its size. ``FastRMSNorm`` computes the same through ``F.rms_norm``,
which gives the same bits: in float32 directly, and for lower precisions (fms upcasts when
``use_high_precision_pow``) on the upcast input, scaled by the weight after the downcast as fms
does. Any other configuration (a mean, a shift, no scale, or a low-precision pow) goes through
fms's own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fms.modules.layernorm import LayerNormParameterized


class FastRMSNorm(LayerNormParameterized):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_mean or self.elementwise_shift or not self.elementwise_scale:
            return super().forward(x)
        if x.dtype == torch.float32:
            return self._float32_norm(x)
        if not self.use_high_precision_pow:
            return super().forward(x)
        return self._upcast_norm(x)

    def _float32_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The plain RMS norm of float32 ``x`` (subclasses put another kernel here)."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def _upcast_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The plain RMS norm of lower-precision ``x`` as fms computes it with a float32 pow:
        normalized on the upcast, rounded back, then scaled (subclasses put another kernel
        here)."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x)
        return self.weight * normed


def use_fast_rms_norm(model: torch.nn.Module) -> int:
    """Switch every fms ``LayerNormParameterized`` of ``model`` (in place) to FastRMSNorm;
    returns how many were switched."""
    switched = 0
    for module in model.modules():
        if type(module) is LayerNormParameterized:
            module.__class__ = FastRMSNorm
            switched += 1
    return switched
