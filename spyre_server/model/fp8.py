"""FP8 checkpoints: compressed-tensors' ``float-quantized`` form (what llm-compressor writes for
granite-3.3-8b-instruct-FP8 and the like), read from config.json or refused by name; the linear
layer that holds such a weight; and its tensors through fms's checkpoint adapters.

What HF transformers computes for such a checkpoint on a CPU (transformers 5.24 with
compressed-tensors 0.20, checked bitwise in docs/notes/2026-12-03-fp8-oracle-xeon-amx.md): every
targeted linear layer's weight is ``float8_e4m3fn`` with a ``weight_scale`` per output (or one for
the tensor), both scales cast to the model's dtype at load; the layer computes
``F.linear(fake_quantize_fp8(x, input_scale), (weight.float() * weight_scale).to(dtype))``, the
input rounded to FP8 steps of its static ``input_scale`` where the scheme has one, or of a scale
per token computed from the token (``per_token_fp8_scale``: its largest magnitude / 448) where
the scheme's input scales are dynamic. ``Fp8Linear``
computes exactly that (the reference; slow); the cpu backend's ``NativeFp8Linear`` keeps the
weight in FP8 and computes it within a stated bound (``kernels/linear_bf16.cpp``).

Accepted: one config group targeting ``Linear``; weights 8-bit ``float``, symmetric, static, per
``channel`` or ``tensor``; input activations none or 8-bit ``float``, symmetric, either static
per ``tensor`` or dynamic per ``token`` (llm-compressor's FP8_DYNAMIC); no output activations,
no KV-cache scheme; ``ignore`` exactly ``["lm_head"]``. Everything else is refused by name
(other dynamic scales, groups, blocks, other bit widths, integer schemes, other formats and
methods).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from spyre_server.model.errors import ModelLoadError

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value."""

QUANTIZED_SUFFIXES = ("weight", "weight_scale", "input_scale")
"""An FP8 layer's checkpoint tensors (``<layer>.weight`` and the rest)."""


InputScales = Literal["static", "dynamic"] | None
"""An FP8 layer's input rounding: to FP8 steps of its checkpoint's ``input_scale`` (one per
layer), of a scale per token computed from it (``per_token_fp8_scale``), or none."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """A checkpoint's FP8 scheme, as far as it changes the math."""

    weight_strategy: Literal["channel", "tensor"]
    input_scales: InputScales
    """How each layer's input is rounded to FP8 steps first, if at all."""


def read_fp8_scheme(quantization_config: Mapping[str, Any]) -> Fp8Scheme:
    """``config.json``'s ``quantization_config`` as an ``Fp8Scheme``; ModelLoadError naming
    what is not the accepted form (module docstring)."""
    qc = quantization_config

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(
            f"config.json's quantization_config: {what}; served quantized checkpoints are "
            "compressed-tensors float-quantized FP8 (float8_e4m3fn weights per channel or "
            "tensor; input scales static per tensor, dynamic per token, or none; lm_head "
            "unquantized)"
        )

    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r} is not 'compressed-tensors'")
    if qc.get("format") != "float-quantized":
        raise refuse(f"format {qc.get('format')!r} is not 'float-quantized'")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise refuse(f"quantization_status {qc.get('quantization_status')!r}")
    if qc.get("kv_cache_scheme") is not None:
        raise refuse("a kv_cache_scheme (a quantized KV cache) is not implemented")
    if list(qc.get("ignore") or []) != ["lm_head"]:
        raise refuse(f"ignore {qc.get('ignore')!r} is not ['lm_head']")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config_groups, not one")
    ((name, group),) = groups.items()
    if list(group.get("targets") or []) != ["Linear"]:
        raise refuse(f"{name}'s targets {group.get('targets')!r} are not ['Linear']")
    if group.get("output_activations") is not None:
        raise refuse(f"{name} quantizes output activations")
    weights = group.get("weights") or {}
    _check_args(weights, f"{name}'s weights", ("channel", "tensor"), refuse)
    inputs = group.get("input_activations")
    input_scales: InputScales = None
    if inputs is not None:
        dynamic = inputs.get("dynamic") is True
        strategies = ("token",) if dynamic else ("tensor",)
        _check_args(inputs, f"{name}'s input_activations", strategies, refuse, dynamic=dynamic)
        input_scales = "dynamic" if dynamic else "static"
    return Fp8Scheme(weight_strategy=weights["strategy"], input_scales=input_scales)


