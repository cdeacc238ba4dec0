"""The ``spyre`` backend: the exact programs a Spyre card runs, compiled with torch.compile.

Every prefill step runs the whole ``[1, chunk_size]`` window (padding included) and every decode
step a ``[batch, 1]`` batch, through fms's ``spyre_paged_attn`` (the op the Spyre compiler
lowers; on a CPU, fms's reference implementation, which copies the cache on every call), with
the inputs spyre_inputs.py builds. Logits come from the window's last block, at the last real
token.

The graphs are the reference stack's (sendnn-inference 2.6.3): the model with unfused weights,
its logits cast to float32 inside the graph, run under ``torch.no_grad``, with the dimensions
its model runner marks dynamic, so that one prefill graph and one decode graph serve every step
the scheduler can issue. They are compiled by ``model.compile_backend`` during a warm-up that is
the reference's: one prefill and one decode inside ``torch_sendnn.warmup_mode()``, then one
more of each to deploy them. A step whose shape the scheduler could not have issued is a bug
and fails.

On a CPU this is a fidelity path (the same traced programs as on the card), not a fast one.

A model with a sliding window runs the programs with the reference stack's windowed attention
op instead (windowed_attention.py): the same store, each query attending the keys inside its
window only. An FP8 checkpoint runs them with fms-model-optimizer's FP8 linear layers and
attention op over a float8_e4m3fn KV cache, its decode batches of 1 as 2 (fp8.py).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch

from scheduler import DecodeBatch, DecodeEntry, PrefillChunk, PrefillCompute
from spyre_server.model.fp8 import Fp8Scheme
from spyre_server.model.runner import LocalModelRunner, ProgramShape, ProgramStats, query_heads
from spyre_server.model.spyre import fp8
from spyre_server.model.spyre.compile import (
    GraphCacheCounts,
    compile_model,
    graph_cache_counts,
    size_oblivious,
    warmup_context,
)
from spyre_server.model.spyre.inputs import SpyreInputs, decode_inputs, prefill_inputs
from spyre_server.model.spyre.windowed_attention import windowed_attention_kwargs

logger = logging.getLogger(__name__)

ATTN_NAME = "spyre_paged_attn"

WARMUP_PROMPT_LEN = 42
"""The reference's warm-up prompt length (sendnn-inference 2.6.3, v1/worker/spyre_worker.py,
``_warmup_spyre_dynamic_size``): one block, one chunk, left-padded to the window."""


class SpyreModelRunner(LocalModelRunner):
    prefill_compute = PrefillCompute.WHOLE_WINDOWS
    supports_prompt_logits = False
    """The card's prefill programs return the logits of the window's last block only."""
    supports_inference_mode = False
    """Spyre does not support ``torch.inference_mode`` (the reference's platform.py)."""

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
        sliding_window: int | None = None,
        fp8_scheme: Fp8Scheme | None = None,
        compile_only: bool = False,
        special_token_ids: Sequence[int] = (),
    ) -> None:
        """``sliding_window``: every layer's window in keys, as HF transformers'
        ``sliding_window``; None: none. ``fp8_scheme``: the model is an FP8 checkpoint's
        (``fp8.check_spyre_fp8`` must have accepted it); None: not quantized.
        ``compile_only``: compile for a card without one (``sendnn`` only: the reference's
        ``sendnn_compile_only``). ``special_token_ids``: ids the warm-up prompts leave out
        (eos, bos), as the reference's do."""
        import fms.utils.spyre.paged  # noqa: F401  (registers "spyre_paged_attn" with fms)

        self.fp8 = fp8_scheme is not None
        programs_model = unfused(model)
        if fp8_scheme is not None:
            programs_model = fp8.with_fms_mo_linears(programs_model, fp8_scheme)
        kv_dtype = fp8.kv_cache_dtype(dtype, fp8_scheme)
        super().__init__(
            programs_model, num_blocks=num_blocks, block_size=block_size, dtype=kv_dtype
        )
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.compile_backend = compile_backend
        self.sliding_window = sliding_window
        self._attention: dict[str, Any] = {"attn_name": ATTN_NAME}
        """The programs' attention op and its arguments."""
        if sliding_window is not None:
            self._attention = windowed_attention_kwargs(sliding_window, query_heads(model), dtype)
        if self.fp8:
            self._attention = {"attn_name": fp8.ATTN_NAME}
            self.kv_caches = fp8.scaled_kv_caches(self.kv_caches, max_num_seqs)
        smallest_decode = fp8.MIN_DECODE_BATCH if self.fp8 else 1
        self.programs = frozenset(
            [ProgramShape("prefill", f"1x{chunk_size}")]
            + [ProgramShape("decode", f"{b}x1") for b in range(smallest_decode, max_num_seqs + 1)]
        )
        """Every step shape the card runs: one prefill window, a decode batch per size (an FP8
        model's batches of 1 run as 2). One dynamic graph per kind serves them all."""
        self._compiled, self._compiler = compile_model(
            self.model, compile_backend, max_model_len=max_model_len, compile_only=compile_only
        )
        self._special_token_ids = frozenset(special_token_ids)
        self._num_steps: dict[ProgramShape, int] | None = None
        """Steps per program since warm-up; ``None`` until warm-up has finished."""
        self._graphs: dict[str, int] = {"prefill": 0, "decode": 0}
        """Graphs compiled so far, per kind."""
        self._graphs_at_warmup: dict[str, int] = {}
        self.warmup_graph_cache: GraphCacheCounts | None = None
        """What the compiler's persistent graph cache did during warm-up (inductor's FX graph
        cache; None for the compilers whose cache we cannot see)."""

    # ------------------------------------------------------------------ warm-up
    def warm_up(self) -> None:
        """Compile the prefill and the decode graph as the reference does
        (v1/worker/spyre_worker.py, ``_warmup_spyre_dynamic_size`` and ``_dynamic_warmup``):
        inside ``torch_sendnn.warmup_mode()`` on a card, with size-oblivious dynamic shapes, one
        prefill of a 42-token prompt and one decode of it (an FP8 model: two prompts, then a
        decode of both); then, outside both, one more prefill and decode of another prompt,
        which deploys the programs to the card. Warm-up writes real KV blocks, as the
        reference's does; the cache is zeroed afterwards."""
        cache_before = graph_cache_counts(self.compile_backend)
        if self.fp8:
            (p0, d0), (p1, d1) = self._warmup_request(0), self._warmup_request(1)
            both = DecodeBatch(entries=d0.entries + d1.entries, tkv=max(d0.tkv, d1.tkv))
            first: tuple[PrefillChunk | DecodeBatch, ...] = (p0, p1, both)
            deploy: tuple[PrefillChunk | DecodeBatch, ...] = self._warmup_request(2)
        else:
            first, deploy = self._warmup_request(0), self._warmup_request(1)
        with self.grad_mode():
            with warmup_context(self.compile_backend), size_oblivious():
                logger.info("warm-up: compiling the prefill and the decode graph")
                for step in first:
                    self._run(self._inputs(step))
            logger.info("warm-up: deploying the prefill and the decode program")
            for step in deploy:
                self._run(self._inputs(step))
        # The reference's complete_warmup gives the model a fresh (zeroed) KV cache.
        if self.fp8:
            self.kv_caches = [(fp8.cache_blocks(k), fp8.cache_blocks(v)) for k, v in self.kv_caches]
        self.kv_caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in self.kv_caches]
        if self.fp8:
            self.kv_caches = fp8.scaled_kv_caches(self.kv_caches, self.max_num_seqs)
        self.warmup_graph_cache = graph_cache_counts(self.compile_backend, since=cache_before)
        self._graphs_at_warmup = dict(self._graphs)
        self._num_steps = dict.fromkeys(self.programs, 0)
        logger.info(
            "warmed up: %d prefill and %d decode graph(s) for %d step shapes (%s backend)",
            self._graphs["prefill"],
            self._graphs["decode"],
            len(self.programs),
            self.compile_backend,
        )

    def _warmup_request(self, index: int) -> tuple[PrefillChunk, DecodeBatch]:
        """The prefill and the first decode of warm-up request ``index``: a prompt of
        ``WARMUP_PROMPT_LEN`` tokens in one KV block of its own (block 1, 2, ...), left-padded
        to the chunk window as the scheduler lays it out."""
        bs, chunk = self.block_size, self.chunk_size
        num_blocks = self.kv_caches[0][0].shape[0]
        block = 1 + index % (num_blocks - 1)
        tokens = self._warmup_tokens(WARMUP_PROMPT_LEN + 1, seed=index)
        prompt, generated = tokens[:-1], tokens[-1]
        left_pad = chunk - bs  # the prompt's one block ends the window
        prefill = PrefillChunk(
            request_id=f"warmup-{index}",
            chunk_index=0,
            num_chunks=1,
            num_left_pad_tokens=left_pad,
            window_offset=left_pad,
            token_ids=tuple(prompt),
            positions=tuple(range(len(prompt))),
            slot_mapping=tuple(block * bs + p for p in range(len(prompt))),
            block_table=(block,),
            is_last_chunk=True,
            tkv=chunk,
        )
        position = len(prompt)
        entry = DecodeEntry(
            request_id=f"warmup-{index}",
            token_id=generated,
            position=position,
            slot=block * bs + position,
            block_table=(block,),
        )
        return prefill, DecodeBatch(entries=(entry,), tkv=position + 1)

    def _warmup_tokens(self, n: int, *, seed: int) -> list[int]:
        """``n`` random token ids, none of them 0 or special, as the reference's warm-up
        prompts ("empty tensor causes spyre to hang")."""
        embedding = next(m for m in self.model.modules() if isinstance(m, torch.nn.Embedding))
        vocab = embedding.num_embeddings
        valid = [t for t in range(1, vocab) if t not in self._special_token_ids]
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randint(0, len(valid), (n,), generator=generator)
        return [valid[i] for i in picks.tolist()]

    def program_stats(self) -> ProgramStats | None:
        num_steps = dict(self._num_steps or {})  # keys are fixed at warm-up: safe to copy
        after = sum(self._graphs.values()) - sum(self._graphs_at_warmup.values())
        return ProgramStats(
            warmed=frozenset(num_steps),
            num_steps=num_steps,
            graphs=dict(self._graphs_at_warmup),
            graphs_after_warmup=after if self._num_steps is not None else 0,
        )

    # -------------------------------------------------------------------- steps
    def _inputs(self, step: PrefillChunk | DecodeBatch) -> SpyreInputs:
        if isinstance(step, PrefillChunk):
            return prefill_inputs(step, self.chunk_size, self.block_size)
        return decode_inputs(step, self.block_size)

    def _prefill(self, step: PrefillChunk) -> torch.Tensor | None:
        inputs = prefill_inputs(step, self.chunk_size, self.block_size)
        logits = self._run(inputs)
        if inputs.logits_index is None:
            return None
        return logits[:, inputs.logits_index]

    def _decode(self, step: DecodeBatch) -> torch.Tensor:
        return self._run(decode_inputs(step, self.block_size))[:, -1]

    def _run(self, inputs: SpyreInputs) -> torch.Tensor:
        """The step's logits, one row per row of ``inputs``."""
        if not self.fp8:
            return self._run_program(inputs)
        rows = len(inputs.input_ids)
        padded = fp8.padded_decode(inputs)
        fp8.set_unit_scales(self.kv_caches, len(padded.input_ids))
        return self._run_program(padded)[:rows]

    def _run_program(self, inputs: SpyreInputs) -> torch.Tensor:
        program = inputs.program
        if self._num_steps is not None:
            if program not in self._num_steps:
                raise RuntimeError(
                    f"the {program.kind} program {program.shape} was not warmed up "
                    f"(warmed: {sorted(p.shape for p in self.programs if p.kind == program.kind)})"
                )
            self._num_steps[program] += 1
        tensors = _tensors(inputs)
        graphs_before = self._compiler.graphs
        logits, caches = self._compiled(
            tensors["input_ids"],
            position_ids=tensors["position_ids"],
            past_key_value_states=self.kv_caches,
            use_cache=True,
            last_n_tokens=self.block_size if inputs.kind == "prefill" else 1,
            slot_mapping=tensors["slot_mapping"],
            block_table=tensors["block_table"],
            current_tkv_mask=tensors["current_tkv"],
            left_padded_prompt_mask=tensors["left_padding"],
            **self._attention,
        )
        compiled = self._compiler.graphs - graphs_before
        if compiled:
            self._graphs[inputs.kind] += compiled
            if self._num_steps is not None:
                logger.error(
                    "a %s step compiled %d new graph(s) after warm-up (shape %s): a program "
                    "the warm-up did not cover",
                    inputs.kind,
                    compiled,
                    program.shape,
                )
        # fms's store op returns updated copies of the caches (on a card: device tensors).
        self.kv_caches = [(k, v) for k, v in caches]
        return logits  # type: ignore[no-any-return]


