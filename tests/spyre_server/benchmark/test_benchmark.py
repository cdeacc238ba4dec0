"""``spyre-server bench`` (spyre_server/benchmark/): workloads, statistics, arrivals and /metrics
parsing as units; then whole runs through ``spyre_server.entrypoints.cli.main`` against real servers: the micro
model behind uvicorn (cache hits checked against its own counters and the chunk-grid rule) and a
stub server the benchmark does not know (no /metrics, no cached_tokens), which records what it
receives (request bodies, arrival times, requests in flight)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import shutil
import socket
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spyre_server.benchmark import workloads
from spyre_server.benchmark.client import Completion
from spyre_server.benchmark.errors import BenchError
from spyre_server.benchmark.metrics import CacheDelta, parse_cache_counters
from spyre_server.benchmark.report import format_table, percentile, summarize
from spyre_server.benchmark.runner import (
    SKIPPED,
    RequestResult,
    RunOutcome,
    RunSettings,
    arrival_offsets,
    run_benchmark,
)
from spyre_server.benchmark.tokenizer import load_tokenizer, ordinary_token_ids
from spyre_server.entrypoints import cli
from tests.spyre_server.benchmark.helpers import (
    STUB_MODEL,
    StubLog,
    stub_app,
    write_byte_tokenizer,
)
from tests.spyre_server.http.helpers import (
    BLOCK,
    MAX_MODEL_LEN,
    MODEL_NAME,
    VOCAB_SIZE,
    Server,
    delta,
    expected_cached_tokens,
    micro_config,
    micro_loaded,
    start_server,
)

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))


@pytest.fixture(scope="module")
def byte_tokenizer(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def micro(micro_model: Any, torch_one_thread: None) -> Iterator[Callable[..., Server]]:
    """``micro(**config_overrides)`` -> a fresh micro server (chunk 128, block 64, vocab 256)."""
    from spyre_server.entrypoints.serve import build_app

    servers: list[Server] = []

    def make(**overrides: Any) -> Server:
        server = start_server(build_app(micro_config(**overrides), micro_loaded(micro_model)))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def stub() -> Iterator[Callable[..., tuple[Server, StubLog]]]:
    """``stub(**stub_app_kwargs)`` -> (running stub server, its log)."""
    servers: list[Server] = []

    def make(**kwargs: Any) -> tuple[Server, StubLog]:
        log = StubLog()
        server = start_server(stub_app(log, **kwargs))
        servers.append(server)
        return server, log

    yield make
    for server in servers:
        server.close()


def bench(
    capsys: pytest.CaptureFixture[str], *argv: str, progress: bool = False
) -> tuple[int, str, str]:
    """``spyre-server bench ARGV`` in this process: (exit code, stdout, stderr)."""
    code = cli.main(["bench", *argv, *([] if progress else ["--disable-tqdm"])])
    out, err = capsys.readouterr()
    return code, out, err


def table_value(table: str, label: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith(label + ":")]
    assert len(lines) == 1, (label, table)
    return lines[0].split(":", 1)[1].strip()


# ------------------------------------------------------------------------------------ workloads
VOCAB = list(range(10, 200))


def test_prefix_repetition_exact_lengths_and_prefix_sharing() -> None:
    convs = workloads.prefix_repetition(
        VOCAB, 3, num_prompts=10, prefix_len=70, suffix_len=30, num_prefixes=3, output_len=5
    )
    assert len(convs) == 10
    assert Counter(c.group for c in convs) == {0: 4, 1: 3, 2: 3}  # spread evenly
    prompts = [c.turns[0] for c in convs]
    for c in convs:
        assert c.num_turns == 1 and c.output_len == 5
        assert len(c.turns[0]) == 100
        assert set(c.turns[0]) <= set(VOCAB)
    for a in convs:
        for b in convs:
            if a is not b:
                shared = common_prefix_len(a.turns[0], b.turns[0])
                assert shared == (70 if a.group == b.group else 0), (a.group, b.group)
    assert len({p[70:] for p in prompts}) == 10  # every suffix is its own
    # shuffled with the seed: deterministic, but not the round-robin construction order
    assert [c.group for c in convs] != [i % 3 for i in range(10)]
    again = workloads.prefix_repetition(
        VOCAB, 3, num_prompts=10, prefix_len=70, suffix_len=30, num_prefixes=3, output_len=5
    )
    assert again == convs
    other = workloads.prefix_repetition(
        VOCAB, 4, num_prompts=10, prefix_len=70, suffix_len=30, num_prefixes=3, output_len=5
    )
    assert {c.turns for c in other}.isdisjoint({c.turns for c in convs})


def test_prefix_repetition_without_prefix() -> None:
    convs = workloads.prefix_repetition(
        VOCAB, 0, num_prompts=4, prefix_len=0, suffix_len=9, num_prefixes=2, output_len=1
    )
    assert [len(c.turns[0]) for c in convs] == [9] * 4
    with pytest.raises(ValueError):
        workloads.prefix_repetition(
            VOCAB, 0, num_prompts=4, prefix_len=0, suffix_len=0, num_prefixes=2, output_len=1
        )


def test_shared_system_prompt_groups() -> None:
    convs = workloads.shared_system_prompt(
        VOCAB,
        1,
        num_groups=3,
        prompts_per_group=4,
        system_prompt_len=50,
        question_len=20,
        output_len=7,
    )
    assert len(convs) == 12
    assert Counter(c.group for c in convs) == {0: 4, 1: 4, 2: 4}
    assert all(len(c.turns[0]) == 70 and c.output_len == 7 for c in convs)
    for a in convs:
        for b in convs:
            if a is not b:
                shared = common_prefix_len(a.turns[0], b.turns[0])
                assert shared == (50 if a.group == b.group else 0)
    assert [c.group for c in convs] != sorted(c.group for c in convs)


def test_multi_turn_conversations() -> None:
    convs = workloads.multi_turn(
        VOCAB, 2, num_conversations=3, num_turns=4, turn_len=16, output_len=3
    )
    assert [c.group for c in convs] == [0, 1, 2]
    assert all(c.num_turns == 4 and c.output_len == 3 for c in convs)
    turns = [t for c in convs for t in c.turns]
    assert all(len(t) == 16 and set(t) <= set(VOCAB) for t in turns)
    assert len(set(turns)) == 12


def test_tokenizer_ordinary_ids_exclude_special_tokens(byte_tokenizer: Any) -> None:
    assert len(byte_tokenizer) == VOCAB_SIZE + 2  # 256 bytes + eos + a chat marker
    assert ordinary_token_ids(byte_tokenizer) == list(range(VOCAB_SIZE))
    text = "héllo <|endoftext|>"
    assert byte_tokenizer.encode(text, add_special_tokens=False)[:7] == list(b"h\xc3\xa9llo ")


def test_load_tokenizer_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BenchError, match="no such folder"):
        load_tokenizer(tmp_path / "missing")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(BenchError, match="pass --tokenizer PATH") as info:
        load_tokenizer(None)
    assert str(tmp_path / "spyre-server" / "models" / "SmolLM2-135M-Instruct") in str(info.value)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(BenchError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path / "broken")


# ------------------------------------------------------------------------------ statistics, report
@pytest.mark.parametrize("size", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy(size: int) -> None:
    rng = random.Random(size)
    values = [rng.expovariate(3.0) for _ in range(size)]
    for p in (0, 1, 10, 50, 90, 99, 99.9, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), abs=1e-12)
    assert percentile([], 50) is None
    assert percentile(values, 50) == pytest.approx(statistics.median(values))


def _result(
    conversation: int,
    prompt_len: int,
    *,
    ttft: float | None = None,
    itl: Sequence[float] = (),
    latency: float | None = None,
    output: int = 0,
    cached: int | None = None,
    error: str | None = None,
) -> RequestResult:
    completion = Completion(
        ok=error is None,
        error=error,
        ttft_s=ttft,
        itl_s=list(itl),
        latency_s=latency,
        num_output_tokens=output,
        num_cached_tokens=cached,
    )
    return RequestResult(conversation, 0, [1] * prompt_len, 4, 0.0, 0.0, completion)


def test_summarize_against_independent_statistics() -> None:
    ok = [
        _result(0, 10, ttft=0.1, itl=[0.01, 0.02], latency=0.5, output=3, cached=4),
        _result(1, 20, ttft=0.3, itl=[0.03], latency=0.9, output=2, cached=None),
        _result(2, 30, ttft=0.2, itl=[0.05, 0.04, 0.06], latency=0.7, output=4, cached=6),
    ]
    errors = [f"HTTP 400: e{i % 7}" for i in range(9)]
    failed = [_result(3 + i, 99, error=e) for i, e in enumerate(errors)]
    settings = RunSettings(base_url="http://x", model="m", max_concurrency=3, seed=5)
    outcome = RunOutcome(ok[:2] + failed + ok[2:], 2.5, CacheDelta(queries=60, hits=15))
    s = summarize(outcome, settings, "prefix-repetition", {"num_prompts": 12})

    ttft, latency = [0.1, 0.3, 0.2], [0.5, 0.9, 0.7]
    itl = [0.01, 0.02, 0.03, 0.05, 0.04, 0.06]
    assert s["num_requests"] == 12 and s["num_completed"] == 3 and s["num_failed"] == 9
    assert s["errors"] == [
        {"message": f"HTTP 400: e{i}", "count": 2 if i < 2 else 1} for i in range(5)
    ]
    assert s["duration_s"] == 2.5
    assert s["request_throughput"] == pytest.approx(3 / 2.5)
    assert s["output_throughput"] == pytest.approx(9 / 2.5)
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 9
    assert s["mean_ttft_ms"] == pytest.approx(statistics.mean(ttft) * 1000)
    assert s["p50_ttft_ms"] == pytest.approx(statistics.median(ttft) * 1000)
    for p in (90, 99):
        assert s[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttft, p) * 1000)
        assert s[f"p{p}_e2e_latency_ms"] == pytest.approx(np.percentile(latency, p) * 1000)
    assert s["p50_e2e_latency_ms"] == pytest.approx(700.0)
    assert s["mean_itl_ms"] == pytest.approx(statistics.mean(itl) * 1000)
    assert s["p50_itl_ms"] == pytest.approx(statistics.median(itl) * 1000)
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99) * 1000)
    assert s["prefix_cache_hit_rate"] == 0.25
    assert (s["prefix_cache_hits"], s["prefix_cache_queries"]) == (15, 60)
    assert s["cached_tokens"] == 10  # responses without the field do not count
    assert s["request_rate"] == "inf" and s["max_concurrency"] == 3 and s["seed"] == 5
    json.dumps(s, allow_nan=False)

    table = format_table(s)
    assert table_value(table, "Successful requests") == "3"
    assert table_value(table, "Failed requests") == "9"
    assert table_value(table, "Hit rate (server /metrics)") == "25.00%"
    assert table_value(table, "P50 TTFT (ms)") == "200.00"
    assert "  (2x) HTTP 400: e0" in table.splitlines()


def test_summarize_without_cache_information_or_completions() -> None:
    settings = RunSettings(base_url="http://x", model="m", request_rate=2.0)
    outcome = RunOutcome([_result(0, 5, error="boom")], 1.0, None)
    s = summarize(outcome, settings, "multi-turn", {})
    assert s["prefix_cache_hit_rate"] is None and s["prefix_cache_hits"] is None
    assert s["cached_tokens"] is None and s["p50_ttft_ms"] is None and s["mean_itl_ms"] is None
    assert s["request_rate"] == 2.0
    table = format_table(s)
    assert table_value(table, "Hit rate (server /metrics)") == "n/a"
    assert table_value(table, "P99 E2E (ms)") == "n/a"
    # no queried tokens in the run: the rate is unknown, not a division by zero
    assert CacheDelta(queries=0, hits=0).hit_rate is None


# ------------------------------------------------------------------------------------- arrivals
def test_poisson_arrivals_are_seeded_exponential_gaps() -> None:
    rate = 50.0
    offsets = arrival_offsets(4000, rate, seed=1)
    assert offsets == arrival_offsets(4000, rate, seed=1)
    assert offsets != arrival_offsets(4000, rate, seed=2)
    assert offsets[0] == 0.0
    gaps = np.diff(offsets)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.07)  # exponential: std == mean
    # P(gap < median) = 1/2 with median = ln 2 / rate; P(gap > 3 / rate) = e^-3
    assert (gaps < math.log(2) / rate).mean() == pytest.approx(0.5, abs=0.03)
    assert (gaps > 3 / rate).mean() == pytest.approx(math.exp(-3), abs=0.01)
    assert arrival_offsets(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=1)


# ---------------------------------------------------------------------------- /metrics parsing
def _exposition(labelled: bool) -> str:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name"] if labelled else []
    hits = Counter("vllm:prefix_cache_hits", "h", labels, registry=registry)
    queries = Counter("vllm:prefix_cache_queries", "q", labels, registry=registry)
    if labelled:
        hits.labels("a").inc(5)
        queries.labels("a").inc(10)
        hits.labels("b").inc(7)
        queries.labels("b").inc(20)
    else:
        hits.inc(3)
        queries.inc(4)
    return generate_latest(registry).decode()


def test_parse_cache_counters() -> None:
    labelled = _exposition(labelled=True)
    assert "vllm:prefix_cache_hits_created" in labelled  # must not be summed in
    a = parse_cache_counters(labelled, "a")
    assert a is not None and (a.queries, a.hits) == (10, 5)
    b = parse_cache_counters(labelled, "b")
    assert b is not None and (b.queries, b.hits) == (20, 7)
    c = parse_cache_counters(labelled, "c")  # labelled, but not for this model: nothing counted
    assert c is not None and (c.queries, c.hits) == (0, 0)
    plain = parse_cache_counters(_exposition(labelled=False), "anything")
    assert plain is not None and (plain.queries, plain.hits) == (4, 3)
    assert parse_cache_counters("process_cpu_seconds_total 1.0\n", "a") is None
    only_hits = "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 3\n"
    assert parse_cache_counters(only_hits, "a") is None
    assert parse_cache_counters("<html>not found</html>", "a") is None


# ------------------------------------------------------------------------------ import hygiene
def test_the_cli_and_the_benchmark_stay_light(tokenizer_dir: Path) -> None:
    """``spyre-server serve`` does not load the benchmark's runtime; the benchmark (tokenizer
    included) never imports torch, fms or the scheduler."""
    code = f"""
