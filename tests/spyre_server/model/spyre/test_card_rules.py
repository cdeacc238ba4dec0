"""The card's rules on the spyre backend: its KV block count (spyre_server/model/spyre/
kv_blocks.py, after the reference's ``SpyrePlatform.get_total_spyre_blocks`` in
sendnn-inference 2.6.3's platform.py) and its known-good configurations (known_configs.yaml
and known_configs.py, after the reference's config/model_configs.yaml, model_matcher.py and
model_registry.py): identifying a model from its config.json, matching a configuration, the
nearest known-good one in the refusal, and the operator's override."""

from __future__ import annotations

import json
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spyre_server.config import load_config
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.spyre.known_configs import (
    CardConfig,
    KnownModel,
    RuntimeConfig,
    UnverifiedConfigError,
    card_config,
    hf_fields,
    identify,
    known_models,
    registry_config,
)
from spyre_server.model.spyre.kv_blocks import card_num_blocks, spyre_num_kv_blocks

GRANITE_33_8B = {
    "architectures": ["GraniteForCausalLM"],
    "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12.0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12800,
    "logits_scaling": 16.0,
    "max_position_embeddings": 131072,
    "model_type": "granite",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49159,
}
"""ibm-granite/granite-3.3-8b-instruct's config.json (the fields that matter)."""

FP8 = {"quantization_config": {"format": "float-quantized", "quant_method": "compressed-tensors"}}


def blocks(**settings: Any) -> int:
    values = {"block_size": 64, "num_blocks": None, "enforce_minimum": True} | settings
    values.setdefault("batch_tkv_limit", values["max_model_len"] * values["max_num_seqs"])
    return card_num_blocks(**values)


# --- the KV block count ------------------------------------------------------------------------


def test_unset_the_pool_holds_a_full_batch_and_the_padding_block_in_multiples_of_the_batch() -> (
    None
):
    # The example, granite-3.3-8b at 2048 x 8: 8 * 32 + 1 = 257 -> 264. The host-RAM
    # budget had given 204, below the card's minimum and not a multiple of 8.
    assert blocks(max_model_len=2048, max_num_seqs=8) == 264
    assert blocks(max_model_len=3072, max_num_seqs=16) == 784  # 769 rounded up
    assert blocks(max_model_len=8192, max_num_seqs=4) == 516  # 513 rounded up
    assert blocks(max_model_len=1024, max_num_seqs=1) == 17  # any count is a multiple of 1
    # A max_model_len that is no multiple of 64 still fits a full batch: ceil(1000 / 64) = 16.
    assert blocks(max_model_len=1000, max_num_seqs=2) == 34


def test_a_given_count_is_rounded_down_to_a_multiple_of_the_batch() -> None:
    # The reference's TP=4 override of granite-3.3-8b: 8192 blocks at 32768 x 32.
    assert blocks(max_model_len=32768, max_num_seqs=32, num_blocks=8192, batch_tkv_limit=131072)
    assert blocks(max_model_len=2048, max_num_seqs=8, num_blocks=300) == 296
    assert blocks(max_model_len=2048, max_num_seqs=8, num_blocks=264) == 264


def test_below_the_cards_minimum_sendnn_refuses_and_the_cpu_compile_backends_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ModelLoadError, match=r"200 KV blocks .* minimum .* 257"):
        blocks(max_model_len=2048, max_num_seqs=8, num_blocks=200)
    with caplog.at_level(logging.WARNING):
        assert blocks(max_model_len=2048, max_num_seqs=8, num_blocks=200, enforce_minimum=False)
    assert "257" in caplog.text
    # A batch x tkv limit below a full batch lowers the minimum: min(256, 4096 / 64) + 1 = 65.
    assert blocks(max_model_len=2048, max_num_seqs=8, num_blocks=72, batch_tkv_limit=4096) == 72
    with pytest.raises(ModelLoadError, match="65"):
        blocks(max_model_len=2048, max_num_seqs=8, num_blocks=64, batch_tkv_limit=4096)
    with pytest.raises(ModelLoadError, match="at least 2"):  # nothing left after rounding
        blocks(max_model_len=128, max_num_seqs=4, num_blocks=3, enforce_minimum=False)


