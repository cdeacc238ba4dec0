"""Rotary position embeddings exactly as HF transformers computes them, in the tables fms reads.

HF's rotary embedding is, per rotated pair ``i``, an inverse frequency ``inv_freq[i]`` and, for
every pair, an attention factor: position ``p`` is rotated by the angle ``p * inv_freq[i]`` and
its cos and sin are multiplied by the factor (float32, then cast to the model's dtype). The rope
type of config.json decides both (transformers' ``modeling_rope_utils``); ``RopeSpec`` computes
them with HF's formulas, operation for operation:

- ``default``: ``1 / theta ** (2i / dim)``, factor 1;
- ``linear``: the default frequencies divided by ``factor``;
- ``llama3``: the default frequencies, long wavelengths divided by ``factor`` and a smooth ramp
  between ``low_freq_factor`` and ``high_freq_factor`` (Llama 3.1, 3.2, 3.3);
- ``yarn``: interpolation and extrapolation blended along a ramp set by ``beta_fast`` and
  ``beta_slow`` (truncated unless ``truncate`` is false), factor ``attention_factor`` or
  ``0.1 * mscale * ln(factor) + 1`` (over ``mscale_all_dim``'s);
- ``dynamic``: HF rescales ``theta`` from the length of the whole sequence once it passes
  ``max_position_embeddings``; up to that length its frequencies are these (computed with HF's
  formula at that length);
- ``longrope``: ``short_factor`` divides the default frequencies while the whole sequence fits
  ``original_max_position_embeddings``, ``long_factor`` beyond; factor ``attention_factor`` or
  ``sqrt(1 + ln(factor) / ln(original))``.

``dynamic`` and ``longrope`` change the rotation of every position, cached ones included, when the
sequence grows past a length (HF recomputes the whole sequence at every step): a KV cache cannot
follow them there, so they are exact up to ``RopeSpec.exact_up_to`` tokens and the start is
refused for a longer ``model.max_model_len`` (``spyre_server.model.hf_config.check_serving``).

fms's ``RotaryEmbedding`` rotates with the table ``cached_freqs[device index][alpha]``, per position
and pair the float32 matrix ``[[cos, -sin], [sin, cos]]``; the cpu backend's
``FastRotaryEmbedding``, its native decoders and the spyre backend's programs read the same
table. ``install_rope`` writes HF's table there (the attention factor in its entries) and gives
each ``RotaryEmbedding`` a scaling object that keeps fms from computing another one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fms.modules.positions import RopeNoScalingImpl, RotaryEmbedding

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
"""The rope types config.json may name that are computed here."""

REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
"""The rope parameters each type needs (HF's validation)."""


@dataclass(frozen=True)
class RopeSpec:
    """A model's RoPE as HF reads it from config.json: the type, ``theta`` (``rope_theta``),
    the type's other parameters (``rope_parameters``, or a Hub config's ``rope_scaling``, with
    ``original_max_position_embeddings`` resolved as HF resolves it), the rotated dimension (the
    head size) and ``max_position_embeddings``."""

    rope_type: str
    theta: float
    dim: int
    max_position_embeddings: int
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @property
    def exact_up_to(self) -> int | None:
        """The longest sequence (prompt and output) whose rotations stay those of its prefix in
        HF's model, None for no limit."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.rope_type == "longrope":
            return int(self.parameters["original_max_position_embeddings"])
        return None

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_factor)``: float32 ``[dim // 2]`` and the factor of cos and
        sin, as HF computes them for sequences up to ``exact_up_to``."""
        return _INV_FREQ[self.rope_type](self)

    def table(self, length: int) -> torch.Tensor:
        """fms's rotation table for positions ``0 .. length - 1``: float32
        ``[length, dim // 2, 2, 2]``, ``[[cos, -sin], [sin, cos]]`` of HF's angles, cos and sin
        times the attention factor."""
        inv_freq, factor = self.inv_freq()
        positions = torch.arange(length, dtype=inv_freq.dtype)
        angles = torch.outer(positions, inv_freq).float()
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return torch.stack([cos, -sin, sin, cos], dim=2).view(*angles.shape, 2, 2)


# ------------------------------------------------------------------------ HF's inverse frequencies
# Each mirrors the function of transformers' modeling_rope_utils (or the model's default RoPE)
# expression for expression, so that the float32 results are the same bits.


def _default(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim = spec.dim
    return 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _linear(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(spec.theta, spec.dim)
    inv_freq /= spec.parameters["factor"]
    return inv_freq, 1.0


def _dynamic(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim = spec.dim
    factor = spec.parameters["factor"]
    seq_len = spec.max_position_embeddings  # HF's value for every sequence up to that length
    base = spec.theta * ((factor * seq_len / spec.max_position_embeddings) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    return _base_inv_freq(base, dim), 1.0


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    params = spec.parameters
    base, dim = spec.theta, spec.dim
    factor = params["factor"]
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, mscale: float = 1) -> float:
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def _longrope(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    params = spec.parameters
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = spec.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    # The short factors: every sequence up to ``original`` tokens (exact_up_to).
    ext_factors = torch.tensor(params["short_factor"], dtype=torch.float32)
    inv_freq_shape = torch.arange(0, spec.dim, 2, dtype=torch.int64).float() / spec.dim
    return 1.0 / (ext_factors * spec.theta**inv_freq_shape), float(attention_factor)


def _llama3(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    params = spec.parameters
    inv_freq = _base_inv_freq(spec.theta, spec.dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0


_INV_FREQ = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}
assert set(_INV_FREQ) == set(ROPE_TYPES)


# ----------------------------------------------------------------------------- fms's tables
class HFRopeScaling(RopeNoScalingImpl):
    """fms's scaling interface for a ``RopeSpec``: one table for every length (``alpha`` 1),
    HF's frequencies. fms builds a table from ``compute_scaled_freqs`` without the attention
    factor, so for a spec whose factor is not 1 it refuses to: ``install_rope`` builds every
    table."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__(spec.dim, spec.theta, spec.max_position_embeddings)
        self.spec = spec

    def compute_scaled_freqs(self, device: str, alpha: int) -> torch.Tensor:
        inv_freq, factor = self.spec.inv_freq()
        if factor != 1.0:
            raise RuntimeError(
                f"rope_type {self.spec.rope_type!r} scales cos and sin by {factor}: its tables "
                "are built by spyre_server.model.rope.install_rope, not by fms"
            )
        return inv_freq.to(device)


def rotary_embeddings(model: torch.nn.Module) -> list[RotaryEmbedding]:
    """The distinct fms RotaryEmbedding objects of ``model`` (plain objects held as attributes of
    the model's modules, usually one shared by every attention)."""
    found: dict[int, RotaryEmbedding] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, RotaryEmbedding):
                found.setdefault(id(value), value)
    return list(found.values())


def install_rope(model: torch.nn.Module, spec: RopeSpec, length: int | None = None) -> int:
    """Make every RotaryEmbedding of ``model`` rotate as HF does for ``spec``, with a table of
    ``length`` positions (default ``spec.max_position_embeddings``); returns how many were set.
    A RotaryEmbedding whose dimension is not ``spec.dim`` is an error."""
    length = length or spec.max_position_embeddings
    table = spec.table(length)
    encoders = rotary_embeddings(model)
    for encoder in encoders:
        if encoder.dim != spec.dim or encoder.partial_rope != 1.0:
            raise ValueError(
                f"the model rotates {encoder.dim} of its head dimensions "
                f"(partial_rope {encoder.partial_rope}); config.json says {spec.dim}"
            )
        encoder.rope_scaling = HFRopeScaling(spec)
        # fms treats rope_type "yarn" as another table layout: keep HF's names apart.
        encoder.rope_type = "regular" if spec.rope_type == "default" else f"hf-{spec.rope_type}"
        encoder.cached_freqs = {None: {1: table}}
        encoder.max_seq_len_cached = {None: length}
    return len(encoders)


def rope_length(model: torch.nn.Module) -> int | None:
    """The number of positions the rotation tables of ``model`` cover (None without RoPE)."""
    lengths = [
        min(encoder.max_seq_len_cached.values(), default=0) for encoder in rotary_embeddings(model)
    ]
    return min(lengths) if lengths else None