def _check_args(
    args: Mapping[str, Any],
    what: str,
    strategies: tuple[str, ...],
    refuse: Callable[[str], ModelLoadError],
    *,
    dynamic: bool = False,
) -> None:
    """Static scales with one of ``strategies``, or dynamic ones (``dynamic``: exactly True)."""
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise refuse(f"{what} are {args.get('num_bits')}-bit {args.get('type')!r}, not 8-bit float")
    if args.get("symmetric") is not True:
        raise refuse(f"{what} are not symmetric")
    if not dynamic and args.get("dynamic") not in (False, None):
        raise refuse(f"{what} have dynamic scales ({args.get('dynamic')!r})")
    if args.get("strategy") not in strategies:
        raise refuse(f"{what} strategy {args.get('strategy')!r} is not one of {strategies}")
    for field in ("group_size", "block_structure", "actorder"):
        if args.get(field) is not None:
            raise refuse(f"{what} set {field} ({args[field]!r})")


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float8_e4m3fn steps of ``scale`` (a static per-tensor activation scale,
    shape ``[1]`` as checkpoints store it), in ``scale``'s dtype: compressed-tensors'
    quantize-dequantize, op for op, as HF transformers runs it before an FP8 layer."""
    scaled = (x / scale).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).to(scaled.dtype).to(scale.dtype) * scale


def per_token_fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Each token's (last-dimension row's) dynamic FP8 input scale, ``[..., 1]`` in ``x``'s
    dtype: its largest magnitude / 448, or the dtype's epsilon where that is 0 (compressed-tensors'
    ``compute_dynamic_scales_and_zp`` for a symmetric per-token float scheme, op for op)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / torch.tensor(FP8_MAX, dtype=x.dtype)
    eps = torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype)
    return torch.where(scale == 0, eps, scale)


class Fp8Linear(torch.nn.Module):
    """A linear layer of an FP8 checkpoint, computing what HF transformers computes for it
    (module docstring): ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` ``[out]`` in
    the model's dtype, ``input_scale`` ``[1]`` (or None without static input scales);
    ``dynamic_inputs``: each token rounded to FP8 steps of its own scale."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, *, input_scales: InputScales
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.weight_scale = torch.nn.Parameter(
            torch.empty(out_features, dtype=dtype), requires_grad=False
        )
        self.input_scale = (
            torch.nn.Parameter(torch.empty(1, dtype=dtype), requires_grad=False)
            if input_scales == "static"
            else None
        )
        self.dynamic_inputs = input_scales == "dynamic"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = fake_quantize_fp8(x, self.input_scale).to(x.dtype)
        elif self.dynamic_inputs:
            x = fake_quantize_fp8(x, per_token_fp8_scale(x))
        weight = (self.weight.float() * self.weight_scale.float()[:, None]).to(x.dtype)
        return torch.nn.functional.linear(x, weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"input scales={'static' if self.input_scale is not None else 'dynamic' if self.dynamic_inputs else None}, fp8 weights"
        )


def use_fp8_linears(
    model: torch.nn.Module, scheme: Fp8Scheme, scale_dtype: torch.dtype, head: torch.nn.Module
) -> int:
    """Replace every ``nn.Linear`` of ``model`` but ``head`` (the unquantized LM head) by an
    ``Fp8Linear`` of its shape with scales in ``scale_dtype``, on the meta device, for the
    checkpoint to fill; returns how many. Refuses (ModelLoadError) a layer with a bias:
    compressed-tensors' FP8 layers of the architectures served have none."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child is head:
                continue
            if child.bias is not None:
                raise ModelLoadError(f"an FP8 layer with a bias ({name}) is not implemented")
            with torch.device("meta"):
                fp8 = Fp8Linear(
                    child.in_features,
                    child.out_features,
                    scale_dtype,
                    input_scales=scheme.input_scales,
                )
            setattr(module, name, fp8)
            replaced += 1
    return replaced


def adapt_fp8_tensors(
    partial: dict[str, torch.Tensor],
    adapter: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors (``partial``) in fms's names and layouts, FP8 layers
    included: fms's adapters convert, fuse and permute the rows of plain weights, so each FP8
    layer's weight goes through them as bytes, and its scales as ``[out, 1]`` weights (a
    per-tensor scale repeated per output), then come back as ``<fms layer>.weight``,
    ``.weight_scale`` (``[out]``) and ``.input_scale`` (``[1]``). A fused layer's parts must
    share one input scale (they read one input): ModelLoadError naming it otherwise."""
    plain = dict(partial)
    scales: dict[str, dict[str, torch.Tensor]] = {"weight_scale": {}, "input_scale": {}}
    for key in [k for k in partial if k.endswith(".weight_scale")]:
        layer = key.removesuffix(".weight_scale")
        weight = plain.get(f"{layer}.weight")
        if weight is None or weight.dtype != torch.float8_e4m3fn:
            continue  # left for the strict loader to report
        rows = weight.shape[0]
        for kind in scales:
            value = plain.pop(f"{layer}.{kind}", None)
            if value is not None:
                scales[kind][f"{layer}.weight"] = (
                    value.float().reshape(-1, 1).expand(rows, 1).contiguous()
                )
        plain[f"{layer}.weight"] = weight.view(torch.uint8)
    out = dict(adapter(plain))
    for name, tensor in list(out.items()):
        if tensor.dtype == torch.uint8:
            out[name] = tensor.view(torch.float8_e4m3fn)
    for kind, tensors in scales.items():
        if not tensors:
            continue
        for name, tensor in adapter(tensors).items():
            layer = name.removesuffix(".weight")
            if kind == "weight_scale":
                out[f"{layer}.weight_scale"] = tensor.reshape(-1)
                continue
            if not bool((tensor == tensor[0]).all()):
                raise ModelLoadError(
                    f"the checkpoint's layers fused into {layer} have different input scales "
                    f"({sorted(set(tensor.reshape(-1).tolist()))}); one fused layer reads one "
                    "input"
                )
            out[f"{layer}.input_scale"] = tensor[0].reshape(1)
    return out
