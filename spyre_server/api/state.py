"""What every route handler reads: the engine, the tokenizer, the configuration, the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spyre_server.api.auth import APIKeys
from spyre_server.api.generation import GenerationLimits
from spyre_server.api.generation_defaults import GenerationDefaults
from spyre_server.api.metrics import ServerMetrics
from spyre_server.config import Config
from spyre_server.engine.async_engine import AsyncEngine
from spyre_server.sample.structured_output import GrammarCompiler


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    config: Config
    model_name: str
    limits: GenerationLimits
    metrics: ServerMetrics
    api_keys: APIKeys
    created: int
    model_root: str
    """The model folder the weights were loaded from (the model card's ``root``)."""
    grammars: GrammarCompiler
    """Compiles ``response_format`` for this tokenizer."""
    generation_defaults: GenerationDefaults
    """The model's sampling defaults, for the fields a request leaves out."""
    chat_template: str | None = None
    """Replaces the tokenizer's chat template (``model.chat_template``, loaded); None: its own."""