import sys
from pathlib import Path
import spyre_server.entrypoints.cli
heavy = ("httpx", "tqdm", "transformers", "spyre_server.benchmark.runner")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
from spyre_server.benchmark import cli, client, metrics, report, runner, tokenizer, workloads
tokenizer.ordinary_token_ids(tokenizer.load_tokenizer(Path({str(tokenizer_dir)!r})))
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fms", "scheduler", "kvcache"))
assert not bad, bad
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- CLI without a server
def test_help_lists_the_workloads_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("prefix-repetition", "shared-system-prompt", "multi-turn", "--max-concurrency"):
        assert text in out


def test_invalid_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = bench(capsys, "--turn-len", "5")
    assert code == 2 and out == ""
    assert err == (
        "spyre-server bench: error: --turn-len applies to the multi-turn workload only\n"
    )
    code, _, err = bench(capsys, "multi-turn", "--workload", "shared-system-prompt")
    assert code == 2 and "two workloads" in err
    code, _, err = bench(capsys, "shared-system-prompt", "--num-prompts", "3")
    assert code == 2 and "--num-prompts applies to the prefix-repetition workload only" in err
    code, _, err = bench(capsys, "--output", "/nonexistent-folder/r.json")
    assert code == 2 and "no such folder /nonexistent-folder" in err
    for argv in (["--request-rate", "0"], ["--max-concurrency", "0"], ["--output-len", "0"]):
        with pytest.raises(SystemExit) as info:
            bench(capsys, *argv)
        assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "warned"),
    [
        (["--num-prompts", "3", "--num-prefixes", "4"], True),
        (["--num-prompts", "4", "--num-prefixes", "4"], True),  # each prefix once: no repeat
        (["--num-prompts", "5", "--num-prefixes", "4"], False),
        (["--num-prompts", "3", "--num-prefixes", "4", "--prefix-len", "0"], False),  # no prefix
    ],
)
def test_prefix_repetition_without_repetition_warns(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    warned: bool,
) -> None:
    server, log = stub()
    code, _, err = bench(
        capsys,
        *("--base-url", server.url, "--tokenizer", str(tokenizer_dir)),
        *("--prefix-len", "4", "--suffix-len", "4", "--output-len", "1", *argv),
    )
    assert code == 0, err
    warning = (
        f"spyre-server bench: warning: --num-prompts {argv[1]} is not above --num-prefixes 4: "
        "every prompt gets a prefix of its own, so no prefix repeats and the prefix cache "
        "cannot hit\n"
    )
    assert (warning in err) == warned, err
    assert len(log.bodies) == int(argv[1])  # a warning, not a refusal


