"""Issue 12's shared-prefix workload against any OpenAI-compatible server, and the ratios between
servers measured one after another on the same box.

The prompts are token ids (every peer accepts them, so no tokenizer difference can enter):

- ``cold TTFT``: a new 1,536-token prefix + 64 new tokens, one request, 1 token out;
- ``warm TTFT``: the same prefix with 64 other tokens (the prefix is now cached);
- ``burst cold``: 8 concurrent requests on one new prefix, each with its own 64 tokens, 16 out
  (``ignore_eos``): wall time from sending to the last token;
- ``burst cached``: 8 more on the now-cached prefix.

Every cold measurement uses a prefix never sent before (no cache reset is needed, so the script
works against any server). TTFTs are medians of ``--reps`` rounds after one warm-up round; bursts
are medians of ``--reps`` rounds too. Given several servers (repeat ``--base-url``, ``--label``
and ``--output``), it alternates rounds between them: a before/after pair measured so is not at
the mercy of the box's drift between runs minutes apart.

    python bench/side_by_side.py measure --base-url http://127.0.0.1:8021 --label spyre-server \\
        --output spyre.json
    python bench/side_by_side.py compare spyre.json llama.json vllm.json

``compare`` prints the four columns for each result and the ratios of the first (ours) over
each other one. ``bench/peers/side_by_side.sh`` starts each server in turn and runs both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import shared_prefix

from spyre_server.benchmark.runner import RunOutcome
from spyre_server.benchmark.tokenizer import load_tokenizer, ordinary_token_ids

PREFIX_LEN = 1536
SUFFIX_LEN = 64
BURST = 8
BURST_OUTPUT_LEN = 16
COLUMNS = ("cold_ttft_s", "warm_ttft_s", "burst_cold_s", "burst_cached_s")
HEADERS = ("cold TTFT", "warm TTFT", "burst of 8, cold", "burst of 8, cached")
# The targets: which peer each column is held against, and the absolute limits.
TARGET_PEER = {
    "cold_ttft_s": "llama",
    "warm_ttft_s": "llama",
    "burst_cold_s": "vllm",
    "burst_cached_s": "vllm",
}
ABSOLUTE_TARGET_S = {"burst_cold_s": 6.0, "burst_cached_s": 4.0}


@dataclass(slots=True)
class Result:
    label: str
    base_url: str
    model: str
    cold_ttft_s: float
    warm_ttft_s: float
    burst_cold_s: float
    burst_cached_s: float
    rounds: list[dict[str, float]]
    cached_tokens: dict[str, int | None]
    """``cached_tokens`` the server reported (summed over a burst) in the last round."""


class Client(shared_prefix.Client):
    def run(self, prompts: list[tuple[int, ...]], output_len: int) -> RunOutcome:
        """As shared_prefix's, and every request must produce all its tokens (``ignore_eos``)."""
        outcome = super().run(prompts, output_len)
        produced = sum(r.completion.num_output_tokens for r in outcome.results)
        if produced != len(prompts) * output_len:
            raise SystemExit(f"expected {len(prompts) * output_len} tokens out, got {produced}")
        return outcome

    def burst(self, prefix: tuple[int, ...]) -> tuple[float, int | None]:
        """Wall time of BURST concurrent requests on ``prefix``, and their summed cached tokens."""
        start = time.perf_counter()
        outcome = self.run(
            [prefix + self.tokens(SUFFIX_LEN) for _ in range(BURST)], BURST_OUTPUT_LEN
        )
        wall = time.perf_counter() - start
        cached = [r.completion.num_cached_tokens for r in outcome.results]
        return wall, None if None in cached else sum(c or 0 for c in cached)


def one_round(client: Client) -> tuple[dict[str, float], dict[str, int | None]]:
    """The four measurements on new prefixes, and the cached tokens each reported."""
    cached: dict[str, int | None] = {}
    prefix = client.tokens(PREFIX_LEN)
    cold, cached["cold_ttft"] = client.ttft(prefix + client.tokens(SUFFIX_LEN))
    warm, cached["warm_ttft"] = client.ttft(prefix + client.tokens(SUFFIX_LEN))
    burst_prefix = client.tokens(PREFIX_LEN)
    burst_cold, cached["burst_cold"] = client.burst(burst_prefix)
    burst_cached, cached["burst_cached"] = client.burst(burst_prefix)
    return dict(zip(COLUMNS, (cold, warm, burst_cold, burst_cached), strict=True)), cached