def _tensors(inputs: SpyreInputs) -> dict[str, torch.Tensor]:
    """The step's tensors, with the dimensions marked as the reference marks them
    (v1/worker/spyre_model_runner.py, ``_mark_input_tensors``). Prefill: the batch (1) static,
    the token dimension of the ids, positions and slot mapping and the block table's width
    dynamic. Decode: the batch of every input and the block table's width dynamic, the token
    dimension (1) static."""
    t: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor(inputs.input_ids),
        "position_ids": torch.tensor(inputs.position_ids),
        "slot_mapping": torch.tensor(inputs.slot_mapping),
        "block_table": torch.tensor(inputs.block_table),
        "current_tkv": torch.tensor(inputs.current_tkv),
        "left_padding": torch.tensor(inputs.left_padding),
    }
    dynamo = torch._dynamo
    if inputs.kind == "prefill":
        for name in ("slot_mapping", "position_ids", "block_table", "input_ids"):
            dynamo.mark_static(t[name], 0)
            dynamo.mark_dynamic(t[name], 1)
    else:
        for name in ("block_table", "slot_mapping", "position_ids", "current_tkv", "left_padding"):
            dynamo.mark_dynamic(t[name], 0)
        dynamo.mark_dynamic(t["input_ids"], 0)
        dynamo.mark_dynamic(t["block_table"], 1)
        for name in ("slot_mapping", "position_ids", "input_ids"):
            dynamo.mark_static(t[name], 1)
    return t


def unfused(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with fms's fused projections (the query-key-value ``FusedQKV``, a gated
    linear unit's ``wg1_fused``) split into their parts, as the reference loads models for the
    card (model_executor/model_loader/spyre.py: ``get_model(..., fused_weights=False)``).
    ``model`` itself if it has none (loading.load_model with ``fused_weights=False``), else a
    new module tree over the same weight storage: the caller's model is left as it was."""
    from fms.modules.attention import FusedQKV
    from fms.modules.feedforward import GatedLinearUnit

    def is_fused(module: torch.nn.Module) -> bool:
        return isinstance(module, FusedQKV) or (
            isinstance(module, GatedLinearUnit) and bool(module.fused)
        )

    if not any(is_fused(m) for m in model.modules()):
        return model
    logger.info("splitting the model's fused projections (the spyre backend runs them unfused)")
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    copied = copy.deepcopy(model, memo=shared)
    with torch.no_grad():
        for parent in list(copied.modules()):
            for name, child in list(parent.named_children()):
                if is_fused(child):
                    setattr(parent, name, child.unfuse_weights())
    return copied
