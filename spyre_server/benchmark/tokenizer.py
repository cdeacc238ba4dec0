"""The local HF tokenizer of a benchmark: where the default one is, loading it, its ordinary ids.

The benchmark sends prompts as token ids, so it needs the served model's vocabulary: the ids it may
draw prompts from, and (multi-turn) the encoding of the text a server returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spyre_server.benchmark.errors import BenchError


def default_tokenizer_path() -> Path:
    """The default model's prepared folder (``spyre-server prepare-model`` creates it)."""
    from spyre_server.model.store import DEFAULT_MODEL_NAME, default_cache_dir

    return default_cache_dir() / DEFAULT_MODEL_NAME


def load_tokenizer(path: Path | None) -> Any:
    """Load the HF tokenizer in the folder ``path`` (``None``: the default model's folder).

    A folder with ``tokenizer.json`` is loaded with ``PreTrainedTokenizerFast`` (what
    ``AutoTokenizer`` returns for it too, but without ``AutoConfig``, which imports torch);
    others with ``AutoTokenizer``. Raises BenchError with a one-line message when it fails."""
    if path is None:
        path = default_tokenizer_path()
        if not path.is_dir():
            raise BenchError(
                f"no tokenizer: the default model's folder {path} does not exist; pass "
                "--tokenizer PATH (a local HF tokenizer folder of the served model), or run "
                "`spyre-server prepare-model`"
            )
    if not path.is_dir():
        raise BenchError(f"--tokenizer {path}: no such folder")
    try:
        if (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        message = " ".join(str(exc).split())
        raise BenchError(f"cannot load the tokenizer in {path}: {message}") from None


def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """The ids a random prompt may use: the whole vocabulary minus the special ids and every added
    token (chat markers, padding and the like), ascending."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ids = [i for i in range(len(tokenizer)) if i not in excluded]
    if not ids:
        raise BenchError("the tokenizer has no ordinary (non-special) token ids")
    return ids
