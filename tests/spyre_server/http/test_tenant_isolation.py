"""Tenant isolation of the prefix cache, seen through the real server:

- forced hash collisions (every block hash equal) cost misses, never a wrong hit or a wrong
  answer;
- requests with different ``cache_salt`` never hold a common block, requests with the same salt
  do share;
- with ``server.isolate_cache_per_api_key`` two keys never hold a common block, and the per-key
  salt the scheduler and the KV events see is an HMAC of the key, never the key;
- API keys are compared with ``hmac.compare_digest``, against every configured key.

Block sharing is observed with ``BlockWatch``: it wraps the scheduler's ``schedule`` and
``update_from_output`` (both run on the engine's step thread) and snapshots the block table of
every unfinished request after each call. (That admin endpoints need a key when keys are set is
covered by test_auth_and_admin.py and test_prefix_cache.py.)
"""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvcache import BlockStored, ExtraKeys, KVCacheEvent
from tests.spyre_server.http.helpers import (
    BLOCK,
    ByteChatTokenizer,
    MakeServer,
    Server,
    reference_greedy,
    slow_down,
    unique_text,
)

TOK = ByteChatTokenizer()
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 3


# ------------------------------------------------------------------------------- observation
@dataclass
class Seen:
    """One engine request as the watcher saw it."""

    request_id: str
    extra: ExtraKeys
    num_hit_blocks: int
    hit_blocks: tuple[int, ...]
    blocks: set[int] = field(default_factory=set)


