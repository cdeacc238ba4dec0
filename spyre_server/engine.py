"""The engine: one step = schedule, execute, update (DESIGN §2), plus detokenization.

``LLMEngine`` is synchronous and single-threaded; ``AsyncEngine`` (async_engine.py) drives it from
one background thread. The engine owns no scheduling state: it forwards what the scheduler plans
to the runner and what the runner sampled back to the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler import (
    FinishReason,
    ModelRunnerOutput,
    PrefillChunk,
    RequestOutput,
    ScheduledStep,
    Scheduler,
)
from spyre_server.detokenizer import IncrementalDetokenizer, Tokenizer
from spyre_server.model.runner import ModelRunner
from spyre_server.sampling import SamplingParams, SequenceSampling, TokenLogprobs, prompt_logprobs

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
    stop_reason: int | str | None = None
    """With finish reason STOP: the stop token id or the stop string; ``None`` for EOS."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``params.prompt_logprobs``, on the first delta of the request: one entry per prompt
    token, ``None`` for the first (nothing precedes it)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _RequestState:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    sampling: SequenceSampling
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Collected chunk by chunk; handed out with the first delta."""

    def add_prompt_rows(self, first_position: int, rows: torch.Tensor) -> None:
        """Score the prompt tokens that follow the positions of ``rows`` (log-softmax rows from
        ``first_position`` on). A recomputed position (after a preemption) is not scored again."""
        collected = self.prompt_logprobs
        if collected is None or self.params.prompt_logprobs is None:
            return  # handed out already: this is a recompute after a preemption
        prompt = self.sampling.prompt_token_ids
        start = len(collected) - 1 - first_position  # first row whose target is not scored yet
        end = min(len(prompt) - 1 - first_position, rows.shape[0])
        if start >= end:
            return
        targets = prompt[first_position + start + 1 : first_position + end + 1]
        collected += prompt_logprobs(rows[start:end], targets, self.params.prompt_logprobs)


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
        self._sampling: dict[str, SequenceSampling] = {}
        """What the runner's sampler needs of each request."""

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
        if params.prompt_logprobs is not None and not self.runner.supports_prompt_logits:
            raise ValueError(
                "prompt logprobs (echo with logprobs) are not available on the spyre backend: "
                "its prefill programs return the logits of the window's last block only"
            )
        eos_token_id = None if params.ignore_eos else self.eos_token_id
        self.scheduler.add_request(
            request_id,
            prompt_token_ids,
            # max_tokens 0 (score the prompt only): the one sampled token is dropped (as vLLM)
            max(params.max_tokens, 1),
            stop_token_ids=params.stop_token_ids,
            eos_token_id=eos_token_id,
            cache_salt=cache_salt,
            needs_prompt_logits=params.prompt_logprobs is not None,
        )
        stop_ids = (*params.stop_token_ids, *(() if eos_token_id is None else (eos_token_id,)))
        sampling = SequenceSampling(params, tuple(prompt_token_ids), [], stop_ids)
        if params.grammar is not None:
            sampling.grammar = params.grammar.matcher(
                () if eos_token_id is None else (eos_token_id,)
            )
        self._sampling[request_id] = sampling
        self._states[request_id] = _RequestState(
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.min_tokens
            ),
            num_prompt_tokens=len(prompt_token_ids),
            sampling=sampling,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
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
            result = self.runner.execute(step, self._sampling)
        except Exception as exc:  # a failed step ends only the requests it carried
            logger.exception("model step failed")
            message = f"model step failed: {type(exc).__name__}: {exc}"
            return [
                delta
                for rid in _request_ids(step)
                if (delta := self._end(rid, FinishReason.ERROR, message)) is not None
            ]
        if isinstance(step, PrefillChunk) and step.request_id in result.prompt_logprobs:
            state = self._states.get(step.request_id)
            if state is not None:
                state.add_prompt_rows(step.positions[0], result.prompt_logprobs[step.request_id])
        outputs = self.scheduler.update_from_output(
            step, ModelRunnerOutput(result.sampled_token_ids)
        )
        deltas = []
        for out in outputs:
            state = self._states[out.request_id]
            finish_reason = out.finish_reason
            text_token_ids = out.new_token_ids
            state.sampling.output_token_ids += out.new_token_ids
            grammar_done = self._advance_grammar(state, out.new_token_ids)
            first_prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
            if state.params.max_tokens == 0:  # scoring only: the sampled token is not output
                deltas.append(self._scored_only(out, state, first_prompt_logprobs))
                continue
            stop_reason: int | str | None = None
            if (
                finish_reason is FinishReason.STOP
                and text_token_ids[-1] in state.params.stop_token_ids
            ):
                stop_reason = text_token_ids[-1]
                text_token_ids = text_token_ids[:-1]  # a stop token's text is not output
            text, stopped = state.detokenizer.add_tokens(
                text_token_ids, finished=finish_reason is not None or grammar_done
            )
            if grammar_done and not stopped and finish_reason is None:
                self.scheduler.finish_request(out.request_id, FinishReason.STOP)
                finish_reason = FinishReason.STOP
            if stopped and finish_reason is None:
                self.scheduler.finish_request(out.request_id, FinishReason.STOP)
            if stopped:
                finish_reason = FinishReason.STOP
                stop_reason = state.detokenizer.stop_string
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
                    stop_reason=stop_reason,
                    prompt_logprobs=first_prompt_logprobs,
                )
            )
            if finish_reason is not None:
                self._forget(out.request_id)
        return deltas

    def _advance_grammar(self, state: _RequestState, token_ids: Sequence[int]) -> bool:
        """Feed sampled tokens to the request's grammar; True once it is complete (or, which
        the token mask prevents, broken)."""
        grammar = state.sampling.grammar
        if grammar is None:
            return False
        for token_id in token_ids:
            if not grammar.accept(token_id):
                logger.warning("token %d is outside the request's grammar; stopping", token_id)
                return True
        return grammar.is_terminated

    def _scored_only(
        self,
        out: RequestOutput,
        state: _RequestState,
        scored: list[TokenLogprobs | None] | None,
    ) -> RequestDelta:
        """The end of a max_tokens 0 request (the scheduler ran it with max_tokens 1, so its
        first token ended it): its prompt logprobs, no token, ``length``."""
        self._forget(out.request_id)
        return RequestDelta(
            request_id=out.request_id,
            text="",
            token_ids=[],
            logprobs=[],
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=scored,
        )

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
        del self._sampling[request_id]


def _request_ids(step: ScheduledStep) -> list[str]:
    if isinstance(step, PrefillChunk):
        return [step.request_id]
    return [e.request_id for e in step.entries]
