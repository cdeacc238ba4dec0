"""The raw bytes of one token, for OpenAI's logprob ``bytes`` field (a character split across
tokens can only be rebuilt from these, not from each token's decoded text)."""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """Byte-level BPE tokens map back through the GPT-2 table; SentencePiece byte-fallback
    tokens (``<0xNN>``) are that byte; other pieces are their UTF-8 (``▁`` as a space)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token_id) if convert is not None else None
    if not isinstance(piece, str):
        return str(tokenizer.decode([token_id])).encode()
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    decoder = _byte_level_decoder()
    if _is_byte_level(tokenizer) and all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode()


_BYTE_LEVEL: dict[int, bool] = {}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer is a byte-level BPE (GPT-2 style), looked up once per tokenizer."""
    key = id(tokenizer)
    if key not in _BYTE_LEVEL:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            _BYTE_LEVEL[key] = "ByteLevel" in backend.to_str()
        else:  # a tokenizer without an HF backend says so itself, or is taken as byte-level
            _BYTE_LEVEL[key] = bool(getattr(tokenizer, "is_byte_level", True))
    return _BYTE_LEVEL[key]
