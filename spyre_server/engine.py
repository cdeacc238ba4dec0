"""The engine: one step = schedule, execute, update (DESIGN §2), plus detokenization.

``LLMEngine`` is synchronous and single-threaded; ``AsyncEngine`` (async_engine.py) drives it from
one background thread. The engine owns no scheduling state: it forwards what the scheduler plans
to the runner and what the runner sampled back to the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler import FinishReason, ModelRunnerOutput, PrefillChunk, ScheduledStep, Scheduler
from spyre_server.detokenizer import IncrementalDetokenizer, Tokenizer
from spyre_server.model.runner import ModelRunner
from spyre_server.sampling import SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one request."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _RequestState:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int


class LLMEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        *,
        eos_token_id: int | None,
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self._states: dict[str, _RequestState] = {}
        self._params: dict[str, SamplingParams] = {}

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; raises ValueError for input the model or the limits cannot take."""
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        self.scheduler.add_request(
            request_id,
            prompt_token_ids,
            params.max_tokens,
            stop_token_ids=params.stop_token_ids,
            eos_token_id=None if params.ignore_eos else self.eos_token_id,
            cache_salt=cache_salt,
        )
        self._params[request_id] = params
        self._states[request_id] = _RequestState(
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop),
            num_prompt_tokens=len(prompt_token_ids),
        )

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """End a request now and free its blocks; ``None`` if it is not running or waiting."""
        return self._end(request_id, FinishReason.ABORT)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestDelta]:
        """Run one scheduler step; returns what it produced, per request."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        try:
            result = self.runner.execute(step, self._params)
        except Exception as exc:  # a failed step ends only the requests it carried
            logger.exception("model step failed")
            message = f"model step failed: {type(exc).__name__}: {exc}"
            return [
                delta
                for rid in _request_ids(step)
                if (delta := self._end(rid, FinishReason.ERROR, message)) is not None
            ]
        outputs = self.scheduler.update_from_output(
            step, ModelRunnerOutput(result.sampled_token_ids)
        )
        deltas = []
        for out in outputs:
            state = self._states[out.request_id]
            finish_reason = out.finish_reason
            text_token_ids = out.new_token_ids
            if (
                finish_reason is FinishReason.STOP
                and text_token_ids[-1] in state.params.stop_token_ids
            ):
                text_token_ids = text_token_ids[:-1]  # a stop token's text is not output
            text, stopped = state.detokenizer.add_tokens(
                text_token_ids, finished=finish_reason is not None
            )
            if stopped and finish_reason is None:
                self.scheduler.finish_request(out.request_id, FinishReason.STOP)
            if stopped:
                finish_reason = FinishReason.STOP
            lp = result.logprobs.get(out.request_id)
            deltas.append(
                RequestDelta(
                    request_id=out.request_id,
                    text=text,
                    token_ids=list(out.new_token_ids),
                    logprobs=[lp] if lp is not None else [],
                    finish_reason=finish_reason,
                    num_prompt_tokens=state.num_prompt_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                )
            )
            if finish_reason is not None:
                self._forget(out.request_id)
        return deltas

    def _end(
        self, request_id: str, reason: FinishReason, error: str | None = None
    ) -> RequestDelta | None:
        out = self.scheduler.finish_request(request_id, reason)
        state = self._states.get(request_id)
        if out is None or state is None:
            return None
        self._forget(request_id)
        return RequestDelta(
            request_id=request_id,
            text="",
            token_ids=[],
            logprobs=[],
            finish_reason=reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            error=error,
        )

    def _forget(self, request_id: str) -> None:
        del self._states[request_id]
        del self._params[request_id]


def _request_ids(step: ScheduledStep) -> list[str]:
    if isinstance(step, PrefillChunk):
        return [step.request_id]
    return [e.request_id for e in step.entries]
