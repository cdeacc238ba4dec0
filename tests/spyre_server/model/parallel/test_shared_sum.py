"""The shared-memory sum across ranks: every rank gets the rank-order sum (the gather over
gloo's additions), for tensors of every size that fits, sum after sum (both slots reused)."""

from __future__ import annotations

import threading

import pytest
import torch

from spyre_server.model.cpu.kernels.library import NativeKernelSettings, unsupported_cpu_reason
from spyre_server.model.parallel.shared_sum import SharedSum, SharedSumBuffers

pytestmark = pytest.mark.skipif(
    unsupported_cpu_reason() is not None, reason=f"native kernels: {unsupported_cpu_reason()}"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_rank_order_sum(dtype: torch.dtype, size: int) -> None:
    kernels = NativeKernelSettings().load()
    buffers = SharedSumBuffers.allocate(size, 4 * 64, dtype)
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 64), (4, 64), (3, 5), (2, 64), (1, 1)] * 3  # both slots, reused
    inputs = [
        [torch.randn(shape, generator=generator).to(dtype) for _ in range(size)] for shape in shapes
    ]
    results: list[list[torch.Tensor]] = [[] for _ in range(size)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        shared = SharedSum(buffers, rank, kernels)
        try:
            for parts in inputs:
                tensor = parts[rank].clone()
                assert shared.fits(tensor)
                assert shared.sum_(tensor) is tensor
                results[rank].append(tensor)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    for step, parts in enumerate(inputs):
        want = parts[0].clone()
        for part in parts[1:]:
            want.add_(part)
        for rank in range(size):
            assert torch.equal(results[rank][step], want), (step, rank)


def test_what_does_not_fit_is_left_to_gloo() -> None:
    kernels = NativeKernelSettings().load()
    shared = SharedSum(SharedSumBuffers.allocate(2, 128, torch.float32), 0, kernels)
    assert shared.fits(torch.zeros(2, 64))
    assert not shared.fits(torch.zeros(3, 64))  # more values than a row holds
    assert not shared.fits(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert not shared.fits(torch.zeros(64, 2).t())  # not contiguous
