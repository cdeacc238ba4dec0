"""The config.json reader (spyre_server.model.hf_config) and HF's rotary embeddings
(spyre_server.model.rope): both config.json styles read alike, every rope type computed with
HF's own numbers or refused, every refusal by name, and what the fms config gets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from spyre_server.model.errors import ModelLoadError
from spyre_server.model.hf_config import check_serving, model_spec
from spyre_server.model.rope import ROPE_TYPES, RopeSpec

HEAD_DIM = 64


def llama(**fields: Any) -> dict[str, Any]:
    """A tiny Llama config.json (transformers 5 style: ``rope_parameters``)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        **fields,
    }


def hub_style(config: dict[str, Any]) -> dict[str, Any]:
    """The same config as pre-transformers-5 files carry it: ``rope_theta`` at the top level,
    ``rope_scaling`` (with ``type`` too, as older files have it), no ``rope_parameters``."""
    config = copy.deepcopy(config)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] != "default":
        config["rope_scaling"] = {"type": rope["rope_type"], **rope}
    return config


ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 2048,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 2048,
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 1.5 * i for i in range(HEAD_DIM // 2)],
    },
}
"""One config of each rope type (the yarn one as Qwen3 documents it, the llama3 one as Llama 3.1
ships it, shorter original lengths)."""

ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "yarn-mscale": ROPES["yarn"] | {"mscale": 0.707, "mscale_all_dim": 0.707},
    "yarn-attention-factor": ROPES["yarn"] | {"attention_factor": 1.25},
    "yarn-no-truncate": ROPES["yarn"] | {"truncate": False},
    "longrope-attention-factor": ROPES["longrope"] | {"attention_factor": 1.1, "factor": 8.0},
}


