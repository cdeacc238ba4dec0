"""The Spyre chunked-prefill scheduler (DESIGN §3, §4).

It is the only writer of ``num_computed_tokens`` and block tables. Each step is either one prefill
chunk of one request or one decode token for every decoding request. A request is admitted (FCFS)
when it starts its prefill: its longest exact cache hit is shared, the chunks the hit fully covers
are skipped, and blocks for prompt + max_tokens are reserved so that a running request never runs
out. Preemption by recompute is the last resort when an allocation fails anyway.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from kvcache import BlockHash, BlockHashChain, BlockPool, ExtraKeys, IntegrityError, root_hash
from scheduler.config import PrefillCompute, SchedulerConfig
from scheduler.grid import cdiv
from scheduler.outputs import (
    DecodeBatch,
    DecodeEntry,
    ModelRunnerOutput,
    PrefillChunk,
    RequestOutput,
    ScheduledStep,
    SchedulerStats,
)
from scheduler.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        hash_seed: int | str | bytes | None = None,
        model_name: str | None = None,
    ) -> None:
        self.config = config
        self.pool = BlockPool(
            config.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self._root_hash = root_hash(hash_seed)
        self._model_name = model_name
        self._requests: dict[str, Request] = {}
        """Every unfinished request."""
        self._waiting: deque[Request] = deque()
        self._prefilling: Request | None = None
        self._decoding: list[Request] = []
        """In admission order."""
        self._last_step_was_prefill = False
        self._num_chunks_computed = 0
        self._num_chunks_skipped = 0
        self._num_decode_steps = 0
        self._num_preemptions = 0

    @property
    def root_hash(self) -> BlockHash:
        """The hash every chain's first block is chained onto (``h_{-1}``): its parent."""
        return self._root_hash

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        stop_token_ids: Sequence[int] = (),
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        needs_prompt_logits: bool = False,
    ) -> None:
        """Queue a request. The caller has checked the request against the model (a non-empty
        prompt of ids in the vocabulary, ``0 <= max_tokens``, prompt + max_tokens within
        ``max_model_len``: ``spyre_server.engine.validation``). The scheduler checks what it
        owns and raises ValueError if the id is in use or the request could never run with
        this configuration (more blocks than the pool has, over the volumetric limit).

        ``max_tokens`` 0 prefills (scores) the prompt and ends with finish reason LENGTH and
        no token."""
        cfg = self.config
        assert prompt_token_ids and max_tokens >= 0, "checked by the caller"
        assert len(prompt_token_ids) + max_tokens <= cfg.max_model_len, "checked by the caller"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        extra = ExtraKeys(cache_salt=cache_salt, model_name=self._model_name)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            chain=BlockHashChain(cfg.block_size, self._root_hash, extra),
            stop_token_ids=frozenset(stop_token_ids),
            eos_token_id=eos_token_id,
            needs_prompt_logits=needs_prompt_logits,
        )
        if request.num_blocks_needed > self.pool.num_usable_blocks:
            raise ValueError(
                f"the request needs {request.num_blocks_needed} KV blocks for prompt + max_tokens "
                f"but the cache has {self.pool.num_usable_blocks}"
            )
        tkv = self._max_decode_tkv(request)
        if tkv > cfg.batch_tkv_limit:
            raise ValueError(
                f"the request's decode context ({tkv} tokens: prompt + max_tokens - 1 in whole "
                f"blocks) exceeds max_batch_tkv_limit ({cfg.batch_tkv_limit}) even alone"
            )
        self._requests[request_id] = request
        self._waiting.append(request)
        if self.pool.enable_caching and not needs_prompt_logits:
            self._announce(request, self.pool.lookup(request.chain))

    def finish_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        """End an unfinished request from outside the step (ABORT: the client left; ERROR: its
        step failed) and free its blocks. Every other finish is decided in
        ``update_from_output``. Returns its final output, or ``None`` if no such request is
        unfinished."""
        assert reason in (FinishReason.ABORT, FinishReason.ERROR), reason
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        self._finish(request, reason)
        return self._output(request, ())

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledStep | None:
        """Plan the next step; ``None`` when there is nothing to run."""
        step: ScheduledStep | None = None
        if self._decoding and self.config.interleave and self._last_step_was_prefill:
            step = self._schedule_decode()
        if step is None:
            prefilling = self._prefilling or self._admit_next()
            if prefilling is not None:
                step = self._schedule_prefill(prefilling)
        if step is None and self._decoding:
            step = self._schedule_decode()
        if step is not None:
            self._last_step_was_prefill = isinstance(step, PrefillChunk)
        return step

    def _admit_next(self) -> Request | None:
        if not self._waiting or len(self._decoding) >= self.config.max_num_seqs:
            return None
        request = self._waiting[0]
        if not self._try_admit(request):
            return None
        self._waiting.popleft()
        self._prefilling = request
        return request

    def _try_admit(self, request: Request) -> bool:
        """Admit ``request`` if the volumetric limit and the block reservation allow it."""
        cfg = self.config
        bs = cfg.block_size
        request.num_prefill_tokens = len(request.all_token_ids)  # outputs too after a preemption
        running = self._decoding
        max_tkv = max([self._max_decode_tkv(r) for r in running] + [self._max_decode_tkv(request)])
        if (len(running) + 1) * max_tkv > cfg.batch_tkv_limit:
            return False

        use_cache = self.pool.enable_caching and not request.needs_prompt_logits
        hits: list[int] = []
        if use_cache:
            hits = self.pool.lookup(request.chain, request.num_prefill_tokens // bs)
        reserved = sum(r.num_blocks_needed - len(r.block_table) for r in running)
        blocks_to_take = request.num_blocks_needed - len(hits) + self.pool.num_free_among(hits)
        if self.pool.num_free_blocks - reserved < blocks_to_take:
            return False

        grid = request.grid(cfg.chunk_size)
        usable = grid.usable_hit_blocks(len(hits))
        self.pool.share(hits)
        new_blocks = self.pool.allocate(cdiv(request.num_prefill_tokens, bs) - len(hits))
        assert new_blocks is not None, "the reservation check guarantees the prompt's blocks"
        request.block_table = hits + new_blocks
        request.num_hit_blocks = len(hits)
        request.num_registered_blocks = len(hits)
        request.cached_tail_block_id = hits[-1] if hits else None
        if use_cache:
            self._announce(request, hits)
        request.num_computed_tokens = usable * bs
        request.status = RequestStatus.PREFILLING
        self._num_chunks_skipped += (usable * bs + grid.num_left_pad_tokens) // cfg.chunk_size
        if request.num_cached_tokens is None:  # first admission only (not after a preemption)
            request.num_cached_tokens = self._num_skipped_tokens(request, len(hits), usable)
            if use_cache:  # a bypassed lookup is no query (as in vLLM)
                self.pool.record_admission(len(request.prompt_token_ids), request.num_cached_tokens)
        return True

    def _num_skipped_tokens(
        self, request: Request, num_hit_blocks: int, num_usable_blocks: int
    ) -> int:
        """Prompt tokens whose compute the running backend skips thanks to the hit (DESIGN §4):
        the usable grid part for whole windows; every shared position but the logits one when
        the runner computes only new positions (the hit blocks' slots go to block 0)."""
        bs = self.config.block_size
        if self.config.prefill_compute is PrefillCompute.WHOLE_WINDOWS:
            return num_usable_blocks * bs
        return min(num_hit_blocks * bs, len(request.prompt_token_ids) - 1)

    def _max_decode_tkv(self, request: Request) -> int:
        """Upper bound of the request's padded tkv at every decode step of any batch: its block
        table at its last decode step (prompt + max_tokens - 1 tokens), in whole blocks, since
        every row of a decode batch is left-padded to the widest table (DESIGN §3; the padded
        tkv of a row is ``(widest - its width) * B + position + 1 <= widest * B``). Decode
        attends over the cached prefix too. Fixed for the request's life, so a request that
        passed the check in add_request always fits alone, also after a preemption."""
        bs = self.config.block_size
        return cdiv(len(request.prompt_token_ids) + request.max_tokens - 1, bs) * bs

    def _schedule_prefill(self, request: Request) -> PrefillChunk:
        cfg = self.config
        bs = cfg.block_size
        grid = request.grid(cfg.chunk_size)
        chunk_index = grid.chunk_of(request.num_computed_tokens)
        start, end = grid.chunk_span(chunk_index)
        assert start == request.num_computed_tokens, "prefill resumes on a chunk boundary"
        table = request.block_table
        num_shared_tokens = request.num_hit_blocks * bs  # cached already: written to block 0
        slots = tuple(
            t % bs if t < num_shared_tokens else table[t // bs] * bs + t % bs
            for t in range(start, end)
        )
        window_start = chunk_index * cfg.chunk_size - grid.num_left_pad_tokens
        self._num_chunks_computed += 1
        return PrefillChunk(
            request_id=request.request_id,
            chunk_index=chunk_index,
            num_chunks=grid.num_chunks,
            num_left_pad_tokens=grid.num_left_pad_tokens,
            window_offset=start - window_start,
            token_ids=tuple(request.all_token_ids[start:end]),
            positions=tuple(range(start, end)),
            slot_mapping=slots,
            block_table=tuple(table),
            is_last_chunk=end == grid.num_tokens,
            tkv=(chunk_index + 1) * cfg.chunk_size,
            needs_prompt_logits=request.needs_prompt_logits,
        )

    def _schedule_decode(self) -> DecodeBatch | None:
        bs = self.config.block_size
        entries = []
        max_position = -1
        for request in list(self._decoding):
            if request.status is not RequestStatus.DECODING:
                continue  # preempted while making room for an earlier entry
            tokens = request.all_token_ids
            position = len(tokens) - 1
            table = request.block_table
            if position // bs == len(table) and not self._grow(request):
                continue
            slot = table[position // bs] * bs + position % bs
            entries.append(
                DecodeEntry(request.request_id, tokens[-1], position, slot, tuple(table))
            )
            max_position = max(max_position, position)
        if not entries:
            return None
        widest = max(len(e.block_table) for e in entries)
        padded_tkv = max((widest - len(e.block_table)) * bs + e.position + 1 for e in entries)
        assert len(entries) * padded_tkv <= self.config.batch_tkv_limit, "admission bounds it"
        self._num_decode_steps += 1
        # Victims of a preemption are always newer than the entries already made.
        return DecodeBatch(tuple(entries), tkv=max_position + 1)

    def _grow(self, request: Request) -> bool:
        """Give a decoding request its next block. Preempts the newest other running request
        when the pool is empty (the reservation makes this a last resort); returns False if the
        request itself had to be preempted."""
        while True:
            new_block = self.pool.allocate(1)
            if new_block is not None:
                request.block_table += new_block
                return True
            victim = self._prefilling or self._decoding[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        if request is self._prefilling:
            self._prefilling = None
        else:
            self._decoding.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(request)

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, step: ScheduledStep, output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply an executed step: advance num_computed_tokens, cache the blocks whose KV is now
        complete, append sampled tokens, decide which requests finish and why, free them."""
        if isinstance(step, PrefillChunk):
            request = self._requests.get(step.request_id)
            if request is None or request is not self._prefilling:
                return []  # finished (aborted) while the step ran
            request.num_computed_tokens = step.positions[-1] + 1
            self._register_computed_blocks(request)
            if not step.is_last_chunk:
                return []
            self._prefilling = None
            if request.max_tokens == 0:  # scoring only: the sampled token is not output
                self._finish(request, FinishReason.LENGTH)
                return [self._output(request, ())]
            request.status = RequestStatus.DECODING
            self._decoding.append(request)
            return [self._append_token(request, output)]

        bs = self.config.block_size
        requests = self._requests
        decoding = RequestStatus.DECODING
        outputs = []
        for entry in step.entries:
            request = requests.get(entry.request_id)
            if request is None or request.status is not decoding:
                continue
            request.num_computed_tokens = entry.position + 1
            if request.num_computed_tokens // bs > request.num_registered_blocks:
                self._register_computed_blocks(request)
            outputs.append(self._append_token(request, output))
        return outputs

    def _register_computed_blocks(self, request: Request) -> None:
        """Offer every block whose 64 positions are all computed to the cache, once.

        Each block is chained onto the cached block holding the previous one. When an equal
        block was registered first (a peer computed the same content), the request swaps its
        copy for that block, so it holds a reference to every block of its cached chain.
        """
        bs = self.config.block_size
        limit = request.num_computed_tokens // bs
        if not self.config.cache_decode_blocks:
            limit = min(limit, request.num_prefill_tokens // bs)
        if limit <= request.num_registered_blocks:
            return
        table = request.block_table
        parent = request.cached_tail_block_id
        for index in range(request.num_registered_blocks, limit):
            if index > 0 and parent is None:
                break  # the chain is broken: nobody could reach the later blocks
            parent = self.pool.register(table[index], request.chain, index, parent)
            if parent is None:  # not cached, so neither will the later blocks be
                self._withdraw_announced(request, index)
            elif parent != table[index]:
                # An equal block was cached first: hold it instead of our copy (same KV, and
                # the block we chain onto can then never be recycled under us).
                self.pool.share([parent])
                self.pool.free([table[index]])
                table[index] = parent
        request.cached_tail_block_id = parent
        request.num_registered_blocks = limit

    def _append_token(self, request: Request, output: ModelRunnerOutput) -> RequestOutput:
        """Append the request's sampled token and decide whether it finishes, first rule first:
        a stop token (STOP, its id), EOS (STOP), a stop string in the text (STOP, the string),
        a completed grammar (STOP), max_tokens reached (LENGTH)."""
        request_id = request.request_id
        token_id = output.sampled_token_ids[request_id]
        request.append_output(token_id)
        reason: FinishReason | None = FinishReason.STOP
        if token_id in request.stop_token_ids:
            request.stop_reason = token_id
        elif token_id == request.eos_token_id:
            pass
        elif (stop_string := output.stop_strings.get(request_id)) is not None:
            request.stop_reason = stop_string
        elif request_id in output.completed_grammars:
            pass
        elif len(request.output_token_ids) >= request.max_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
        if reason is not None:
            self._finish(request, reason)
        return self._output(request, (token_id,))

    @staticmethod
    def _output(request: Request, new_token_ids: tuple[int, ...]) -> RequestOutput:
        return RequestOutput(
            request.request_id,
            new_token_ids,
            request.finish_reason,
            request.num_cached_tokens or 0,
            request.stop_reason,
        )

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request is self._prefilling:
            self._prefilling = None
        elif request.status is RequestStatus.DECODING:
            self._decoding.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.finished(reason)
        request.finish_reason = reason
        del self._requests[request.request_id]

    def _announce(self, request: Request, hits: Sequence[int]) -> None:
        """Publish the full blocks of the request's prefill past ``hits`` (its cached prefix)
        as soon as it is queued: a router may then send the prefix's next requests here, where
        they queue behind this one (prefills run one at a time, in order) and hit its blocks
        once written (DESIGN §4, KV events). At admission: announcements the hits now cover
        are consumed; a request re-queued by a preemption is announced again."""
        num_hits = len(hits)
        announced = request.announced_blocks
        if announced:
            covered = range(announced.start, min(num_hits, announced.stop))
            self.pool.withdraw(request.chain, covered)  # cached now: nothing is removed
            request.announced_blocks = range(max(announced.start, num_hits), announced.stop)
            return
        end = len(request.all_token_ids) // self.config.block_size
        request.announced_blocks = range(num_hits, max(num_hits, end))
        self.pool.announce(request.chain, request.announced_blocks)

    def _withdraw_announced(self, request: Request, first: int) -> None:
        """The announced blocks from ``first`` on will not be registered by ``request``."""
        announced = request.announced_blocks
        withdrawn = range(max(first, announced.start), announced.stop)
        if withdrawn:
            self.pool.withdraw(request.chain, withdrawn)
            request.announced_blocks = range(announced.start, withdrawn.start)

    def _release_blocks(self, request: Request) -> None:
        self._withdraw_announced(request, request.num_registered_blocks)
        request.announced_blocks = range(0)
        self.pool.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.num_hit_blocks = 0
        request.num_registered_blocks = 0
        request.cached_tail_block_id = None

    # ------------------------------------------------------------- inspection
    def reset_prefix_cache(self) -> int:
        """Drop every cached block from lookups (always succeeds); returns how many. Routers
        forget every block too (``AllBlocksCleared``), announced ones included: a waiting
        request is announced again at admission, and the rest of a prefill publishes its
        blocks as it registers them."""
        for request in self._requests.values():
            request.announced_blocks = range(0)
        return self.pool.reset()

    def block_tables(self) -> dict[str, list[int]]:
        return {rid: r.block_table for rid, r in self._requests.items() if r.block_table}

    def check_integrity(self) -> None:
        """The pool's invariants, with every reference accounted for by a request's table, and
        every announced block accounted for by a request that will register or withdraw it."""
        self.pool.check_integrity(self.block_tables())
        pending = Counter(
            r.chain.hashes[index]
            for r in self._requests.values()
            for index in r.pending_announced_blocks
        )
        # A registration of equal content by another request takes an announcement too, so the
        # pool may hold fewer than the requests account for, never more.
        unaccounted = self.pool.announced_hashes() - pending
        if unaccounted:
            raise IntegrityError(
                f"{unaccounted.total()} announced blocks in the pool belong to no request"
            )

    def make_stats(self) -> SchedulerStats:
        running = len(self._decoding) + (self._prefilling is not None)
        return SchedulerStats(
            num_running=running,
            num_waiting=len(self._waiting),
            kv_cache_usage=self.pool.usage(),
            prefix_cache_queries=self.pool.stats.num_query_tokens,
            prefix_cache_hits=self.pool.stats.num_hit_tokens,
            num_prefill_chunks_computed=self._num_chunks_computed,
            num_prefill_chunks_skipped=self._num_chunks_skipped,
            num_decode_steps=self._num_decode_steps,
            num_preemptions=self._num_preemptions,
        )
