"""API parity with vLLM's OpenAI server, through the official ``openai`` client and raw HTTP on
the micro model: prompt logprobs (echo + logprobs, max_tokens 0) against a teacher-forced full
forward, unknown and unsupported fields, penalties and logit_bias, stop_reason, model cards."""

from __future__ import annotations

import json
import logging
from typing import Any

import openai
import pytest
import torch

from tests.spyre_server.http.helpers import (
    CHUNK,
    MODEL_NAME,
    ByteChatTokenizer,
    Server,
    iter_sse,
    json_payloads,
    start_server,
    unique_text,
)

TOK = ByteChatTokenizer()
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def teacher_forced(model: Any, prompt: list[int]) -> torch.Tensor:
    """Log-softmax rows of one full forward over the whole prompt (no cache, fms's default
    attention): row t scores token t + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)


def assert_prompt_logprobs(logprobs: Any, prompt: list[int], rows: torch.Tensor, top: int) -> None:
    assert logprobs.tokens[: len(prompt)] == [TOK.decode([t]) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for t in range(1, len(prompt)):
        expected = float(rows[t - 1, prompt[t]])
        assert logprobs.token_logprobs[t] == pytest.approx(expected, abs=2e-4), t
        values, ids = rows[t - 1].topk(top)
        # keyed by token text, as OpenAI's format has it (tokens with equal text collapse)
        expected_top = {
            TOK.decode([i]): v for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        }
        got = logprobs.top_logprobs[t]
        assert list(got) == list(expected_top)
        assert list(got.values()) == pytest.approx(list(expected_top.values()), abs=2e-4)


# --------------------------------------------------------------------------- prompt logprobs
def test_echo_logprobs_match_a_teacher_forced_forward_across_chunks(
    server: Server, http_micro_model: Any
) -> None:
    text = unique_text("echo-three-chunks", 2 * CHUNK + 40)  # 296 tokens: three prefill chunks
    prompt = TOK.encode(text)
    rows = teacher_forced(http_micro_model, prompt)
    client = server.openai()
    out = client.completions.create(
        model=MODEL_NAME, prompt=text, max_tokens=2, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith(text)
    assert len(choice.logprobs.tokens) == len(prompt) + 2
    assert_prompt_logprobs(choice.logprobs, prompt, rows, 2)
    # the first generated token is the argmax of the last prompt row, scored by it
    first = int(rows[-1].argmax())
    assert choice.logprobs.token_logprobs[len(prompt)] == pytest.approx(
        float(rows[-1, first]), abs=2e-4
    )
    assert choice.logprobs.text_offset[:3] == [0, 1, 2]
    assert out.usage.completion_tokens == 2


def test_max_tokens_zero_with_echo_scores_the_prompt_only(
    server: Server, http_micro_model: Any
) -> None:
    """What evaluation harnesses send: the prompt's logprobs, no output, finish_reason length."""
    prompt = TOK.encode("Scoring only, please.")
    rows = teacher_forced(http_micro_model, prompt)
    out = server.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text == "Scoring only, please."
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(prompt)
    assert_prompt_logprobs(choice.logprobs, prompt, rows, 1)
    assert out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(prompt)
    # echo without logprobs, max_tokens 0: the prompt text, no logprobs
    plain = server.openai().completions.create(
        model=MODEL_NAME, prompt="just echo", max_tokens=0, echo=True
    )
    assert plain.choices[0].text == "just echo" and plain.choices[0].logprobs is None


