"""Executes a scheduler step on an fms model with our paged attention (DESIGN §2, §3).

The runner does exactly what the step says and holds no scheduling state. On the CPU it computes
only the positions whose KV must be written (slot outside block 0) and the position whose logits
are needed; padding and recomputed cached positions cost nothing, since attention reads the cached
copy through the block table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from fms.modules.attention import MultiHeadAttention

from scheduler import DecodeBatch, PrefillChunk, ScheduledStep
from spyre_server.model.paged_attention import paged_attention_kwargs, plan_attention
from spyre_server.sampling import SamplingParams, SequenceSampling, TokenLogprobs, sample

SamplingInputs = Mapping[str, SamplingParams | SequenceSampling]
"""What the sampler needs of each request of a step, by request id."""


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def kv_cache_shape(model: torch.nn.Module) -> KVCacheShape:
    """Read layers, KV heads and head size off the model's attention modules."""
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no fms MultiHeadAttention modules")
    first = attentions[0]
    if first.emb_kq_per_head != first.emb_v_per_head:
        raise ValueError("key and value head sizes differ; the paged KV cache needs them equal")
    return KVCacheShape(len(attentions), first.kvheads, first.emb_kq_per_head)


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    """For a prefill chunk with ``needs_prompt_logits``: the log-softmax of the logits at every
    position of the chunk, ``[len(step.positions), vocab]`` float32, in position order."""


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, *, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.model = model
        self.block_size = block_size
        shape = kv_cache_shape(model)
        self.kv_shape = shape
        # Zeros, not empty: masked-out keys are still multiplied by 0 and must not be NaN.
        self.kv_caches = [
            (
                torch.zeros(
                    num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype
                ),
                torch.zeros(
                    num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype
                ),
            )
            for _ in range(shape.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, step: ScheduledStep, params: SamplingInputs) -> StepResult:
        """Run the step, write its KV, and sample a token for every row that must produce one."""
        if isinstance(step, PrefillChunk) and step.needs_prompt_logits:
            return self._prefill_with_prompt_logprobs(step, params)
        logits = self.compute_logits(step)
        if logits is None:
            return StepResult({}, {})
        if isinstance(step, PrefillChunk):
            return self._sample(logits, [step.request_id], [step.positions[-1] + 1], params)
        return self._sample(
            logits,
            [e.request_id for e in step.entries],
            [e.position + 1 for e in step.entries],
            params,
        )

    @torch.inference_mode()
    def compute_logits(self, step: ScheduledStep) -> torch.Tensor | None:
        """Run the step's forward pass (writing its KV) and return the logits ``[rows, vocab]``
        of the rows that must sample: the last prefill chunk's final position, or every decode
        entry in order. ``None`` for a prefill chunk that samples nothing."""
        if isinstance(step, PrefillChunk):
            return self._prefill(step)
        return self._decode(step)

    def _prefill_with_prompt_logprobs(
        self, step: PrefillChunk, params: SamplingInputs
    ) -> StepResult:
        """A chunk whose every position's logits are wanted: all of them are computed."""
        logits = self._forward_chunk(step, 0, last_n_tokens=len(step.token_ids))[0]
        rows = torch.log_softmax(logits.float(), dim=-1)
        if not step.is_last_chunk:
            return StepResult({}, {}, {step.request_id: rows})
        result = self._sample(logits[-1:], [step.request_id], [step.positions[-1] + 1], params)
        return StepResult(result.sampled_token_ids, result.logprobs, {step.request_id: rows})

    def _prefill(self, step: PrefillChunk) -> torch.Tensor | None:
        bs = self.block_size
        # Positions whose KV goes to block 0 form a prefix of the chunk (the shared hit blocks):
        # skip them, except the last position when it must produce the logits.
        first = next((i for i, s in enumerate(step.slot_mapping) if s >= bs), None)
        if first is None:
            if not step.is_last_chunk:
                return None  # nothing to write, nothing to sample
            first = len(step.token_ids) - 1
        logits = self._forward_chunk(step, first, last_n_tokens=1)
        return logits[:, -1] if step.is_last_chunk else None

    def _forward_chunk(self, step: PrefillChunk, first: int, *, last_n_tokens: int) -> torch.Tensor:
        """Compute the chunk's positions from index ``first`` on (writing their KV)."""
        positions = step.positions[first:]
        input_ids = torch.tensor([step.token_ids[first:]])
        plan = plan_attention([step.block_table], [positions], self.block_size)
        kwargs = paged_attention_kwargs(torch.tensor(step.slot_mapping[first:]), plan)
        position_ids = torch.tensor([positions])
        return self._forward(input_ids, position_ids, kwargs, last_n_tokens=last_n_tokens)

    def _decode(self, step: DecodeBatch) -> torch.Tensor:
        entries = step.entries
        plan = plan_attention(
            [e.block_table for e in entries], [[e.position] for e in entries], self.block_size
        )
        kwargs = paged_attention_kwargs(torch.tensor([e.slot for e in entries]), plan)
        position_ids = torch.tensor([[e.position] for e in entries])
        input_ids = torch.tensor([[e.token_id] for e in entries])
        return self._forward(input_ids, position_ids, kwargs, last_n_tokens=1)[:, -1]

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kwargs: dict[str, object],
        *,
        last_n_tokens: int,
    ) -> torch.Tensor:
        logits, _ = self.model(
            input_ids,
            position_ids=position_ids,
            past_key_value_states=self.kv_caches,
            use_cache=True,
            last_n_tokens=last_n_tokens,
            **kwargs,
        )
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        positions: list[int],
        params: SamplingInputs,
    ) -> StepResult:
        result = sample(logits, [params[r] for r in request_ids], positions)
        logprobs = {
            r: lp for r, lp in zip(request_ids, result.logprobs, strict=True) if lp is not None
        }
        return StepResult(dict(zip(request_ids, result.token_ids, strict=True)), logprobs)
