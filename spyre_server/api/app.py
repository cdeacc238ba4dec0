"""The FastAPI application: routes, auth, error envelopes, body limit (DESIGN §6)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from spyre_server.api import chat, completions, models
from spyre_server.api.errors import (
    APIError,
    api_error_handler,
    error_body,
    http_error_handler,
    internal_error_handler,
    validation_error_handler,
)
from spyre_server.api.middleware import Auth, BodyLimit, RequestId
from spyre_server.api.render import register_render_routes
from spyre_server.api.server_info import register_server_info_routes
from spyre_server.api.state import ServerState
from spyre_server.api.tokenize import register_tokenize_routes
from spyre_server.kv_events.service import start_kv_events

MAX_BODY_BYTES = 4 * 2**20


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler = state.engine.core.scheduler
        kv_events = start_kv_events(state.config.kv_events, scheduler, state.model_name)
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown()
            if kv_events is not None:
                kv_events.close()

    app = FastAPI(title="spyre-server", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    # The last added runs first: request id, then the body limit, then auth.
    open_paths = {"/health"} | (set() if state.config.server.metrics_require_auth else {"/metrics"})
    app.add_middleware(Auth, keys=state.api_keys, open_paths=frozenset(open_paths))
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(RequestId)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_alive:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine step loop is not running"), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        dropped = await state.engine.call(lambda engine: engine.scheduler.reset_prefix_cache())
        return {"success": True, "dropped_blocks": dropped}

    def authorize(request: Request) -> str | None:
        return state.api_keys.key_of(request)

    for module in (completions, chat, models):
        app.include_router(module.router)
    register_tokenize_routes(app, state, authorize)
    register_render_routes(app, state, authorize)
    register_server_info_routes(app, state)
    state.metrics.add_cache_config_info(state.engine.core.scheduler.config)
    return app
