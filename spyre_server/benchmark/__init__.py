"""``spyre-server bench``: an HTTP load generator for any OpenAI-compatible ``/v1/completions``
server, measuring latency, throughput and prefix-cache hits the way vLLM's ``vllm bench serve``
and SGLang's ``bench_serving`` do.

Modules: ``workloads`` (prompts as exact token-id lists), ``tokenizer`` (the local HF tokenizer),
``client`` (one streamed request and its timings), ``runner`` (arrivals, concurrency, progress),
``metrics`` (the server's /metrics prefix-cache counters), ``report`` (statistics, table, JSON),
``cli`` (the ``bench`` subcommand). Nothing here imports torch, fms or the scheduler.
"""
