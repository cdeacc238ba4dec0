"""Structured output (``response_format`` ``json_object`` / ``json_schema``) with xgrammar: a
grammar compiled once per request, a matcher per sequence, and a token bitmask applied to the
logits rows of the sequences that have one (vectorised: one C++ fill per row, one masked
write for the batch).

xgrammar is imported lazily: without it the server runs, and only a request that asks for
structured output gets a 400 saying so.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class StructuredOutputError(ValueError):
    """The response_format cannot be served (malformed schema, xgrammar missing)."""


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A compiled grammar; each sequence that follows it gets its own ``matcher``."""

    compiled: Any
    description: str

    def matcher(self, stop_token_ids: Sequence[int]) -> GrammarState:
        """A fresh matcher; it ends at one of ``stop_token_ids``, or, when there are none, as
        soon as the grammar is complete."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(
            self.compiled,
            override_stop_tokens=list(stop_token_ids) or None,
            terminate_without_stop_token=not stop_token_ids,
        )
        return GrammarState(matcher)


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammars(logits: torch.Tensor, states: Sequence[GrammarState]) -> None:
    """Mask, in place, every token row ``i`` of ``logits`` that ``states[i]`` does not allow
    next (a terminated state leaves its row as it is)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[1])
    for row, state in enumerate(states):
        if not state.is_terminated:
            state.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])


class GrammarCompiler:
    """Compiles ``response_format`` values for one tokenizer; the tokenizer's vocabulary is
    read once, on first use (a few seconds for a 49k vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compile(self, response_format: dict[str, Any]) -> Grammar | None:
        """``None`` for ``{"type": "text"}``; raises StructuredOutputError for what cannot be
        compiled."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise StructuredOutputError(
                    "response_format json_schema needs {'json_schema': {'name': ..., "
                    "'schema': {...}}}"
                )
            schema = spec.get("schema", {})
        else:
            raise StructuredOutputError(
                f"response_format type {kind!r} is not one of text, json_object, json_schema"
            )
        compiler = self._get_compiler()
        try:
            # No free whitespace: small models otherwise loop on blanks inside the JSON.
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError on bad schemas
            raise StructuredOutputError(f"the JSON schema cannot be compiled: {exc}") from None
        return Grammar(compiled, str(kind))

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise StructuredOutputError(
                        "structured output needs the xgrammar package, which is not installed"
                    ) from None
                self._compiler = xgr.GrammarCompiler(
                    _tokenizer_info(xgr, self._tokenizer, self._vocab_size)
                )
            return self._compiler


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int) -> Any:
    """From an HF tokenizer; else (a test tokenizer) from its byte-level token strings."""
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    vocab = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size)