def test_prompt_logprobs_skip_the_cache_lookup_and_still_register_blocks(server: Server) -> None:
    text = unique_text("echo-cache", 3 * 64 + 5)  # three full blocks
    client = server.openai()
    for _ in range(2):
        scored = client.completions.create(
            model=MODEL_NAME, prompt=text, max_tokens=1, echo=True, logprobs=0, temperature=0
        )
        # the scoring request computes its whole prompt, whatever is cached
        assert scored.usage.prompt_tokens_details.cached_tokens == 0
    plain = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1, temperature=0)
    # ...but its blocks were registered: a later plain request hits them (how many of the hit
    # tokens count as cached depends on the backend's accounting rule, so only > 0 here)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_echo_carries_the_prompt_and_its_logprobs_in_the_first_chunk(
    server: Server, http_micro_model: Any
) -> None:
    prompt = TOK.encode("stream me")
    rows = teacher_forced(http_micro_model, prompt)
    with server.http().stream(
        "POST",
        COMPLETIONS,
        json={
            "prompt": "stream me",
            "max_tokens": 3,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
            "stream": True,
        },
    ) as response:
        events = json_payloads(list(iter_sse(response)))
    first = events[0]["choices"][0]
    assert first["text"].startswith("stream me")
    lp = first["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1] == pytest.approx(float(rows[0, prompt[1]]), abs=2e-4)
    assert len(lp["tokens"]) >= len(prompt)
    total = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"])
    assert total == len(prompt) + 3


def test_max_tokens_zero_without_echo_and_in_chat_is_400(server: Server) -> None:
    response = server.http().post(COMPLETIONS, json={"prompt": "x", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    response = server.http().post(CHAT, json={"messages": MESSAGES, "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


# ------------------------------------------------------------------- unknown / unsupported
@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETIONS, "max_token", 5),  # a typo
        (CHAT, "max_token", 5),
        (CHAT, "stream_options", {"include_usage": True, "typo": 1}),
    ],
)
def test_unknown_fields_are_400_naming_them(
    server: Server, path: str, field: str, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    body: dict[str, Any] = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    body[field] = value
    with caplog.at_level(logging.INFO, logger="spyre_server.api.errors"):
        response = server.http().post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field
    assert "unknown field" in error["message"]
    # the server log says why
    assert any("400 POST" in r.getMessage() and field in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (CHAT, "tool_choice", "required"),
        (CHAT, "continue_final_message", True),
        (CHAT, "echo", True),
        (COMPLETIONS, "suffix", "tail"),
        (CHAT, "guided_json", {"type": "object"}),
        (COMPLETIONS, "skip_special_tokens", False),  # we always skip them
        (COMPLETIONS, "no_stop_trim", True),
        (CHAT, "return_hidden_states", True),
    ],
)
def test_unsupported_fields_are_400_naming_them(
    server: Server, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    body[field] = value
    response = server.http().post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert field in error["message"]


def test_neutral_values_of_unsupported_fields_pass(server: Server) -> None:
    """Values some clients always send that ask for nothing."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 1,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": None,
    }
    response = server.http().post(CHAT, json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_fields_vllm_router_adds_pass(server: Server, path: str) -> None:
    """vllm-router forwards every request with these three fields, asking for what this server
    does anyway."""
    body: dict[str, Any] = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    body |= {
        "max_tokens": 1,
        "skip_special_tokens": True,
        "no_stop_trim": False,
        "return_hidden_states": False,
    }
    response = server.http().post(path, json=body)
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------ penalties and biases
def reference_processed_greedy(
    model: Any,
    prompt: list[int],
    steps: int,
    *,
    bias: dict[int, float] | None = None,
    frequency: float = 0.0,
    presence: float = 0.0,
    repetition: float = 1.0,
) -> list[int]:
    """Greedy decoding by full forward passes, with OpenAI's / vLLM's logit adjustments written
    out per token: the oracle of the vectorised processors."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([ids]))[0, -1].float().tolist()
            for token, b in (bias or {}).items():
                logits[token] += b
            for token in range(len(logits)):
                if token in ids and repetition != 1.0:
                    logit = logits[token]
                    logits[token] = logit / repetition if logit > 0 else logit * repetition
                count = out.count(token)
                logits[token] -= frequency * count + presence * (count > 0)
            best = max(range(len(logits)), key=lambda t: logits[t])
            ids.append(best)
            out.append(best)
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {"bias": {90: 100.0}},
        {"bias": {90: 3.0}, "frequency": 1.0},
        {"bias": {90: 3.0}, "presence": 2.0},
        {"repetition": 1.8},
        {"bias": {65: -100.0, 66: 2.0}, "frequency": 0.5, "presence": 0.5, "repetition": 1.3},
    ],
    ids=["bias", "frequency", "presence", "repetition", "all"],
)
def test_logit_bias_and_penalties_match_a_per_token_reference(
    server: Server, http_micro_model: Any, settings: dict[str, Any]
) -> None:
    prompt = TOK.encode("abcabc")
    expected = reference_processed_greedy(http_micro_model, prompt, 8, **settings)
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 0,
        "logit_bias": {str(t): b for t, b in settings.get("bias", {}).items()},
        "frequency_penalty": settings.get("frequency", 0.0),
        "presence_penalty": settings.get("presence", 0.0),
        "repetition_penalty": settings.get("repetition", 1.0),
    }
    response = server.http().post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [TOK.decode([t]) for t in expected]
    if settings.get("bias", {}).get(90, 0) >= 100:
        assert expected == [90] * 8  # a bias of 100 wins every step
    plain = reference_processed_greedy(http_micro_model, prompt, 8)
    assert expected != plain  # every setting changes the output


