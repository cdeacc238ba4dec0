"""Completions and chat through the official ``openai`` client against a real server on the tiny
random llama: greedy output and logprobs against an independent reference (full forward passes),
streaming, usage, n > 1, stop strings / stop tokens / eos, seeds, echo, max_tokens defaults."""

from __future__ import annotations

import math
import threading
from typing import Any

import openai
import pytest

from tests.spyre_server.http.helpers import (
    DEFAULT_MAX_TOKENS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    ByteChatTokenizer,
    MakeServer,
    Server,
    chat_prompt_ids,
    reference_greedy,
    unique_text,
)

TOK = ByteChatTokenizer()
PROMPT = "Hello world"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture(scope="module")
def ref_prompt(http_micro_model: Any) -> list[Any]:
    """Greedy reference for PROMPT: 24 steps with top-2 logprobs."""
    return reference_greedy(http_micro_model, TOK.encode(PROMPT), 24, 2)


@pytest.fixture(scope="module")
def ref_chat(http_micro_model: Any) -> list[Any]:
    return reference_greedy(http_micro_model, chat_prompt_ids(MESSAGES), 12, 2)


def ids_of(ref: list[Any]) -> list[int]:
    return [step.token_id for step in ref]


def assert_text_of(text: str, token_ids: list[int]) -> None:
    """The text is the decoded tokens, up to a trailing incomplete UTF-8 sequence held back."""
    full = TOK.decode(token_ids)
    assert full.startswith(text), (text, full)
    assert set(full[len(text) :]) <= {"\ufffd"}, (text, full)


def assert_usage(usage: Any, prompt: int, completion: int, cached: int = 0) -> None:
    assert usage.prompt_tokens == prompt
    assert usage.completion_tokens == completion
    assert usage.total_tokens == prompt + completion
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached


# ------------------------------------------------------------------------------------ completions
def test_completion_greedy_matches_reference_with_logprobs(server: Server, ref_prompt: Any) -> None:
    ref = ref_prompt[:12]
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2
    )
    assert out.object == "text_completion"
    assert out.model == MODEL_NAME
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert_text_of(choice.text, ids_of(ref))
    assert_usage(out.usage, prompt=len(PROMPT), completion=12)

    lp = choice.logprobs
    assert lp is not None
    assert lp.tokens == [TOK.decode([s.token_id]) for s in ref]
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for got, want, top in zip(lp.token_logprobs, ref, lp.top_logprobs, strict=True):
        assert got == pytest.approx(want.logprob, abs=1e-4)
        # top 2 alternatives keyed by their text (ids with the same text share one key)
        assert set(top) == {TOK.decode([t]) for t, _ in want.top}
        for text, value in top.items():
            assert any(
                TOK.decode([t]) == text and value == pytest.approx(v, abs=1e-4) for t, v in want.top
            )
        if len(top) == 2:  # no two alternatives share a text: the chosen one is the best
            assert max(top.values()) == pytest.approx(got, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]


def test_completion_logprobs_zero_gives_no_alternatives(server: Server, ref_prompt: Any) -> None:
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert lp.token_logprobs == pytest.approx([s.logprob for s in ref_prompt[:3]], abs=1e-4)
    assert lp.top_logprobs == [{}, {}, {}]


def test_completion_without_logprobs_has_none(server: Server) -> None:
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0
    )
    assert out.choices[0].logprobs is None


def test_completion_token_id_prompts_and_prompt_lists(server: Server, ref_prompt: Any) -> None:
    client = server.openai()
    ids = TOK.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert_text_of(by_ids.choices[0].text, ids_of(ref_prompt[:6]))
    assert_usage(by_ids.usage, prompt=len(ids), completion=6)

    other = "Another prompt"
    many = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, other], max_tokens=6, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert_text_of(many.choices[0].text, ids_of(ref_prompt[:6]))
    single = client.completions.create(model=MODEL_NAME, prompt=other, max_tokens=6, temperature=0)
    assert many.choices[1].text == single.choices[0].text
    assert_usage(many.usage, prompt=len(PROMPT) + len(other), completion=12)

    many_ids = client.completions.create(
        model=MODEL_NAME, prompt=[ids, TOK.encode(other)], max_tokens=6, temperature=0
    )
    assert [c.text for c in many_ids.choices] == [c.text for c in many.choices]


def test_completion_echo_prepends_the_prompt(server: Server, ref_prompt: Any) -> None:
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True
    )
    text = out.choices[0].text
    assert text.startswith(PROMPT)
    assert_text_of(text[len(PROMPT) :], ids_of(ref_prompt[:5]))
    assert_usage(out.usage, prompt=len(PROMPT), completion=5)


