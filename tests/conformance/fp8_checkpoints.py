"""FP8 checkpoints as llm-compressor writes them (compressed-tensors ``float-quantized``), made
from a conformance checkpoint: each decoder linear layer's weight in float8_e4m3fn with its
scale (amax / 448 per output row, or for the whole tensor), and either a static input scale per
layer (amax / 448 of the layer's input over calibration prompts, as its minmax observer finds
it), dynamic per-token input scales (FP8_DYNAMIC: nothing stored), or none; the LM head,
embeddings and norms as they were."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from spyre_server.model.fp8 import InputScales

FP8_MAX = 448.0


def quantization_config(per_channel: bool, inputs: InputScales) -> dict[str, Any]:
    def args(strategy: str, dynamic: bool = False) -> dict[str, Any]:
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": dynamic,
            "strategy": strategy,
            "group_size": None,
            "block_structure": None,
            "actorder": None,
            "observer": None if dynamic else "minmax",
        }

    input_activations = {"static": args("tensor"), "dynamic": args("token", dynamic=True)}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": ["lm_head"],
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": args("channel" if per_channel else "tensor"),
                "input_activations": input_activations.get(inputs) if inputs else None,
                "output_activations": None,
            }
        },
    }


@torch.no_grad()
def input_amax(checkpoint: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Layer name -> the largest |input| of that linear layer over ``prompts`` (HF's model in
    bfloat16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    amax: dict[str, float] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, inputs: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))

        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(hook(name))
    for prompt in prompts:
        model(torch.tensor([prompt]))
    return amax


def quantize(
    source: Path,
    target: Path,
    *,
    per_channel: bool,
    inputs: InputScales,
    prompts: list[list[int]],
) -> Path:
    """``source``'s checkpoint as an FP8 checkpoint in ``target`` (created); returns it."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    amax = input_amax(source, prompts) if inputs == "static" else {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        layer = key.removesuffix(".weight")
        if not (key.startswith("model.layers.") and key.endswith("proj.weight")):
            out[key] = tensor
            continue
        w = tensor.float()
        top = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = (top / FP8_MAX).to(tensor.dtype)
        out[key] = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[f"{layer}.weight_scale"] = scale
        if inputs == "static":
            out[f"{layer}.input_scale"] = torch.tensor([amax[layer] / FP8_MAX], dtype=tensor.dtype)
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config(per_channel, inputs)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