def test_logit_bias_outside_the_vocabulary_is_400(server: Server) -> None:
    response = server.http().post(COMPLETIONS, json={"prompt": "x", "logit_bias": {"256": 1}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logit_bias"


def test_min_tokens_and_stop_reason(make_server: Any) -> None:
    eos = 90
    server = make_server(eos_token_id=eos)
    client = server.openai()
    early = client.completions.create(
        model=MODEL_NAME, prompt="abc", max_tokens=5, temperature=0, logit_bias={str(eos): 100}
    )
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    assert early.choices[0].model_extra["stop_reason"] is None  # EOS
    held = client.completions.create(
        model=MODEL_NAME,
        prompt="abc",
        max_tokens=5,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 3},
    )
    assert held.usage.completion_tokens == 4  # 3 forced non-EOS tokens, then EOS
    by_token = client.completions.create(
        model=MODEL_NAME,
        prompt="abc",
        max_tokens=5,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"stop_token_ids": [65]},
    )
    assert by_token.choices[0].model_extra["stop_reason"] == 65
    assert by_token.choices[0].text == ""  # the stop token's text is not output
    assert by_token.usage.completion_tokens == 1
    by_string = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logit_bias={"65": 100},
        stop=["AA"],
    )
    assert by_string.choices[0].finish_reason == "stop"
    assert by_string.choices[0].model_extra["stop_reason"] == "AA"


# ----------------------------------------------------------------------------- model cards
def test_models_retrieve_and_card_fields(server: Server) -> None:
    client = server.openai()
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME
    assert card.model_extra["root"] == MODEL_NAME  # the micro model's path is its name
    assert card.model_extra["parent"] is None
    listed = client.models.list().data
    assert [m.model_dump() for m in listed] == [card.model_dump()]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


# ------------------------------------------------------------------------------------ best_of
def test_best_of_returns_the_samples_of_highest_cumulative_logprob(server: Server) -> None:
    client = server.openai()
    common: dict[str, Any] = {"model": MODEL_NAME, "prompt": "best of", "max_tokens": 6, "seed": 7}
    # the oracle: the same seeded samples, all returned with their logprobs (sample j of a
    # seeded request uses seed + j, with best_of as with n)
    every = client.completions.create(n=4, logprobs=0, **common)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    order = sorted(range(4), key=lambda j: -scores[j])
    best = client.completions.create(n=1, best_of=4, **common)
    assert [c.text for c in best.choices] == [every.choices[order[0]].text]
    assert best.choices[0].logprobs is None  # not asked for
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all 4 were generated
    two = client.completions.create(n=2, best_of=4, logprobs=0, **common)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [every.choices[j].text for j in order[:2]]