def test_the_spyre_backend_sizes_by_the_cards_rule_not_the_memory_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def spyre(**overrides: Any) -> int:
        settings = {"model.backend": "spyre", "model.max_model_len": 2048} | overrides
        return spyre_num_kv_blocks(load_config(environ={}, overrides=settings))

    assert spyre() == 264  # default max_num_seqs 8
    assert spyre(**{"scheduler.max_num_seqs": 16, "model.max_model_len": 3072}) == 784
    assert spyre(**{"scheduler.max_batch_tkv_limit": 4096, "cache.num_blocks": 75}) == 72
    with pytest.raises(ModelLoadError, match="minimum"):  # sendnn: the card's minimum holds
        spyre(**{"cache.num_blocks": 64})
    assert spyre(**{"cache.num_blocks": 64, "model.compile_backend": "eager"}) == 64
    with caplog.at_level(logging.WARNING):
        assert spyre(**{"cache.kv_cache_memory": "64MiB"}) == 264
    assert "kv_cache_memory is not used on the spyre backend" in caplog.text


def test_the_spyre_engines_pool_is_the_cards(make_engine: Callable[..., Any]) -> None:
    """Through build_engine (eager): unset, a full batch of the micro engine's 1024 x 4 plus the
    padding block, 65 -> 68; given, rounded down to a multiple of 4."""
    spyre = {"model__backend": "spyre", "model__compile_backend": "eager"}
    spyre |= {"scheduler__max_num_seqs": 4, "scheduler__chunk_size": 128}
    engine = make_engine(cache__num_blocks=None, **spyre)
    assert engine.scheduler.pool.num_blocks == 68
    engine = make_engine(cache__num_blocks=70, **spyre)
    assert engine.scheduler.pool.num_blocks == 68
    cpu = make_engine(cache__num_blocks=70)  # the cpu backend takes the count as given
    assert cpu.scheduler.pool.num_blocks == 70


# --- the known-good configurations -------------------------------------------------------------


def test_the_registry_holds_the_references_text_decoders() -> None:
    models = {m.name: m for m in known_models()}
    granite = models["ibm-granite/granite-3.3-8b-instruct"]
    assert {c.key for c in granite.configs if c.tp == 1} == {(3072, 16), (8192, 4)}
    (tp4,) = [c for c in granite.configs if c.tp == 4]
    assert (tp4.key, tp4.max_batch_tkv_limit, tp4.num_blocks) == ((32768, 32), 131072, 8192)
    assert tp4.env == {"FLEX_HDMA_P2PSIZE": "268435456", "FLEX_HDMA_COLLSIZE": "33554432"}
    assert models["ibm-granite/granite-4.1-30b"].configs[0].num_blocks == 2080
    assert "meta-llama/Llama-3.1-8B-Instruct" in models
    for model in models.values():
        assert model.match["model_type"] and model.configs
        for config in model.configs:  # a listed block count passes the card's own rules
            if config.num_blocks is not None:
                assert config.max_batch_tkv_limit is not None
                given = blocks(
                    max_model_len=config.max_model_len,
                    max_num_seqs=config.max_num_seqs,
                    num_blocks=config.num_blocks,
                    batch_tkv_limit=config.max_batch_tkv_limit,
                )
                assert given == config.num_blocks


def test_a_model_is_identified_by_its_config_fields_the_most_specific_match_winning() -> None:
    assert identify(hf_fields(GRANITE_33_8B)).name == "ibm-granite/granite-3.3-8b-instruct"  # type: ignore[union-attr]
    fp8 = identify(hf_fields(GRANITE_33_8B | FP8))
    assert fp8 is not None and fp8.name == "ibm-granite/granite-3.3-8b-instruct-FP8"
    assert identify(hf_fields(GRANITE_33_8B | {"vocab_size": 49152})) is None
    assert identify(hf_fields(GRANITE_33_8B | {"model_type": "llama"})) is None
    # A model_type transformers does not know is matched on its plain fields.
    swa = {k: v for k, v in GRANITE_33_8B.items() if k != "architectures"}
    swa |= {"model_type": "granite_swa", "num_hidden_layers": 44, "vocab_size": 100352}
    assert identify(hf_fields(swa)).name == "ibm-granite/swa-20b"  # type: ignore[union-attr]


