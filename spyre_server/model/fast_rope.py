"""fms's rotary position embedding, computed with one cos and one sin per rotated pair.

fms rotates each (even, odd) pair of a head by multiplying it with a 2x2 matrix per position:
a broadcast product six dimensions wide and a sum over its last one, 5x the cost of the rotation
itself (SmolLM2, a 256-token chunk: 3.7 ms of a layer's 8 ms outside the matrix products, against
0.7 ms here). ``FastRotaryEmbedding`` does the same arithmetic on the matrix's entries
(``cos * x0 - sin * x1``, ``sin * x0 + cos * x1``), so the result is the same bit for bit, and
looks the entries up once per forward instead of once per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from fms.modules.positions import RotaryEmbedding


class FastRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose ``adjusted_qk`` takes the fast path for plain RoPE with explicit
    position ids (what the cpu runner passes); anything else (YaRN, partial rotary, positions
    derived from the cache) goes through fms's own code."""

    _last_positions: torch.Tensor | None = None
    _last_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def adjusted_qk(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_kv_state: Any = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is None or self.rope_type == "yarn" or self.partial_rope != 1.0:
            return super().adjusted_qk(q, k, position_ids, past_kv_state, use_cache)
        cos, sin = self._cos_sin(q.device, position_ids)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _cos_sin(
        self, device: torch.device, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, seq, 1, head_dim / 2]`` each. Every layer of one forward gets the same
        ``position_ids`` tensor: the entries are looked up for the first and reused."""
        if position_ids is self._last_positions and self._last_cos_sin is not None:
            return self._last_cos_sin
        alpha = self.compute_freqs_cis(device, int(position_ids.max()) + 1)
        rotations = self.cached_freqs[device.index][alpha][position_ids].float()
        # rotations[..., i, :, :] = [[cos, -sin], [sin, cos]] of pair i
        cos_sin = (rotations[..., 0, 0].unsqueeze(2), rotations[..., 1, 0].unsqueeze(2))
        self._last_positions, self._last_cos_sin = position_ids, cos_sin
        return cos_sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, seq, heads, head_dim]`` with each (even, odd) pair rotated."""
    pairs = x.float().view(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((cos * even - sin * odd, sin * even + cos * odd), dim=-1)
    return rotated.flatten(3).type_as(x)


def use_fast_rope(model: torch.nn.Module) -> int:
    """Switch every fms RotaryEmbedding of ``model`` (in place) to FastRotaryEmbedding; returns
    how many were switched. fms's RotaryEmbedding is a plain object (not a module) held as an
    attribute of the model and its attention modules, usually one instance shared by all."""
    switched = 0
    for module in model.modules():
        for value in vars(module).values():
            if type(value) is RotaryEmbedding:
                value.__class__ = FastRotaryEmbedding
                switched += 1
    return switched
