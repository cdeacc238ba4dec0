"""The model's own sampling defaults (its ``generation_config.json``), applied to the fields a
request leaves out, as vLLM does (``--generation-config auto``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """``None``: the model ships no default; OpenAI's then applies."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def read(cls, model_folder: Path) -> GenerationDefaults:
        """From ``model_folder/generation_config.json``; none if the file is missing."""
        path = model_folder / "generation_config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return cls()
        top_k = config.get("top_k")
        defaults = cls(
            temperature=_number(config.get("temperature")),
            top_p=_number(config.get("top_p")),
            # HF's top_k 0 (and its default of 50 is not written to the file) means "off".
            top_k=int(top_k) if isinstance(top_k, int) and top_k > 0 else None,
            repetition_penalty=_number(config.get("repetition_penalty")),
        )
        if defaults != cls():
            logger.info("sampling defaults from %s: %s", path, defaults)
        return defaults


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
