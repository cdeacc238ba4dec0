"""Loads an HF checkpoint's tensors into an fms model built on the meta device, strictly.

Every tensor of the checkpoint fills a parameter of the model and every parameter and buffer of
the model is filled from the checkpoint, else ModelLoadError naming the keys: tensors missing
from some layers (named as the checkpoint would name them), tensors nothing consumes, parameters
left unfilled, a tensor whose shape is not the parameter's. A tied LM head (``tie_word_embeddings``)
is the token embedding: it counts as filled, and a checkpoint that carries it anyway must carry
the embedding's values.

fms's loader (``fms.utils.serialization.load_state_dict_into_model``, ibm-fms 1.13.1) only logs
the tensors it did not use and leaves the parameters no tensor filled as they were allocated, so
a checkpoint with a misnamed or missing tensor loads and computes with garbage. Here fms's
registered HF adapters convert names and layouts, one layer's tensors at a time as fms does (they
fuse a layer's projections), and this module places what they return. fms's Mixtral adapter
reads Mistral's original consolidated layout (``layers.N.attention.wq``, experts stacked by
``block_sparse_moe.w1``), not the Hub's, and does not permute the query and key rows for fms's
rotary layout; ``_mixtral_adapter`` converts the Hub layout
(``model.layers.N.block_sparse_moe.experts.M.w1/w2/w3.weight``, ``...gate.weight``) and
transformers 5's fused one (``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``,
``mlp.gate.weight``).
"""

from __future__ import annotations

import re
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from spyre_server.model.errors import ModelLoadError
from spyre_server.model.fp8 import Fp8Linear, adapt_fp8_tensors
from spyre_server.model.hf_config import ModelSpec

_LAYER_KEY = re.compile(r"^(?P<prefix>.*?\.)(?P<index>\d+)\.(?P<rest>.+)$")
"""A per-layer key: the first numeric segment is the layer (``model.layers.3.mlp...``)."""

EMBEDDING = "base_model.embedding.weight"
HEAD = "head.weight"
"""fms's names of the token embedding and the LM head (every family served)."""

_LISTED = 8
"""Keys named in full in an error message; the rest are counted."""

Adapter = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def load_checkpoint(
    model: torch.nn.Module, path: Path, spec: ModelSpec, dtype: torch.dtype
) -> None:
    """Fill every parameter and buffer of ``model`` (built on the meta device from
    ``spec.fms_config``) from the checkpoint in ``path``, in ``dtype``, tying the LM head to the
    embedding where ``spec`` ties them; ModelLoadError when the checkpoint and the model do not
    match one to one."""
    from fms.utils import serialization

    try:
        tensors = serialization.load_state_dict(str(path), source="hf")
    except AssertionError as exc:  # fms's way of saying it found no checkpoint file
        raise ModelLoadError(
            f"no checkpoint in {path} (*.safetensors, *.bin, *.pt): {exc}"
        ) from exc
    keys = sorted(tensors.keys())
    missing = missing_layer_tensors(keys, spec.num_layers)
    if missing:
        raise ModelLoadError(
            f"the checkpoint in {path} lacks tensors other layers have: {_listing(missing)}"
        )
    adapter = _adapter(spec, model)
    targets = _targets(model)
    filled: dict[str, str] = {}
    unused: list[str] = []
    head_tensor: torch.Tensor | None = None
    with torch.no_grad():
        for group in _groups(keys):
            partial = {key: tensors[key] for key in group}
            if spec.tie_word_embeddings and spec.head_key in partial:
                head_tensor = partial.pop(spec.head_key)
            try:
                adapted = (
                    adapter(dict(partial))
                    if spec.fp8 is None
                    else adapt_fp8_tensors(dict(partial), adapter)
                )
            except Exception as exc:
                raise ModelLoadError(
                    f"cannot convert the checkpoint tensors {_listing(group)} to fms's "
                    f"{spec.fms_architecture}: {type(exc).__name__}: {exc}"
                ) from exc
            for name, tensor in adapted.items():
                origin = _origin(name, tensor, partial)
                if name not in targets:
                    unused.append(origin)
                    continue
                if name in filled:
                    raise ModelLoadError(
                        f"the checkpoint fills {name} twice: from {filled[name]} and {origin}"
                    )
                _place(model, name, tensor, dtype, origin)
                filled[name] = origin
            _release(tensors, group)
        if unused:
            raise ModelLoadError(
                f"the checkpoint in {path} has tensors {spec.architecture} does not use: "
                f"{_listing(unused)}"
            )
        if spec.tie_word_embeddings:
            _tie(model, spec, head_tensor, dtype)
    unfilled = [name for name, tensor in _tensors(model) if tensor.is_meta]
    if unfilled:
        hints = {EMBEDDING: spec.embedding_key, HEAD: spec.head_key}
        named = [f"{n} ({hints[n]})" if n in hints else n for n in unfilled]
        raise ModelLoadError(
            f"the checkpoint in {path} does not fill the model's parameters (fms names): "
            f"{_listing(named)}"
        )


