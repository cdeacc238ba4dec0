from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted once per admitted request, in tokens (DESIGN §4)."""

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``None`` before any query: there is no rate yet."""
        if self.num_query_tokens == 0:
            return None
        return self.num_hit_tokens / self.num_query_tokens
