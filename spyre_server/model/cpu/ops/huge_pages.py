"""Memory for the packed weights a decode step streams, on 2 MB pages where Linux grants them.

A decode step reads every packed weight once, front to back, so a 4 KB page costs a TLB miss
and a page walk every 4 KB of the stream. Most distributions back anonymous memory with
transparent huge pages only where the process asks (``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``madvise``). ``huge_page_empty`` allocates a tensor whose bytes start on a 2 MB
boundary and advises ``MADV_HUGEPAGE`` for its whole 2 MB pages before anything writes them, so
the first writes (the packing) fault them in as huge pages.

This is advice: where the kernel ignores it (THP ``never``, or not built) the tensor is the
same, on small pages, and only the speed differs; nothing computed depends on it. Tensors under
2 MB are plain ``torch.empty`` (they cannot fill a huge page). The over-allocation is virtual
where the allocator maps fresh memory: the bytes before the 2 MB boundary are never touched, and
the tail past the last whole 2 MB page is not advised here (memory the allocator reuses keeps
whatever advice it had).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable

import torch

HUGE_PAGE_BYTES = 2 << 20
"""x86-64's transparent huge page."""
_MADV_HUGEPAGE = 14
"""``<sys/mman.h>``'s advice: back this range with transparent huge pages."""

_log = logging.getLogger(__name__)


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` values of ``dtype``; from 2 MB on, its data
    starts on a 2 MB boundary and its whole 2 MB pages are advised ``MADV_HUGEPAGE`` (Linux)."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    data = raw[offset : offset + nbytes]
    _advise_huge(data.data_ptr(), nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return data.view(dtype)


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _advise_huge(address: int, length: int) -> None:
    if _madvise()(address, length, _MADV_HUGEPAGE) != 0:
        _log_refusal(ctypes.get_errno())


@functools.cache
def _log_refusal(errno: int) -> None:
    _log.info("packed weights stay on 4 KB pages: madvise(MADV_HUGEPAGE) failed, errno %d", errno)
