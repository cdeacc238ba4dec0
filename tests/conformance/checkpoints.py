"""Tiny random-weight HF checkpoints shaped like the models Spyre users serve (issue 30).

Each ``Architecture`` is a config dict for one of transformers' own model classes, with the real
model's values for every field that changes the math (rope type and scaling, multipliers, tied
embeddings, sliding window, MoE routing, q/k norms, biases, MQA/GQA) and only the sizes shrunk
(hidden 256, 2 layers, head_dim 64 or 128 as the native attention kernels need, 32 for the
8-KV-head Mixtral). ``build_checkpoint`` instantiates the class, draws EVERY parameter from a
seeded generator (norm weights and biases included: with transformers' init they are ones and
zeros, and a server that ignored them would pass), saves it with ``save_pretrained``
(safetensors) and copies the default model's tokenizer (SmolLM2's, 49152 tokens) next to it.
``hub_style`` rewrites config.json afterwards as checkpoints on the Hub written before
transformers 5 carry it: ``rope_theta`` and ``rope_scaling`` at the top level, no
``rope_parameters``.

The weights' scales are chosen so that greedy decoding is well conditioned (the top two logits
of every greedy step of the oracle are far apart compared with float32 rounding; the suite checks
this) and the attention depends on positions (a wrong RoPE or window changes the tokens; the
suite checks this too, against HF with the field removed).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 49152
"""The default model's tokenizer (SmolLM2): the checkpoints use its vocabulary."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

SEED = 1234

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""Llama 3.1-8B's (and 3.2's, 3.3's) rope scaling, with its ``rope_theta`` 500000."""


@dataclass(frozen=True)
class Architecture:
    """A checkpoint to build: ``architecture`` (the transformers class, also config.json's
    ``architectures[0]``), ``model_type`` and the config fields."""

    name: str
    architecture: str
    model_type: str
    fields: dict[str, Any]
    hub_style: bool = False
    """Rewrite config.json as a pre-transformers-5 checkpoint: ``rope_theta`` and
    ``rope_scaling`` instead of ``rope_parameters``."""
    shaped_like: str = ""
    """The real model whose config fields this one copies."""
    logit_std: float = 3.0
    """Standard deviation of the logits (after any ``logits_scaling``)."""
    embedding_std: float = 1.0
    """Standard deviation of the token embeddings' entries."""
    qk_gain: float = 2.0
    """Queries and keys are this many times what fan-in scaled projections give (the gain is on
    their norms' weights where the model normalizes them per head)."""
    seed: int = SEED
    drop_tensors: tuple[str, ...] = ()
    """Removed from the saved checkpoint (loading must then fail, naming them)."""
    extra_tensors: tuple[tuple[str, int], ...] = ()
    """(name, length) of zero vectors added to the saved checkpoint (loading must then fail,
    naming them)."""


def _llama(**fields: Any) -> dict[str, Any]:
    base = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return base | fields


