"""Where each tensor-parallel rank runs: its own cores on a CPU, its own card on Spyre.

On the cpu backend (and the spyre backend's CPU runs, ``eager``/``inductor``) rank ``r`` is
pinned to whole physical cores ``[r*T, (r+1)*T)`` (with their hyper-threads) of the cores this
process may use, taken socket by socket, and runs ``T`` torch threads: ``model.num_threads``,
else the physical cores divided by the ranks. Ranks never share a core, so one rank's sleeping
OpenMP workers never wait behind another's. On a Spyre node (``sendnn``) each rank drives one
card; the cards are those the container was given (``/dev/vfio``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from spyre_server.config import Config
from spyre_server.model.errors import ModelLoadError

Core = tuple[int, ...]
"""A physical core by the CPUs (hyper-threads) it runs."""


@dataclass(frozen=True, slots=True)
class RankPlacement:
    num_threads: int
    cpus: tuple[int, ...] | None
    """The CPUs the rank is pinned to (None: not pinned, on a Spyre card)."""


def place_ranks(size: int, num_threads: int | None, cores: list[Core]) -> list[RankPlacement]:
    """Pin ``size`` ranks of ``num_threads`` threads each (None: ``len(cores) // size``) to
    whole cores of ``cores`` (in order). ModelLoadError when there are fewer cores than ranks
    or than the threads they need."""
    if len(cores) < size:
        raise ModelLoadError(
            f"model.tensor_parallel_size {size} needs a core per rank; this process may use "
            f"{len(cores)} physical core(s)"
        )
    threads = num_threads or len(cores) // size
    if threads * size > len(cores):
        raise ModelLoadError(
            f"model.tensor_parallel_size {size} x model.num_threads {threads} needs "
            f"{threads * size} physical cores; this process may use {len(cores)}"
        )
    return [
        RankPlacement(
            threads,
            tuple(sorted(cpu for core in cores[r * threads : (r + 1) * threads] for cpu in core)),
        )
        for r in range(size)
    ]


def place_on_cards(size: int, num_threads: int | None, num_cards: int) -> list[RankPlacement]:
    """One Spyre card per rank; ModelLoadError when fewer cards than ranks are here."""
    if num_cards < size:
        raise ModelLoadError(
            f"model.tensor_parallel_size {size} needs a Spyre card per rank; this container "
            f"has {num_cards} (the numbered devices in /dev/vfio)"
        )
    threads = num_threads or max(1, len(usable_cores()) // size)
    return [RankPlacement(threads, None) for _ in range(size)]


def placements(config: Config) -> list[RankPlacement]:
    """The ranks of ``config``'s ``model.tensor_parallel_size`` on this host (ModelLoadError
    when they do not fit)."""
    model = config.model
    size = model.tensor_parallel_size
    if model.backend == "spyre" and model.compile_backend == "sendnn":
        return place_on_cards(size, model.num_threads, count_spyre_cards())
    return place_ranks(size, model.num_threads, usable_cores())


def usable_cores() -> list[Core]:
    """The physical cores this process may use, each with its hyper-threads, socket by socket
    (Linux sysfs topology; without it, each CPU is a core)."""
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = int((topology / "physical_package_id").read_text())
            core = int((topology / "core_id").read_text())
        except (OSError, ValueError):
            package, core = 0, cpu
        cores.setdefault((package, core), []).append(cpu)
    return [tuple(cpus) for _, cpus in sorted(cores.items())]


def count_spyre_cards(vfio: Path = Path("/dev/vfio")) -> int:
    """The Spyre cards passed to this container: the numbered IOMMU-group devices in
    ``/dev/vfio`` (vllm-spyre's documented ``-v /dev/vfio:/dev/vfio``; the Kubernetes device
    plugin mounts the same)."""
    try:
        return sum(1 for entry in vfio.iterdir() if entry.name.isdigit())
    except OSError:
        return 0
