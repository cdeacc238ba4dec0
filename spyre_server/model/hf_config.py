"""Reads an HF checkpoint's config.json into the fms model that computes what HF transformers'
model of the same checkpoint computes, or refuses it by name.

The architectures accepted are ``FAMILIES`` (config.json's ``architectures[0]``, with its
``model_type``). For each, every config field HF's model class reads is either mapped onto the fms
model's config or refused when it holds a value we do not compute; fields HF's class does not read
do not change its math and are ignored. Plain fields take HF's values, defaults included (the
config.json is read by transformers' own config class for its ``model_type``). Rotary embeddings
are read here from config.json in both of its styles: transformers 5's ``rope_parameters`` (with
``rope_theta`` inside) and the Hub's pre-5 ``rope_scaling`` with a top-level ``rope_theta``; see
``spyre_server.model.rope`` for what each rope type computes.

Refused whatever the serving settings: an architecture not in ``FAMILIES`` (fms has no model of
it, or it is not checked against HF), a ``model_type`` that does not go with the architecture,
a ``quantization_config`` other than the FP8 form ``spyre_server.model.fp8`` reads (and FP8 on
architectures outside ``FP8_ARCHITECTURES``), attention or final logit softcapping, layer types
other than full (and sliding, where the architecture has it) attention, a rope type not in
``rope.ROPE_TYPES``, rope parameters per layer type, partial rotary embeddings, an activation fms
does not compute, and the few per-family settings listed in each builder. Refused for some
serving settings only (``check_serving``): a sequence longer than a rope type or learned position
table is exact for, and a sliding window shorter than ``model.max_model_len`` while the attention
paths ignore it.

fms's own readers (``fms.models.hf.config_utils.param_builders``, ibm-fms 1.13.1) are not used:
they look for ``rope_scaling`` inside ``rope_parameters`` (transformers 5 never writes it there,
so Llama 3's ``rope_type: llama3`` became plain RoPE), drop rope scaling for Granite, Mistral,
Mixtral and Qwen3, pass Mixtral's KV-head count as ``kv_heads`` (MixtralConfig's field is
``kvheads``: fms's config update drops unknown names silently, leaving 8), leave the activation
at the fms default for Llama and GPT-BigCode, keep GPT-BigCode's ``pad_id`` 0 (fms then zeroes
the position embedding of every token 0, HF does not), and build from the registry's first
variant, so a field they do not pass takes that variant's value. Here every fms config is built
field by field from its dataclass defaults, and an unknown field name is an error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fms.utils.config import ModelConfig

from spyre_server.model.errors import ModelLoadError
from spyre_server.model.fp8 import Fp8Scheme, read_fp8_scheme
from spyre_server.model.rope import REQUIRED, ROPE_TYPES, RopeSpec

LAYER_TYPES = ("full_attention", "sliding_attention")

FP8_ARCHITECTURES = frozenset({"llama", "granite", "mistral", "qwen3"})
"""fms architectures whose FP8 checkpoints are served: dense decoders whose linear layers are
plain projections without biases (Mixtral's experts and GPT-BigCode's biased layers are not)."""

SOFTCAPPING_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "logit_softcapping")

ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu-tanh",
    "gelu_new": "gelu-tanh",
    "relu": "relu",
}
"""config.json's activation (HF's ACT2FN name) -> fms's. ``gelu_new`` is HF's own float32
formula of the tanh approximation, the function torch's tanh GELU computes."""


