"""Offline generation for scripts and tests: the same engine, no HTTP."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from spyre_server.config import Config
from spyre_server.engine.core import LLMEngine, RequestResult
from spyre_server.engine.factory import build_engine, check_backend
from spyre_server.engine.validation import check_max_tokens, check_prompt
from spyre_server.model.loading import (
    configure_torch,
    fp8_scale_dtype_for,
    fused_weights_for,
    load_model,
    model_dtype,
    resolve_model_path,
    weights_in_process,
)
from spyre_server.sample.sampler import SamplingParams

Prompt = str | Sequence[int]


@dataclass(slots=True, kw_only=True)
class GenerationOutput(RequestResult):
    request_id: str
    prompt_token_ids: list[int]


class LLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: Config) -> LLM:
        configure_torch(config)
        check_backend(config)
        loaded = load_model(
            resolve_model_path(config),
            model_dtype(config),
            fused_weights=fused_weights_for(config),
            fp8_scale_dtype=fp8_scale_dtype_for(config),
            weights=weights_in_process(config),
        )
        return cls(build_engine(config, loaded))

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel ranks); no generation afterwards."""
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
                check_prompt(token_ids, self.engine.limits)
                check_max_tokens(p.max_tokens, len(token_ids), self.engine.limits)
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, p, cache_salt=cache_salt)
                outputs[request_id] = GenerationOutput(
                    request_id=request_id, prompt_token_ids=token_ids
                )
        except ValueError:
            for request_id in outputs:  # all or nothing
                self.engine.abort_request(request_id)
            raise
        pending = set(outputs)
        while pending and self.engine.has_unfinished_requests:
            for delta in self.engine.step():
                outputs[delta.request_id].apply(delta)
                if delta.finished:
                    pending.discard(delta.request_id)
        return list(outputs.values())

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.tokenizer.encode(prompt))
        return list(prompt)
