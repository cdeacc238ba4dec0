"""Where does vllm-router's ``kv_aware`` send a prefix's second request while the replica that
got the first one is still computing it?

Three ``spyre-server serve`` replicas (the default model, as ``router_cluster.py`` starts them)
behind ``vllm-router --policy kv_aware`` with one static KV-event source each, and an independent
ZMQ subscriber on every replica's events. Each trial sends a fresh 512-token prefix plus 64 tokens
(``--first-max-tokens`` generated, so that it runs for a while), then a second prompt with the
same prefix, either ``--gap`` seconds later (the first still running) or after the first finished.
Printed per trial: the replica of each request, the second's ``cached_tokens``, and how many
``BlockStored`` events the observer had received from the first's replica before the second was
sent (so whether the router could have known). A last kind of trial sends the first request to a
replica directly, bypassing the router, so that only the KV events can tell the router where it is:

    .venv/bin/python bench/router_inflight.py --trials 3

Needs ``vllm-router`` (in the dev extras).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import threading
import time
from typing import Any

import httpx
import msgpack
import zmq
from router_cluster import BIN, cache_counters, free_port, model_name, start_replicas, wait_ready

PREFIX_TOKENS, SUFFIX_TOKENS = 512, 64


class StoredCounter:
    """Counts ``BlockStored`` events per replica as a subscriber receives them, with times."""

    def __init__(self, endpoints: list[str]) -> None:
        self.received: list[list[tuple[float, int]]] = [[] for _ in endpoints]
        for replica, endpoint in enumerate(endpoints):
            threading.Thread(target=self._listen, args=(replica, endpoint), daemon=True).start()

    def _listen(self, replica: int, endpoint: str) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        while True:
            _, events, _ = msgpack.unpackb(sock.recv_multipart()[-1])
            stored = sum(1 for event in events if event["type"] == "BlockStored")
            if stored:
                self.received[replica].append((time.monotonic(), stored))

    def before(self, replica: int, moment: float) -> int:
        return sum(n for t, n in self.received[replica] if t < moment)


def complete(base: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body | {"temperature": 0}, timeout=300)
    response.raise_for_status()
    return response.json()["usage"]  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials of each kind")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between the two sends")
    parser.add_argument("--first-max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    args = parser.parse_args()
    replicas = start_replicas(3, None, args.threads)
    urls = [url for url, _, _ in replicas]
    name = model_name(urls[0])
    cmd = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port := free_port())]
    cmd += ["--policy", "kv_aware", "--worker-urls", *urls]
    cmd += ["--kv-event-block-size", "64", "--kv-event-model", name]
    for url, events, _ in replicas:
        cmd += ["--kv-event-source", f"{url}={events}"]
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    stored = StoredCounter([events for _, events, _ in replicas])
    rng = random.Random(0)
    try:
        wait_ready(base, router, 120)
        time.sleep(1)  # the router's and the observer's subscriptions join
        kinds = ["overlapped"] * args.trials + ["after"] * args.trials + ["direct"] * args.trials
        for trial, kind in enumerate(kinds):
            prefix = [rng.randrange(100, 40_000) for _ in range(PREFIX_TOKENS)]
            first, second = (
                prefix + [rng.randrange(100, 40_000) for _ in range(SUFFIX_TOKENS)] for _ in "ab"
            )
            start = [cache_counters(url)[0] for url in urls]
            target = urls[trial % len(urls)] if kind == "direct" else base
            worker = threading.Thread(
                target=complete, args=(target, name, first, args.first_max_tokens)
            )
            worker.start()
            if kind == "overlapped":
                time.sleep(args.gap)
            else:
                worker.join()
                time.sleep(0.2)  # the finished request's last events reach the subscribers
            first_on = [i for i, url in enumerate(urls) if cache_counters(url)[0] > start[i]]
            sent = time.monotonic()
            known = {i: stored.before(i, sent) for i in first_on}
            middle = [cache_counters(url)[0] for url in urls]
            cached = complete(base, name, second, 4)["prompt_tokens_details"]["cached_tokens"]
            worker.join()
            second_on = [i for i, url in enumerate(urls) if cache_counters(url)[0] > middle[i]]
            when = {
                "overlapped": f"{args.gap} s after the first",
                "after": "after the first finished",
                "direct": "after the first (sent to a replica directly) finished",
            }[kind]
            print(
                f"second sent {when}: first on replica {first_on}, second on {second_on}, "
                f"second's cached_tokens {cached}; BlockStored received from the first's replica "
                f"before the second was sent (cumulative): {known}",
                flush=True,
            )
    finally:
        router.terminate()
        router.wait(30)
        for _, _, process in replicas:
            process.terminate()
        for _, _, process in replicas:
            process.wait(60)


if __name__ == "__main__":
    main()
