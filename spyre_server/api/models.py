"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from spyre_server.api.errors import APIError
from spyre_server.api.serving import server_state
from spyre_server.api.state import ServerState

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: Annotated[ServerState, Depends(server_state)]) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(
    model_id: str, state: Annotated[ServerState, Depends(server_state)]
) -> dict[str, Any]:
    if model_id != state.model_name:
        raise APIError(
            404,
            f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
            code="model_not_found",
        )
    return model_card(state)


def model_card(state: ServerState) -> dict[str, Any]:
    """vLLM's card: ``root`` is where the weights come from, ``parent`` the base model of an
    adapter (none here)."""
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "spyre-server",
        "root": state.model_root,
        "parent": None,
        "max_model_len": state.limits.max_model_len,
    }
