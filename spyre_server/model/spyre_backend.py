"""The ``spyre`` backend: the exact programs a Spyre card runs, compiled with torch.compile.

Every prefill step runs the whole ``[1, chunk_size]`` window (padding included) and every decode
step a ``[batch, 1]`` batch, through fms's ``spyre_paged_attn`` (the op the Spyre compiler
lowers; on a CPU, fms's reference implementation, which copies the cache on every call), with
the inputs spyre_inputs.py builds. Logits come from the window's last block, at the last real
token. The programs are compiled by ``model.compile_backend`` and all warmed up before the
first request: a step whose program was not warmed up is a bug and fails.

On a CPU this is a fidelity path (the same traced programs as on the card), not a fast one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from scheduler import DecodeBatch, PrefillChunk, PrefillCompute
from spyre_server.model.compile import compile_model, size_oblivious, warmup_context
from spyre_server.model.runner import ModelRunner, ProgramShape, ProgramStats
from spyre_server.model.spyre_inputs import SpyreInputs, decode_inputs, prefill_inputs

logger = logging.getLogger(__name__)

ATTN_NAME = "spyre_paged_attn"


class SpyreModelRunner(ModelRunner):
    prefill_compute = PrefillCompute.WHOLE_WINDOWS
    supports_prompt_logits = False
    """The card's prefill programs return the logits of the window's last block only."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        chunk_size: int,
        max_num_seqs: int,
        max_model_len: int,
        compile_backend: str,
    ) -> None:
        import fms.utils.spyre.paged  # noqa: F401  (registers "spyre_paged_attn" with fms)

        super().__init__(model, num_blocks=num_blocks, block_size=block_size, dtype=dtype)
        # Inference tensors, as the caches the programs return (no recompilation); one layer at
        # a time, so start-up holds one layer's copy beyond the cache, not a second cache.
        with torch.inference_mode():
            for layer, (k, v) in enumerate(self.kv_caches):
                self.kv_caches[layer] = (k.clone(), v.clone())
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.compile_backend = compile_backend
        self.programs = frozenset(
            [ProgramShape("prefill", f"1x{chunk_size}")]
            + [ProgramShape("decode", f"{b}x1") for b in range(1, max_num_seqs + 1)]
        )
        """Every program the scheduler can issue: one prefill window, a decode batch per size."""
        self._compiled = compile_model(model, compile_backend)
        self._num_steps: dict[ProgramShape, int] | None = None
        """Steps per program since warm-up; ``None`` until warm-up has finished."""

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile and run every program once (with dynamic block-table widths of one and of
        several blocks), then, on a card, once more outside warm-up mode to deploy them."""
        warmups = list(self._warmup_inputs())
        with warmup_context(self.compile_backend):
            for inputs in tqdm(warmups, desc="warming up Spyre programs", unit="program"):
                self._run(inputs)
        if self.compile_backend == "sendnn":
            for inputs in (warmups[0], warmups[-1]):
                self._run(inputs)  # deploys the compiled programs to the card
        for k, v in self.kv_caches:  # warm-up wrote only to block 0, the sink: tidy it
            k[0].zero_()
            v[0].zero_()
        assert {i.program for i in warmups} == self.programs
        self._num_steps = dict.fromkeys(self.programs, 0)
        logger.info(
            "warmed up %d Spyre programs (%s backend)", len(self.programs), self.compile_backend
        )

    def _warmup_inputs(self) -> Iterator[SpyreInputs]:
        """Synthetic steps that write only to block 0, over the shortest and a longer table."""
        bs, chunk = self.block_size, self.chunk_size
        window_blocks = chunk // bs
        max_blocks = -(-self.max_model_len // bs)
        prefill_widths = sorted({window_blocks, min(2 * window_blocks, max_blocks)})
        for width in prefill_widths:
            tkv = width * bs
            yield SpyreInputs(
                kind="prefill",
                input_ids=[[1] * chunk],
                position_ids=[list(range(tkv - chunk, tkv))],
                slot_mapping=[[w % bs for w in range(chunk)]],
                block_table=[[0] * width],
                current_tkv=[tkv],
                left_padding=[0],
                logits_index=bs - 1,
            )
        decode_widths = [1, 2] if max_blocks >= 2 else [1]
        # Batch 1 last: a program first traced at batch 1 specialises on it.
        for batch in [*range(2, self.max_num_seqs + 1), 1]:
            width = decode_widths[batch % len(decode_widths)]
            position = width * bs - 1
            yield SpyreInputs(
                kind="decode",
                input_ids=[[1]] * batch,
                position_ids=[[position]] * batch,
                slot_mapping=[[position % bs]] * batch,
                block_table=[[0] * width] * batch,
                current_tkv=[position + 1] * batch,
                left_padding=[0] * batch,
                logits_index=0,
            )

    def program_stats(self) -> ProgramStats | None:
        num_steps = dict(self._num_steps or {})  # keys are fixed at warm-up: safe to copy
        return ProgramStats(warmed=frozenset(num_steps), num_steps=num_steps)

    # -------------------------------------------------------------------- steps
    def _prefill(self, step: PrefillChunk) -> torch.Tensor | None:
        inputs = prefill_inputs(step, self.chunk_size, self.block_size)
        logits = self._run(inputs)
        if inputs.logits_index is None:
            return None
        return logits[:, inputs.logits_index].float()

    def _decode(self, step: DecodeBatch) -> torch.Tensor:
        return self._run(decode_inputs(step, self.block_size))[:, -1].float()

    def _run(self, inputs: SpyreInputs) -> torch.Tensor:
        program = inputs.program
        if self._num_steps is not None:
            if program not in self._num_steps:
                raise RuntimeError(
                    f"the {program.kind} program {program.shape} was not warmed up "
                    f"(warmed: {sorted(p.shape for p in self.programs if p.kind == program.kind)})"
                )
            self._num_steps[program] += 1
        tensors = _tensors(inputs)
        with size_oblivious():
            logits, caches = self._compiled(
                tensors["input_ids"],
                position_ids=tensors["position_ids"],
                past_key_value_states=self.kv_caches,
                use_cache=True,
                last_n_tokens=self.block_size if inputs.kind == "prefill" else 1,
                attn_name=ATTN_NAME,
                slot_mapping=tensors["slot_mapping"],
                block_table=tensors["block_table"],
                current_tkv_mask=tensors["current_tkv"],
                left_padded_prompt_mask=tensors["left_padding"],
            )
        # fms's store op returns updated copies of the caches (on a card: device tensors).
        self.kv_caches = [(k, v) for k, v in caches]
        return logits  # type: ignore[no-any-return]


def _tensors(inputs: SpyreInputs) -> dict[str, torch.Tensor]:
    """The step's tensors, with the dimensions that vary within one program marked dynamic
    (vllm-spyre's marking): the block-table width always, the batch of a decode step."""
    tensors: dict[str, Any] = {
        "input_ids": torch.tensor(inputs.input_ids),
        "position_ids": torch.tensor(inputs.position_ids),
        "slot_mapping": torch.tensor(inputs.slot_mapping),
        "block_table": torch.tensor(inputs.block_table),
        "current_tkv": torch.tensor(inputs.current_tkv),
        "left_padding": torch.tensor(inputs.left_padding),
    }
    torch._dynamo.mark_dynamic(tensors["block_table"], 1)
    if inputs.kind == "decode":
        for tensor in tensors.values():
            torch._dynamo.mark_dynamic(tensor, 0)
    return tensors
