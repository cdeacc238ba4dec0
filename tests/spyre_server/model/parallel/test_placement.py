"""Where ranks run: whole cores each, or a Spyre card each; refused when they do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from spyre_server.model.errors import ModelLoadError
from spyre_server.model.parallel.placement import (
    RankPlacement,
    count_spyre_cards,
    place_on_cards,
    place_ranks,
    usable_cores,
)
from spyre_server.model.parallel.runner import check_shared_memory

TWO_SOCKETS = [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]
"""8 cores with their hyper-threads, 4 per socket, in the order ``usable_cores`` gives."""


def test_each_rank_gets_whole_cores_of_its_own() -> None:
    assert place_ranks(2, None, TWO_SOCKETS) == [
        RankPlacement(4, (0, 1, 2, 3, 8, 9, 10, 11)),
        RankPlacement(4, (4, 5, 6, 7, 12, 13, 14, 15)),
    ]
    assert place_ranks(4, 1, TWO_SOCKETS) == [
        RankPlacement(1, (0, 8)),
        RankPlacement(1, (1, 9)),
        RankPlacement(1, (2, 10)),
        RankPlacement(1, (3, 11)),
    ]
    assert place_ranks(2, None, [(0,), (1,), (2,)]) == [
        RankPlacement(1, (0,)),
        RankPlacement(1, (1,)),
    ]


def test_too_few_cores_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="needs a core per rank; this process may use 1"):
        place_ranks(2, None, [(0, 1)])
    with pytest.raises(ModelLoadError, match=r"2 x model\.num_threads 3 needs 6 physical cores"):
        place_ranks(2, 3, TWO_SOCKETS[:5])


def test_usable_cores_cover_this_process_cpus_once() -> None:
    import os

    cores = usable_cores()
    cpus = [cpu for core in cores for cpu in core]
    assert sorted(cpus) == sorted(os.sched_getaffinity(0))


def test_spyre_cards_are_the_numbered_vfio_devices(tmp_path: Path) -> None:
    for name in ("vfio", "12", "13", "27"):
        (tmp_path / name).touch()
    assert count_spyre_cards(tmp_path) == 3
    assert count_spyre_cards(tmp_path / "absent") == 0
    assert place_on_cards(2, 4, 3) == [RankPlacement(4, None), RankPlacement(4, None)]
    with pytest.raises(ModelLoadError, match="needs a Spyre card per rank; this container has 1"):
        place_on_cards(2, 4, 1)


def test_too_little_shared_memory_is_refused_at_start(tmp_path: Path) -> None:
    check_shared_memory(1 << 20, tmp_path)
    with pytest.raises(ModelLoadError, match=r"docker run --shm-size 1g"):
        check_shared_memory(1 << 62, tmp_path)
