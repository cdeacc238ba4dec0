"""API keys: constant-time Bearer check, and the per-key cache salt (an HMAC, never the key)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

_SALT_KEY = b"spyre-server/cache-salt/v1"


class APIKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def match(self, authorization: str) -> str | None:
        """The configured key an ``Authorization`` header carries, or ``None``."""
        scheme, _, token = authorization.partition(" ")
        presented = token.strip().encode()
        # Compare against every key, always: the time taken does not reveal which one matched.
        matched = [hmac.compare_digest(presented, key) for key in self._keys]
        if scheme.lower() != "bearer" or not any(matched):
            return None
        return token.strip()

    def key_of(self, request: Request) -> str | None:
        """The caller's key (checked by the Auth middleware), ``None`` when keys are off."""
        if not self._keys:
            return None
        return self.match(request.headers.get("authorization", ""))


def tenant_salt(api_key: str) -> str:
    """The cache salt that keeps one key's cache blocks apart from every other key's."""
    return hmac.new(_SALT_KEY, api_key.encode(), hashlib.sha256).hexdigest()
