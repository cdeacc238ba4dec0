"""Memory for the packed weights a decode step streams, on 2 MB pages where Linux grants them.

A decode step reads every packed weight once, front to back, so a 4 KB page costs a TLB miss
and a page walk every 4 KB of the stream. Most distributions back anonymous memory with
transparent huge pages only where the process asks (``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``madvise``). ``huge_page_empty`` allocates a tensor whose bytes start on a 2 MB
boundary and advises ``MADV_HUGEPAGE`` for its whole 2 MB pages before anything writes them, so
the first writes (the packing) fault them in as huge pages.

The bytes come from a fresh anonymous mapping of their own, never from the allocator's heap:
memory the heap reuses is already backed by 4 KB pages, which advice does not replace (glibc
serves allocations of up to 32 MB from it once a large block has been freed, so most packed
weights would stay on small pages). The mapping is 2 MB larger than the tensor, for the
alignment; the bytes before the boundary and past the tensor are never touched, so they take no
memory, and the tail past the last whole 2 MB page is not advised (a huge page there would fill
memory the tensor does not use).

This is advice: where the kernel ignores it (THP ``never``, or not built) the tensor is the
same, on small pages, and only the speed differs; nothing computed depends on it. Tensors under
2 MB are plain ``torch.empty`` (they cannot fill a huge page).
"""

from __future__ import annotations

import functools
import logging
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
"""x86-64's transparent huge page."""

_log = logging.getLogger(__name__)


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` values of ``dtype``; from 2 MB on (Linux),
    its data is a fresh mapping's, starts on a 2 MB boundary, and its whole 2 MB pages are
    advised ``MADV_HUGEPAGE``. The tensor keeps the mapping alive."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.empty(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError as refused:
        _log_refusal(refused.errno)
    return raw[offset : offset + nbytes].view(dtype)


@functools.cache
def _log_refusal(errno: int | None) -> None:
    _log.info("packed weights stay on 4 KB pages: madvise(MADV_HUGEPAGE) failed, errno %s", errno)
