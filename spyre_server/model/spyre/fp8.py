"""FP8 checkpoints on the spyre backend, run as the reference stack runs them on the card.

sendnn-inference 2.6.3 (model_executor/model_loader/spyre.py, platform.py, v1/worker/
spyre_worker.py) serves an FP8 checkpoint through fms-model-optimizer's FP8 addon
(fms_mo 0.8.7, ``aiu_addons/fp8``), whose modules and ops are what the card's compiler receives:

- Linear layers: fms_mo's ``FP8Linear``, float8_e4m3fn weights with float32 scales kept as
  loaded; its input rounded to FP8 with the checkpoint's static per-tensor scale or a scale per
  token, then ``torch._scaled_mm`` (the card's FP8 matrix product). The other parameters stay in
  the model's dtype.
- Attention: fms's attention op ``spyre_paged_attn_fp8`` (fp8_attn.py), over a KV cache of
  float8_e4m3fn blocks held in fms_mo's ``ScaledTensor`` with one scale per sequence of the
  step. The scales are static, 1.0: keys and values are stored as their nearest float8_e4m3fn
  values (``_set_scale_for_fp8``). The query and the products stay in the model's dtype.
- Decode batches of at least 2: a batch of 1 runs as 2, its one row twice, and the first row's
  logits are kept (``_adjust_input_for_fp8``); warm-up prefills two prompts and decodes them
  together before the deploy request; ``scheduler.max_num_seqs`` of 1 is refused (platform.py).

What the addon cannot run, we refuse at start (``check_spyre_fp8``): its ``FP8Linear`` asserts
that per-channel weights come with per-token inputs, so per-channel weights with a static input
scale; a sliding window (no FP8 windowed attention op); tensor parallelism (refused for every
FP8 checkpoint here).

Importing the addon replaces aten's CPU ``_scaled_mm`` kernels for the whole process with its
own (fp8_spyre_op.py: both operands converted to the output dtype, then a plain product); only
a spyre backend serving an FP8 checkpoint imports it (and the image's install check).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from spyre_server.model.errors import ModelLoadError
from spyre_server.model.fp8 import Fp8Linear, Fp8Scheme
from spyre_server.model.spyre.inputs import SpyreInputs

ATTN_NAME = "spyre_paged_attn_fp8"

MIN_DECODE_BATCH = 2
"""The smallest decode batch the reference's FP8 programs run (a batch of 1 is padded to it)."""

ADDON_MODULES = (
    "fms_mo.aiu_addons.fp8.fp8_utils",
    "fms_mo.aiu_addons.fp8.fp8_linear",
    "fms_mo.aiu_addons.fp8.fp8_attn",
)
"""Importing these registers fms_mo's FP8 linear type, its ops and ``spyre_paged_attn_fp8``."""

ADDON_REQUIREMENT = "fms-model-optimizer 0.8.7 with torchao 0.11 (scripts/setup.sh installs both)"


def kv_cache_dtype(dtype: torch.dtype, fp8_scheme: Fp8Scheme | None) -> torch.dtype:
    """The spyre backend's KV cache dtype: float8_e4m3fn for an FP8 checkpoint (the
    reference's), the model's ``dtype`` otherwise."""
    return dtype if fp8_scheme is None else torch.float8_e4m3fn


def load_fp8_addon() -> None:
    """Import fms-model-optimizer's FP8 addon; ModelLoadError naming it where it is missing."""
    try:
        for name in ADDON_MODULES:
            importlib.import_module(name)
        if not hasattr(importlib.import_module(ADDON_MODULES[1]), "FP8Linear"):
            raise ImportError("fms_mo defines FP8Linear only where torchao imports")
    except ImportError as exc:
        raise ModelLoadError(
            "FP8 checkpoints on the spyre backend run through fms-model-optimizer's FP8 addon "
            f"(fms_mo.aiu_addons.fp8), as sendnn-inference runs them; it needs "
            f"{ADDON_REQUIREMENT}: {type(exc).__name__}: {exc}"
        ) from exc


def check_spyre_fp8(scheme: Fp8Scheme, *, max_num_seqs: int, sliding_window: bool) -> None:
    """Refuse (ModelLoadError, naming it) what the reference cannot run an FP8 checkpoint with
    on the card; then load the addon (``load_fp8_addon``)."""
    if max_num_seqs < MIN_DECODE_BATCH:
        raise ModelLoadError(
            "FP8 checkpoints on the spyre backend need scheduler.max_num_seqs of at least "
            f"{MIN_DECODE_BATCH} (the card's FP8 decode programs run batches of 2 or more; "
            "sendnn-inference refuses batch size 1 too)"
        )
    if scheme.weight_strategy == "channel" and scheme.input_scales == "static":
        raise ModelLoadError(
            "FP8 checkpoints with per-channel weight scales and a static input scale are not "
            "served on the spyre backend: fms-model-optimizer's FP8Linear multiplies "
            "per-channel weights only with per-token inputs (serve it on the cpu backend)"
        )
    if sliding_window:
        raise ModelLoadError(
            "FP8 checkpoints with a sliding window are not served on the spyre backend: "
            f"{ATTN_NAME} has no windowed form"
        )
    load_fp8_addon()


