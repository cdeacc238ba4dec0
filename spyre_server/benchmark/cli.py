"""The ``spyre-server bench`` subcommand: its options (``add_parser``) and ``run``.

This module is imported by ``spyre_server.entrypoints.cli`` for every command, so it only builds the argument
parser at import time; ``run`` imports the rest (httpx, tqdm, transformers) when it runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from spyre_server.benchmark.errors import BenchError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_WORKLOAD = "prefix-repetition"

# Each workload's own options and their defaults. prefix-repetition follows vLLM's benchmark;
# shared-system-prompt is SGLang's generated-shared-prefix shape scaled down for a CPU.
WORKLOAD_OPTIONS: dict[str, dict[str, int]] = {
    "prefix-repetition": {
        "num_prompts": 100,
        "prefix_len": 256,
        "suffix_len": 256,
        "num_prefixes": 10,
        "output_len": 128,
    },
    "shared-system-prompt": {
        "num_groups": 4,
        "prompts_per_group": 8,
        "system_prompt_len": 512,
        "question_len": 64,
        "output_len": 32,
    },
    "multi-turn": {
        "num_conversations": 8,
        "num_turns": 4,
        "turn_len": 64,
        "output_len": 32,
    },
}
_ALL_OPTIONS = sorted({name for opts in WORKLOAD_OPTIONS.values() for name in opts})
_OPTION_HELP = {
    "num_prompts": "prompts",
    "prefix_len": "tokens of each prefix",
    "suffix_len": "tokens of each prompt's own suffix",
    "num_prefixes": "distinct prefixes",
    "num_groups": "distinct system prompts",
    "prompts_per_group": "questions per system prompt",
    "system_prompt_len": "tokens of each system prompt",
    "question_len": "tokens of each question",
    "num_conversations": "conversations",
    "num_turns": "turns (requests) per conversation",
    "turn_len": "new user tokens per turn",
}
# Lengths that may be 0 (the other options must be at least 1).
_MAY_BE_ZERO = {"prefix_len", "suffix_len"}

DESCRIPTION = """\
Load-test an OpenAI-compatible server through /v1/completions (streaming), like "vllm bench
serve": prompts are token-id lists of exact lengths drawn from the tokenizer's ordinary ids. Reports
TTFT, inter-token and end-to-end latency percentiles, throughput, and the prefix-cache hit rate
from the server's /metrics (vLLM counter names; n/a when the server has none).

workloads (defaults in brackets):
  prefix-repetition     --num-prompts prompts spread over --num-prefixes random prefixes, each
                        prefix + its own suffix [100 prompts, 10 prefixes, 256 + 256 tokens,
                        128 out]; vLLM's prefix_repetition dataset
  shared-system-prompt  --num-groups x --prompts-per-group prompts, system prompt + question
                        [4 x 8, 512 + 64 tokens, 32 out]; SGLang's generated-shared-prefix
  multi-turn            --num-conversations chats of --num-turns turns; each turn resends the
                        history (previous prompt + the response re-encoded) plus --turn-len new
                        tokens [8 chats, 4 turns, 64 tokens, 32 out]

