"""The ranks of one model (tensor parallelism): a gloo process group on this host and the one
collective a step needs, the sum of the output projections' partial results.

Two ways to sum, one per backend:
- ``sum_`` (cpu backend): every rank gathers all partial results and adds them in rank order.
  Each element's sum is then the same bits on every rank and in a step of any size, so the
  prefix cache's promise (a row's KV is the same whatever else the step computes, DESIGN §4)
  holds at any rank count. gloo's own all-reduce splits the buffer by its length, so from three
  ranks on an element's order of additions would depend on the step's size. The gather goes
  through shared memory (``shared_sum.py``) where the ranks have it, else over gloo: the same
  additions, so the same bits.
- ``all_reduce`` (spyre backend): ``torch.distributed._functional_collectives.all_reduce``, the
  op fms's TP modules use (``fms/distributed/tensorparallel.py``), which torch.compile traces
  into the step's graph, as the card's compiler receives it from the reference stack.

The reference (sendnn-inference 2.6.3, ``v1/worker/spyre_worker.py`` ``init_device``) uses a
gloo group too, with a 60-minute timeout (``SENDNN_INFERENCE_GLOO_TIMEOUT_MINUTES``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from spyre_server.model.parallel.shared_sum import SharedSum

GLOO_TIMEOUT = datetime.timedelta(minutes=60)
"""How long a collective waits for a rank (the reference's default). A rank that dies is seen
by the engine within a step, which then stops every rank, so no collective waits this long."""


@dataclass(slots=True)
class RankGroup:
    rank: int
    size: int
    shared: SharedSum | None = None
    """The shared-memory gather, where every rank has it (``use_shared_memory``)."""

    def use_shared_memory(self, shared: SharedSum | None) -> bool:
        """Gather through ``shared`` if every rank has one (None: this rank has not); returns
        whether the group does."""
        everyone = torch.tensor([int(shared is not None)])
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        self.shared = shared if everyone.item() == 1 else None
        return self.shared is not None

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` (contiguous) by the sum of every rank's ``tensor``, added in rank
        order (the same bits on every rank and for any number of rows); returns it."""
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.sum_(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor)
        tensor.copy_(parts[0])
        for part in parts[1:]:
            tensor.add_(part)
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``tensor``, as a traceable functional collective (a new
        tensor)."""
        return funcol.all_reduce(tensor, "sum", dist.group.WORLD)  # type: ignore[arg-type]


def init_rank_group(rank: int, size: int, rendezvous: str) -> RankGroup:
    """Join the ranks' gloo process group through ``rendezvous`` (a file path every rank
    shares). The ranks run on this host: gloo talks over the loopback interface unless
    ``GLOO_SOCKET_IFNAME`` names another."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=size,
        timeout=GLOO_TIMEOUT,
    )
    return RankGroup(rank, size)
