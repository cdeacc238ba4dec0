"""What routers and operators ask a replica about itself: ``GET /get_load`` (``{"load": N}``,
vllm-router's ``power_of_two``), ``GET /server_info`` and ``GET /version``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI

from spyre_server.api.state import ServerState
from spyre_server.kv_events.service import default_topic


def server_version() -> str:
    try:
        return version("spyre-server")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def register_server_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/get_load")
    async def get_load() -> dict[str, int]:
        """Engine requests added and not yet finished (queued, prefilling or decoding)."""
        return {"load": state.engine.num_active_requests}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": server_version()}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        config = state.config
        scheduler = state.engine.core.scheduler.config
        kv_events = config.kv_events
        return {
            "version": server_version(),
            "model": state.model_name,
            "max_model_len": state.limits.max_model_len,
            "block_size": scheduler.block_size,
            "num_blocks": scheduler.num_blocks,
            "chunk_size": scheduler.chunk_size,
            "max_num_seqs": scheduler.max_num_seqs,
            "enable_prefix_caching": scheduler.enable_prefix_caching,
            "kv_events": {
                "enabled": kv_events.enabled,
                "endpoint": kv_events.endpoint,
                "replay_endpoint": kv_events.replay_endpoint,
                "topic": default_topic(state.model_name)
                if kv_events.topic is None
                else kv_events.topic,
            },
        }
