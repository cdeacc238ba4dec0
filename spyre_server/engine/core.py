"""The engine: one step = schedule, execute, update (DESIGN §2), plus detokenization.

``LLMEngine`` is synchronous and single-threaded; ``AsyncEngine`` (async_engine.py) drives it from
one background thread. The engine owns no scheduling state: it forwards what the scheduler plans
to the runner and what the runner sampled back to the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from scheduler import (
    FinishReason,
    ModelRunnerOutput,
    PrefillChunk,
    RequestOutput,
    ScheduledStep,
    Scheduler,
)
from spyre_server.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from spyre_server.engine.validation import RequestLimits
from spyre_server.model.runner import FatalRunnerError, ModelRunner
from spyre_server.sample.sampler import (
    SamplingParams,
    SequenceSampling,
    TokenLogprobs,
    prompt_logprobs,
)

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


@dataclass(slots=True, kw_only=True)
class RequestResult:
    """A request's output so far, folded from its deltas by ``apply``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """With finish reason STOP: the stop token id or stop string (``None``: EOS, grammar)."""
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token (``None`` first)."""
    error: str | None = None

    def apply(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = delta.error


@dataclass(slots=True)
class _RequestState:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    sampling: SequenceSampling
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Collected chunk by chunk; handed out with the first delta."""

    def advance_grammar(self, token_id: int) -> bool:
        """Feed a sampled token to the request's grammar; True once it is complete (or, which
        the token mask prevents, broken)."""
        grammar = self.sampling.grammar
        if grammar is None:
            return False
        if not grammar.accept(token_id):
            logger.warning("token %d is outside the request's grammar; stopping", token_id)
            return True
        return bool(grammar.is_terminated)

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
        model_name: str,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.model_name = model_name
        """The name clients use for the model (``model.served_model_name``, else the folder's)."""
        self.limits = RequestLimits(scheduler.config.max_model_len, vocab_size)
        """What callers check a request against before ``add_request`` (validation.py)."""
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
        """Queue a request checked against ``self.limits`` (``validation.check_prompt`` and
        ``check_max_tokens``). Raises ValueError for what only the engine can answer: an id in
        use, a request the KV cache or the batch limit can never hold, prompt logprobs on a
        backend without them."""
        if params.prompt_logprobs is not None and not self.runner.supports_prompt_logits:
            raise ValueError(
                "prompt logprobs (echo with logprobs) are not available on the spyre backend: "
                "its prefill programs return the logits of the window's last block only"
            )
        eos_token_id = None if params.ignore_eos else self.eos_token_id
        self.scheduler.add_request(
            request_id,
            prompt_token_ids,
            params.max_tokens,
            stop_token_ids=params.stop_token_ids,
            eos_token_id=eos_token_id,
            cache_salt=cache_salt,
            needs_prompt_logits=params.prompt_logprobs is not None,
        )
        request = self.scheduler.get_request(request_id)
        assert request is not None
        stop_ids = (*params.stop_token_ids, *(() if eos_token_id is None else (eos_token_id,)))
        # The sampler reads the scheduler's own list of output tokens (penalties, min_tokens).
        sampling = SequenceSampling(
            params, tuple(prompt_token_ids), request.output_token_ids, stop_ids
        )
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
        """Run one scheduler step; returns what it produced, per request. The scheduler decides
        which requests finish and why, from the sampled tokens and what they completed in the
        text (stop strings, grammars), which the engine observes here."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        try:
            result = self.runner.execute(step, self._sampling)
        except FatalRunnerError:
            raise  # no step can run any more: the engine stops
        except Exception as exc:  # a failed step ends only the requests it carried
            logger.exception("model step failed")
            message = f"model step failed: {type(exc).__name__}: {exc}"
            return [
                delta
                for rid in _request_ids(step)
                if (delta := self._end(rid, FinishReason.ERROR, message)) is not None
            ]
        if isinstance(step, PrefillChunk) and step.request_id in result.prompt_logprobs:
            self._states[step.request_id].add_prompt_rows(
                step.positions[0], result.prompt_logprobs[step.request_id]
            )
        outputs = self.scheduler.update_from_output(step, self._observe(result.sampled_token_ids))
        return [self._delta(out, result.logprobs.get(out.request_id)) for out in outputs]

    def _observe(self, sampled_token_ids: dict[str, int]) -> ModelRunnerOutput:
        """Feed each sampled token to its request's text and grammar, provisionally."""
        stop_strings = {}
        completed_grammars = set()
        for request_id, token_id in sampled_token_ids.items():
            state = self._states[request_id]
            if (stop_string := state.detokenizer.add_token(token_id)) is not None:
                stop_strings[request_id] = stop_string
            if state.advance_grammar(token_id):
                completed_grammars.add(request_id)
        return ModelRunnerOutput(sampled_token_ids, stop_strings, frozenset(completed_grammars))

    def _delta(self, out: RequestOutput, logprobs: TokenLogprobs | None) -> RequestDelta:
        state = self._states[out.request_id]
        finished = out.finish_reason is not None
        # A stop token's text is not output; nor is the token of a max_tokens 0 request.
        drop_token = not out.new_token_ids or isinstance(out.stop_reason, int)
        text = state.detokenizer.release(drop_last=drop_token, finished=finished)
        first_prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
        if finished:
            self._forget(out.request_id)
        return RequestDelta(
            request_id=out.request_id,
            text=text,
            token_ids=list(out.new_token_ids),
            logprobs=[logprobs] if logprobs is not None and out.new_token_ids else [],
            finish_reason=out.finish_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            stop_reason=out.stop_reason,
            prompt_logprobs=first_prompt_logprobs,
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
