"""The ``cpu`` backend: computes only what must be computed, through our paged attention.

Of a prefill chunk it computes the positions whose KV must be written (slot outside block 0) and
the position whose logits are needed; padding and recomputed cached positions cost nothing,
since attention reads the cached copy through the block table. With a sliding window every
step's plan carries it, so every attention path (our kernels, SDPA's flash kernel, fms's forward
through our op) attends only the keys inside each query's window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scheduler import DecodeBatch, PrefillChunk, PrefillCompute
from spyre_server.model.cpu.paged_attention import (
    AttentionPlan,
    PagedAttentionKernel,
    paged_attention_kwargs,
    plan_attention,
)
from spyre_server.model.runner import KVCaches, LocalModelRunner

StepDecoder = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, KVCaches, int], torch.Tensor | None
]
"""``(input_ids, position_ids, slot_mapping, plan, kv_caches, last_n_tokens) -> logits``: a
whole step, as the model's forward with our paged-attention op computes it
(``prepare.cpu_decoder``: ``NativeDecoder``, ``NativeBf16Decoder`` or ``AtenDecoder``); None
for ``last_n_tokens`` 0, where only the KV is written."""


class CpuModelRunner(LocalModelRunner):
    prefill_compute = PrefillCompute.NEW_POSITIONS
    supports_prompt_logits = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        attention: PagedAttentionKernel | None = None,
        decoder: StepDecoder | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """``attention``: the kernel for the paged-attention op's compute (None: SDPA's flash
        kernel on gathered blocks). ``decoder``: runs the steps instead of the model's forward
        (the same logits and KV; ``prepare.cpu_decoder``). ``sliding_window``: every layer's
        window in keys, as HF transformers' ``sliding_window`` (the query at position p attends
        the keys at p - W + 1 .. p); None: none."""
        super().__init__(model, num_blocks=num_blocks, block_size=block_size, dtype=dtype)
        self.attention = attention
        self.decoder = decoder
        self.sliding_window = sliding_window

    def _prefill(self, step: PrefillChunk) -> torch.Tensor | None:
        bs = self.block_size
        # Positions whose KV goes to block 0 form a prefix of the chunk (the shared hit blocks):
        # skip them, except the last position when it must produce the logits.
        first = next((i for i, s in enumerate(step.slot_mapping) if s >= bs), None)
        if first is None:
            if not step.is_last_chunk:
                return None  # nothing to write, nothing to sample
            first = len(step.token_ids) - 1
        # A chunk that samples nothing writes its KV only: no LM head.
        logits = self._forward_chunk(step, first, last_n_tokens=int(step.is_last_chunk))
        return None if logits is None else logits[:, -1]

    def _prompt_logits(self, step: PrefillChunk) -> torch.Tensor:
        logits = self._forward_chunk(step, 0, last_n_tokens=len(step.token_ids))
        assert logits is not None
        return logits[0]

    def _forward_chunk(
        self, step: PrefillChunk, first: int, *, last_n_tokens: int
    ) -> torch.Tensor | None:
        """Compute the chunk's positions from index ``first`` on (writing their KV); the logits
        of the last ``last_n_tokens`` of them (None for 0)."""
        positions = step.positions[first:]
        return self._forward(
            torch.tensor([step.token_ids[first:]]),
            torch.tensor([positions]),
            torch.tensor(step.slot_mapping[first:]),
            plan_attention([step.block_table], [positions], self.block_size, self.sliding_window),
            last_n_tokens=last_n_tokens,
        )

    def _decode(self, step: DecodeBatch) -> torch.Tensor:
        entries = step.entries
        positions = [[e.position] for e in entries]
        logits = self._forward(
            torch.tensor([[e.token_id] for e in entries]),
            torch.tensor(positions),
            torch.tensor([e.slot for e in entries]),
            plan_attention(
                [e.block_table for e in entries], positions, self.block_size, self.sliding_window
            ),
            last_n_tokens=1,
        )
        assert logits is not None
        return logits[:, -1]

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
        *,
        last_n_tokens: int,
    ) -> torch.Tensor | None:
        """The step's logits for the last ``last_n_tokens`` positions of each row; None for 0
        (the KV only)."""
        if self.decoder is not None:
            return self.decoder(
                input_ids, position_ids, slot_mapping, plan, self.kv_caches, last_n_tokens
            )
        logits, _ = self.model(
            input_ids,
            position_ids=position_ids,
            past_key_value_states=self.kv_caches,
            use_cache=True,
            last_n_tokens=max(last_n_tokens, 1),  # fms reads 0 as every position
            **paged_attention_kwargs(slot_mapping, plan, self.attention),
        )
        return logits if last_n_tokens else None
