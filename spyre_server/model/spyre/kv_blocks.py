"""The spyre backend's KV block count, by the card's rules (the reference's
``SpyrePlatform.get_total_spyre_blocks`` in sendnn-inference 2.6.3's ``platform.py``).

- Unset (``cache.num_blocks`` null, no registry value): a full batch of ``max_model_len``
  requests plus the padding block 0, ``max_num_seqs * ceil(max_model_len / 64) + 1``, rounded
  UP to a multiple of ``max_num_seqs`` (the card's pool is a multiple of the batch size).
  ``cache.kv_cache_memory`` (a host-RAM budget) is not used: the card's memory is not the
  host's.
- Set (``cache.num_blocks``, or a known-good configuration's value): rounded DOWN to a
  multiple of ``max_num_seqs``, staying within the value given.
- At least ``min(full batch, batch_tkv_limit / 64) + 1`` blocks.

Where we differ: the reference refuses to start below that minimum on every backend, because
its scheduler reserves no blocks for a request's decode. Ours reserves them at admission, so
a smaller pool only admits fewer requests at once: we refuse with ``sendnn`` (the card runs
what the reference runs) and warn with ``eager`` / ``inductor``, whose CPU runs copy the
whole cache at every layer and are best given a small pool. The full batch counts
``ceil(max_model_len / 64)`` blocks a request where the reference counts the floor: the same
for every max_model_len that is a multiple of 64, one block more otherwise, so that a
max_model_len request fits.
"""

from __future__ import annotations

import logging

from scheduler import SchedulerConfig
from spyre_server.config import Config
from spyre_server.model.errors import ModelLoadError

logger = logging.getLogger(__name__)


def card_num_blocks(
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    batch_tkv_limit: int,
    num_blocks: int | None,
    enforce_minimum: bool,
) -> int:
    """The KV pool's size in blocks, block 0 included (see the module's docstring);
    ModelLoadError below the minimum when ``enforce_minimum``."""
    blocks_per_seq = -(-max_model_len // block_size)
    full_batch = max_num_seqs * blocks_per_seq
    if num_blocks is not None:
        asked = num_blocks
        count = num_blocks // max_num_seqs * max_num_seqs
    else:
        asked = full_batch + 1  # + the padding block
        count = -(-asked // max_num_seqs) * max_num_seqs
    if count != asked:
        logger.info(
            "KV blocks rounded from %d to %d, a multiple of scheduler.max_num_seqs (%d), as the "
            "Spyre card needs",
            asked,
            count,
            max_num_seqs,
        )
    minimum = min(full_batch, batch_tkv_limit // block_size) + 1
    if count < minimum:
        message = (
            f"{count} KV blocks are fewer than the Spyre card's minimum for max_model_len "
            f"{max_model_len} x max_num_seqs {max_num_seqs}: {minimum} (a full batch, or the "
            "batch x tkv limit, in blocks, plus the padding block)"
        )
        if enforce_minimum:
            raise ModelLoadError(f"{message}; raise cache.num_blocks or leave it unset")
        logger.warning("%s; served anyway (compile_backend is not sendnn)", message)
    if count < 2:
        raise ModelLoadError(
            f"cache.num_blocks {num_blocks} rounds down to {count} KV blocks, a multiple of "
            f"scheduler.max_num_seqs ({max_num_seqs}); at least 2 are needed"
        )
    return count


def spyre_num_kv_blocks(config: Config) -> int:
    """``card_num_blocks`` for ``config`` (with a known-good configuration's values applied:
    ``registry_config(...).apply``); the minimum is enforced with compile_backend sendnn."""
    cache = config.cache
    limits = SchedulerConfig(
        block_size=cache.block_size,
        chunk_size=config.scheduler.chunk_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=config.model.max_model_len,
        max_batch_tkv_limit=config.scheduler.max_batch_tkv_limit,
    )
    if cache.num_blocks is None and "kv_cache_memory" in cache.model_fields_set:
        logger.warning(
            "cache.kv_cache_memory is not used on the spyre backend: the card's pool holds a "
            "full batch (set cache.num_blocks to choose another size)"
        )
    return card_num_blocks(
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=config.model.max_model_len,
        block_size=cache.block_size,
        batch_tkv_limit=limits.batch_tkv_limit,
        num_blocks=cache.num_blocks,
        enforce_minimum=config.model.compile_backend == "sendnn",
    )