@pytest.mark.parametrize(
    ("workload", "argv"),
    [("shared-system-prompt", ["--prompts-per-group", "1"]), ("multi-turn", ["--num-turns", "1"])],
)
def test_other_workloads_without_repetition_warn(
    workload: str,
    argv: list[str],
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, _ = stub()
    code, _, err = bench(
        capsys,
        *(workload, "--base-url", server.url, "--tokenizer", str(tokenizer_dir), *argv),
        "--output-len",
        "1",
    )
    assert code == 0, err
    assert f"spyre-server bench: warning: {argv[0]} 1: " in err


def test_unreachable_server_fails_fast(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no default tokenizer either
    port = free_port()
    code, out, err = bench(capsys, "--base-url", f"http://127.0.0.1:{port}")
    assert code == 1 and out == ""
    assert err.startswith(f"spyre-server bench: error: cannot connect to http://127.0.0.1:{port}: ")
    assert "refused" in err.lower()
    assert err.count("\n") == 1


# ------------------------------------------------------------------- a server it does not know
def test_unknown_server_without_metrics(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, log = stub(token_delay=0.02)
    assert server.http().get("/metrics").status_code == 404
    out_file = tmp_path / "result.json"
    code, out, err = bench(
        capsys,
        "--base-url",
        f"{server.url}/v1/",
        "--tokenizer",
        str(tokenizer_dir),
        *("--num-prompts", "6", "--num-prefixes", "2", "--prefix-len", "8", "--suffix-len", "8"),
        *("--output-len", "5", "--output", str(out_file)),
        progress=True,
    )
    assert code == 0, out + err
    s = json.loads(out_file.read_text())
    assert s["model"] == STUB_MODEL  # the first id of /v1/models
    assert s["base_url"] == server.url
    assert s["num_completed"] == 6 and s["num_failed"] == 0 and s["errors"] == []
    assert s["prefix_cache_hit_rate"] is None and s["prefix_cache_queries"] is None
    assert s["cached_tokens"] is None
    assert s["total_input_tokens"] == 6 * 16 and s["total_output_tokens"] == 6 * 5
    # 5 chunks 20 ms apart: 4 gaps each, TTFT at least one delay
    assert s["p50_itl_ms"] >= 15 and s["p99_itl_ms"] >= s["p50_itl_ms"]
    assert s["p50_ttft_ms"] >= 15 and s["p50_e2e_latency_ms"] >= 5 * 15
    assert s["p50_ttft_ms"] <= s["p90_ttft_ms"] <= s["p99_ttft_ms"]
    assert table_value(out, "Hit rate (server /metrics)") == "n/a"
    assert table_value(out, "Cached prompt tokens (usage)") == "n/a"
    assert table_value(out, "Successful requests") == "6"
    assert "6/6" in err  # the progress bar, on stderr

    assert len(log.bodies) == 6
    for body, headers in zip(log.bodies, log.headers, strict=True):
        prompt = body.pop("prompt")
        assert len(prompt) == 16 and all(isinstance(t, int) and 0 <= t < 256 for t in prompt)
        assert body == {
            "model": STUB_MODEL,
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        assert "authorization" not in headers


def test_model_api_key_and_no_ignore_eos_are_sent(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, log = stub()
    code, _, err = bench(
        capsys,
        "--base-url",
        server.url,
        *("--tokenizer", str(tokenizer_dir), "--model", "other", "--api-key", "sk-123"),
        *("--no-ignore-eos", "--num-prompts", "2", "--prefix-len", "4", "--output-len", "2"),
    )
    assert code == 0, err
    assert [b["model"] for b in log.bodies] == ["other", "other"]
    assert all("ignore_eos" not in b for b in log.bodies)
    assert all(h["authorization"] == "Bearer sk-123" for h in log.headers)


def test_failed_requests_are_counted_not_fatal(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    byte_tokenizer: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fail(body: dict[str, Any]) -> str | None:
        return "even first token" if body["prompt"][0] % 2 == 0 else None

    server, _ = stub(fail=fail)
    convs = workloads.prefix_repetition(
        ordinary_token_ids(byte_tokenizer),
        11,
        num_prompts=12,
        prefix_len=0,
        suffix_len=6,
        num_prefixes=1,
        output_len=2,
    )
    num_failing = sum(c.turns[0][0] % 2 == 0 for c in convs)
    assert 0 < num_failing < 12
    out_file = tmp_path / "r.json"
    code, out, err = bench(
        capsys,
        *("--base-url", server.url, "--tokenizer", str(tokenizer_dir), "--seed", "11"),
        *("--num-prompts", "12", "--prefix-len", "0", "--suffix-len", "6", "--num-prefixes", "1"),
        *("--output-len", "2", "--output", str(out_file)),
    )
    assert code == 0, err
    s = json.loads(out_file.read_text())
    assert s["num_failed"] == num_failing and s["num_completed"] == 12 - num_failing
    assert s["errors"] == [{"message": "HTTP 400: even first token", "count": num_failing}]
    assert s["total_input_tokens"] == 6 * (12 - num_failing)
    assert f"  ({num_failing}x) HTTP 400: even first token" in out.splitlines()


def test_max_concurrency_limits_requests_in_flight(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--tokenizer", str(tokenizer_dir), "--num-prompts", "12", "--prefix-len", "4"]
    argv += ["--output-len", "10"]
    limited, limited_log = stub(token_delay=0.02)
    code, _, err = bench(capsys, "--base-url", limited.url, *argv, "--max-concurrency", "3")
    assert code == 0, err
    assert len(limited_log.bodies) == 12
    assert limited_log.max_in_flight == 3
    unlimited, unlimited_log = stub(token_delay=0.02)
    code, _, err = bench(capsys, "--base-url", unlimited.url, *argv)
    assert code == 0, err
    assert unlimited_log.max_in_flight == 12


def test_poisson_arrivals_reach_the_server_on_schedule(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    byte_tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, log = stub(token_delay=0.001)
    num, rate, seed = 12, 10.0, 7
    code, _, err = bench(
        capsys,
        *("--base-url", server.url, "--tokenizer", str(tokenizer_dir), "--seed", str(seed)),
        *("--request-rate", str(rate), "--num-prompts", str(num), "--prefix-len", "0"),
        *("--suffix-len", "8", "--output-len", "1"),
    )
    assert code == 0, err
    convs = workloads.prefix_repetition(
        ordinary_token_ids(byte_tokenizer),
        seed,
        num_prompts=num,
        prefix_len=0,
        suffix_len=8,
        num_prefixes=10,
        output_len=1,
    )
    index = {c.turns[0]: i for i, c in enumerate(convs)}
    arrived = {index[tuple(b["prompt"])]: t for b, t in zip(log.bodies, log.arrivals, strict=True)}
    assert sorted(arrived) == list(range(num))
    scheduled = arrival_offsets(num, rate, seed)
    assert scheduled[-1] > 0.5  # a schedule worth checking: gaps of 100 ms on average
    for i in range(num):
        assert arrived[i] - arrived[0] == pytest.approx(scheduled[i], abs=0.08), i


def test_multi_turn_history_through_the_cli(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    byte_tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The stub always answers the same text, so every turn's exact prompt is known."""
    server, log = stub(token_delay=0.001)
    code, _, err = bench(
        capsys,
        *("--workload", "multi-turn", "--base-url", server.url, "--tokenizer", str(tokenizer_dir)),
        *("--num-conversations", "2", "--num-turns", "3", "--turn-len", "10", "--output-len", "4"),
        "--max-concurrency",
        "1",
    )
    assert code == 0, err
    answer = byte_tokenizer.encode(" t0 t1 t2 t3", add_special_tokens=False)
    assert len(answer) == 12
    prompts = [b["prompt"] for b in log.bodies]
    # one conversation at a time: c0 t0, c0 t1, c0 t2, c1 t0, ...
    assert [len(p) for p in prompts] == [10, 10 + 12 + 10, 2 * (10 + 12) + 10] * 2
    for conv in (prompts[:3], prompts[3:]):
        for previous, current in itertools.pairwise(conv):
            assert current[: len(previous) + 12] == previous + answer


def test_models_endpoint_failure_and_default_tokenizer(
    stub: Callable[..., tuple[Server, StubLog]],
    tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    broken = FastAPI()

    @broken.get("/v1/models")
    async def models() -> Any:
        return JSONResponse({"error": {"message": "model registry down"}}, status_code=503)

    broken_server = start_server(broken)
    try:
        code, out, err = bench(capsys, "--base-url", broken_server.url)
    finally:
        broken_server.close()
    assert code == 1 and out == ""
    assert err == (
        f"spyre-server bench: error: GET {broken_server.url}/v1/models returned HTTP 503: "
        "model registry down\n"
    )

    server, log = stub()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = bench(capsys, "--base-url", server.url, "--num-prompts", "2")
    assert code == 2 and out == ""
    assert "pass --tokenizer PATH" in err and err.count("\n") == 1
    default = tmp_path / "spyre-server" / "models" / "SmolLM2-135M-Instruct"
    shutil.copytree(tokenizer_dir, default)
    code, _, err = bench(
        capsys, "--base-url", server.url, "--num-prompts", "2", "--output-len", "1"
    )
    assert code == 0, err
    assert len(log.bodies) == 2 and all(max(b["prompt"]) < 256 for b in log.bodies)


# ----------------------------------------------------------------------- the real micro server
def test_prefix_repetition_hits_match_the_server_counters(
    micro: Callable[..., Server],
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One prefix of 5 full blocks, 4 prompts of 384 tokens, one at a time: the first computes
    everything, each later one hits the 5 prefix blocks, none of whose positions the cpu
    backend computes."""
    server = micro()
    prefix_len, suffix_len, num_prompts, output_len = 5 * BLOCK, 64, 4, 4
    prompt_len = prefix_len + suffix_len
    per_hit = 320  # 384 tokens, 5 blocks hit (cpu backend): min(5 * 64, 384 - 1) = 320
    expected = (num_prompts - 1) * per_hit
    out_file = tmp_path / "r.json"
    before = server.metrics()
    code, out, err = bench(
        capsys,
        *("--base-url", server.url, "--tokenizer", str(tokenizer_dir), "--max-concurrency", "1"),
        *("--num-prompts", str(num_prompts), "--num-prefixes", "1"),
        *("--prefix-len", str(prefix_len), "--suffix-len", str(suffix_len)),
        *("--output-len", str(output_len), "--output", str(out_file)),
    )
    after = server.metrics()
    assert code == 0, err
    s = json.loads(out_file.read_text())
    assert s["model"] == MODEL_NAME
    assert s["num_completed"] == num_prompts and s["num_failed"] == 0
    assert s["cached_tokens"] == expected
    assert s["prefix_cache_hits"] == delta(after, before, "vllm:prefix_cache_hits_total")
    assert s["prefix_cache_hits"] == expected
    assert s["prefix_cache_queries"] == delta(after, before, "vllm:prefix_cache_queries_total")
    assert s["prefix_cache_queries"] == num_prompts * prompt_len
    assert s["prefix_cache_hit_rate"] == pytest.approx(expected / (num_prompts * prompt_len))
    assert s["total_input_tokens"] == num_prompts * prompt_len
    assert s["total_input_tokens"] == delta(after, before, "vllm:prompt_tokens_total")
    assert s["total_output_tokens"] == num_prompts * output_len
    assert s["total_output_tokens"] == delta(after, before, "vllm:generation_tokens_total")
    assert 0 < s["p50_ttft_ms"] <= s["p90_ttft_ms"] <= s["p99_ttft_ms"]
    assert s["p50_e2e_latency_ms"] >= s["p50_ttft_ms"] > 0
    assert s["request_throughput"] == pytest.approx(num_prompts / s["duration_s"])
    assert s["workload_options"] == {
        "num_prompts": num_prompts,
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "num_prefixes": 1,
        "output_len": output_len,
    }
    assert table_value(out, "Hit rate (server /metrics)") == f"{expected / (4 * prompt_len):.2%}"
    assert table_value(out, "Cached prompt tokens (usage)") == str(expected)
    assert table_value(out, "Hit / queried tokens (server)") == f"{expected} / {4 * prompt_len}"


def test_shared_system_prompt_hits_match_the_server(
    micro: Callable[..., Server],
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """2 groups x 3 prompts of 256 + 64 tokens, one at a time: the first prompt of each group
    misses, the others hit the 4 system-prompt blocks (256 positions not computed)."""
    server = micro()
    per_hit = 256  # 320 tokens, 4 blocks hit (cpu backend): min(4 * 64, 320 - 1) = 256
    out_file = tmp_path / "r.json"
    before = server.metrics()
    code, _, err = bench(
        capsys,
        "shared-system-prompt",
        *("--base-url", server.url, "--tokenizer", str(tokenizer_dir), "--max-concurrency", "1"),
        *("--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "256"),
        *("--question-len", "64", "--output-len", "2", "--output", str(out_file)),
    )
    after = server.metrics()
    assert code == 0, err
    s = json.loads(out_file.read_text())
    assert s["num_completed"] == 6
    assert s["cached_tokens"] == 2 * 2 * per_hit
    assert s["prefix_cache_hits"] == delta(after, before, "vllm:prefix_cache_hits_total")
    assert s["prefix_cache_hits"] == 2 * 2 * per_hit
    assert s["prefix_cache_hit_rate"] == pytest.approx(4 * per_hit / (6 * 320))


def test_multi_turn_resends_the_history_and_hits_it(
    micro: Callable[..., Server], byte_tokenizer: Any
) -> None:
    """Each turn = previous prompt + the previous answer re-encoded + a new turn; the previous
    prompt's full blocks are cached (the answer's maybe: random bytes re-encode differently)."""
    server = micro()
    convs = workloads.multi_turn(
        ordinary_token_ids(byte_tokenizer),
        5,
        num_conversations=2,
        num_turns=3,
        turn_len=100,
        output_len=8,
    )

    def encode(text: str) -> list[int]:
        return list(byte_tokenizer.encode(text, add_special_tokens=False))

    settings = RunSettings(
        base_url=server.url, model=MODEL_NAME, max_concurrency=2, show_progress=False
    )
    before = server.metrics()
    outcome = asyncio.run(run_benchmark(settings, convs, encode))
    after = server.metrics()
    assert len(outcome.results) == 6
    assert all(r.completion.ok for r in outcome.results), [
        r.completion.error for r in outcome.results
    ]
    for c, conv in enumerate(convs):
        turns = sorted((r for r in outcome.results if r.conversation == c), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        assert turns[0].prompt_ids == list(conv.turns[0])
        assert turns[0].completion.num_cached_tokens == 0
        for prev, cur in itertools.pairwise(turns):
            history = prev.prompt_ids + encode(prev.completion.text)
            assert cur.prompt_ids == history + list(conv.turns[cur.turn])
            assert cur.sent_s >= prev.sent_s + (prev.completion.latency_s or 0)
            cached = cur.completion.num_cached_tokens
            n = len(cur.prompt_ids)
            assert cached is not None
            assert expected_cached_tokens(n, len(prev.prompt_ids) // BLOCK) <= cached
            assert cached <= expected_cached_tokens(n, n // BLOCK)
        for r in turns:
            assert r.completion.num_prompt_tokens == len(r.prompt_ids) < MAX_MODEL_LEN
            assert r.completion.num_output_tokens == 8
    assert outcome.cache is not None
    total_cached = sum(r.completion.num_cached_tokens or 0 for r in outcome.results)
    assert total_cached > 0
    assert outcome.cache.hits == total_cached
    assert outcome.cache.hits == delta(after, before, "vllm:prefix_cache_hits_total")


def test_server_errors_and_api_keys(
    micro: Callable[..., Server],
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = micro(server__api_keys=["secret"])
    base = ["--base-url", server.url, "--tokenizer", str(tokenizer_dir)]
    code, out, err = bench(capsys, *base)
    assert code == 1 and out == ""
    assert err.startswith(
        f"spyre-server bench: error: GET {server.url}/v1/models returned HTTP 401"
    )

    # prompts longer than max_model_len: every request fails with the server's message
    out_file = tmp_path / "r.json"
    code, out, err = bench(
        capsys,
        *base,
        *("--api-key", "secret", "--num-prompts", "3", "--prefix-len", "1000"),
        *("--suffix-len", "100", "--output", str(out_file)),
    )
    assert code == 1, err  # nothing completed
    s = json.loads(out_file.read_text())
    assert s["num_completed"] == 0 and s["num_failed"] == 3
    [error] = s["errors"]
    assert error["count"] == 3
    assert error["message"].startswith(
        "HTTP 400: This model's maximum context length is 1024 tokens. However, you requested "
        "1100 tokens in the prompt"
    )
    assert s["p50_ttft_ms"] is None and s["request_throughput"] == 0
    assert table_value(out, "Failed requests") == "3"

    code, _, err = bench(
        capsys, *base, *("--api-key", "secret", "--num-prompts", "2", "--output-len", "2")
    )
    assert code == 0, err


def test_skipped_turns_after_a_failure_are_counted() -> None:
    """A conversation whose turn fails stops; its remaining turns count as failed, unsent."""

    async def run() -> RunOutcome:
        convs = [workloads.Conversation(0, ((1, 2), (3,), (4,)), 2)]
        settings = RunSettings(
            base_url=f"http://127.0.0.1:{free_port()}", model="m", show_progress=False
        )
        return await run_benchmark(settings, convs, lambda text: [])

    outcome = asyncio.run(run())
    assert [r.turn for r in outcome.results] == [0, 1, 2]
    first, *rest = outcome.results
    assert not first.completion.ok and first.completion.error
    assert first.completion.error.startswith("ConnectError")
    assert [r.completion.error for r in rest] == [SKIPPED, SKIPPED]
    assert outcome.cache is None