@dataclass(frozen=True)
class ModelSpec:
    """What to build for a checkpoint and how to load it.

    ``fms_config`` is the fms model's config (its class's ``from_config`` builds the model);
    ``rope`` the rotary embedding HF computes (None for learned positions); ``sliding_window``
    the number of keys a query attends on ``sliding_window_layers`` (HF's semantics: the query
    at position p sees the keys at p - sliding_window + 1 .. p), None and empty without one;
    the fms config (and so the model's ``config``) carries both as attributes of those names.
    ``embedding_key`` / ``head_key`` name the checkpoint's token embedding and LM head (a tied
    checkpoint may leave the head out)."""

    architecture: str
    model_type: str
    fms_architecture: str
    fms_config: ModelConfig
    num_layers: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeSpec | None
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    embedding_key: str = "model.embed_tokens.weight"
    head_key: str = "lm_head.weight"
    learned_positions: bool = False
    fp8: Fp8Scheme | None = None
    """The checkpoint's FP8 scheme (``spyre_server.model.fp8``), None for unquantized weights."""


# --------------------------------------------------------------------------------- reading
def read_model_spec(path: Path) -> ModelSpec:
    """The spec of the checkpoint folder ``path`` (its config.json); ModelLoadError when it is
    refused."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    return model_spec(raw)


def model_spec(raw: Mapping[str, Any]) -> ModelSpec:
    """The spec of a config.json's contents; ModelLoadError when it is refused."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"config.json names no architecture; supported: {_supported()}")
    architecture = architectures[0]
    family = FAMILIES.get(architecture)
    if family is None:
        raise ModelLoadError(
            f"architecture {architecture} is not supported (architectures we serve exactly: "
            f"{_supported()})"
        )
    model_type = raw.get("model_type")
    if model_type != family.model_type:
        raise ModelLoadError(
            f"config.json's model_type {model_type!r} does not go with its architecture "
            f"{architecture} (model_type {family.model_type!r})"
        )
    _refuse_common(raw, architecture)
    hf = _hf_config(raw)
    spec = family.build(hf, raw)
    if not raw.get("quantization_config"):
        return spec
    fp8 = read_fp8_scheme(raw["quantization_config"])
    if spec.fms_architecture not in FP8_ARCHITECTURES:
        raise ModelLoadError(
            f"config.json's quantization_config: FP8 checkpoints of {architecture} are not "
            f"implemented (FP8 is served for {', '.join(sorted(FP8_ARCHITECTURES))})"
        )
    return replace(spec, fp8=fp8)


def _supported() -> str:
    return ", ".join(FAMILIES)


def _hf_config(raw: Mapping[str, Any]) -> Any:
    """config.json as transformers' config class for its model_type reads it (HF's defaults)."""
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return CONFIG_MAPPING[raw["model_type"]].from_dict(fields)
    except Exception as exc:
        raise ModelLoadError(
            f"transformers cannot read config.json ({type(exc).__name__}: {exc})"
        ) from exc


def _refuse_common(raw: Mapping[str, Any], architecture: str) -> None:
    for name in SOFTCAPPING_FIELDS:
        if raw.get(name) is not None:
            raise ModelLoadError(
                f"config.json's {name} ({raw[name]}): logit softcapping is not implemented "
                f"for {architecture}"
            )


def _layer_types(hf: Any, raw: Mapping[str, Any], allowed: tuple[str, ...]) -> list[str] | None:
    types = getattr(hf, "layer_types", None) or raw.get("layer_types")
    if types is None:
        return None
    unsupported = sorted({t for t in types if t not in allowed})
    if unsupported:
        raise ModelLoadError(
            f"config.json's layer_types has {unsupported}: {raw['architectures'][0]} is served "
            f"with layer types {list(allowed)} only"
        )
    return list(types)


