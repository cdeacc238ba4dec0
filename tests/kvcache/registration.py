"""Registering a table's blocks the way the scheduler does, for the pool tests."""

from __future__ import annotations

from kvcache import BlockHashChain, BlockPool


def register_all(
    pool: BlockPool, table: list[int], chain: BlockHashChain, num: int | None = None
) -> list[int | None]:
    """Offer the first ``num`` full blocks of ``table`` as the scheduler does: each block chained
    onto the id returned for the previous one (the cached holder of that content). Once a
    register returns ``None`` the chain is broken: later blocks are not offered (``None``)."""
    count = chain.num_blocks if num is None else num
    returned: list[int | None] = []
    parent: int | None = None
    for i in range(count):
        if i > 0 and parent is None:
            returned.append(None)
            continue
        parent = pool.register(table[i], chain, i, parent)
        returned.append(parent)
        if parent is not None and parent != table[i]:
            hold_twin(pool, table, i, parent)
    return returned


def hold_twin(pool: BlockPool, table: list[int], index: int, twin: int) -> None:
    """As the scheduler does: hold the equal block that was cached first instead of our copy."""
    pool.share([twin])
    pool.free([table[index]])
    table[index] = twin
