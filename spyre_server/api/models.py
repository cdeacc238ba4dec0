"""``GET /v1/models``: the one model this server serves."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from spyre_server.api.serving import server_state
from spyre_server.api.state import ServerState

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: Annotated[ServerState, Depends(server_state)]) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state)]}


def model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "spyre-server",
        "max_model_len": state.limits.max_model_len,
    }
