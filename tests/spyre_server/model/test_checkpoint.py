"""Loading HF checkpoints (spyre_server.model.loading.load_model with spyre_server.model.checkpoint):
strict (every tensor used, every parameter filled, refusals naming the keys), Mixtral's Hub and
transformers-5 layouts, and the loaded fms model computing HF transformers' float32 greedy tokens
on the conformance suite's tiny checkpoints (tests/conformance/checkpoints.py), each architecture
and rope type the loader accepts."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from spyre_server.model.errors import ModelLoadError
from spyre_server.model.loading import LoadedModel, load_model
from tests.conformance.checkpoints import ARCHITECTURES, VOCAB_SIZE, build_checkpoint

WEIGHTS = "model.safetensors"

Build = Callable[[str], Path]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Build:
    """Architecture name -> its conformance checkpoint, built once per module."""
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in cache:
            cache[name] = build_checkpoint(ARCHITECTURES[name], root / name, smollm2_path)
        return cache[name]

    return build


def edited(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the checkpoint ``source`` whose tensors ``edit`` changed in place."""
    shutil.copytree(source, target)
    tensors = load_file(target / WEIGHTS)
    edit(tensors)
    save_file(tensors, target / WEIGHTS, metadata={"format": "pt"})
    return target


def refusal(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, torch.float32)
    return str(info.value)


# ----------------------------------------------------------------------------- strictness
def test_a_checkpoint_with_an_extra_tensor_is_refused_naming_it(
    built: Build, tmp_path: Path
) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)
        tensors["model.layers.1.self_attn.extra_proj.weight"] = torch.zeros(4, 4)

    message = refusal(edited(built("llama3"), tmp_path / "extra", add))
    assert "has tensors LlamaForCausalLM does not use" in message
    assert "model.layers.0.self_attn.extra_proj.weight" in message
    assert "model.layers.1.self_attn.extra_proj.weight" in message