def test_fields_are_read_with_hf_defaults_as_the_reference_reads_them() -> None:
    """The reference matches vLLM's HF config object: a field config.json leaves out has the
    config class's default (Llama: num_key_value_heads = num_attention_heads)."""
    pattern = KnownModel(
        "tiny", {"model_type": "llama", "num_key_value_heads": 4}, (), (RuntimeConfig(1, 64, 1),)
    )
    raw = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64}
    assert identify(hf_fields(raw), (pattern,)) is pattern
    assert identify(dict(raw), (pattern,)) is None  # the plain fields lack it


def card(raw: Any = GRANITE_33_8B, **settings: Any) -> CardConfig:
    values = {"model_label": "/models/granite", "tp": 1, "environ": {}} | settings
    return card_config(raw, **values)


def test_a_known_good_configuration_passes() -> None:
    verdict = card(max_model_len=3072, max_num_seqs=16)
    assert verdict.problems == ()
    assert verdict.model is not None and verdict.runtime is not None
    assert (verdict.max_batch_tkv_limit, verdict.num_blocks, dict(verdict.env)) == (None, None, {})
    verdict.check(allow_unverified=False)


def test_outside_the_known_good_ones_the_message_names_the_nearest() -> None:
    verdict = card(max_model_len=2048, max_num_seqs=8)  # the README's example
    (problem,) = verdict.problems
    assert "ibm-granite/granite-3.3-8b-instruct" in problem
    assert "3072 x 16 on tp 1, 8192 x 4 on tp 1" in problem  # the known-good ones
    assert "the nearest is 3072 x 16 on tp 1" in problem
    assert "model.max_model_len 3072, scheduler.max_num_seqs 16" in problem
    with pytest.raises(UnverifiedConfigError) as info:
        verdict.check(allow_unverified=False)
    assert "not a known-good configuration of the Spyre card" in str(info.value)
    assert "--allow-unverified-config" in str(info.value)
    assert "model.allow_unverified_config: true" in str(info.value)
    # Nearer the other one; and a tp size the model has no entry at all for.
    assert "the nearest is 8192 x 4 on tp 1" in card(max_model_len=8192, max_num_seqs=8).problems[0]
    assert "the nearest is 8192 x 4 on tp 1" in card(max_model_len=6144, max_num_seqs=4).problems[0]
    assert (
        "the nearest is 8192 x 4 on tp 2"
        in card(tp=2, max_model_len=4096, max_num_seqs=4).problems[0]
    )
    fp8 = card(GRANITE_33_8B | FP8, max_model_len=8192, max_num_seqs=4)  # FP8: 3072 x 16 only
    assert "the nearest is 3072 x 16 on tp 1" in fp8.problems[0]


def test_an_unknown_model_is_refused_naming_the_nearest_known_one() -> None:
    verdict = card(GRANITE_33_8B | {"vocab_size": 49152}, max_model_len=3072, max_num_seqs=16)
    (problem,) = verdict.problems
    assert "/models/granite (model_type 'granite') is none of the models of" in problem
    assert "the nearest is ibm-granite/granite-3.3-8b-instruct" in problem
    assert "vocab_size 49159 (this model: 49152)" in problem
    assert card(None, max_model_len=3072, max_num_seqs=16).problems


def test_the_configurations_values_apply_and_the_operators_differing_ones_are_named() -> None:
    tp4 = {"tp": 4, "max_model_len": 32768, "max_num_seqs": 32}
    verdict = card(**tp4)
    assert verdict.problems == ()
    assert (verdict.max_batch_tkv_limit, verdict.num_blocks) == (131072, 8192)
    assert dict(verdict.env) == {"FLEX_HDMA_P2PSIZE": "268435456", "FLEX_HDMA_COLLSIZE": "33554432"}
    config = load_config(environ={}, overrides={"model.backend": "spyre"})
    applied = verdict.apply(config)
    assert (applied.scheduler.max_batch_tkv_limit, applied.cache.num_blocks) == (131072, 8192)
    assert applied.model == config.model

    # The operator's own values are kept, and named (the reference warns, or refuses under
    # SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG).
    own = card(**tp4, num_blocks=4096, max_batch_tkv_limit=65536)
    assert (own.num_blocks, own.max_batch_tkv_limit) == (4096, 65536)
    assert len(own.problems) == 2
    assert "cache.num_blocks is 4096;" in own.problems[1] and "takes 8192" in own.problems[1]
    # A variable already set: kept; named when it differs.
    same = card(**tp4, environ={"FLEX_HDMA_P2PSIZE": "268435456"})
    assert same.problems == () and "FLEX_HDMA_P2PSIZE" not in same.env
    other = card(**tp4, environ={"FLEX_HDMA_P2PSIZE": "1"})
    assert other.problems == (
        "FLEX_HDMA_P2PSIZE is 1; ibm-granite/granite-3.3-8b-instruct "
        "with max_model_len x max_num_seqs 32768 x 32 on tp 4 takes 268435456",
    )