def fms_mo_linear_config(scheme: Fp8Scheme) -> dict[str, Any]:
    """The ``linear_config`` of fms_mo's ``FP8Linear`` for ``scheme`` (the fields it reads,
    as fms_mo's ``_infer_quantization_config`` passes them from config.json)."""
    weights = {"symmetric": True, "dynamic": False, "strategy": scheme.weight_strategy}
    inputs: dict[str, Any] | None = None
    if scheme.input_scales == "static":
        inputs = {"symmetric": True, "dynamic": False, "strategy": "tensor"}
    elif scheme.input_scales == "dynamic":
        inputs = {"symmetric": True, "dynamic": True, "strategy": "token"}
    return {
        "linear_type": "fp8",
        "weights": weights,
        "input_activations": inputs,
        "output_activations": None,
    }


def with_fms_mo_linears(model: torch.nn.Module, scheme: Fp8Scheme) -> torch.nn.Module:
    """A new module tree over ``model``'s tensors with each ``Fp8Linear`` replaced by fms_mo's
    ``FP8Linear`` over the same float8_e4m3fn weight, its scales in float32 in the shapes
    fms_mo reads (``[out, 1]`` per channel, ``[1]`` per tensor; the input scale ``[1]``).
    ``model`` is left as it was. The addon must be loaded (``load_fp8_addon``)."""
    fp8_linear = importlib.import_module("fms_mo.aiu_addons.fp8.fp8_linear").FP8Linear
    config = fms_mo_linear_config(scheme)
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    copied = copy.deepcopy(model, memo=shared)
    for parent in list(copied.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Fp8Linear):
                continue
            with torch.device("meta"):
                linear = fp8_linear(child.in_features, child.out_features, False, config)
            scale = child.weight_scale.detach().float()
            if scheme.weight_strategy == "tensor":
                if not bool((scale == scale[0]).all()):
                    raise ModelLoadError(f"{name}: per-tensor weight scales differ by row")
                scale = scale[:1]
            else:
                scale = scale.reshape(-1, 1)
            linear.weight = child.weight
            linear.weight_scale = torch.nn.Parameter(scale.contiguous(), requires_grad=False)
            if child.input_scale is not None:
                input_scale = child.input_scale.detach().float().reshape(1)
                linear.input_scale = torch.nn.Parameter(input_scale, requires_grad=False)
            setattr(parent, name, linear)
    return copied


def scaled_kv_caches(
    caches: Sequence[tuple[torch.Tensor, torch.Tensor]], max_num_seqs: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's float8_e4m3fn key and value blocks in fms_mo's ``ScaledTensor``, with a
    unit scale per sequence slot (at least ``MIN_DECODE_BATCH``) not yet applied
    (``scaled=False``), as the reference allocates its FP8 cache
    (``set_past_key_value_states``). The blocks are shared, not copied; each step sets its own
    scales (``set_unit_scales``)."""
    batch = max(MIN_DECODE_BATCH, max_num_seqs)
    scaled_tensor = importlib.import_module("fms_mo.aiu_addons.fp8.fp8_utils").ScaledTensor

    def scaled(data: torch.Tensor) -> torch.Tensor:
        if data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 KV blocks are float8_e4m3fn, not {data.dtype}")
        return scaled_tensor(data, torch.ones(batch, dtype=torch.float32), False)  # type: ignore[no-any-return]

    return [(scaled(k), scaled(v)) for k, v in caches]


def cache_blocks(cache: torch.Tensor) -> torch.Tensor:
    """The float8_e4m3fn blocks a ``ScaledTensor`` cache holds."""
    return cache._data  # type: ignore[attr-defined,no-any-return]


def set_unit_scales(caches: Sequence[tuple[torch.Tensor, torch.Tensor]], batch: int) -> None:
    """Give every layer's cache ``batch`` static scales of 1.0, marked applied, for a step of
    ``batch`` rows (the reference's ``_set_scale_for_fp8``)."""
    for key, value in caches:
        for tensor in (key, value):
            tensor._scale = torch.ones(batch, dtype=torch.float32)  # type: ignore[attr-defined]
            tensor._scaled = True  # type: ignore[attr-defined]


def padded_decode(inputs: SpyreInputs) -> SpyreInputs:
    """``inputs`` as the reference's FP8 programs run it: a decode step of one row as two
    (the row twice; ``_adjust_input_for_fp8``), anything else as it is. The second row writes
    the same keys and values to the same slot; its logits are dropped."""
    if inputs.kind != "decode" or len(inputs.input_ids) >= MIN_DECODE_BATCH:
        return inputs
    return replace(
        inputs,
        input_ids=inputs.input_ids * 2,
        position_ids=inputs.position_ids * 2,
        slot_mapping=inputs.slot_mapping * 2,
        block_table=inputs.block_table * 2,
        current_tkv=inputs.current_tkv * 2,
        left_padding=inputs.left_padding * 2,
    )