@pytest.mark.parametrize(
    "body", [{"n": 3, "best_of": 2}, {"best_of": 3, "stream": True}], ids=["below-n", "stream"]
)
def test_best_of_below_n_or_streamed_is_400(server: Server, body: dict[str, Any]) -> None:
    response = server.http().post(COMPLETIONS, json={"prompt": "x", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "best_of"


# ------------------------------------------------------------------------- structured output
YES_NO = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("eos_token_id", [None, 0], ids=["no-eos", "eos"])
def test_json_schema_output_follows_the_schema(make_server: Any, eos_token_id: int | None) -> None:
    """The random micro model never writes JSON by itself: every answer here is the grammar's.
    Without EOS the answer ends when the grammar is complete; with one, at EOS."""
    server = make_server(eos_token_id=eos_token_id)
    client = server.openai()
    answers = set()
    for seed in range(6):
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=40,
            temperature=1.5,
            seed=seed,
            response_format=YES_NO,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        answers.add(json.loads(choice.message.content)["answer"])
        assert set(json.loads(choice.message.content)) == {"answer"}
    assert answers <= {"yes", "no"}
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.choices[0].message.content)


def test_json_object_through_completions_streaming(server: Server) -> None:
    """json_object: the first token must open an object; a bias on "}" then closes it."""
    body = {
        "prompt": "x",
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "response_format": {"type": "json_object"},
        "logit_bias": {"125": 50},  # "}"
    }
    with server.http().stream("POST", COMPLETIONS, json=body) as response:
        events = json_payloads(list(iter_sse(response)))
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == "{}"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "yaml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        {"type": "json_schema", "json_schema": "not an object"},
    ],
)
def test_bad_response_format_is_400(server: Server, response_format: Any) -> None:
    body = {"messages": MESSAGES, "response_format": response_format}
    response = server.http().post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


def test_grammar_mask_allows_exactly_the_grammars_next_tokens() -> None:
    from spyre_server.sample.structured_output import GrammarCompiler, apply_grammars

    grammars = GrammarCompiler(TOK, 256)
    grammar = grammars.compile({"type": "json_object"})
    assert grammar is not None and grammars.compile({"type": "text"}) is None
    states = [grammar.matcher(()), grammar.matcher(())]
    assert states[1].accept(ord("{"))
    logits = torch.zeros(2, 256)
    apply_grammars(logits, states)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [ord("{")]
    # after "{" (no free whitespace): a key's quote or the closing brace
    assert (logits[1] == 0).nonzero().flatten().tolist() == [ord('"'), ord("}")]
    assert bool((logits[logits != 0] == float("-inf")).all())


# ---------------------------------------------------------------------- generation defaults
def test_the_models_generation_config_sets_the_defaults(
    http_micro_model: Any, one_torch_thread: None, tmp_path: Any
) -> None:
    """A model folder whose generation_config.json says temperature 0: requests that leave
    temperature out are greedy; a request's own temperature still wins."""
    import dataclasses

    from spyre_server.entrypoints.serve import build_app
    from tests.spyre_server.http.helpers import micro_config, micro_loaded, reference_greedy

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "top_k": 0}')
    loaded = dataclasses.replace(micro_loaded(http_micro_model), path=tmp_path)
    server = start_server(build_app(micro_config(), loaded))
    try:
        client = server.openai()
        expected = [s.token_id for s in reference_greedy(http_micro_model, TOK.encode("abc"), 6, 0)]
        for _ in range(2):
            out = client.completions.create(
                model=MODEL_NAME, prompt="abc", max_tokens=6, logprobs=0
            )
            tokens = out.choices[0].logprobs.tokens
            assert tokens == [TOK.decode([t]) for t in expected]
        hot = client.completions.create(
            model=MODEL_NAME, prompt="abc", max_tokens=6, logprobs=0, temperature=2.0, seed=3
        )
        assert hot.choices[0].logprobs.tokens != [TOK.decode([t]) for t in expected]
    finally:
        server.close()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, {}),
        ("not json", {}),
        ('{"bos_token_id": 1, "eos_token_id": 2}', {}),  # SmolLM2's: no sampling defaults
        (
            '{"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}',
            {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05},
        ),
        ('{"temperature": true, "top_k": 0}', {}),
    ],
)
def test_generation_defaults_read_only_sampling_numbers(
    tmp_path: Any, content: str | None, expected: dict[str, float]
) -> None:
    from spyre_server.api.generation_defaults import GenerationDefaults

    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    assert GenerationDefaults.read(tmp_path) == GenerationDefaults(**expected)
