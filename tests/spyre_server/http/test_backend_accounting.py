"""cached_tokens and the cache metrics through the public API, on both backends (DESIGN §4):
each counts the prompt tokens whose compute the running backend skipped. The chunk view
(spyre:prefill_chunks_total) is the Spyre plan's on both; the program metrics are the spyre
backend's."""

from __future__ import annotations

from typing import Any

import pytest

from tests.spyre_server.http.helpers import (
    MakeServer,
    delta,
    micro_config,
    micro_loaded,
    start_server,
    unique_text,
)

CHUNK = 256
MAX_NUM_SEQS = 4


# The examples, chunk 256, blocks of 64, a prompt sent twice:
# - 141 tokens: 2 full blocks hit. cpu: their 128 positions are not computed (13 are). spyre:
#   one chunk, which is the last: the whole window runs, nothing is skipped.
# - 596 tokens: 9 full blocks hit. cpu: 576 positions not computed. spyre: padded 640, 3 chunks,
#   2 blocks of left padding: min((2 + 9) // 4, 3 - 1) = 2 whole chunks skipped = 8 blocks
#   minus the 2 padding blocks = 384 tokens.
@pytest.mark.parametrize(
    ("backend", "length", "cached", "chunks_skipped"),
    [
        ("cpu", 141, 128, 0),
        ("spyre", 141, 0, 0),
        ("cpu", 596, 576, 2),
        ("spyre", 596, 384, 2),
    ],
)
def test_cached_tokens_are_what_the_backend_skipped(
    make_server: MakeServer, backend: str, length: int, cached: int, chunks_skipped: int
) -> None:
    server = make_server(
        model__backend=backend,
        model__compile_backend="eager",
        scheduler__chunk_size=CHUNK,
        scheduler__max_num_seqs=MAX_NUM_SEQS,
    )
    client = server.openai()
    prompt = unique_text(f"accounting-{length}", length)
    first = client.completions.create(model="micro", prompt=prompt, max_tokens=3, temperature=0)
    before = server.metrics()
    second = client.completions.create(model="micro", prompt=prompt, max_tokens=3, temperature=0)
    after = server.metrics()

    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens == cached  # type: ignore[union-attr]
    assert second.choices[0].text == first.choices[0].text
    assert delta(after, before, "vllm:prefix_cache_queries_total") == length
    assert delta(after, before, "vllm:prefix_cache_hits_total") == cached
    num_chunks = -(-length // CHUNK)
    assert delta(after, before, "spyre:prefill_chunks_total", source="cache") == chunks_skipped
    assert (
        delta(after, before, "spyre:prefill_chunks_total", source="computed")
        == num_chunks - chunks_skipped
    )
    if backend == "spyre":
        # What the compiler built: one dynamic prefill and one dynamic decode graph, which
        # serve the prefill window and every decode batch size up to MAX_NUM_SEQS.
        assert after.value("spyre:warmed_programs") == 2
        assert after.value("spyre:programs_compiled_after_warmup_total") == 0
        steps = delta(after, before, "spyre:program_steps_total", kind="prefill", shape="1x256")
        assert steps == num_chunks - chunks_skipped
        decode = delta(after, before, "spyre:program_steps_total", kind="decode", shape="1x1")
        assert decode == 2  # max_tokens 3: the prefill samples the first token
    else:
        assert after.value("spyre:warmed_programs") == 0
        assert not [f for f in after.families if f.name == "spyre:program_steps"]


def test_prompt_logprobs_are_refused_on_the_spyre_backend(make_server: MakeServer) -> None:
    """Its prefill programs return the logits of a window's last block only."""
    spyre = make_server(model__backend="spyre", model__compile_backend="eager")
    body = {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}
    response = spyre.http().post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert "spyre backend" in response.json()["error"]["message"]
    cpu = make_server()
    response = cpu.http().post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_a_server_whose_step_thread_has_other_torch_threads_compiles_nothing_after_warmup(
    http_micro_model: Any, one_torch_thread: None
) -> None:
    """As ``serve`` runs it: the model loaded on one torch thread, the step thread on
    ``model.num_threads`` (here 2). Dynamo guards the programs on torch's thread count, so the
    warm-up must run at the step thread's count, or the first steps compile both again."""
    import torch

    from spyre_server.entrypoints.serve import build_app

    assert torch.get_num_threads() == 1
    config = micro_config(
        model__backend="spyre", model__compile_backend="eager", scheduler__chunk_size=CHUNK
    )
    server = start_server(build_app(config, micro_loaded(http_micro_model), num_threads=2))
    try:
        client = server.openai()
        client.completions.create(model="micro", prompt="abc", max_tokens=3, temperature=0)
        metrics = server.metrics()
    finally:
        server.close()
    assert metrics.value("spyre:warmed_programs") == 2
    assert metrics.value("spyre:programs_compiled_after_warmup_total") == 0
    assert torch.get_num_threads() == 1  # this thread's count is left as it was
