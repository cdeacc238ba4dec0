"""The real default model (SmolLM2-135M-Instruct, float32) behind a real server, through the
official openai client. Slow: loading the model takes seconds."""

from __future__ import annotations

from typing import Any

import pytest

from tests.spyre_server.http.helpers import BLOCK, Server, start_server

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"


def test_models_lists_the_default_model(smollm2_server: Server) -> None:
    models = smollm2_server.openai().models.list()
    assert [m.id for m in models.data] == [NAME]


def test_capital_of_france_completion(smollm2_server: Server) -> None:
    out = smollm2_server.openai().completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert out.choices[0].text.startswith(" Paris"), out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_chat_answers_paris(smollm2_server: Server) -> None:
    client = smollm2_server.openai()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(
        model=NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
    )
    content = out.choices[0].message.content or ""
    assert "Paris" in content, content
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens  # type: ignore[union-attr]


def test_long_shared_system_prompt_is_cached(smollm2_server: Server, smollm2_loaded: Any) -> None:
    tokenizer = smollm2_loaded.tokenizer
    system = " ".join(
        f"Rule {i}: answer politely, briefly and only about geography." for i in range(60)
    )

    def conversation(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    def prompt_ids(question: str) -> list[int]:
        text = tokenizer.apply_chat_template(
            conversation(question), add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    first_ids = prompt_ids("Where is Lyon?")
    second_ids = prompt_ids("Where is Nice?")
    common = next(
        (i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b),
        min(len(first_ids), len(second_ids)),
    )
    assert (len(second_ids), common, common // BLOCK) == (848, 840, 13)
    expected = 832  # 848 tokens, 13 blocks hit (cpu backend): min(13 * 64, 848 - 1) = 832

    client = smollm2_server.openai()
    smollm2_server.reset_cache()
    first = client.chat.completions.create(
        model=NAME,
        messages=conversation("Where is Lyon?"),  # type: ignore[arg-type]
        max_tokens=2,
        temperature=0,
    )
    second = client.chat.completions.create(
        model=NAME,
        messages=conversation("Where is Nice?"),  # type: ignore[arg-type]
        max_tokens=2,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == len(first_ids)
    assert second.usage.prompt_tokens == len(second_ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens == expected  # type: ignore[union-attr]
    metrics = smollm2_server.metrics()
    assert metrics.value("vllm:kv_cache_usage_perc", model_name=NAME) == 0


def test_a_chat_template_override_reaches_the_hf_tokenizer(smollm2_loaded: Any) -> None:
    """model.chat_template goes to the real tokenizer's apply_chat_template."""
    from spyre_server.config import load_config
    from spyre_server.entrypoints.serve import build_app

    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    config = load_config(
        environ={},
        overrides={
            "cache.num_blocks": 16,
            "model.max_model_len": 2048,
            "model.dtype": "float32",
            "model.chat_template": template,
        },
    )
    server = start_server(build_app(config, smollm2_loaded))
    try:
        out = server.openai().chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            temperature=0,
        )
    finally:
        server.close()
    rendered = "user: Hi\nassistant:"
    expected = smollm2_loaded.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.usage is not None and out.usage.prompt_tokens == len(expected)
    default = smollm2_loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert len(smollm2_loaded.tokenizer.encode(default, add_special_tokens=False)) != len(expected)