def test_default_max_tokens_and_its_cap_by_max_model_len(server: Server) -> None:
    client = server.openai()
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0)
    assert out.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert out.choices[0].finish_reason == "length"
    for room in (4, 1):
        prompt = unique_text(f"cap-{room}", MAX_MODEL_LEN - room)
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0)
        assert out.usage.completion_tokens == room
        assert out.usage.prompt_tokens == MAX_MODEL_LEN - room
        assert out.choices[0].finish_reason == "length"


def test_prompt_plus_max_tokens_exactly_max_model_len_is_accepted(server: Server) -> None:
    prompt = unique_text("exact-fit", MAX_MODEL_LEN - 3)
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0
    )
    assert out.usage.completion_tokens == 3
    assert out.usage.total_tokens == MAX_MODEL_LEN


# ------------------------------------------------------------------------------------------ chat
def test_chat_greedy_matches_reference_with_logprobs(server: Server, ref_chat: Any) -> None:
    out = server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert out.object == "chat.completion"
    assert out.model == MODEL_NAME
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert_text_of(choice.message.content or "", ids_of(ref_chat))
    assert_usage(out.usage, prompt=len(chat_prompt_ids(MESSAGES)), completion=12)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 12
    for entry, want in zip(content, ref_chat, strict=True):
        assert entry.token == TOK.decode([want.token_id])
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 2
        assert [t.token for t in entry.top_logprobs] == [TOK.decode([t]) for t, _ in want.top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in want.top], abs=1e-4
        )


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(server: Server, http_micro_model: Any) -> None:
    """OpenAI: ``bytes`` is the token's UTF-8 byte representation, so that the bytes of the
    tokens that split a character can be combined into it. A byte-level token such as 0xAA must
    report [0xAA], not the bytes of U+FFFD (the test tokenizer follows the HF byte-level
    convention in ``convert_ids_to_tokens``)."""
    messages = [{"role": "user", "content": "Say something."}]
    ref = reference_greedy(http_micro_model, chat_prompt_ids(messages), 12, 2)
    assert any(s.token_id >= 0x80 for s in ref), "the check needs a non-ASCII byte token"
    out = server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [e.bytes for e in content] == [[s.token_id] for s in ref]
    assert [[t.bytes for t in e.top_logprobs] for e in content] == [
        [[t] for t, _ in s.top] for s in ref
    ]


def test_chat_equals_completion_of_the_templated_prompt(server: Server) -> None:
    client = server.openai()
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=TOK.apply_chat_template(MESSAGES),
        max_tokens=10,
        temperature=0,
    )
    assert chat.choices[0].message.content == completion.choices[0].text


def test_chat_max_completion_tokens_and_content_parts(server: Server) -> None:
    client = server.openai()
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say something."}]}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=3,
        temperature=0,
    )
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]
    default = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], temperature=0
    )
    assert default.usage is not None
    assert default.usage.completion_tokens == DEFAULT_MAX_TOKENS


def test_chat_logprobs_without_alternatives(server: Server, ref_chat: Any) -> None:
    out = server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=0,
        logprobs=True,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [e.logprob for e in content] == pytest.approx(
        [s.logprob for s in ref_chat[:3]], abs=1e-4
    )
    assert all(e.top_logprobs == [] for e in content)
    plain = server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=0,
    )
    assert plain.choices[0].logprobs is None


# ------------------------------------------------------------------------------------- streaming
def test_completion_stream_equals_non_stream_and_ends_with_usage(server: Server) -> None:
    client = server.openai()
    prompt = unique_text("stream-completion", 150)  # two chunks
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) >= 3
    *content, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert full.usage is not None
    assert_usage(full.usage, prompt=150, completion=16, cached=0)
    # 150 tokens: 2 full blocks hit, none of their positions computed (cpu backend)
    assert_usage(last.usage, prompt=150, completion=16, cached=128)
    assert all(c.usage is None for c in content)
    assert all(c.id == last.id for c in chunks)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]