def measure(servers: list[tuple[Client, str]], reps: int) -> list[Result]:
    """``reps`` rounds per server after one warm-up round each. With several servers (all up at
    once, only one driven at a time) the rounds alternate between them, the order reversed every
    round, so that the box's drift over minutes falls on each alike."""
    rounds: dict[str, list[dict[str, float]]] = {label: [] for _, label in servers}
    cached: dict[str, dict[str, int | None]] = {}
    for index in range(reps + 1):  # round 0 warms the servers up and is not counted
        for client, label in servers if index % 2 == 0 else servers[::-1]:
            row, cached[label] = one_round(client)
            name = f"{label}: " if len(servers) > 1 else ""
            print(
                f"  {name}round {index}{' (warm-up)' if index == 0 else ''}: "
                + ", ".join(f"{h} {row[c]:.3f} s" for h, c in zip(HEADERS, COLUMNS, strict=True)),
                flush=True,
            )
            if index > 0:
                rounds[label].append(row)
    results = []
    for client, label in servers:
        medians = {c: statistics.median(r[c] for r in rounds[label]) for c in COLUMNS}
        results.append(
            Result(
                label,
                client.base_url,
                client.model,
                **medians,
                rounds=rounds[label],
                cached_tokens=cached[label],
            )
        )
    return results


def compare(results: list[Result], *, absolute_targets: bool = True) -> str:
    """The four columns per server, then ours (the first) over each peer, and (with
    ``absolute_targets``) ours against the default model's absolute targets."""
    lines = [
        "| server | " + " | ".join(HEADERS) + " |",
        "|---|" + "---|" * len(HEADERS),
    ]
    for r in results:
        lines.append(
            f"| {r.label} | " + " | ".join(f"{getattr(r, c):.3f} s" for c in COLUMNS) + " |"
        )
    ours = results[0]
    for peer in results[1:]:
        ratios = []
        for c in COLUMNS:
            ratio = getattr(ours, c) / getattr(peer, c)
            target = TARGET_PEER[c] in peer.label.lower()
            verdict = f" ({'PASS' if ratio <= 1.0 else 'FAIL'})" if target else ""
            ratios.append(f"{ratio:.2f}x{verdict}")
        lines.append(f"| {ours.label} / {peer.label} | " + " | ".join(ratios) + " |")
    absolute = [
        f"{h} {getattr(ours, c):.2f} s (< {ABSOLUTE_TARGET_S[c]:.0f} s: "
        f"{'PASS' if getattr(ours, c) < ABSOLUTE_TARGET_S[c] else 'FAIL'})"
        for h, c in zip(HEADERS, COLUMNS, strict=True)
        if c in ABSOLUTE_TARGET_S
    ]
    if absolute_targets:
        lines.append("")
        lines.append(f"{ours.label}: " + "; ".join(absolute))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "measure", help="run the workload against a server, or several in alternate rounds"
    )
    run.add_argument("--base-url", required=True, action="append", help="repeat for several")
    run.add_argument("--label", required=True, action="append", help="each server's name")
    run.add_argument("--output", type=Path, required=True, action="append", help="JSON each")
    run.add_argument("--tokenizer", type=Path, default=None)
    run.add_argument("--reps", type=int, default=3)
    run.add_argument("--seed", type=int, default=0)
    cmp = sub.add_parser("compare", help="tabulate results; the first file is ours")
    cmp.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "measure":
        if not len(args.base_url) == len(args.label) == len(args.output):
            parser.error("give each --base-url a --label and an --output")
        vocab = ordinary_token_ids(load_tokenizer(args.tokenizer))
        servers = []
        for url, label in zip(args.base_url, args.label, strict=True):
            client = Client(url.rstrip("/"), vocab, args.seed)
            print(f"== {label} at {client.base_url} (model {client.model}) ==", flush=True)
            servers.append((client, label))
        results = measure(servers, args.reps)
        for result, output in zip(results, args.output, strict=True):
            output.write_text(json.dumps(asdict(result), indent=2) + "\n")
        print(compare(results))
    else:
        results = [Result(**json.loads(p.read_text())) for p in args.results]
        print(compare(results))


if __name__ == "__main__":
    main()