def test_the_override_starts_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    verdict = card(max_model_len=2048, max_num_seqs=8)
    with caplog.at_level(logging.WARNING):
        verdict.check(allow_unverified=True)
    assert "has not validated" in caplog.text and "3072 x 16" in caplog.text


def test_the_registry_is_consulted_with_sendnn_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GRANITE_33_8B))

    def verdict(**overrides: Any) -> CardConfig:
        settings = {"model.backend": "spyre", "model.max_model_len": 2048} | overrides
        return registry_config(load_config(environ={}, overrides=settings), tmp_path)

    assert verdict().problems  # 2048 x 8 on the card
    assert verdict(**{"model.max_model_len": 3072, "scheduler.max_num_seqs": 16}).problems == ()
    # The tensor-parallel size is matched too: 32768 x 32 is known-good on 4 cards only.
    four_cards = {"model.max_model_len": 32768, "scheduler.max_num_seqs": 32}
    assert verdict(**four_cards, **{"model.tensor_parallel_size": 4}).problems == ()
    assert "the nearest is" in verdict(**four_cards).problems[0]
    assert verdict(**{"model.compile_backend": "eager"}).problems == ()
    assert verdict(**{"model.compile_backend": "inductor"}).problems == ()
    assert verdict(**{"model.backend": "cpu"}).problems == ()
    default_model = registry_config(
        load_config(environ={}, overrides={"model.backend": "spyre"}), None
    )
    assert (
        "the default model (SmolLM2-135M-Instruct) is none of the models"
        in default_model.problems[0]
    )


@pytest.fixture
def fake_torch_sendnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for torch_sendnn, so that the start gets past the compiler's import."""
    monkeypatch.setitem(sys.modules, "torch_sendnn", types.ModuleType("torch_sendnn"))
    for name in ("VLLM_DT_CHUNK_LEN", "VLLM_DT_MAX_CONTEXT_LEN", "VLLM_DT_MAX_BATCH_SIZE"):
        monkeypatch.setenv(name, "before")  # restored after the test
    for name in ("VLLM_DT_MAX_BATCH_TKV_LIMIT", "COMPILATION_MODE", "FLEX_OVERWRITE_NMB_FRAME"):
        monkeypatch.setenv(name, "before")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the bound port
def test_the_server_refuses_an_unverified_configuration_before_the_model_loads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fake_torch_sendnn: None,
) -> None:
    from spyre_server.entrypoints import cli

    (tmp_path / "config.json").write_text(json.dumps(GRANITE_33_8B))  # no weights: never loaded
    monkeypatch.setenv("SPYRE_SERVER_MODEL__BACKEND", "spyre")
    monkeypatch.setenv("SPYRE_SERVER_MODEL__COMPILE_BACKEND", "sendnn")
    code = cli.main(["serve", str(tmp_path), "--port", "0", "--max-model-len", "2048"])
    err = capsys.readouterr().err
    assert code == 2
    assert "not a known-good configuration of the Spyre card" in err
    assert "the nearest is 3072 x 16 on tp 1" in err and "--allow-unverified-config" in err


def test_the_override_and_a_known_good_configuration_pass_the_start_check(
    tmp_path: Path, fake_torch_sendnn: None
) -> None:
    from spyre_server.engine.factory import check_backend

    (tmp_path / "config.json").write_text(json.dumps(GRANITE_33_8B))
    settings = {"model.backend": "spyre", "model.path": tmp_path}
    with pytest.raises(UnverifiedConfigError):
        check_backend(load_config(environ={}, overrides=settings | {"model.max_model_len": 2048}))
    check_backend(
        load_config(
            environ={},
            overrides=settings
            | {"model.max_model_len": 2048, "model.allow_unverified_config": True},
        )
    )
    known = {"model.max_model_len": 3072, "scheduler.max_num_seqs": 16}
    check_backend(load_config(environ={}, overrides=settings | known))