def _rope(rope_type: str, theta: float, **params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **params}}


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        Architecture(
            "llama",
            "LlamaForCausalLM",
            "llama",
            _llama(tie_word_embeddings=True, **_rope("default", 100000.0)),
            shaped_like="SmolLM2-135M (plain RoPE, GQA 4:2, tied embeddings)",
            embedding_std=0.1,
        ),
        Architecture(
            "llama3",
            "LlamaForCausalLM",
            "llama",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                max_position_embeddings=131072,
                **_rope(
                    "llama3", 500000.0, **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}
                ),
            ),
            shaped_like="Llama-3.1-8B (rope_type llama3, head_dim 128), transformers-5 config.json",
        ),
        Architecture(
            "llama3-hub",
            "LlamaForCausalLM",
            "llama",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                max_position_embeddings=131072,
                **_rope(
                    "llama3", 500000.0, **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}
                ),
            ),
            hub_style=True,
            shaped_like="Llama-3.1-8B as on the Hub: rope_scaling + rope_theta (pre-5 config.json)",
        ),
        Architecture(
            "rope-linear",
            "LlamaForCausalLM",
            "llama",
            _llama(**_rope("linear", 10000.0, factor=4.0)),
            shaped_like="a Llama with linear position interpolation (factor 4)",
        ),
        Architecture(
            "rope-dynamic",
            "LlamaForCausalLM",
            "llama",
            # HF rescales the base for the whole sequence once it exceeds 256 positions: the
            # rotation of a cached prefix then depends on the total length.
            _llama(max_position_embeddings=256, **_rope("dynamic", 10000.0, factor=2.0)),
            shaped_like="a Llama with dynamic NTK scaling (factor 2 beyond 256 positions)",
        ),
        Architecture(
            "rope-yarn",
            "LlamaForCausalLM",
            "llama",
            _llama(
                max_position_embeddings=32768,
                **_rope(
                    "yarn",
                    1000000.0,
                    factor=4.0,
                    original_max_position_embeddings=8192,
                    beta_fast=32.0,
                    beta_slow=1.0,
                ),
            ),
            shaped_like="Qwen3 with its documented YaRN setting (factor 4 over 8192)",
        ),
        Architecture(
            "rope-longrope",
            "LlamaForCausalLM",
            "llama",
            _llama(
                max_position_embeddings=131072,
                **_rope(
                    "longrope",
                    10000.0,
                    original_max_position_embeddings=4096,
                    short_factor=[1.0 + 0.05 * i for i in range(32)],
                    long_factor=[1.0 + 1.5 * i for i in range(32)],
                ),
            ),
            shaped_like="Phi-3-128k's LongRoPE (short/long factors, 4096 original positions)",
        ),
        Architecture(
            "granite",
            "GraniteForCausalLM",
            "granite",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                tie_word_embeddings=True,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.0078125,
                logits_scaling=16.0,
                **_rope("default", 10000000.0),
            ),
            shaped_like="granite-3.3-8b-instruct (multipliers, logits_scaling, tied embeddings)",
            # Tied random embeddings favour repeating the input token (its own logit gains
            # sqrt(hidden) over the others'): with embedding_multiplier 12 they must be small.
            embedding_std=0.002,
            qk_gain=6.0,  # attention_multiplier 1/128, not 1/sqrt(128)
        ),
        Architecture(
            "mistral",
            "MistralForCausalLM",
            "mistral",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                sliding_window=None,
                **_rope("default", 1000000.0),
            ),
            shaped_like="Mistral-7B-Instruct-v0.3 (no sliding window)",
        ),
        Architecture(
            "mistral-swa",
            "MistralForCausalLM",
            "mistral",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                sliding_window=100,
                **_rope("default", 10000.0),
            ),
            shaped_like="Mistral-7B-v0.1 (sliding_window 4096 there; 100 here, below the prompts)",
        ),
        Architecture(
            "mixtral",
            "MixtralForCausalLM",
            "mixtral",
            _llama(
                intermediate_size=128,
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=None,
                router_jitter_noise=0.0,
                **_rope("default", 1000000.0),
            ),
            shaped_like="Mixtral-8x7B (8 experts, top 2, Hub key layout) with GQA 4:2",
        ),
        Architecture(
            "mixtral-kv8",
            "MixtralForCausalLM",
            "mixtral",
            _llama(
                intermediate_size=128,
                num_attention_heads=8,
                num_key_value_heads=8,
                head_dim=32,
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=None,
                router_jitter_noise=0.0,
                **_rope("default", 1000000.0),
            ),
            shaped_like="Mixtral-8x7B with 8 KV heads (8 query heads)",
        ),
        Architecture(
            "gpt-bigcode",
            "GPTBigCodeForCausalLM",
            "gpt_bigcode",
            {
                "vocab_size": VOCAB_SIZE,
                "n_embd": 256,
                "n_inner": 1024,
                "n_layer": 2,
                "n_head": 2,
                "n_positions": 2048,
                "multi_query": True,
                "activation_function": "gelu_pytorch_tanh",
                "layer_norm_epsilon": 1e-5,
                "scale_attn_weights": True,
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            shaped_like="granite-20b-code / StarCoder (multi-query, learned positions, biases)",
            embedding_std=0.01,
        ),
        Architecture(
            "qwen3",
            "Qwen3ForCausalLM",
            "qwen3",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                rms_norm_eps=1e-6,
                attention_bias=False,
                use_sliding_window=False,
                **_rope("default", 1000000.0),
            ),
            shaped_like="Qwen3-8B (q/k norms, head_dim 128)",
        ),
        Architecture(
            "llama-missing-tensor",
            "LlamaForCausalLM",
            "llama",
            _llama(tie_word_embeddings=True, **_rope("default", 100000.0)),
            shaped_like="the llama checkpoint without one norm's weight",
            embedding_std=0.1,
            drop_tensors=("model.layers.0.post_attention_layernorm.weight",),
        ),
        Architecture(
            "llama-extra-tensor",
            "LlamaForCausalLM",
            "llama",
            _llama(tie_word_embeddings=True, **_rope("default", 100000.0)),
            shaped_like="the llama checkpoint with a tensor no parameter takes (lm_head.bias)",
            embedding_std=0.1,
            extra_tensors=(("lm_head.bias", VOCAB_SIZE),),
        ),
        Architecture(
            "qwen2",
            "Qwen2ForCausalLM",
            "qwen2",
            _llama(
                num_attention_heads=2,
                num_key_value_heads=1,
                rms_norm_eps=1e-6,
                use_sliding_window=False,
                **_rope("default", 1000000.0),
            ),
            shaped_like="Qwen2.5-7B (biases on q/k/v)",
        ),
    ]
}