class BlockWatch:
    """Snapshots every unfinished request's block table after each ``schedule()`` and
    ``update_from_output()`` (on the step thread) and checks, at every snapshot:

    - requests with different extra keys (salt) hold no common block;
    - a block a request holds that carries a hash carries the request's own chain hash for that
      position (the chain hash covers the salt);
    - a block a request got from the cache at admission (``num_hit_blocks``) was last held, at
      the same position, by a request with the same token prefix and the same extra keys: no
      wrong hit.
    """

    def __init__(self, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
        self.scheduler = server.engine.scheduler
        self.requests: dict[str, Seen] = {}
        self.violations: list[str] = []
        self.overlapping: set[frozenset[str]] = set()
        # block id -> (position, token prefix through that block or None, extra keys encoded)
        self._last_holder: dict[int, tuple[int, tuple[int, ...] | None, bytes]] = {}
        scheduler = self.scheduler
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def watched_schedule() -> Any:
            step = schedule()
            self._snapshot()
            return step

        def watched_update(step: Any, output: Any) -> Any:
            outputs = update(step, output)
            self._snapshot()
            return outputs

        monkeypatch.setattr(scheduler, "schedule", watched_schedule)
        monkeypatch.setattr(scheduler, "update_from_output", watched_update)

    def _snapshot(self) -> None:
        scheduler = self.scheduler
        pool = scheduler.pool
        tables = scheduler.block_tables()
        alive = {rid: scheduler.get_request(rid) for rid in tables}
        known = [rid for rid in tables if rid in self.requests]
        new = [rid for rid in tables if rid not in self.requests]
        for rid in known:
            self._remember(alive[rid], tables[rid])
        for rid in new:
            request, table = alive[rid], tables[rid]
            hits = tuple(table[: request.num_hit_blocks])
            self.requests[rid] = Seen(rid, request.chain.extra, request.num_hit_blocks, hits)
            for index, block_id in enumerate(hits):
                want = (
                    index,
                    tuple(request.all_token_ids[: (index + 1) * BLOCK]),
                    request.chain.extra.encoded,
                )
                got = self._last_holder.get(block_id)
                if got != want:
                    self.violations.append(
                        f"{rid} hit block {block_id} at position {index}, last held as "
                        f"{None if got is None else (got[0], got[2])}: not its own prefix"
                    )
            self._remember(request, table)
        for rid, table in tables.items():
            request = alive[rid]
            self.requests[rid].blocks.update(table)
            for index, block_id in enumerate(table):
                block_hash = pool.block_hash(block_id)
                chain = request.chain.hashes
                if block_hash is not None and (index >= len(chain) or chain[index] != block_hash):
                    self.violations.append(
                        f"{rid} holds block {block_id} at position {index} with a hash that is "
                        "not its own"
                    )
        rids = sorted(tables)
        for i, a in enumerate(rids):
            for b in rids[i + 1 :]:
                self.overlapping.add(frozenset((a, b)))
                if alive[a].chain.extra.encoded != alive[b].chain.extra.encoded:
                    common = set(tables[a]) & set(tables[b])
                    if common:
                        self.violations.append(
                            f"{a} and {b} (different salts) both hold blocks {sorted(common)}"
                        )

    def _remember(self, request: Any, table: Sequence[int]) -> None:
        tokens = request.all_token_ids
        for index, block_id in enumerate(table):
            full = len(tokens) >= (index + 1) * BLOCK
            prefix = tuple(tokens[: (index + 1) * BLOCK]) if full else None
            self._last_holder[block_id] = (index, prefix, request.chain.extra.encoded)

    def of(self, request_id: str) -> Seen:
        """The (single) engine request of the HTTP request with this ``X-Request-Id``."""
        (seen,) = [s for rid, s in self.requests.items() if rid.startswith(f"{request_id}-")]
        return seen

    def check(self) -> None:
        assert not self.violations, "\n".join(self.violations[:10])


# ---------------------------------------------------------------------------------- requests
def complete(
    server: Server,
    request_id: str,
    prompt: str,
    api_key: str | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    response = server.http(api_key=api_key).post(
        COMPLETIONS, json=body | kwargs, headers={"x-request-id": request_id}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def assert_matches_oracle(model: Any, prompt: str, out: dict[str, Any]) -> None:
    """Greedy tokens and logprobs equal a plain full forward pass (no cache at all)."""
    ref = reference_greedy(model, TOK.encode(prompt), MAX_TOKENS, 1)
    logprobs = out["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [TOK.decode([s.token_id]) for s in ref]
    assert logprobs["token_logprobs"] == pytest.approx([s.logprob for s in ref], abs=1e-4)


def shared_blocks(a: str, b: str) -> int:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return common // BLOCK


def finish(server: Server, watch: BlockWatch) -> None:
    server.wait_idle()
    server.engine.scheduler.check_integrity()
    watch.check()
    assert server.metrics().value("vllm:num_preemptions_total") == 0


# ----------------------------------------------------------------------- forced hash collisions
COLLIDING_DIGEST = b"\x5a" * 16


@pytest.fixture
def colliding_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every xxh3_128 digest kvcache/hashing.py computes (root and every block) is the same."""
    import kvcache.hashing

    stub = SimpleNamespace(xxh3_128_digest=lambda data: COLLIDING_DIGEST)
    monkeypatch.setattr(kvcache.hashing, "xxhash", stub)


def _collision_prompts() -> list[tuple[str, str]]:
    p = unique_text("collide/P", 192)  # 3 blocks, 2 chunks, 1 block of left padding
    q = p[:BLOCK] + unique_text("collide/Q", 128)  # shares P's first block only
    r = unique_text("collide/R", 192)  # shares nothing
    long = unique_text("collide/L", 384)  # 6 blocks, 3 chunks, no padding
    return [("P", p), ("Q", q), ("R", r), ("S", p), ("L", long), ("L2", long)]


# cached_tokens of the sequence above with real hashes, and with every hash equal: then the
# pool keeps one cached block per hash, a chain breaks after its first block (the second
# block's hash is taken by the first), and a colliding block of other content is a miss. The
# cpu backend skips every position of a hit block but the logits one: S hits 3 blocks of its
# 192 tokens (191), L2 6 of 384 (383); under collisions L2 hits 1 block (64).
REAL_HASHES = {"P": 0, "Q": 64, "R": 0, "S": 191, "L": 0, "L2": 383}
ALL_COLLIDE = {"P": 0, "Q": 64, "R": 0, "S": 0, "L": 0, "L2": 64}


@pytest.mark.parametrize("collide", [False, True], ids=["real-hashes", "all-hashes-equal"])
def test_hash_collisions_cost_misses_never_wrong_hits(
    request: pytest.FixtureRequest,
    make_server: MakeServer,
    monkeypatch: pytest.MonkeyPatch,
    http_micro_model: Any,
    collide: bool,
) -> None:
    if collide:
        request.getfixturevalue("colliding_hashes")
    server = make_server()
    watch = BlockWatch(server, monkeypatch)
    expected = ALL_COLLIDE if collide else REAL_HASHES
    for name, prompt in _collision_prompts():
        out = complete(server, f"collide-{name}", prompt)
        assert cached(out) == expected[name], name
        assert_matches_oracle(http_micro_model, prompt, out)
    finish(server, watch)
    chains = [
        server.engine.scheduler.pool.block_hash(b)
        for s in watch.requests.values()
        for b in s.blocks
    ]
    if collide:  # the patch took: every cached hash is the one digest
        assert {h for h in chains if h is not None} == {COLLIDING_DIGEST}
    hits = {name: watch.of(f"collide-{name}").num_hit_blocks for name, _ in _collision_prompts()}
    # L2 shares L's first block under collisions
    assert hits == (
        {"P": 0, "Q": 1, "R": 0, "S": 0, "L": 0, "L2": 1}
        if collide
        else {"P": 0, "Q": 1, "R": 0, "S": 3, "L": 0, "L2": 6}
    )


def test_concurrent_requests_with_colliding_hashes_get_the_oracle_output(
    colliding_hashes: None,
    make_server: MakeServer,
    monkeypatch: pytest.MonkeyPatch,
    http_micro_model: Any,
) -> None:
    """Eight requests in flight at once (shared and unshared prefixes, some identical), every
    block hash equal: outputs equal the oracle, cached_tokens never exceed what a true shared
    prefix allows, no request holds a block of another prefix, the pool stays consistent."""
    server = make_server()
    watch = BlockWatch(server, monkeypatch)
    slow_down(monkeypatch, server, 0.005)
    base = unique_text("collide-c/base", 256)
    prompts = {
        "a": base + unique_text("collide-c/a", 64),
        "b": base + unique_text("collide-c/b", 64),
        "c": base[:128] + unique_text("collide-c/c", 192),
        "d": unique_text("collide-c/d", 320),
        "e": base + unique_text("collide-c/a", 64),  # = a
        "f": base[:64] + unique_text("collide-c/f", 70),
        "g": unique_text("collide-c/g", 200),
        "h": base + unique_text("collide-c/b", 64),  # = b
    }
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = {
            name: pool.submit(complete, server, f"collide-c-{name}", prompt)
            for name, prompt in prompts.items()
        }
        outs = {name: future.result(timeout=120) for name, future in futures.items()}
    # (prompt tokens, most full blocks shared with another prompt, the most cached_tokens a true
    # shared prefix allows on the cpu backend: min(shared blocks * 64, tokens - 1))
    limits = {
        "a": (320, 5, 319),  # shared with e
        "b": (320, 5, 319),  # shared with h
        "c": (320, 2, 128),  # base[:128], shared with a, b, e, h
        "d": (320, 0, 0),
        "e": (320, 5, 319),  # = a
        "f": (134, 1, 64),  # base[:64]
        "g": (200, 0, 0),
        "h": (320, 5, 319),  # = b
    }
    for name, prompt in prompts.items():
        assert_matches_oracle(http_micro_model, prompt, outs[name])
        best = max(shared_blocks(prompt, other) for o, other in prompts.items() if o != name)
        num_tokens, num_shared, most = limits[name]
        assert (len(prompt), best) == (num_tokens, num_shared), name
        assert cached(outs[name]) <= most, name
    assert len(watch.overlapping) > 1, "the requests did not run concurrently"
    finish(server, watch)


# -------------------------------------------------------------------------------- cache_salt
def test_different_cache_salts_never_share_blocks(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch, http_micro_model: Any
) -> None:
    server = make_server()
    watch = BlockWatch(server, monkeypatch)
    long = unique_text("salt-blocks/long", 300)  # 4 full blocks, cached_tokens 256 on a hit
    short = unique_text("salt-blocks/short", 100)  # 1 full block: 64 positions skipped on a hit
    hit = 256  # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    plan = [
        ("long-a1", long, "tenant-a", 0),
        ("long-b1", long, "tenant-b", 0),
        ("long-none1", long, None, 0),
        ("long-a2", long, "tenant-a", hit),
        ("long-b2", long, "tenant-b", hit),
        ("long-none2", long, None, hit),
        ("short-a1", short, "tenant-a", 0),
        ("short-b1", short, "tenant-b", 0),
        ("short-a2", short, "tenant-a", 64),
        ("short-b2", short, "tenant-b", 64),
    ]
    for rid, prompt, salt, want in plan:
        extra = {} if salt is None else {"cache_salt": salt}
        out = complete(server, rid, prompt, **extra)
        assert cached(out) == want, rid
        assert_matches_oracle(http_micro_model, prompt, out)
    finish(server, watch)

    def seen(rid: str) -> Seen:
        return watch.of(rid)

    for first in ("long-a1", "long-b1", "long-none1", "short-a1", "short-b1"):
        assert seen(first).num_hit_blocks == 0, first
    # the same salt shares the blocks its first request registered; another salt gets none
    for salt in ("a", "b", "none"):
        again = seen(f"long-{salt}2")
        assert again.num_hit_blocks == 4
        assert set(again.hit_blocks) <= seen(f"long-{salt}1").blocks
    for salt in ("a", "b"):
        again = seen(f"short-{salt}2")
        assert again.num_hit_blocks == 1  # shared although cached_tokens is 0
        assert set(again.hit_blocks) <= seen(f"short-{salt}1").blocks
    cached_a = {b for r in ("long-a1", "long-a2") for b in seen(r).hit_blocks}
    cached_b = {b for r in ("long-b1", "long-b2") for b in seen(r).hit_blocks}
    assert cached_a and cached_b and not cached_a & cached_b
    assert {seen(r).extra.cache_salt for r in ("long-a1", "long-b1", "long-none1")} == {
        "tenant-a",
        "tenant-b",
        None,
    }


def test_concurrent_requests_with_different_salts_never_share_blocks(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch, http_micro_model: Any
) -> None:
    """The same prompt under four salts, twice each, all in flight together: each request's
    lookup runs after the others' prefills registered their blocks, yet only the same salt
    shares."""
    server = make_server()
    watch = BlockWatch(server, monkeypatch)
    slow_down(monkeypatch, server, 0.005)
    prompt = unique_text("salt-concurrent", 300)
    salts = ["s1", "s2", "s3", "s4"]
    jobs = [(f"conc-{salt}-{i}", salt) for i in range(2) for salt in salts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(complete, server, rid, prompt, cache_salt=salt) for rid, salt in jobs
        ]
        outs = [f.result(timeout=120) for f in futures]
    for out in outs:
        assert_matches_oracle(http_micro_model, prompt, out)
    finish(server, watch)
    assert len(watch.overlapping) > 1, "the requests did not run concurrently"
    by_salt: dict[str | None, set[int]] = {}
    for rid, _ in jobs:
        s = watch.of(rid)
        by_salt.setdefault(s.extra.cache_salt, set()).update(s.hit_blocks)
    for salt in salts:
        # one of the two requests of a salt hit the other's blocks (all 4 full blocks)
        assert len(by_salt[salt]) == 4, by_salt
    for i, a in enumerate(salts):
        for b in salts[i + 1 :]:
            assert not by_salt[a] & by_salt[b]
    # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    assert sorted(cached(o) for o in outs) == [0] * 4 + [256] * 4


# ---------------------------------------------------------------------------- per-key isolation
KEY_A = "sk-alpha-0f3c9e1d-SECRET"
KEY_B = "sk-bravo-77a2b4c8-SECRET"


def test_isolated_api_keys_never_share_blocks_and_salts_are_hmacs(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch, http_micro_model: Any
) -> None:
    server = make_server(server__api_keys=[KEY_A, KEY_B], server__isolate_cache_per_api_key=True)
    tenant_salt = server.state.api_keys.tenant_salt
    scheduler = server.engine.scheduler
    events: list[KVCacheEvent] = []
    scheduler.pool.subscribe(events.append)  # the engine is idle: no step runs concurrently
    salts_added: list[str | None] = []
    add_request = scheduler.add_request

    def recording_add_request(*args: Any, **kwargs: Any) -> Any:
        salts_added.append(kwargs.get("cache_salt"))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(scheduler, "add_request", recording_add_request)
    watch = BlockWatch(server, monkeypatch)
    prompt = unique_text("per-key", 300)
    hit = 256  # 300 tokens, 4 blocks hit (cpu backend): min(4 * 64, 300 - 1) = 256
    plan = [
        ("key-a1", KEY_A, {}, 0),
        ("key-b1", KEY_B, {}, 0),
        ("key-a2", KEY_A, {}, hit),
        ("key-b2", KEY_B, {}, hit),
        ("key-a-s1", KEY_A, {"cache_salt": "shared"}, 0),
        ("key-b-s1", KEY_B, {"cache_salt": "shared"}, 0),
        ("key-b-s2", KEY_B, {"cache_salt": "shared"}, hit),
        # a client cannot name another tenant's derived salt to reach its cache
        ("key-b-forged", KEY_B, {"cache_salt": f"{tenant_salt(KEY_A)}:"}, 0),
    ]
    for rid, key, extra, want in plan:
        out = complete(server, rid, prompt, api_key=key, **extra)
        assert cached(out) == want, rid
        assert_matches_oracle(http_micro_model, prompt, out)
    # concurrently as well
    slow_down(monkeypatch, server, 0.005)
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(complete, server, f"key-conc-{i}", prompt, api_key=key)
            for i, key in enumerate([KEY_A, KEY_B, KEY_A, KEY_B])
        ]
        assert {cached(f.result(timeout=120)) for f in futures} == {hit}
    finish(server, watch)

    blocks_a = {b for r, s in watch.requests.items() if _key_of(r) == "a" for b in s.hit_blocks}
    blocks_b = {b for r, s in watch.requests.items() if _key_of(r) == "b" for b in s.hit_blocks}
    assert blocks_a and blocks_b and not blocks_a & blocks_b
    assert watch.of("key-b1").num_hit_blocks == 0
    assert watch.of("key-b-forged").num_hit_blocks == 0

    # The salt the scheduler sees: the key's HMAC salt, then the client's salt; never a key.
    salt_a, salt_b = tenant_salt(KEY_A), tenant_salt(KEY_B)
    assert re.fullmatch("[0-9a-f]{64}", salt_a) and re.fullmatch("[0-9a-f]{64}", salt_b)
    assert salt_a != salt_b and tenant_salt(KEY_A) == salt_a  # per key, stable
    assert salt_a != hashlib.sha256(KEY_A.encode()).hexdigest()  # keyed, not a plain digest
    assert watch.of("key-a1").extra.cache_salt == f"{salt_a}:"
    assert watch.of("key-b-s1").extra.cache_salt == f"{salt_b}:shared"
    assert len(salts_added) == len(plan) + 4
    seen_salts = [s.extra.cache_salt for s in watch.requests.values()]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored, "no KV events were reported"
    texts = [str(s) for s in salts_added + seen_salts] + [repr(e) for e in events]
    texts += [e.extra_keys.encoded.decode("utf-8", "replace") for e in stored]
    for key in (KEY_A, KEY_B):
        for fragment in (key, key.removeprefix("sk-"), key[-12:]):
            assert not any(fragment in text for text in texts), fragment
    assert {e.extra_keys.cache_salt for e in stored} <= {
        f"{salt_a}:",
        f"{salt_b}:",
        f"{salt_b}:shared",
        f"{salt_a}:shared",
        f"{salt_b}:{salt_a}:",
    }


def _key_of(engine_request_id: str) -> str | None:
    for tag in ("a", "b"):
        if engine_request_id.startswith(f"key-{tag}"):
            return tag
    if engine_request_id.startswith("key-conc-"):
        return "a" if int(engine_request_id.split("-")[2]) % 2 == 0 else "b"
    return None


# ------------------------------------------------------------------------- constant-time auth
def test_api_keys_are_compared_in_constant_time_against_every_key(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check of an Authorization header calls hmac.compare_digest once per configured key,
    whichever key (if any) matches: no early exit, no plain ``==``."""
    import hmac

    import spyre_server.api.auth as auth

    keys = ["k-one", "k-two-is-much-longer-0123456789", "k-3"]
    server = make_server(server__api_keys=keys)
    calls: list[tuple[bytes, bytes]] = []
    lock = threading.Lock()

    def counting_compare(a: Any, b: Any) -> bool:
        with lock:
            calls.append((bytes(a), bytes(b)))
        return hmac.compare_digest(a, b)

    monkeypatch.setattr(
        auth, "hmac", SimpleNamespace(compare_digest=counting_compare, new=hmac.new)
    )
    configured = sorted(k.encode() for k in keys)
    presented: list[tuple[str | None, int]] = [
        (None, 401),
        ("Bearer nope", 401),
        ("Bearer k-on", 401),  # a prefix of a key
        ("Bearer k-one-and-more", 401),
        ("Basic k-one", 401),  # the right token under the wrong scheme: still compared
        *[(f"Bearer {k}", 200) for k in keys],
    ]
    requests = [
        ("GET", "/v1/models", None),
        ("POST", COMPLETIONS, {"prompt": "x", "max_tokens": 1}),
    ]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for (authorization, status), (method, path, body) in itertools.product(presented, requests):
            calls.clear()
            headers = {} if authorization is None else {"Authorization": authorization}
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == status, (authorization, path, response.text)
            token = (authorization or "").partition(" ")[2].strip().encode()
            # one group of len(keys) comparisons per check (the middleware, then the handler)
            assert calls, "hmac.compare_digest was not used"
            assert len(calls) % len(keys) == 0, calls
            for i in range(0, len(calls), len(keys)):
                group = calls[i : i + len(keys)]
                assert sorted(b for _, b in group) == configured, group
                assert {a for a, _ in group} == {token}, group


def test_per_key_salts_are_keyed_by_a_deployment_secret() -> None:
    """Without cache.hash_seed the HMAC key is random per process (like the hash root), so a salt
    seen in KV events cannot be checked against guessed API keys; with a seed, replicas that
    share hashes derive the same salts, and another seed gives other salts."""
    from spyre_server.api.auth import APIKeys, salt_secret

    def salt(secret: bytes) -> str:
        return APIKeys([KEY_A], secret).tenant_salt(KEY_A)

    assert salt(salt_secret(None)) != salt(salt_secret(None))
    assert salt(salt_secret(7)) == salt(salt_secret(7)) == salt(salt_secret("7"))
    assert salt(salt_secret(7)) != salt(salt_secret(8))
    assert len(salt_secret(None)) == len(salt_secret("replica-seed")) == 32