def read_rope(
    raw: Mapping[str, Any], *, dim: int, max_position_embeddings: int, default_theta: float
) -> RopeSpec:
    """config.json's rotary embedding, read as transformers 5 reads it: ``rope_parameters``, or
    a Hub config's ``rope_scaling`` (which transformers prefers when both are given; they must
    agree here), ``rope_type`` (or the older ``type``, default ``default``), ``rope_theta``
    from the parameters, else the top level, else the config class's default; for llama3, yarn
    and longrope ``original_max_position_embeddings`` from the top level of config.json, else
    the parameters, else ``max_position_embeddings``."""
    parameters = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if parameters and scaling:
        conflicts = sorted(k for k, v in scaling.items() if k in parameters and parameters[k] != v)
        if conflicts:
            raise ModelLoadError(
                f"config.json's rope_parameters and rope_scaling disagree on {conflicts}"
            )
    params = dict(scaling or parameters)
    nested = sorted(k for k in params if k in LAYER_TYPES)
    if nested:
        raise ModelLoadError(
            f"config.json's rope parameters per layer type ({nested}) are not supported"
        )
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"config.json's rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)})"
        )
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta")
    if theta is None:
        theta = default_theta
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = raw.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise ModelLoadError(
            f"config.json's partial_rotary_factor {partial}: only full rotary embeddings "
            "(partial_rotary_factor 1) are supported"
        )
    if rope_type in ("llama3", "yarn", "longrope"):
        original = raw.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings", max_position_embeddings)
        params["original_max_position_embeddings"] = original
    missing = [k for k in REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json's rope_type {rope_type!r} needs {missing}")
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(params[name]) != dim // 2:
                raise ModelLoadError(
                    f"config.json's longrope {name} has {len(params[name])} entries, the head "
                    f"size {dim} needs {dim // 2}"
                )
    return RopeSpec(
        rope_type=rope_type,
        theta=float(theta),
        dim=dim,
        max_position_embeddings=max_position_embeddings,
        parameters=params,
    )


# ------------------------------------------------------------------------------- families
def _activation(hf: Any, name: str) -> str:
    act = getattr(hf, name)
    if act not in ACTIVATIONS:
        raise ModelLoadError(
            f"config.json's {name} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[act]


def _grow_factor(inner: int, hidden: int) -> float:
    """fms sizes a feed-forward layer ``int(factor * hidden)``: the factor giving ``inner``."""
    factor = inner / hidden
    if int(factor * hidden) != inner:
        factor = math.nextafter(factor, math.inf)
    assert int(factor * hidden) == inner, (inner, hidden)
    return factor


def _head_dim(hf: Any) -> int:
    """HF's head size: ``head_dim`` where the config has one, else hidden / heads."""
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def _require_even_heads(hf: Any, architecture: str) -> int:
    """fms's LLaMA and Mixtral size heads as hidden / heads: a config saying otherwise is
    refused."""
    head_dim = _head_dim(hf)
    if hf.hidden_size % hf.num_attention_heads or head_dim * hf.num_attention_heads != (
        hf.hidden_size
    ):
        raise ModelLoadError(
            f"config.json's head_dim {head_dim} with hidden_size {hf.hidden_size} and "
            f"{hf.num_attention_heads} heads: fms's {architecture} supports head_dim = "
            "hidden_size / num_attention_heads only"
        )
    return head_dim


def _rope(hf: Any, raw: Mapping[str, Any], head_dim: int) -> RopeSpec:
    return read_rope(
        raw,
        dim=head_dim,
        max_position_embeddings=int(hf.max_position_embeddings),
        default_theta=float(type(hf).default_theta),
    )


def _spec(
    hf: Any,
    raw: Mapping[str, Any],
    fms_architecture: str,
    fms_config: ModelConfig,
    head_dim: int,
    rope: RopeSpec | None,
    **extra: Any,
) -> ModelSpec:
    window = extra.get("sliding_window")
    # The attention paths read the window from the fms model's config (copied into the model).
    layers = extra.get("sliding_window_layers", ())
    fms_config.sliding_window = window  # type: ignore[attr-defined]
    fms_config.sliding_window_layers = layers  # type: ignore[attr-defined]
    return ModelSpec(
        architecture=raw["architectures"][0],
        model_type=raw["model_type"],
        fms_architecture=fms_architecture,
        fms_config=fms_config,
        num_layers=int(hf.num_hidden_layers),
        head_dim=head_dim,
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        rope=rope,
        **extra,
    )


def _window(hf: Any, layers: list[int]) -> dict[str, Any]:
    window = getattr(hf, "sliding_window", None)
    if window is None or not layers:
        return {"sliding_window": None, "sliding_window_layers": ()}
    return {"sliding_window": int(window), "sliding_window_layers": tuple(layers)}


def _llama(hf: Any, raw: Mapping[str, Any]) -> ModelSpec:
    from fms.models.llama import LLaMAConfig

    _layer_types(hf, raw, ("full_attention",))
    head_dim = _require_even_heads(hf, "LLaMA")
    rope = _rope(hf, raw, head_dim)
    config = LLaMAConfig(
        src_vocab_size=hf.vocab_size,
        emb_dim=hf.hidden_size,
        norm_eps=hf.rms_norm_eps,
        nheads=hf.num_attention_heads,
        kvheads=hf.num_key_value_heads,
        nlayers=hf.num_hidden_layers,
        hidden_grow_factor=_grow_factor(hf.intermediate_size, hf.hidden_size),
        multiple_of=1,
        activation_fn=_activation(hf, "hidden_act"),
        p_dropout=0.0,
        max_expected_seq_len=hf.max_position_embeddings,
        attn_bias=bool(hf.attention_bias),
        mlp_bias=bool(hf.mlp_bias),
        tie_heads=bool(hf.tie_word_embeddings),
        rope_theta=rope.theta,
        fused_weights=True,
    )
    return _spec(hf, raw, "llama", config, head_dim, rope)


def _granite(hf: Any, raw: Mapping[str, Any]) -> ModelSpec:
    from fms.models.granite import GraniteConfig

    _layer_types(hf, raw, ("full_attention",))
    head_dim = _head_dim(hf)
    rope = _rope(hf, raw, head_dim)
    config = GraniteConfig(
        src_vocab_size=hf.vocab_size,
        emb_dim=hf.hidden_size,
        norm_eps=hf.rms_norm_eps,
        nheads=hf.num_attention_heads,
        head_dim=head_dim,
        kvheads=hf.num_key_value_heads,
        nlayers=hf.num_hidden_layers,
        hidden_grow_factor=_grow_factor(hf.intermediate_size, hf.hidden_size),
        multiple_of=1,
        activation_fn=_activation(hf, "hidden_act"),
        p_dropout=0.0,
        max_expected_seq_len=hf.max_position_embeddings,
        ntk_scaling=False,
        attn_bias=bool(hf.attention_bias),
        mlp_bias=bool(hf.mlp_bias),
        tie_heads=bool(hf.tie_word_embeddings),
        rope_theta=rope.theta,
        embedding_multiplier=float(hf.embedding_multiplier),
        logits_scaling=float(hf.logits_scaling),
        residual_multiplier=float(hf.residual_multiplier),
        attention_multiplier=float(hf.attention_multiplier),
        fused_weights=True,
    )
    return _spec(hf, raw, "granite", config, head_dim, rope)


def _mistral(hf: Any, raw: Mapping[str, Any]) -> ModelSpec:
    from fms.models.mistral import MistralConfig

    _layer_types(hf, raw, ("full_attention",))
    head_dim = _head_dim(hf)
    rope = _rope(hf, raw, head_dim)
    window = _window(hf, list(range(hf.num_hidden_layers)))
    config = MistralConfig(
        src_vocab_size=hf.vocab_size,
        nheads=hf.num_attention_heads,
        nlayers=hf.num_hidden_layers,
        hidden_grow_factor=_grow_factor(hf.intermediate_size, hf.hidden_size),
        multiple_of=1,
        tie_heads=bool(hf.tie_word_embeddings),
        p_dropout=0.0,
        activation_fn=_activation(hf, "hidden_act"),
        emb_dim=hf.hidden_size,
        head_dim=head_dim,
        max_expected_seq_len=hf.max_position_embeddings,
        kvheads=hf.num_key_value_heads,
        norm_eps=hf.rms_norm_eps,
        sliding_window=window["sliding_window"],
        rope_base=rope.theta,
        fused_weights=True,
    )
    return _spec(hf, raw, "mistral", config, head_dim, rope, **window)


def _mixtral(hf: Any, raw: Mapping[str, Any]) -> ModelSpec:
    from fms.models.mixtral import MixtralConfig

    _layer_types(hf, raw, ("full_attention",))
    head_dim = _require_even_heads(hf, "Mixtral")
    if _activation(hf, "hidden_act") != "silu":
        raise ModelLoadError(
            f"config.json's hidden_act {hf.hidden_act!r}: fms's Mixtral experts compute SiLU only"
        )
    rope = _rope(hf, raw, head_dim)
    window = _window(hf, list(range(hf.num_hidden_layers)))
    config = MixtralConfig(
        src_vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        norm_eps=hf.rms_norm_eps,
        nheads=hf.num_attention_heads,
        kvheads=hf.num_key_value_heads,
        nlayers=hf.num_hidden_layers,
        hidden_dim=hf.intermediate_size,
        p_dropout=0.0,
        num_experts=hf.num_local_experts,
        top_k_experts=hf.num_experts_per_tok,
        max_expected_seq_len=hf.max_position_embeddings,
        rope_base=rope.theta,
        ntk_scaling=False,
        fused_weights=True,
    )
    return _spec(hf, raw, "mixtral", config, head_dim, rope, **window)


def _gpt_bigcode(hf: Any, raw: Mapping[str, Any]) -> ModelSpec:
    from fms.models.gpt_bigcode import GPTBigCodeConfig

    _layer_types(hf, raw, ("full_attention",))
    if not hf.scale_attn_weights:
        raise ModelLoadError(
            "config.json's scale_attn_weights false: GPTBigCodeForCausalLM is served with "
            "attention scaled by 1/sqrt(head size) only"
        )
    if hf.add_cross_attention:
        raise ModelLoadError(
            "config.json's add_cross_attention true: cross-attention is not supported"
        )
    inner = hf.n_inner if hf.n_inner is not None else 4 * hf.hidden_size
    config = GPTBigCodeConfig(
        src_vocab_size=hf.vocab_size,
        emb_dim=hf.hidden_size,
        nheads=hf.num_attention_heads,
        nlayers=hf.num_hidden_layers,
        max_expected_seq_len=hf.max_position_embeddings,
        hidden_grow_factor=_grow_factor(inner, hf.hidden_size),
        activation_fn=_activation(hf, "activation_function"),
        p_dropout=0.0,
        emb_dropout=0.0,
        multiquery_attn=bool(hf.multi_query),
        ln_eps=hf.layer_norm_epsilon,
        # fms zeroes the position embedding of every token equal to pad_id (its default 0);
        # HF's model treats no token apart.
        pad_id=None,
        tie_heads=bool(hf.tie_word_embeddings),
        fused_weights=True,
    )
    return _spec(
        hf,
        raw,
        "gpt_bigcode",
        config,
        hf.hidden_size // hf.num_attention_heads,
        None,
        embedding_key="transformer.wte.weight",
        learned_positions=True,
    )


def _qwen3(hf: Any, raw: Mapping[str, Any]) -> ModelSpec:
    from fms.models.qwen3 import Qwen3Config

    types = _layer_types(hf, raw, LAYER_TYPES) or ["full_attention"] * hf.num_hidden_layers
    head_dim = _head_dim(hf)
    rope = _rope(hf, raw, head_dim)
    window = _window(hf, [i for i, t in enumerate(types) if t == "sliding_attention"])
    config = Qwen3Config(
        src_vocab_size=hf.vocab_size,
        emb_dim=hf.hidden_size,
        norm_eps=hf.rms_norm_eps,
        nheads=hf.num_attention_heads,
        kvheads=hf.num_key_value_heads,
        nlayers=hf.num_hidden_layers,
        hidden_grow_factor=_grow_factor(hf.intermediate_size, hf.hidden_size),
        multiple_of=1,
        activation_fn=_activation(hf, "hidden_act"),
        p_dropout=0.0,
        max_expected_seq_len=hf.max_position_embeddings,
        attn_bias=bool(hf.attention_bias),
        mlp_bias=False,
        tie_heads=bool(hf.tie_word_embeddings),
        rope_theta=rope.theta,
        head_dim=head_dim,
        fused_weights=False,
    )
    return _spec(hf, raw, "qwen3", config, head_dim, rope, **window)


@dataclass(frozen=True)
class Family:
    model_type: str
    build: Callable[[Any, Mapping[str, Any]], ModelSpec]


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", _llama),
    "GraniteForCausalLM": Family("granite", _granite),
    "MistralForCausalLM": Family("mistral", _mistral),
    "MixtralForCausalLM": Family("mixtral", _mixtral),
    "GPTBigCodeForCausalLM": Family("gpt_bigcode", _gpt_bigcode),
    "Qwen3ForCausalLM": Family("qwen3", _qwen3),
}
"""config.json's architecture -> its model_type and the builder of its spec: the architectures
every one of whose config fields is mapped or refused, checked against HF transformers by the
conformance suite (tests/conformance)."""


# ------------------------------------------------------------------------- serving limits
def check_serving(spec: ModelSpec, max_model_len: int, *, sliding_window_attention: bool) -> None:
    """Refuse serving ``spec`` with sequences of ``max_model_len`` tokens where the result
    would not be HF's: a rope type exact for shorter sequences only, learned positions for
    fewer positions, a sliding window shorter than ``max_model_len`` when the attention paths
    do not apply it (``sliding_window_attention`` False; a window of at least ``max_model_len``
    keys never hides a key)."""
    rope = spec.rope
    if rope is not None and rope.exact_up_to is not None and max_model_len > rope.exact_up_to:
        what = {
            "dynamic": "rescales RoPE by the length of the whole sequence beyond "
            "max_position_embeddings",
            "longrope": "switches from short_factor to long_factor for the whole sequence beyond "
            "original_max_position_embeddings",
        }[rope.rope_type]
        raise ModelLoadError(
            f"config.json's rope_type {rope.rope_type!r} {what} ({rope.exact_up_to} tokens): "
            "keys cached before would be rotated otherwise than HF rotates them. Serve it with "
            f"model.max_model_len <= {rope.exact_up_to} (now {max_model_len})"
        )
    if spec.learned_positions and max_model_len > spec.max_position_embeddings:
        raise ModelLoadError(
            f"{spec.architecture} has learned positions for {spec.max_position_embeddings} "
            f"tokens: model.max_model_len ({max_model_len}) must not exceed it"
        )
    window = spec.sliding_window
    if (
        window is not None
        and window < max_model_len
        and (len(spec.sliding_window_layers) != spec.num_layers)
    ):
        raise ModelLoadError(
            f"config.json's sliding_window ({window} tokens) applies to layers "
            f"{list(spec.sliding_window_layers)} of {spec.num_layers} only (layer_types, "
            "max_window_layers): a window on some layers only is not supported; serve it with "
            f"model.max_model_len <= {window}"
        )
    if window is not None and window < max_model_len and not sliding_window_attention:
        raise ModelLoadError(
            f"config.json's sliding_window ({window} tokens, on {len(spec.sliding_window_layers)}"
            f" of {spec.num_layers} layers of {spec.architecture}) is shorter than "
            f"model.max_model_len ({max_model_len}), and sliding-window attention is not "
            f"supported yet: serve it with model.max_model_len <= {window}"
        )