def hf_config(arch: Architecture) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch.model_type, **arch.fields)
    config.architectures = [arch.architecture]
    return config


def randomize(model: Any, arch: Architecture) -> None:
    """Draw every parameter from a generator seeded with ``arch.seed``, in name order: matrices
    with fan-in scaling (outputs of unit scale; queries and keys ``arch.qk_gain`` times that, so
    that attention is sharp enough for positions to matter), token embeddings at
    ``arch.embedding_std``, learned position embeddings at 0.5, norm weights around 1 and biases
    around 0 (both random). The LM head (or, with tied embeddings, the final norm's gain) makes
    logits of standard deviation ``arch.logit_std`` after any ``logits_scaling``."""
    import torch

    config = model.config
    hidden = model.get_output_embeddings().weight.shape[-1]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    logits_scaling = getattr(config, "logits_scaling", 1.0)
    head_std = arch.logit_std * logits_scaling / math.sqrt(hidden)
    final_gain = head_std / arch.embedding_std if tied else 1.0
    generator = torch.Generator().manual_seed(arch.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("wpe.weight"):
                value = noise * 0.5
            elif param is model.get_input_embeddings().weight:
                value = noise * arch.embedding_std
            elif param is model.get_output_embeddings().weight:
                value = noise * head_std
            elif param.ndim == 1 and name.endswith("bias"):
                value = noise * 0.1
            elif param.ndim == 1:  # norm weights
                gain = final_gain if any(name.endswith(n) for n in FINAL_NORMS) else 1.0
                if any(part in name for part in ("q_norm", "k_norm")):
                    gain = arch.qk_gain
                value = gain * (1.0 + noise * 0.1)
            else:  # [out, in], or [experts, out, in]
                value = noise / math.sqrt(param.shape[-1])
                if any(part in name for part in ("q_proj", "k_proj")):
                    value = value * arch.qk_gain
            param.copy_(value)


FINAL_NORMS = ("model.norm.weight", "transformer.ln_f.weight")


def build_checkpoint(arch: Architecture, directory: Path, tokenizer_dir: Path) -> Path:
    """Save ``arch``'s random-weight checkpoint into ``directory`` (created) and return it."""
    import torch
    import transformers

    torch.manual_seed(arch.seed)  # transformers' own init, overwritten by randomize
    model = getattr(transformers, arch.architecture)(hf_config(arch)).eval()
    randomize(model, arch)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    if arch.hub_style:
        write_hub_style_config(directory / "config.json")
    if arch.drop_tensors or arch.extra_tensors:
        edit_tensors(directory / "model.safetensors", arch)
    return directory


def edit_tensors(path: Path, arch: Architecture) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name in arch.drop_tensors:
        del tensors[name]
    for name, length in arch.extra_tensors:
        tensors[name] = torch.zeros(length)
    save_file(tensors, path, metadata={"format": "pt"})


def write_hub_style_config(path: Path) -> None:
    """config.json as transformers 4.x wrote it: ``rope_theta`` and ``rope_scaling`` (with
    ``rope_type``, and ``type`` as older files also carry) at the top level."""
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope["rope_type"]
    config["rope_scaling"] = None if rope_type == "default" else rope
    config["transformers_version"] = "4.43.0.dev0"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