def test_an_extra_top_level_tensor_is_refused_naming_it(built: Build, tmp_path: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.rotary_emb.inv_freq"] = torch.zeros(64)

    assert "model.rotary_emb.inv_freq" in refusal(edited(built("llama3"), tmp_path / "x", add))


def test_a_tensor_missing_from_one_layer_is_refused_naming_it(built: Build, tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.mlp.down_proj.weight"]
        del tensors["model.layers.0.self_attn.k_proj.weight"]  # fused with q and v by fms

    message = refusal(edited(built("llama3"), tmp_path / "missing", drop))
    assert "lacks tensors other layers have" in message
    assert "model.layers.0.self_attn.k_proj.weight, model.layers.1.mlp.down_proj.weight" in message


def test_a_missing_untied_head_is_refused_naming_it(built: Build, tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["lm_head.weight"]
        del tensors["model.norm.weight"]

    message = refusal(edited(built("llama3"), tmp_path / "headless", drop))
    assert "does not fill the model's parameters" in message
    assert "head.weight (lm_head.weight)" in message
    assert "base_model.dec_norm.weight" in message


def test_a_tensor_every_layer_lacks_is_refused(built: Build, tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith("self_attn.q_norm.weight")]:
            del tensors[name]

    message = refusal(edited(built("qwen3"), tmp_path / "no-q-norm", drop))
    assert "base_model.layers.0.attn.in_proj.q_norm.weight" in message
    assert "base_model.layers.1.attn.in_proj.q_norm.weight" in message


def test_a_shape_config_json_does_not_give_is_refused(built: Build, tmp_path: Path) -> None:
    target = tmp_path / "wider"
    shutil.copytree(built("llama3"), target)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] = 640
    (target / "config.json").write_text(json.dumps(config))
    message = refusal(target)
    assert "model.layers.0.mlp.down_proj.weight has shape [256, 512]" in message
    assert "[256, 640]" in message


def test_a_tied_head_counts_as_filled_and_must_be_the_embedding(
    built: Build, tmp_path: Path
) -> None:
    """granite ties its embeddings and its checkpoint has no lm_head.weight."""
    source = built("granite")
    assert "lm_head.weight" not in load_file(source / WEIGHTS)
    loaded = load_model(source, torch.float32)
    model = loaded.model
    assert model.head.weight is model.base_model.embedding.weight

    def same(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    load_model(edited(source, tmp_path / "same", same), torch.float32)

    def other(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1

    message = refusal(edited(source, tmp_path / "other", other))
    assert "ties the word embeddings" in message and "lm_head.weight" in message


def test_every_parameter_comes_from_the_checkpoint(built: Build) -> None:
    """Each fms parameter holds the checkpoint's values (no allocation left as it was)."""
    path = built("llama3")
    tensors = load_file(path / WEIGHTS)
    model = load_model(path, torch.float32).model
    assert torch.equal(model.base_model.embedding.weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(model.head.weight, tensors["lm_head.weight"])
    w2 = model.base_model.layers[1].ff_sub_layer.w2.weight
    assert torch.equal(w2, tensors["model.layers.1.mlp.down_proj.weight"])
    assert not any(p.is_meta for p in model.parameters())


# ------------------------------------------------------------------------------- Mixtral
def test_mixtral_hub_layout_is_read_with_its_kv_heads(built: Build) -> None:
    path = built("mixtral")
    tensors = load_file(path / WEIGHTS)
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in tensors
    loaded = load_model(path, torch.float32)
    ffn = loaded.model.base_model.layers[1].ff_sub_layer
    expert = 5
    w1 = tensors[f"model.layers.1.block_sparse_moe.experts.{expert}.w1.weight"]
    w3 = tensors[f"model.layers.1.block_sparse_moe.experts.{expert}.w3.weight"]
    assert torch.equal(ffn.cond_ffn.w13[expert], torch.cat([w1, w3]))
    w2 = tensors[f"model.layers.1.block_sparse_moe.experts.{expert}.w2.weight"]
    assert torch.equal(ffn.cond_ffn.w2[expert], w2)
    assert torch.equal(ffn.gate.weight, tensors["model.layers.1.block_sparse_moe.gate.weight"])
    assert loaded.model.config.kvheads == 2


def test_mixtral_transformers5_layout_loads_the_same_model(built: Build, tmp_path: Path) -> None:
    source = built("mixtral")

    def fuse(tensors: dict[str, torch.Tensor]) -> None:
        for layer in range(2):
            prefix = f"model.layers.{layer}.block_sparse_moe."
            w = {
                (e, k): tensors.pop(f"{prefix}experts.{e}.{k}.weight")
                for e in range(8)
                for k in ("w1", "w2", "w3")
            }
            fused = f"model.layers.{layer}.mlp."
            tensors[fused + "experts.gate_up_proj"] = torch.stack(
                [torch.cat([w[e, "w1"], w[e, "w3"]]) for e in range(8)]
            )
            tensors[fused + "experts.down_proj"] = torch.stack([w[e, "w2"] for e in range(8)])
            tensors[fused + "gate.weight"] = tensors.pop(prefix + "gate.weight")

    hub = load_model(source, torch.float32).model.state_dict()
    fused = load_model(edited(source, tmp_path / "fused", fuse), torch.float32).model.state_dict()
    assert hub.keys() == fused.keys()
    assert all(torch.equal(hub[k], fused[k]) for k in hub)


def test_a_mixtral_expert_missing_a_matrix_is_refused_naming_it(
    built: Build, tmp_path: Path
) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]

    message = refusal(edited(built("mixtral"), tmp_path / "no-w3", drop))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in message


# ------------------------------------------------------------------------ against HF
COMPARED = ["llama3", "llama3-hub", "mixtral", "mixtral-kv8", "gpt-bigcode"]
"""Llama 3's rope scaling in both config.json styles, Mixtral (Hub layout, GQA and 8 KV heads),
GPT-BigCode (token 0 in the prompt). The conformance suite (tests/conformance) compares every
architecture the loader accepts with HF, served on every path."""

PROMPT_LENGTH = 300
MAX_TOKENS = 8


def prompt() -> list[int]:
    """Random ids with the special ids real prompts carry (0-2), past 256 positions."""
    rng = random.Random(30)
    ids = [rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_LENGTH)]
    ids[0:1] = [1]
    ids[140:143] = [2, 0, 1]
    return ids


@torch.no_grad()
def greedy(forward: Callable[[torch.Tensor], torch.Tensor], ids: list[int]) -> list[int]:
    ids = list(ids)
    for _ in range(MAX_TOKENS):
        ids.append(int(forward(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-MAX_TOKENS:]


@pytest.mark.parametrize("name", COMPARED)
def test_the_loaded_model_gives_hfs_float32_greedy_tokens(built: Build, name: str) -> None:
    """fms's forward of the loaded model (no cache) against HF's: the same greedy tokens, and
    logits within float32 rounding of each other."""
    from transformers import AutoModelForCausalLM

    path = built(name)
    loaded: LoadedModel = load_model(path, torch.float32)
    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt()
    with torch.no_grad():
        ours, theirs = loaded.model(torch.tensor([ids])), hf(torch.tensor([ids])).logits
    assert float((ours - theirs).abs().max()) < 1e-3
    assert greedy(lambda x: loaded.model(x, last_n_tokens=1), ids) == greedy(
        lambda x: hf(x, logits_to_keep=1).logits, ids
    )


def test_rope_tables_grow_to_max_model_len(built: Build, tmp_path: Path) -> None:
    """HF rotates positions past max_position_embeddings as any other: starting an engine
    with a longer model.max_model_len extends the tables, with HF's numbers."""
    from transformers import AutoModelForCausalLM

    from spyre_server.config import load_config
    from spyre_server.model.loading import check_serving_config
    from spyre_server.model.rope import rope_length

    target = tmp_path / "short"
    shutil.copytree(built("llama3"), target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 256
    config["rope_parameters"]["original_max_position_embeddings"] = 128
    (target / "config.json").write_text(json.dumps(config))
    loaded = load_model(target, torch.float32)
    assert rope_length(loaded.model) == 256
    check_serving_config(load_config(environ={}, overrides={"model.max_model_len": 512}), loaded)
    assert rope_length(loaded.model) == 512
    hf: Any = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.tensor([prompt()[:PROMPT_LENGTH]])
    with torch.no_grad():
        assert float((loaded.model(ids) - hf(ids).logits).abs().max()) < 1e-3