def test_completion_stream_without_include_usage_has_no_usage(server: Server) -> None:
    chunks = list(
        server.openai().completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream_and_ends_with_usage(server: Server) -> None:
    client = server.openai()
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    first, *content, last = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and first.id.startswith("chatcmpl-")
    assert (
        "".join(c.choices[0].delta.content or "" for c in content)
        == full.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert last.choices == []
    assert last.usage is not None
    assert_usage(last.usage, prompt=len(chat_prompt_ids(MESSAGES)), completion=12)


def test_chat_stream_with_logprobs(server: Server, ref_chat: Any) -> None:
    chunks = list(
        server.openai().chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
        )
    )
    entries = [
        e for c in chunks[1:] if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.logprob for e in entries] == pytest.approx(
        [s.logprob for s in ref_chat[:6]], abs=1e-4
    )
    assert all(len(e.top_logprobs) == 1 for e in entries)


# ------------------------------------------------------------------------------------------ n > 1
def test_n_greedy_samples_share_the_prompt_and_count_it_once(
    server: Server, ref_prompt: Any
) -> None:
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, n=3
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        assert_text_of(choice.text, ids_of(ref_prompt[:6]))
        assert choice.finish_reason == "length"
    assert_usage(out.usage, prompt=len(PROMPT), completion=18)


def test_n_streamed_chat_samples(server: Server) -> None:
    chunks = list(
        server.openai().chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    finished = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1]
    assert texts[0] == texts[1]
    assert chunks[-1].usage is not None
    assert_usage(chunks[-1].usage, prompt=len(chat_prompt_ids(MESSAGES)), completion=10)


def test_n_seeded_samples_are_different_samples(server: Server) -> None:
    """n > 1 asks for n samples. With a seed they must be reproducible, but still n different
    draws (vLLM gives sample i the seed + i), not n copies of one sample."""
    client = server.openai()
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.5,
        "seed": 42,
    }
    out = client.completions.create(n=3, **kwargs)
    texts = [c.text for c in out.choices]
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in again.choices] == texts  # reproducible
    assert len(set(texts)) == 3, texts


# ------------------------------------------------------------------------------------------ seeds
def test_seed_makes_sampling_reproducible(server: Server) -> None:
    client = server.openai()

    def sample(seed: int | None) -> str:
        out = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.5, seed=seed
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    assert sample(None) != sample(None)

    # The same seed gives the same sample while another request shares the decode batch.
    results: list[str] = []
    other = threading.Thread(
        target=lambda: results.append(
            client.completions.create(
                model=MODEL_NAME, prompt="batch mate", max_tokens=40, temperature=1.0
            )
            .choices[0]
            .text
        )
    )
    other.start()
    try:
        assert sample(1234) == first
    finally:
        other.join(30)
    assert len(results) == 1


# ----------------------------------------------------------------------------------- stop / eos
def _stop_for(text: str) -> tuple[str, int]:
    """A 2-character stop string that first occurs at index >= 2 of ``text`` (no U+FFFD)."""
    for i in range(2, len(text) - 1):
        candidate = text[i : i + 2]
        if "\ufffd" not in candidate and text.find(candidate) == i:
            return candidate, i
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text_before_it(server: Server) -> None:
    client = server.openai()
    full = (
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    stop, at = _stop_for(full)
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never-seen"]
    )
    assert out.choices[0].text == full[:at]
    assert out.choices[0].finish_reason == "stop"
    assert 1 <= out.usage.completion_tokens < 24  # type: ignore[union-attr]

    streamed = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == full[:at]
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert stop not in "".join(c.choices[0].text for c in streamed)


def test_chat_stop_string(server: Server) -> None:
    client = server.openai()
    full = (
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    assert full is not None
    stop, at = _stop_for(full)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stop=stop,
    )
    assert out.choices[0].message.content == full[:at]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_generation(server: Server, ref_prompt: Any) -> None:
    ids = ids_of(ref_prompt)
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = server.openai().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [ids[k]]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == k + 1  # type: ignore[union-attr]


def test_eos_token_ends_generation_and_is_not_in_the_text(
    make_server: MakeServer, ref_prompt: Any
) -> None:
    ids = ids_of(ref_prompt)
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    server = make_server(eos_token_id=ids[k])
    client = server.openai()
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert out.usage.completion_tokens == k + 1  # type: ignore[union-attr]
    assert_text_of(choice.text, ids[:k])
    ignored = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 24  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------- sampling
def test_top_k_one_and_tiny_top_p_are_greedy(server: Server, ref_prompt: Any) -> None:
    client = server.openai()
    top_k_1 = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"top_k": 1}
    )
    assert_text_of(top_k_1.choices[0].text, ids_of(ref_prompt[:8]))
    tiny_top_p = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=1e-6
    )
    assert_text_of(tiny_top_p.choices[0].text, ids_of(ref_prompt[:8]))


def test_logprobs_are_finite_at_temperature(server: Server) -> None:
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 8
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert math.isfinite(value) and value <= 0
        assert 1 <= len(top) <= 3
        assert max(top.values()) >= value - 1e-6


def test_models_list_via_openai(server: Server) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].owned_by == "spyre-server"


def test_openai_client_raises_typed_errors(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert not_found.value.status_code == 404
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=MAX_MODEL_LEN)
    assert bad.value.param == "max_tokens"
