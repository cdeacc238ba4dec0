"""fms's rotary position embedding, computed with one cos and one sin per rotated pair.

fms rotates each (even, odd) pair of a head by multiplying it with a 2x2 matrix per position:
a broadcast product six dimensions wide and a sum over its last one, several times the work of
the rotation itself. ``FastRotaryEmbedding`` does the same arithmetic on the matrix's entries
(``cos * x0 - sin * x1``, ``sin * x0 + cos * x1``), so the result is the same bit for bit, and
looks the entries up once per forward instead of once per layer. It computes both halves of
every pair at once, ``x * cos + swap(x) * (-sin, sin)``: three tensor ops per rotation (a step
runs two rotations per layer, and each op has a fixed cost whatever its size).
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
    _last_tables: tuple[torch.Tensor, torch.Tensor] | None = None

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
        cos, signed_sin = self._tables(q.device, position_ids)
        return self._rotate(q, cos, signed_sin), self._rotate(k, cos, signed_sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """One rotation (subclasses put another kernel here)."""
        return _rotate(x, cos, signed_sin)

    def _tables(
        self, device: torch.device, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)``, ``[batch, seq, 1, head_dim]`` each, float32: pair ``i`` has
        ``(cos_i, cos_i)`` and ``(-sin_i, sin_i)``. Every layer of one forward gets the same
        ``position_ids`` tensor: the tables are built for the first and reused."""
        if position_ids is self._last_positions and self._last_tables is not None:
            return self._last_tables
        alpha = self.compute_freqs_cis(device, int(position_ids.max()) + 1)
        rotations = self.cached_freqs[device.index][alpha][position_ids].float()
        # rotations[..., i, :, :] = [[cos, -sin], [sin, cos]] of pair i
        cos = rotations[..., 0, 0].unsqueeze(2)
        sin = rotations[..., 1, 0].unsqueeze(2)
        tables = (
            cos.repeat_interleave(2, dim=-1),
            torch.stack((-sin, sin), dim=-1).flatten(-2),
        )
        self._last_positions, self._last_tables = position_ids, tables
        return tables


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, seq, heads, head_dim]`` with each (even, odd) pair rotated, computed in
    float32 as fms does: ``(cos * even + (-sin) * odd, cos * odd + sin * even)``, the same
    bits as fms's ``cos * even - sin * odd`` and ``sin * even + cos * odd``."""
    x32 = x if x.dtype == torch.float32 else x.float()
    swapped = x32.view(*x.shape[:-1], -1, 2).flip(-1).flatten(-2)  # (odd, even) in every pair
    rotated = x32 * cos
    rotated += swapped * signed_sin
    return rotated if x.dtype == torch.float32 else rotated.type_as(x)


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
