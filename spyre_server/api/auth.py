"""API keys: constant-time Bearer check, and the per-key cache salt (an HMAC, never the key)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request

_SALT_DOMAIN = b"spyre-server/cache-salt/v1|"


def salt_secret(hash_seed: int | str | None) -> bytes:
    """The HMAC key of the per-API-key cache salts. Random per process, like the hash chain's
    root; derived from ``cache.hash_seed`` when that is set, so that replicas which share block
    hashes also share salts (keep such a seed secret, as the keys themselves)."""
    if hash_seed is None:
        return secrets.token_bytes(32)
    return hashlib.sha256(_SALT_DOMAIN + str(hash_seed).encode()).digest()


class APIKeys:
    def __init__(self, keys: list[str], salt_secret: bytes) -> None:
        self._keys = [k.encode() for k in keys]
        self._salt_secret = salt_secret

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

    def tenant_salt(self, api_key: str) -> str:
        """The cache salt that keeps one key's cache blocks apart from every other key's: a
        keyed HMAC, so that a salt seen in KV events reveals nothing about the key."""
        return hmac.new(self._salt_secret, api_key.encode(), hashlib.sha256).hexdigest()
