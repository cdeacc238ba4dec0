"""Fixtures for the deployment tests: real micro-model servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.spyre_server.http.helpers import Server, micro_config, micro_loaded, start_server


@pytest.fixture(scope="module")
def deploy_micro_model() -> Any:
    """The tiny random fms llama of the HTTP tests (vocab 256, float32, seed 0)."""
    import fms.models
    import torch

    torch.manual_seed(0)
    return fms.models.get_model(
        "llama", "micro", data_type=torch.float32, nheads=4, kvheads=2
    ).eval()


@pytest.fixture
def make_micro_server(deploy_micro_model: Any) -> Iterator[Callable[..., Server]]:
    """``make_micro_server(**config_overrides)`` -> a fresh running micro server (its counters
    start at 0); stopped at teardown. Torch runs on one thread meanwhile."""
    import torch

    from spyre_server.entrypoints.serve import build_app

    servers: list[Server] = []

    def make(**overrides: Any) -> Server:
        app = build_app(micro_config(**overrides), micro_loaded(deploy_micro_model))
        servers.append(start_server(app))
        return servers[-1]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield make
    finally:
        for server in servers:
            server.close()
        torch.set_num_threads(threads)
