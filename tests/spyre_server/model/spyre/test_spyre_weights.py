"""The spyre backend's weights are unfused, as the reference stack loads them for the card
(sendnn-inference 2.6.3, model_executor/model_loader/spyre.py: ``fused_weights=False``):
``loading.load_model(fused_weights=False)`` builds and fills the model unfused, and the spyre
runner splits a model built fused elsewhere without touching it. Unfused computes what fused
computes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fms.modules.attention import FusedQKV, UnfusedQKV
from fms.modules.feedforward import GatedLinearUnit

from spyre_server.config import load_config
from spyre_server.model.loading import fused_weights_for, load_model
from spyre_server.model.spyre.runner import unfused
from tests.conformance.checkpoints import ARCHITECTURES, build_checkpoint


def fused_modules(model: torch.nn.Module) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, FusedQKV) or (isinstance(m, GatedLinearUnit) and m.fused)
    ]


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out[0] if isinstance(out, tuple) else out


def test_the_spyre_backend_loads_unfused_the_cpu_backend_fused() -> None:
    spyre = load_config(environ={}, overrides={"model.backend": "spyre"})
    assert not fused_weights_for(spyre)
    assert fused_weights_for(load_config(environ={}, overrides={}))


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("unfused")
    return lambda name: build_checkpoint(ARCHITECTURES[name], root / name, smollm2_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "granite", "mistral", "gpt-bigcode", "qwen3"])
def test_a_checkpoint_loaded_unfused_computes_what_fused_does(
    checkpoint: Callable[[str], Path], name: str
) -> None:
    path = checkpoint(name)
    fused = load_model(path, torch.float32).model
    split = load_model(path, torch.float32, fused_weights=False).model
    assert not fused_modules(split)
    assert any(isinstance(m, UnfusedQKV) for m in split.modules())
    assert unfused(split) is split  # the runner runs it as loaded
    ids = torch.randint(1, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(split, ids), logits(fused, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_mixtral_stays_fused_where_fms_has_no_unfused_form(
    checkpoint: Callable[[str], Path],
) -> None:
    """fms's MixtralConfig: fused_weights "Doesn't work with False!"; loading keeps it fused
    and the spyre runner splits its attention's projection."""
    loaded = load_model(checkpoint("mixtral"), torch.float32, fused_weights=False)
    assert fused_modules(loaded.model)
    assert not fused_modules(unfused(loaded.model))


def test_the_runner_splits_a_fused_model_over_the_same_storage(micro_model: Any) -> None:
    assert fused_modules(micro_model)  # fms's default
    before = {n: p.data_ptr() for n, p in micro_model.named_parameters()}
    split = unfused(micro_model)
    assert split is not micro_model and not fused_modules(split)
    assert fused_modules(micro_model)  # the caller's model is as it was
    assert {n: p.data_ptr() for n, p in micro_model.named_parameters()} == before
    storages = {p.untyped_storage().data_ptr() for p in micro_model.parameters()}
    assert {p.untyped_storage().data_ptr() for p in split.parameters()} <= storages
    ids = torch.randint(1, 255, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(split, ids), logits(micro_model, ids), rtol=1e-5, atol=1e-5)
