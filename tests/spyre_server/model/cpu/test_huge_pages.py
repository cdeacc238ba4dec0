"""Packed weights on 2 MB pages (``ops/huge_pages.py``): where the data starts, what is advised,
and that the native linear layers pack into that memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from spyre_server.model.cpu.kernels.library import default_kernel_dir, load_native_kernels
from spyre_server.model.cpu.ops.huge_pages import HUGE_PAGE_BYTES, huge_page_empty
from spyre_server.model.cpu.ops.native_linear import NativeBf16Linear, NativeFp8Linear
from tests.conftest import needs_native_kernels

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="this kernel has no transparent huge pages to advise",
)


def mapping_fields(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields of the mapping that holds ``address``."""
    fields: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            if fields is not None:
                break
            start, end = (int(part, 16) for part in head.split("-"))
            if start <= address < end:
                fields = {}
        elif fields is not None:
            fields[head.rstrip(":")] = rest.strip()
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def advised_huge(address: int) -> bool:
    """Whether the mapping holding ``address`` carries MADV_HUGEPAGE (``hg`` in its VmFlags)."""
    return "hg" in mapping_fields(address)["VmFlags"].split()


@needs_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_from_2_mb_the_data_starts_on_a_huge_page_and_is_advised(dtype: torch.dtype) -> None:
    numel = (5 * HUGE_PAGE_BYTES + 4096 + 6) // dtype.itemsize
    tensor = huge_page_empty(numel, dtype)
    assert (tensor.shape, tensor.dtype, tensor.is_contiguous()) == ((numel,), dtype, True)
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert advised_huge(tensor.data_ptr())
    assert advised_huge(tensor.data_ptr() + 5 * HUGE_PAGE_BYTES - 1)
    tensor.fill_(3)  # every byte is the tensor's own, writable
    assert int(tensor[-1]) == 3 and int(tensor[0]) == 3


@needs_thp
def test_its_memory_is_untouched_until_written_even_after_the_heap_served_large_blocks() -> None:
    """Advice does not replace the 4 KB pages of memory already written, and glibc serves blocks
    of up to 32 MB from reused heap memory once a large block has been freed: the tensor's pages
    must be fresh, none resident before the first write, for that write to fault huge pages."""
    for _ in range(3):
        churn = torch.ones(40 << 20, dtype=torch.uint8)  # freed: glibc raises its mmap threshold
        del churn
    for nbytes in (3 * HUGE_PAGE_BYTES, 9 * HUGE_PAGE_BYTES + 100):
        tensor = huge_page_empty(nbytes, torch.uint8)
        assert mapping_fields(tensor.data_ptr())["Rss"] == "0 kB", nbytes
        assert advised_huge(tensor.data_ptr())
        tensor.fill_(1)
        assert int(tensor.sum()) == nbytes


def test_under_2_mb_it_is_a_plain_tensor() -> None:
    tensor = huge_page_empty(HUGE_PAGE_BYTES // 2 - 1, torch.bfloat16)
    assert (tensor.numel(), tensor.dtype, tensor.storage_offset()) == (
        HUGE_PAGE_BYTES // 2 - 1,
        torch.bfloat16,
        0,
    )
    assert tensor.untyped_storage().nbytes() == tensor.numel() * 2


@needs_thp
@needs_native_kernels
def test_native_linears_pack_onto_advised_huge_pages() -> None:
    kernels = load_native_kernels(default_kernel_dir())
    linear = torch.nn.Linear(1024, 2048, bias=False, dtype=torch.bfloat16)
    bf16 = NativeBf16Linear(linear, kernels)
    fp8 = NativeFp8Linear(linear.weight.to(torch.float8_e4m3fn), torch.ones(2048), kernels)
    for packed in (bf16.packed, fp8.packed):
        assert packed.data_ptr() % HUGE_PAGE_BYTES == 0
        assert advised_huge(packed.data_ptr())
    x = torch.randn(3, 1024, dtype=torch.bfloat16)
    # The packing wrote the memory it was given: the layers still compute the weight's product.
    expected = x.float() @ linear.weight.float().T
    torch.testing.assert_close(bf16(x).float(), expected, atol=0.05, rtol=0.02)
    expected8 = x.float() @ linear.weight.to(torch.float8_e4m3fn).float().T
    torch.testing.assert_close(fp8(x).float(), expected8, atol=0.05, rtol=0.02)