exit status: 0 when at least one request completed, 1 when none did or the server cannot be
reached, 2 for invalid options or a missing tokenizer."""


def _int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    parse.__name__ = "int"
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError("must be positive")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    from spyre_server.benchmark.workloads import WORKLOADS

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (latency, throughput, prefix-cache hits)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    choices = ", ".join(WORKLOADS)
    parser.add_argument(
        "workload",
        nargs="?",
        choices=WORKLOADS,
        metavar="WORKLOAD",
        help=f"{choices} (default {DEFAULT_WORKLOAD})",
    )
    parser.add_argument(
        "--workload",
        dest="workload_option",
        choices=WORKLOADS,
        metavar="WORKLOAD",
        help="the same, as an option",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        metavar="URL",
        help=f"the server (default: {DEFAULT_BASE_URL})",
    )
    server.add_argument(
        "--model", metavar="NAME", help="model name (default: the first id of GET /v1/models)"
    )
    server.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    server.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="local HF tokenizer folder of the served model (default: the "
        "SmolLM2-135M-Instruct folder that spyre-server prepare-model prepares)",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        default=math.inf,
        metavar="RATE",
        help="requests (conversations) per second, Poisson arrivals (default: inf, all at once)",
    )
    load.add_argument(
        "--max-concurrency",
        type=_int_at_least(1),
        metavar="N",
        help="at most this many requests in flight (a multi-turn conversation holds its slot "
        "from its first turn to its last)",
    )
    load.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals (default 0)")
    load.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos: true (outputs may then end before --output-len)",
    )
    load.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="seconds per request (default 600)",
    )
    for name, options in WORKLOAD_OPTIONS.items():
        group = parser.add_argument_group(f"{name} workload")
        for option, default in options.items():
            if option != "output_len":
                group.add_argument(
                    "--" + option.replace("_", "-"),
                    type=_int_at_least(0 if option in _MAY_BE_ZERO else 1),
                    metavar="N",
                    help=f"{_OPTION_HELP[option]} (default {default})",
                )
    common = parser.add_argument_group("every workload")
    common.add_argument(
        "--output-len",
        type=_int_at_least(1),
        metavar="N",
        help="tokens generated per request (default: "
        + ", ".join(f"{opts['output_len']} for {w}" for w, opts in WORKLOAD_OPTIONS.items())
        + ")",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output", type=Path, metavar="FILE", help="also write the results as JSON to this file"
    )
    output.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


def _fail(message: str, code: int) -> int:
    print(f"spyre-server bench: error: {message}", file=sys.stderr, flush=True)
    return code


def _workload_choice(args: argparse.Namespace) -> str:
    if args.workload and args.workload_option and args.workload != args.workload_option:
        raise BenchError(f"two workloads given: {args.workload} and {args.workload_option}")
    return str(args.workload or args.workload_option or DEFAULT_WORKLOAD)


def workload_options(args: argparse.Namespace, workload: str) -> dict[str, int]:
    """The chosen workload's options (defaults filled in). Raises BenchError for an option that
    belongs to another workload only."""
    own = WORKLOAD_OPTIONS[workload]
    for name in _ALL_OPTIONS:
        if name not in own and getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            others = [w for w, opts in WORKLOAD_OPTIONS.items() if name in opts]
            raise BenchError(f"{flag} applies to the {' / '.join(others)} workload only")
    options = {n: getattr(args, n) if getattr(args, n) is not None else d for n, d in own.items()}
    if workload == "prefix-repetition" and options["prefix_len"] + options["suffix_len"] < 1:
        raise BenchError("--prefix-len + --suffix-len must be at least 1")
    return options


def no_repetition_warning(workload: str, options: dict[str, int]) -> str | None:
    """Why a run of these options cannot measure prefix caching (no prompt repeats another's
    prefix), or ``None``."""
    repeats = options.get("num_prompts", 0) > options.get("num_prefixes", 0)
    if workload == "prefix-repetition" and options["prefix_len"] > 0 and not repeats:
        return (
            f"--num-prompts {options['num_prompts']} is not above --num-prefixes "
            f"{options['num_prefixes']}: every prompt gets a prefix of its own, so no "
            "prefix repeats and the prefix cache cannot hit"
        )
    if workload == "shared-system-prompt" and options["prompts_per_group"] == 1:
        return "--prompts-per-group 1: no system prompt repeats, so the prefix cache cannot hit"
    if workload == "multi-turn" and options["num_turns"] == 1:
        return "--num-turns 1: no history is resent, so the prefix cache cannot hit"
    return None


def normalize_base_url(url: str) -> str:
    """Without trailing slashes or ``/v1``: the benchmark adds ``/v1/...`` and ``/metrics``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def run(args: argparse.Namespace) -> int:
    """Run the benchmark of the parsed ``bench`` arguments; print the table; return the exit
    status (see DESCRIPTION)."""
    import asyncio

    from spyre_server.benchmark import workloads
    from spyre_server.benchmark.client import fetch_model_ids
    from spyre_server.benchmark.report import format_table, summarize, write_json
    from spyre_server.benchmark.runner import RunSettings, run_benchmark
    from spyre_server.benchmark.tokenizer import load_tokenizer, ordinary_token_ids

    try:
        workload = _workload_choice(args)
        options = workload_options(args, workload)
    except BenchError as exc:
        return _fail(str(exc), 2)
    if args.output is not None and not args.output.parent.is_dir():
        return _fail(f"--output {args.output}: no such folder {args.output.parent}", 2)
    base_url = normalize_base_url(args.base_url)
    try:
        model_ids = fetch_model_ids(base_url, args.api_key, min(args.request_timeout, 30.0))
    except BenchError as exc:
        return _fail(str(exc), 1)
    model = args.model or model_ids[0]
    if model not in model_ids:
        print(
            f"spyre-server bench: warning: {base_url} lists {model_ids}, not {model!r}",
            file=sys.stderr,
        )
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        vocab = ordinary_token_ids(tokenizer)
    except BenchError as exc:
        return _fail(str(exc), 2)

    conversations = workloads.build(workload, vocab, args.seed, options)
    settings = RunSettings(
        base_url=base_url,
        model=model,
        api_key=args.api_key,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout,
        show_progress=not args.disable_tqdm,
    )

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    num_requests = sum(c.num_turns for c in conversations)
    warning = no_repetition_warning(workload, options)
    if warning is not None:
        print(f"spyre-server bench: warning: {warning}", file=sys.stderr, flush=True)
    print(
        f"spyre-server bench: {workload}, {num_requests} requests, model {model!r} at {base_url}",
        file=sys.stderr,
        flush=True,
    )
    try:
        outcome = asyncio.run(run_benchmark(settings, conversations, encode))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    summary = summarize(outcome, settings, workload, options)
    print(format_table(summary), flush=True)
    if args.output is not None:
        try:
            write_json(args.output, summary)
        except OSError as exc:
            return _fail(f"cannot write {args.output}: {exc}", 1)
    return 0 if summary["num_completed"] > 0 else 1
