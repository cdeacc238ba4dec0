"""Fixtures for the HTTP tests: real uvicorn servers on 127.0.0.1 around ``build_app`` (see
helpers.py). One shared micro server serves the tests that keep the default configuration; tests
that change the configuration or patch the engine start their own with ``make_server``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import default_model_missing
from tests.spyre_server.http.helpers import (
    MakeServer,
    Server,
    micro_config,
    micro_loaded,
    start_server,
)


@pytest.fixture(scope="session")
def http_micro_model(request: pytest.FixtureRequest) -> Any:
    """The tiny random fms llama (vocab 256, 4 query / 2 KV heads, float32, seed 0); reuses the
    suite-wide one when a shared conftest offers it. Stateless: servers may share it."""
    for name in ("tiny_llama", "micro_model"):
        try:
            return request.getfixturevalue(name)
        except pytest.FixtureLookupError:
            pass
    import fms.models
    import torch

    torch.manual_seed(0)
    return fms.models.get_model(
        "llama", "micro", data_type=torch.float32, nheads=4, kvheads=2
    ).eval()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The micro model gains nothing from more threads; on a shared 2-core box one is fastest.
    Module-scoped, so that the rest of the session gets its thread count back."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def make_server(http_micro_model: Any, one_torch_thread: None) -> Iterator[MakeServer]:
    """``make_server(eos_token_id=None, api_key=None, **config_overrides)`` -> a fresh running
    server on the micro model (``api_key`` is what its clients send); stopped at teardown."""
    from spyre_server.entrypoints.serve import build_app

    servers: list[Server] = []

    def make(
        eos_token_id: int | None = None, api_key: str | None = None, **overrides: Any
    ) -> Server:
        app = build_app(micro_config(**overrides), micro_loaded(http_micro_model, eos_token_id))
        server = start_server(app, api_key=api_key)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def micro_server(http_micro_model: Any, one_torch_thread: None) -> Iterator[Server]:
    from spyre_server.entrypoints.serve import build_app

    server = start_server(build_app(micro_config(), micro_loaded(http_micro_model)))
    yield server
    server.close()


@pytest.fixture
def server(micro_server: Server) -> Iterator[Server]:
    """The shared micro server (default micro configuration). Tests that look at cache hits use
    prompts no other test sends. Afterwards: nothing left running, every block free, loop alive."""
    yield micro_server
    micro_server.wait_idle(timeout=10)
    assert micro_server.async_engine.is_alive


@pytest.fixture(scope="session")
def smollm2_loaded(request: pytest.FixtureRequest) -> Any:
    """SmolLM2-135M-Instruct loaded with fms in float32 (the suite-wide one when offered)."""
    try:
        return request.getfixturevalue("smollm2_fp32")
    except pytest.FixtureLookupError:
        pass
    import torch

    from spyre_server.model.loading import load_model
    from spyre_server.model.store import ModelStoreError, default_cache_dir, prepare_default_model

    try:
        path = prepare_default_model(default_cache_dir())
    except ModelStoreError as exc:
        default_model_missing(str(exc))
    return load_model(path, torch.float32)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_loaded: Any) -> Iterator[Server]:
    """A real server on SmolLM2 (float32, default chunk size), on two torch threads."""
    import torch

    from spyre_server.config import load_config
    from spyre_server.entrypoints.serve import build_app

    config = load_config(
        environ={},
        overrides={"cache.num_blocks": 200, "model.max_model_len": 2048, "model.dtype": "float32"},
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    server = start_server(build_app(config, smollm2_loaded))
    try:
        yield server
    finally:
        server.close()
        torch.set_num_threads(previous)
