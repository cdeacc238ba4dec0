"""``model.chat_template`` (``serve --chat-template``): chat requests use the given template
instead of the tokenizer's own, from a file or inline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.spyre_server.http.helpers import (
    MODEL_NAME,
    ByteChatTokenizer,
    MakeServer,
    reference_greedy,
)

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
RENDERED = "<system>Be brief.<user>Hi!<assistant>"
"""TEMPLATE applied to MESSAGES, by hand."""
DEFAULT_RENDERED = "system: Be brief.\nuser: Hi!\nassistant: "
"""The test tokenizer's own template applied to MESSAGES."""


def chat(server: Any) -> Any:
    return server.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("where", ["inline", "file"])
def test_the_chat_template_replaces_the_tokenizers_own(
    make_server: MakeServer, http_micro_model: Any, tmp_path: Path, where: str
) -> None:
    value = TEMPLATE
    if where == "file":
        path = tmp_path / "chat.jinja"
        path.write_text(TEMPLATE)
        value = str(path)
    out = chat(make_server(model__chat_template=value))
    assert out.usage is not None and out.usage.prompt_tokens == len(RENDERED)
    # the model saw exactly the rendered prompt: its greedy continuation is that prompt's
    expected = reference_greedy(http_micro_model, ByteChatTokenizer().encode(RENDERED), 4, 0)
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.content is not None
    got = [entry.bytes for entry in out.choices[0].logprobs.content]
    assert got == [[step.token_id] for step in expected]  # a byte tokenizer: id = byte


def test_without_a_chat_template_the_tokenizers_own_is_used(make_server: MakeServer) -> None:
    out = chat(make_server())
    assert out.usage is not None and out.usage.prompt_tokens == len(DEFAULT_RENDERED)
