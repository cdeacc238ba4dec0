"""Offline generation for scripts and tests: the same engine, no HTTP."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler import FinishReason
from spyre_server.config import Config
from spyre_server.engine import LLMEngine
from spyre_server.engine_factory import build_engine, check_backend
from spyre_server.model.loading import (
    configure_torch,
    load_model,
    model_dtype,
    resolve_model_path,
)
from spyre_server.sampling import SamplingParams, TokenLogprobs

Prompt = str | Sequence[int]


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token (``None`` first)."""
    stop_reason: int | str | None = None


class LLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: Config) -> LLM:
        configure_torch(config)
        check_backend(config)
        loaded = load_model(resolve_model_path(config), model_dtype(config))
        return cls(build_engine(config, loaded))

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[GenerationOutput]:
        """Run all prompts to completion (batched by the scheduler); outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        outputs: dict[str, GenerationOutput] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                token_ids = self.encode(prompt)
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, p, cache_salt=cache_salt)
                outputs[request_id] = GenerationOutput(request_id, token_ids)
        except ValueError:
            for request_id in outputs:  # all or nothing
                self.engine.abort_request(request_id)
            raise
        pending = set(outputs)
        while pending and self.engine.has_unfinished_requests:
            for delta in self.engine.step():
                out = outputs[delta.request_id]
                out.text += delta.text
                out.token_ids += delta.token_ids
                out.logprobs += delta.logprobs
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    out.stop_reason = delta.stop_reason
                    out.finish_reason = delta.finish_reason
                    out.error = delta.error
                    pending.discard(delta.request_id)
        return list(outputs.values())

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.tokenizer.encode(prompt))
        return list(prompt)