def hf_rope(config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """HF's own inverse frequencies and attention factor for ``config`` (its model's init)."""
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = CONFIG_MAPPING[config["model_type"]].from_dict(
        {k: v for k, v in config.items() if k != "model_type"}
    )
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[rope_type](hf, None)


def spec_of(config: dict[str, Any]) -> RopeSpec:
    rope = model_spec(config).rope
    assert rope is not None
    return rope


# ----------------------------------------------------------------------------- rope types
@pytest.mark.parametrize("name", [*ROPES, *ROPE_VARIANTS])
def test_both_config_styles_read_as_the_same_rope(name: str) -> None:
    rope = (ROPES | ROPE_VARIANTS)[name]
    config = llama(rope_parameters=copy.deepcopy(rope))
    assert spec_of(config) == spec_of(hub_style(config))


@pytest.mark.parametrize("name", [*ROPES, *ROPE_VARIANTS])
def test_every_rope_type_computes_hf_numbers(name: str) -> None:
    """The inverse frequencies are HF's to the bit (the same float32 expressions), the
    attention factor HF's, and the table's entries HF's cos and sin times that factor."""
    config = llama(rope_parameters=copy.deepcopy((ROPES | ROPE_VARIANTS)[name]))
    ours, factor = spec_of(config).inv_freq()
    theirs, their_factor = hf_rope(config)
    assert torch.equal(ours, theirs.float())
    assert factor == their_factor
    positions = torch.tensor([0, 1, 7, 100, 1000, 2047])
    table = spec_of(config).table(2048)[positions]
    angles = positions[:, None].float() * theirs.float()[None, :]
    torch.testing.assert_close(table[..., 0, 0], angles.cos() * their_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(table[..., 1, 0], angles.sin() * their_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(table[..., 0, 1], -table[..., 1, 0], rtol=0, atol=0)
    torch.testing.assert_close(table[..., 1, 1], table[..., 0, 0], rtol=0, atol=0)


def test_llama3_is_not_plain_rope() -> None:
    """Llama 3's rope_type llama3 is not plain RoPE (ibm-fms 1.13.1's reader builds plain RoPE
    for it under transformers 5)."""
    scaled, _ = spec_of(llama(rope_parameters=ROPES["llama3"])).inv_freq()
    plain, _ = spec_of(llama(rope_parameters={"rope_theta": 500000.0})).inv_freq()
    assert not torch.equal(scaled, plain)


def test_rope_theta_defaults_as_hf() -> None:
    no_theta = llama(rope_parameters=None)
    assert spec_of(no_theta).theta == 10000.0
    assert spec_of(llama(rope_parameters=None, rope_theta=5e5)).theta == 5e5
    mixtral = mixtral_config(rope_parameters=None)
    assert spec_of(mixtral).theta == 1e6  # MixtralConfig's default_theta


def test_original_max_position_embeddings_resolved_as_hf() -> None:
    """llama3, yarn and longrope: the top-level field wins (Phi-3's files), then the rope
    parameters, then max_position_embeddings."""
    rope = {k: v for k, v in ROPES["llama3"].items() if k != "original_max_position_embeddings"}
    assert (
        spec_of(llama(rope_parameters=rope)).parameters["original_max_position_embeddings"] == 8192
    )
    top = llama(rope_parameters=ROPES["llama3"], original_max_position_embeddings=4096)
    assert spec_of(top).parameters["original_max_position_embeddings"] == 4096
    for config in (llama(rope_parameters=rope), top):
        assert torch.equal(spec_of(config).inv_freq()[0], hf_rope(config)[0].float())


@pytest.mark.parametrize(
    ("rope", "refusal"),
    [
        ({"rope_type": "proportional", "partial_rotary_factor": 0.5}, "'proportional'"),
        ({"rope_type": "su"}, "rope_type 'su' is not supported"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
        ({"rope_type": "linear"}, "'factor'"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 2048}, "'factor'"),
        (ROPES["longrope"] | {"short_factor": [1.0] * 3}, "short_factor has 3 entries"),
        ({"full_attention": {"rope_type": "default"}}, "per layer type (['full_attention'])"),
    ],
    ids=["proportional", "unknown", "partial", "llama3-incomplete", "linear-no-factor",
         "yarn-no-factor", "longrope-length", "per-layer-type"],
)  # fmt: skip
def test_unsupported_rope_is_refused_by_name(rope: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ModelLoadError, match=r"rope|partial") as info:
        model_spec(llama(rope_parameters=rope))
    assert refusal in str(info.value)
    if "rope_type" in rope and rope["rope_type"] not in ROPE_TYPES:
        assert "supported: default, linear, dynamic, yarn, llama3, longrope" in str(info.value)


def test_conflicting_rope_fields_are_refused() -> None:
    config = llama(rope_parameters=ROPES["linear"], rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ModelLoadError, match=r"rope_parameters and rope_scaling disagree"):
        model_spec(config)


# ----------------------------------------------------------------------- serving limits
@pytest.mark.parametrize(
    ("rope", "limit"), [("dynamic", 8192), ("longrope", 2048)], ids=["dynamic", "longrope"]
)
def test_length_dependent_rope_is_exact_up_to_its_length_only(rope: str, limit: int) -> None:
    spec = model_spec(llama(rope_parameters=ROPES[rope]))
    check_serving(spec, limit, sliding_window_attention=False)
    with pytest.raises(ModelLoadError, match=f"rope_type '{rope}'.*max_model_len <= {limit}"):
        check_serving(spec, limit + 1, sliding_window_attention=False)


@pytest.mark.parametrize("rope", ["default", "linear", "yarn", "llama3"])
def test_other_ropes_have_no_length_limit(rope: str) -> None:
    spec = model_spec(llama(rope_parameters=ROPES[rope]))
    check_serving(spec, 100_000, sliding_window_attention=False)


def test_learned_positions_bound_the_length() -> None:
    spec = model_spec(gpt_bigcode_config())
    check_serving(spec, 2048, sliding_window_attention=False)
    with pytest.raises(ModelLoadError, match="learned positions for 2048 tokens"):
        check_serving(spec, 2049, sliding_window_attention=False)


def test_a_window_shorter_than_max_model_len_is_refused_until_attention_applies_it() -> None:
    spec = model_spec(mistral_config(sliding_window=100))
    assert (spec.sliding_window, spec.sliding_window_layers) == (100, (0, 1))
    assert spec.fms_config.sliding_window == 100
    assert spec.fms_config.sliding_window_layers == (0, 1)
    check_serving(spec, 100, sliding_window_attention=False)  # the window hides nothing
    with pytest.raises(ModelLoadError, match=r"sliding_window \(100 tokens.*max_model_len <= 100"):
        check_serving(spec, 101, sliding_window_attention=False)
    check_serving(spec, 101, sliding_window_attention=True)


def test_mistral_without_sliding_window_field_gets_hfs_default() -> None:
    """MistralConfig's default window is 4096: a config.json leaving the field out has one."""
    config = mistral_config()
    del config["sliding_window"]
    assert model_spec(config).sliding_window == 4096
    assert model_spec(mistral_config(sliding_window=None)).sliding_window is None


def test_qwen3_window_on_some_layers_is_refused() -> None:
    config = qwen3_config(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    spec = model_spec(config)
    assert (spec.sliding_window, spec.sliding_window_layers) == (64, (1,))
    with pytest.raises(ModelLoadError, match=r"applies to layers \[1\] of 2 only"):
        check_serving(spec, 65, sliding_window_attention=True)
    assert model_spec(qwen3_config(sliding_window=64)).sliding_window is None  # not in use


# ------------------------------------------------------------------------------- refusals
def mistral_config(**fields: Any) -> dict[str, Any]:
    return (
        llama(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
        | fields
    )


def mixtral_config(**fields: Any) -> dict[str, Any]:
    return (
        llama(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        )
        | fields
    )


def qwen3_config(**fields: Any) -> dict[str, Any]:
    return llama(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=HEAD_DIM) | fields


def gpt_bigcode_config(**fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["GPTBigCodeForCausalLM"],
        "model_type": "gpt_bigcode",
        "vocab_size": 128,
        "n_embd": 256,
        "n_inner": 1024,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 2048,
        "multi_query": True,
        "activation_function": "gelu_pytorch_tanh",
        **fields,
    }


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (llama(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
         "architecture Qwen2ForCausalLM is not supported"),
        (llama(architectures=["GraniteMoeHybridForCausalLM"]),
         "architecture GraniteMoeHybridForCausalLM is not supported"),
        (llama(architectures=[]), "names no architecture"),
        (llama(model_type="mistral"), "model_type 'mistral' does not go with"),
        (llama(quantization_config={"quant_method": "gptq"}), "quantization_config"),
        (llama(attn_logit_softcapping=50.0), "attn_logit_softcapping (50.0)"),
        (llama(final_logit_softcapping=30.0), "final_logit_softcapping (30.0)"),
        (llama(layer_types=["full_attention", "sliding_attention"]),
         "layer_types has ['sliding_attention']"),
        (qwen3_config(layer_types=["full_attention", "linear_attention"]),
         "layer_types has ['linear_attention']"),
        (llama(hidden_act="gelu_fast"), "hidden_act 'gelu_fast' is not supported"),
        (llama(head_dim=32), "head_dim 32 with hidden_size 256"),
        (mixtral_config(head_dim=32), "head_dim 32 with hidden_size 256"),
        (mixtral_config(hidden_act="gelu"), "Mixtral experts compute SiLU only"),
        (gpt_bigcode_config(scale_attn_weights=False), "scale_attn_weights false"),
        (gpt_bigcode_config(add_cross_attention=True), "add_cross_attention true"),
    ],
    ids=["qwen2", "granite-hybrid", "no-architecture", "model-type", "quantized",
         "attn-softcap", "final-softcap", "llama-sliding-layers", "qwen3-linear-layers",
         "activation", "llama-head-dim", "mixtral-head-dim", "mixtral-activation",
         "bigcode-unscaled", "bigcode-cross-attention"],
)  # fmt: skip
def test_refused_by_name(config: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        model_spec(config)
    assert refusal in str(info.value)


def test_refusal_of_an_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError) as info:
        model_spec(llama(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    for name in ("LlamaForCausalLM", "GraniteForCausalLM", "MixtralForCausalLM", "Qwen3"):
        assert name in str(info.value)


# ------------------------------------------------------------------------ the fms configs
def test_mixtral_reads_its_kv_heads_and_experts() -> None:
    """config.json's num_key_value_heads is the fms model's (ibm-fms 1.13.1's reader passes it
    under a name MixtralConfig does not have, so every Mixtral gets 8 KV heads)."""
    spec = model_spec(mixtral_config(num_key_value_heads=2, num_experts_per_tok=1))
    config = spec.fms_config
    assert (config.kvheads, config.nheads, config.dim, config.hidden_dim) == (2, 4, 256, 128)
    assert (config.num_experts, config.top_k_experts, config.rope_base) == (8, 1, 1e4)


def test_activation_and_sizes_are_mapped() -> None:
    spec = model_spec(llama(hidden_act="gelu", intermediate_size=700, tie_word_embeddings=True))
    config = spec.fms_config
    assert config.activation_fn == "gelu"
    assert int(config.hidden_grow_factor * config.emb_dim) == 700
    assert config.multiple_of == 1 and config.tie_heads and spec.tie_word_embeddings


def test_gpt_bigcode_treats_no_token_as_padding() -> None:
    """fms's GPT-BigCode zeroes the position embedding of tokens equal to its pad_id (default
    0); HF's treats no token apart."""
    spec = model_spec(gpt_bigcode_config(activation_function="gelu"))
    assert spec.fms_config.pad_id is None
    assert spec.fms_config.activation_fn == "gelu"
    assert spec.rope is None and spec.learned_positions


def test_granite_multipliers_and_rope_scaling() -> None:
    config = llama(
        architectures=["GraniteForCausalLM"],
        model_type="granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
        rope_parameters=ROPES["llama3"],
    )
    spec = model_spec(config)
    fms = spec.fms_config
    assert (fms.embedding_multiplier, fms.residual_multiplier) == (12.0, 0.22)
    assert (fms.attention_multiplier, fms.logits_scaling) == (0.0078125, 16.0)
    assert spec.rope is not None and spec.rope.rope_type == "llama3"
