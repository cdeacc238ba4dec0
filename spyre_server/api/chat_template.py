"""``model.chat_template`` / ``serve --chat-template``: a Jinja chat template that replaces the
tokenizer's own, given as a file path or inline (as vLLM accepts it)."""

from __future__ import annotations

from pathlib import Path

_JINJA_CHARACTERS = "{}\n"
"""Text holding any of these is an inline template, not a file name (vLLM's rule)."""


def load_chat_template(value: str) -> str:
    """The template text: the file's content if ``value`` names a readable file, else ``value``
    itself when it looks like a template. Raises ValueError for a file name that cannot be read
    (a missing file must not become a template that renders its own path)."""
    try:
        return Path(value).expanduser().read_text()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        if any(c in value for c in _JINJA_CHARACTERS):
            return value
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ValueError(
            f"{value!r} is neither a readable file nor an inline Jinja template ({reason})"
        ) from None