def missing_layer_tensors(keys: Iterable[str], num_layers: int) -> list[str]:
    """The per-layer keys some layer of ``0 .. num_layers - 1`` lacks while another has them."""
    present = set(keys)
    patterns = set()
    for key in present:
        match = _LAYER_KEY.match(key)
        if match is not None and int(match["index"]) < num_layers:
            patterns.add((match["prefix"], match["rest"]))
    expected = {f"{prefix}{i}.{rest}" for prefix, rest in patterns for i in range(num_layers)}
    return sorted(expected - present, key=_natural)


def _natural(key: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _listing(keys: list[str]) -> str:
    keys = sorted(keys, key=_natural)
    shown = ", ".join(keys[:_LISTED])
    return shown + (f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else "")


def _groups(keys: list[str]) -> list[list[str]]:
    """The keys by layer (an adapter fuses a layer's tensors), the other keys in one group."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        match = _LAYER_KEY.match(key)
        groups.setdefault("" if match is None else match["prefix"] + match["index"], []).append(key)
    return list(groups.values())


def _release(tensors: MutableMapping[str, Any], keys: list[str]) -> None:
    """Drop the loaded tensors of ``keys`` (the checkpoint is read lazily, file by file)."""
    maps = tensors.maps if isinstance(tensors, ChainMap) else [tensors]
    for mapping in maps:
        for key in keys:
            mapping.pop(key, None)


def _origin(name: str, tensor: torch.Tensor, partial: Mapping[str, torch.Tensor]) -> str:
    """The checkpoint key a converted tensor comes from, or what it was made of."""
    for key, value in partial.items():
        if value is tensor:
            return key
    return f"{name} (converted from {_listing(list(partial))})"


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def _targets(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in _tensors(model)}


def _place(
    model: torch.nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype, origin: str
) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._parameters.get(attr)
    if current is None:
        current = module._buffers[attr]
    if tuple(tensor.shape) != tuple(current.shape):
        raise ModelLoadError(
            f"the checkpoint's {origin} has shape {list(tensor.shape)}, the model built from "
            f"config.json has {list(current.shape)} for it ({name})"
        )
    # An FP8 layer's tensors keep the dtypes it was built with (its weight FP8, its scales
    # ``use_fp8_linears``'s scale dtype); every other tensor takes the model's dtype.
    keep = isinstance(module, Fp8Linear)
    if current.dtype == torch.float8_e4m3fn and tensor.dtype != current.dtype:
        raise ModelLoadError(
            f"the checkpoint's {origin} is {tensor.dtype}, the model's FP8 layer takes "
            f"float8_e4m3fn ({name})"
        )
    value = tensor.to(dtype=current.dtype if keep else dtype).contiguous()
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=current.requires_grad)
    else:
        module._buffers[attr] = value


def _tie(
    model: torch.nn.Module, spec: ModelSpec, head_tensor: torch.Tensor | None, dtype: torch.dtype
) -> None:
    embedding = model.get_parameter(EMBEDDING)
    if embedding.is_meta:
        return  # reported as unfilled
    if head_tensor is not None and not torch.equal(head_tensor.to(dtype), embedding):
        raise ModelLoadError(
            f"config.json ties the word embeddings (tie_word_embeddings true), but the "
            f"checkpoint's {spec.head_key} is not its {spec.embedding_key}"
        )
    module_name, _, attr = HEAD.rpartition(".")
    model.get_submodule(module_name)._parameters[attr] = embedding


# ------------------------------------------------------------------------------ adapters
def _adapter(spec: ModelSpec, model: torch.nn.Module) -> Adapter:
    config = model.config
    if spec.fms_architecture == "mixtral":
        return lambda partial: _mixtral_adapter(partial, config)

    from fms.utils import serialization

    return lambda partial: serialization.get_adapted(
        spec.fms_architecture, "hf", partial, {"model_config": config}
    )


_MIXTRAL_TOP = {
    "model.embed_tokens.weight": EMBEDDING,
    "model.norm.weight": "base_model.dec_norm.weight",
    "lm_head.weight": HEAD,
}
_MIXTRAL_LAYER = {
    "input_layernorm.weight": "ln.weight",
    "post_attention_layernorm.weight": "ff_ln.weight",
    "self_attn.o_proj.weight": "attn.dense.weight",
    "block_sparse_moe.gate.weight": "ff_sub_layer.gate.weight",
    "mlp.gate.weight": "ff_sub_layer.gate.weight",
    "mlp.experts.gate_up_proj": "ff_sub_layer.cond_ffn.w13",
    "mlp.experts.down_proj": "ff_sub_layer.cond_ffn.w2",
}
_MIXTRAL_QKV = {
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
}
_MIXTRAL_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def _rope_rows(weight: torch.Tensor, head_size: int) -> torch.Tensor:
    """A query or key projection from HF's rotary layout (each head's first half rotates with
    its second half) to fms's (adjacent pairs rotate together), as fms's Llama adapter does."""
    heads = weight.size(0) // head_size
    return weight.view(heads, 2, -1, weight.size(1)).transpose(1, 2).reshape(*weight.size())


def _mixtral_adapter(partial: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Hub- or transformers-5-layout Mixtral tensors -> fms's Mixtral names and layouts. What it
    cannot convert (an unknown name, a layer lacking a projection or an expert's matrix) keeps
    its checkpoint name, for the strict loader to report."""
    out: dict[str, torch.Tensor] = {}
    attention: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    experts: dict[str, dict[tuple[int, str], tuple[str, torch.Tensor]]] = {}
    for name, tensor in partial.items():
        if name in _MIXTRAL_TOP:
            out[_MIXTRAL_TOP[name]] = tensor
            continue
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match is None:
            out[name] = tensor
            continue
        layer, rest = f"base_model.layers.{match[1]}.", match[2]
        if rest in _MIXTRAL_LAYER:
            out[layer + _MIXTRAL_LAYER[rest]] = tensor
        elif rest in _MIXTRAL_QKV:
            attention.setdefault(layer, {})[_MIXTRAL_QKV[rest]] = (name, tensor)
        elif (expert := _MIXTRAL_EXPERT.fullmatch(rest)) is not None:
            experts.setdefault(layer, {})[int(expert[1]), expert[2]] = (name, tensor)
        else:
            out[name] = tensor
    head_size = config.dim // config.nheads
    for layer, qkv in attention.items():
        if set(qkv) != {"q", "k", "v"}:
            out.update(dict(qkv.values()))
            continue
        out[layer + "attn.in_proj.qkv_fused.weight"] = torch.cat(
            [_rope_rows(qkv["q"][1], head_size), _rope_rows(qkv["k"][1], head_size), qkv["v"][1]]
        )
    for layer, matrices in experts.items():
        wanted = {(e, w) for e in range(config.num_experts) for w in ("w1", "w2", "w3")}
        if set(matrices) != wanted:
            out.update(dict(matrices.values()))
            continue
        rows = range(config.num_experts)
        out[layer + "ff_sub_layer.cond_ffn.w13"] = torch.stack(
            [torch.cat([matrices[e, "w1"][1], matrices[e, "w3"][1]]) for e in rows]
        )
        out[layer + "ff_sub_layer.cond_ffn.w2"] = torch.stack([matrices[e, "w2"][1] for e in rows])
    return out
