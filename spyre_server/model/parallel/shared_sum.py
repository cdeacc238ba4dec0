"""The cpu backend's sum across ranks through shared memory: the same additions in the same
order as ``RankGroup.sum_``'s gather over gloo, so the same bits, without gloo's round trips
over the loopback interface (which cost about a millisecond even for one row).

The engine allocates the buffers before the ranks start (``SharedSumBuffers.allocate``): two
slots, each with one row of ``max_numel`` values per rank, and one flag per rank, each on its
own cache line. For its ``k``-th sum a rank copies its partial result into its row of slot
``k % 2``, publishes ``k`` in its flag (``kernels/rank_sync.cpp``: after a full fence), waits
until every rank's flag reaches ``k``, and adds the rows in rank order. A slot is written again
two sums later, when every rank has published ``k + 1`` and so has read slot ``k % 2``.

Every rank makes the same sums in the same order (each step runs the same layers on every
rank), so the sequence numbers agree. A rank waiting for one that died spins until the engine,
which sees the death, stops every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spyre_server.model.cpu.kernels.library import NativeKernels

FLAG_STRIDE = 16
"""int64 values between two ranks' flags: one 128-byte line each (no false sharing)."""

SPINS_PER_CALL = 1 << 16
"""Rounds of the wait loop per call into the kernel; the Python loop around it asks again."""


@dataclass(frozen=True, slots=True)
class SharedSumBuffers:
    """Shared-memory tensors (``share_memory_``) that every rank of one model maps."""

    data: torch.Tensor
    """``[2, ranks, max_numel]``: two slots of one row per rank."""
    flags: torch.Tensor
    """``[ranks * FLAG_STRIDE]`` int64: rank ``r``'s flag at ``r * FLAG_STRIDE``."""

    @classmethod
    def allocate(cls, size: int, max_numel: int, dtype: torch.dtype) -> SharedSumBuffers:
        return cls(
            torch.zeros(2, size, max_numel, dtype=dtype).share_memory_(),
            torch.zeros(size * FLAG_STRIDE, dtype=torch.int64).share_memory_(),
        )


class SharedSum:
    """One rank's view of ``SharedSumBuffers``: ``sum_(tensor)`` for the tensors that fit."""

    def __init__(self, buffers: SharedSumBuffers, rank: int, kernels: NativeKernels) -> None:
        self._data = buffers.data
        self._rank = rank
        self._size = buffers.data.shape[1]
        self._publish = kernels.rank_publish
        self._wait = kernels.rank_wait
        self._flags_ptr = buffers.flags.data_ptr()
        self._own_flag_ptr = self._flags_ptr + rank * FLAG_STRIDE * buffers.flags.element_size()
        self._sequence = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.dtype == self._data.dtype
            and tensor.numel() <= self._data.shape[2]
            and tensor.is_contiguous()
        )

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` (``fits``) by the sum of every rank's, added in rank order."""
        self._sequence += 1
        sequence = self._sequence
        rows = self._data[sequence % 2, :, : tensor.numel()]
        rows[self._rank].copy_(tensor.view(-1))
        self._publish(self._own_flag_ptr, sequence)
        while not self._wait(self._flags_ptr, FLAG_STRIDE, self._size, sequence, SPINS_PER_CALL):
            pass
        out = tensor.view(-1)
        out.copy_(rows[0])
        for rank in range(1, self._size):
            out.add_(rows[rank])
        return tensor
