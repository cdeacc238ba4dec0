"""Incremental detokenization with stop strings.

Text is released only once it is stable: a token sequence that ends inside a multi-byte character
decodes to U+FFFD and waits for the next token, and the last ``max(len(stop)) - 1`` characters are
held back while they could still be the start of a stop string.

Stop strings are looked for only once more than ``min_tokens`` tokens exist, as vLLM does: text
of the first ``min_tokens`` tokens never stops a request by itself, but a stop string that ends
in a later token's text may begin in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_PROMPT_CONTEXT_TOKENS = (
    5  # prompt tokens decoded with the output, so leading spaces come out right
)


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    __slots__ = (
        "_emitted",
        "_hold_back",
        "_min_tokens",
        "_num_tokens",
        "_prefix_offset",
        "_read_offset",
        "_staged",
        "_stop",
        "_token_ids",
        "_tokenizer",
        "stop_string",
        "text",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = tuple(stop)
        self._hold_back = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._num_tokens = 0
        """Output tokens added so far."""
        self.text = ""
        """The output text so far (cut before a stop string once one is found)."""
        self.stop_string: str | None = None
        """The stop string found, if one was."""
        self._emitted = 0
        self._staged: tuple[int, int, int, str] | None = None
        """State before the provisional token: tokens, offsets, text."""

    def add_token(self, token_id: int) -> str | None:
        """Add a sampled token; returns the stop string its text completed, if one did. The
        token stays provisional until ``release``, which can take it back."""
        self._staged = (self._num_tokens, self._prefix_offset, self._read_offset, self.text)
        if self.stop_string is not None:
            return None  # the text already ended before a stop string
        self._token_ids.append(token_id)
        self._num_tokens += 1
        return self.stop_string if self._append(self._decode_new(flush=False)) else None

    def release(self, *, drop_last: bool = False, finished: bool = False) -> str:
        """The text that can be released now. ``drop_last`` takes back the token added last
        (a stop token: its text is not output); ``finished`` releases everything left, an
        incomplete character included (as U+FFFD)."""
        if drop_last and self._staged is not None:
            num_tokens, self._prefix_offset, self._read_offset, self.text = self._staged
            del self._token_ids[len(self._token_ids) - (self._num_tokens - num_tokens) :]
            self._num_tokens = num_tokens
            self.stop_string = None
        self._staged = None
        stopped = self.stop_string is not None
        if finished and not stopped:
            self._append(self._decode_new(flush=True))
            stopped = self.stop_string is not None
        releasable = len(self.text) if finished or stopped else len(self.text) - self._hold_back
        delta = self.text[self._emitted : max(releasable, self._emitted)]
        self._emitted += len(delta)
        return delta

    def add_tokens(self, token_ids: Sequence[int], finished: bool) -> tuple[str, bool]:
        """Add several tokens and release; returns (text released now, stop string found)."""
        for token_id in token_ids:
            if self.add_token(token_id) is not None:
                break
        return self.release(finished=finished), self.stop_string is not None

    def _append(self, new_text: str) -> bool:
        """Add decoded text; cut it before a stop string and return True if one appears (once
        more than ``min_tokens`` tokens exist)."""
        if not new_text:
            return False
        new_from = len(self.text)
        self.text += new_text
        if self._num_tokens <= self._min_tokens:
            return False
        found = self._find_stop(new_from)
        if found is None:
            return False
        cut, self.stop_string = found
        self.text = self.text[:cut]
        return True

    def _decode_new(self, flush: bool) -> str:
        ids = self._token_ids
        prefix_text = self._tokenizer.decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full_text = self._tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not flush):
            return ""  # nothing new, or an incomplete character: wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full_text[len(prefix_text) :]

    def _find_stop(self, new_from: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the text from ``new_from`` on (the first listed
        on a tie), and where it starts. Text before ``new_from`` was searched already, or is the
        first ``min_tokens`` tokens' text."""
        found = [
            (i, s)
            for s in self._stop
            if (i := self.text.find(s, max(0, new_from - len(s) + 1))) >= 0
        ]
        return min(found, key=lambda f: f[0]) if found else None
