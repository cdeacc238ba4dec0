"""The card's known-good configurations (``known_configs.yaml``): which model a checkpoint is,
and whether the card's stack has validated the configuration it is served with.

The reference is sendnn-inference 2.6.3's model registry: ``config/model_configs.yaml`` (the
data), ``config/model_matcher.py`` (a model is identified by fields of its HF config),
``config/model_registry.py`` (the most specific match wins; tensor-parallel size,
max_model_len and max_num_seqs are matched exactly) and ``config/configurators/
model_configurator.py`` (a configuration's block count, batch x tkv limit and environment,
the operator's own values kept with a warning). It consults the registry only with the
``sendnn`` backend (``platform.py``), and so do we.

Where we differ: outside a known-good configuration the reference starts anyway (capping
max_num_seqs at 32 and max_model_len at 32K) unless SENDNN_INFERENCE_REQUIRE_KNOWN_CONFIG is
set; we refuse, naming the nearest known-good configuration, unless the operator sets
``model.allow_unverified_config`` (``--allow-unverified-config``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from spyre_server.config import Config
from spyre_server.model.errors import ModelLoadError

logger = logging.getLogger(__name__)

KNOWN_CONFIGS = Path(__file__).with_name("known_configs.yaml")
REGISTRY = "spyre_server/model/spyre/known_configs.yaml"
"""How messages name it."""

OVERRIDE_HINT = (
    "model.allow_unverified_config: true (--allow-unverified-config, "
    "SPYRE_SERVER_MODEL__ALLOW_UNVERIFIED_CONFIG=true)"
)


class UnverifiedConfigError(ModelLoadError):
    """The configuration is not one the card's stack has validated; the message names the
    nearest one that is, and the override."""


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """One known-good configuration of a model."""

    tp: int
    max_model_len: int
    max_num_seqs: int
    max_batch_tkv_limit: int | None = None
    num_blocks: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        return self.max_model_len, self.max_num_seqs

    @property
    def shape(self) -> str:
        return f"{self.max_model_len} x {self.max_num_seqs}"


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    match: Mapping[str, Any]
    """config.json fields that identify the model (``model_type`` among them)."""
    platforms: tuple[str, ...]
    configs: tuple[RuntimeConfig, ...]

    @property
    def specificity(self) -> int:
        """The reference's field count: every field but model_type, a mapping 1 + its keys."""
        fields = [v for k, v in self.match.items() if k != "model_type"]
        return len(fields) + sum(len(v) for v in fields if isinstance(v, Mapping))


@functools.cache
def known_models(path: Path = KNOWN_CONFIGS) -> tuple[KnownModel, ...]:
    """The models of ``path``, in its order; ValueError for a malformed file."""
    data = yaml.safe_load(path.read_text()) or {}
    models = []
    for name, entry in (data.get("models") or {}).items():
        match = dict(entry["match"])
        if not isinstance(match.get("model_type"), str):
            raise ValueError(f"{path}: {name}: match needs a model_type")
        configs = tuple(
            RuntimeConfig(
                tp=int(c["tp"]),
                max_model_len=int(c["max_model_len"]),
                max_num_seqs=int(c["max_num_seqs"]),
                max_batch_tkv_limit=c.get("max_batch_tkv_limit"),
                num_blocks=c.get("num_blocks"),
                env={str(k): str(v) for k, v in (c.get("env") or {}).items()},
            )
            for c in entry["configs"]
        )
        keys = [(c.tp, c.max_model_len, c.max_num_seqs) for c in configs]
        if not configs or len(set(keys)) != len(keys):
            raise ValueError(f"{path}: {name}: no configs, or one listed twice")
        models.append(KnownModel(name, match, tuple(entry.get("platforms") or ()), configs))
    return tuple(models)


# ------------------------------------------------------------------------------ matching
def hf_fields(raw: Mapping[str, Any]) -> Any:
    """config.json as the reference's matcher sees it: transformers' config class for its
    model_type (with HF's defaults), or the plain fields for a model_type transformers does
    not know."""
    model_type = raw.get("model_type")
    try:
        from transformers import CONFIG_MAPPING

        fields = {k: v for k, v in raw.items() if k != "model_type"}
        return CONFIG_MAPPING[model_type].from_dict(fields)
    except Exception:  # an unknown model_type, or fields transformers refuses
        return dict(raw)


def _get(config: Any, name: str) -> tuple[bool, Any]:
    if isinstance(config, Mapping):
        return name in config, config.get(name)
    return hasattr(config, name), getattr(config, name, None)


def _matches(config: Any, pattern: Mapping[str, Any]) -> bool:
    """Every field of ``pattern`` is in ``config`` and equal; a mapping field holds keys each
    equal (``model_matcher.py``)."""
    for name, expected in pattern.items():
        present, actual = _get(config, name)
        if not present:
            return False
        if isinstance(expected, Mapping):
            if actual is None or not _matches(actual, expected):
                return False
        elif actual != expected:
            return False
    return True


def identify(config: Any, models: tuple[KnownModel, ...] | None = None) -> KnownModel | None:
    """The known model ``config`` (``hf_fields``) is: of those whose fields all match, the one
    with the most fields, the first listed among equals (``model_registry.py``)."""
    best: KnownModel | None = None
    for model in known_models() if models is None else models:
        if _matches(config, model.match) and (best is None or model.specificity > best.specificity):
            best = model
    return best


def _closest_model(config: Any, models: tuple[KnownModel, ...]) -> tuple[KnownModel, list[str]]:
    """The known model with the fewest fields that differ from ``config``, and those fields."""

    def differences(model: KnownModel) -> list[str]:
        out = []
        for name, expected in model.match.items():
            present, actual = _get(config, name)
            if isinstance(expected, Mapping):
                if not present or actual is None or not _matches(actual, expected):
                    out.append(f"{name} {expected}")
            elif not present or actual != expected:
                out.append(f"{name} {expected} (this model: {actual if present else 'none'})")
        return out

    return min(((m, differences(m)) for m in models), key=lambda pair: len(pair[1]))


def nearest(
    configs: tuple[RuntimeConfig, ...], max_model_len: int, max_num_seqs: int
) -> RuntimeConfig:
    """The configuration closest to ``max_model_len x max_num_seqs``: the smallest sum of
    the two factors' log2 distances (then the longer max_model_len)."""
    return min(
        configs,
        key=lambda c: (
            abs(math.log2(c.max_model_len / max_model_len))
            + abs(math.log2(c.max_num_seqs / max_num_seqs)),
            -c.max_model_len,
        ),
    )


# ------------------------------------------------------------------------------ the check
@dataclass(frozen=True, slots=True)
class CardConfig:
    """What the registry says about one start: the known model and configuration (if any),
    the values the card's stack takes from it, and what is outside it."""

    model: KnownModel | None = None
    runtime: RuntimeConfig | None = None
    problems: tuple[str, ...] = ()
    """Why the configuration is not a known-good one (empty: it is)."""
    max_batch_tkv_limit: int | None = None
    """``scheduler.max_batch_tkv_limit``: the operator's, else the registry's, else unset."""
    num_blocks: int | None = None
    """``cache.num_blocks``: the operator's, else the registry's, else unset."""
    env: Mapping[str, str] = field(default_factory=dict)
    """The configuration's environment, for the variables not set already."""

    def apply(self, config: Config) -> Config:
        """``config`` with the registry's batch x tkv limit and block count where it left
        them unset."""
        scheduler = config.scheduler.model_copy(
            update={"max_batch_tkv_limit": self.max_batch_tkv_limit}
        )
        cache = config.cache.model_copy(update={"num_blocks": self.num_blocks})
        return config.model_copy(update={"scheduler": scheduler, "cache": cache})

    def check(self, allow_unverified: bool) -> None:
        """Refuse a configuration outside the known-good ones (UnverifiedConfigError), or with
        ``allow_unverified``, warn and go on."""
        if not self.problems:
            if self.model is not None and self.runtime is not None:
                logger.info(
                    "known-good configuration: %s, tp %d, max_model_len x max_num_seqs %s",
                    self.model.name,
                    self.runtime.tp,
                    self.runtime.shape,
                )
            return
        message = "; ".join(self.problems)
        if not allow_unverified:
            raise UnverifiedConfigError(
                f"not a known-good configuration of the Spyre card: {message}. To start "
                f"anyway, set {OVERRIDE_HINT}"
            )
        logger.warning(
            "model.allow_unverified_config: starting a configuration the Spyre card's stack "
            "has not validated: %s",
            message,
        )


def read_config_json(path: Path | None) -> Mapping[str, Any] | None:
    """A model folder's config.json, or None where there is none to read (the model loader
    reports that)."""
    if path is None:
        return None
    try:
        raw = json.loads((path.expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def card_config(
    raw: Mapping[str, Any] | None,
    *,
    model_label: str,
    tp: int,
    max_model_len: int,
    max_num_seqs: int,
    max_batch_tkv_limit: int | None = None,
    num_blocks: int | None = None,
    environ: Mapping[str, str] | None = None,
    models: tuple[KnownModel, ...] | None = None,
) -> CardConfig:
    """The registry's verdict on serving the model whose config.json is ``raw`` (None: none
    to read; ``model_label`` names the model in messages) on ``tp`` cards with these limits.
    The operator's ``max_batch_tkv_limit`` and ``num_blocks`` (None: unset) win over the
    registry's, as the reference's configurator keeps them, and are reported where they
    differ; so is a variable of the configuration's environment already set otherwise."""
    models = known_models() if models is None else models
    environ = os.environ if environ is None else environ
    own = CardConfig(max_batch_tkv_limit=max_batch_tkv_limit, num_blocks=num_blocks)
    shape = f"max_model_len x max_num_seqs {max_model_len} x {max_num_seqs} on tp {tp}"
    if raw is None:
        return replace(own, problems=(f"{model_label} is none of the models of {REGISTRY}",))
    fields = hf_fields(raw)
    model = identify(fields, models)
    if model is None:
        closest, differences = _closest_model(fields, models)
        return replace(
            own,
            problems=(
                f"{model_label} (model_type {raw.get('model_type')!r}) is none of the models "
                f"of {REGISTRY}; the nearest is {closest.name}, which has "
                + ", ".join(differences),
            ),
        )
    machine = platform.machine()
    if model.platforms and machine not in model.platforms:
        logger.warning(
            "the card's stack does not support %s on %s (it does on %s)",
            model.name,
            machine,
            ", ".join(model.platforms),
        )
    wanted = (tp, max_model_len, max_num_seqs)
    runtime = next((c for c in model.configs if (c.tp, *c.key) == wanted), None)
    if runtime is None:
        best = nearest(
            tuple(c for c in model.configs if c.tp == tp) or model.configs,
            max_model_len,
            max_num_seqs,
        )
        known = ", ".join(f"{c.shape} on tp {c.tp}" for c in model.configs)
        return replace(
            own,
            model=model,
            problems=(
                f"{model.name} with {shape} (its known-good configurations: {known}); the "
                f"nearest is {best.shape} on tp {best.tp}: model.max_model_len "
                f"{best.max_model_len}, scheduler.max_num_seqs {best.max_num_seqs}",
            ),
        )
    problems = [
        f"{key} is {value}; {model.name} with {shape} takes {known}"
        for key, value, known in (
            ("scheduler.max_batch_tkv_limit", max_batch_tkv_limit, runtime.max_batch_tkv_limit),
            ("cache.num_blocks", num_blocks, runtime.num_blocks),
        )
        if value is not None and known is not None and value != known
    ]
    problems += [
        f"{name} is {environ[name]}; {model.name} with {shape} takes {value}"
        for name, value in runtime.env.items()
        if environ.get(name, value) != value
    ]
    return CardConfig(
        model=model,
        runtime=runtime,
        problems=tuple(problems),
        max_batch_tkv_limit=(
            runtime.max_batch_tkv_limit if max_batch_tkv_limit is None else max_batch_tkv_limit
        ),
        num_blocks=runtime.num_blocks if num_blocks is None else num_blocks,
        env={name: value for name, value in runtime.env.items() if name not in environ},
    )


DEFAULT_MODEL_LABEL = "the default model (SmolLM2-135M-Instruct)"


def registry_config(config: Config, model_path: Path | None) -> CardConfig:
    """The registry's verdict for ``config`` serving the model folder ``model_path`` (None:
    the default model). Consulted on the spyre backend with compile_backend sendnn only, as
    the reference does (``platform.py``); elsewhere the operator's values, nothing to check."""
    scheduler, cache = config.scheduler, config.cache
    if config.model.backend != "spyre" or config.model.compile_backend != "sendnn":
        return CardConfig(
            max_batch_tkv_limit=scheduler.max_batch_tkv_limit, num_blocks=cache.num_blocks
        )
    return card_config(
        read_config_json(model_path),
        model_label=DEFAULT_MODEL_LABEL if model_path is None else str(model_path),
        tp=config.model.tensor_parallel_size,
        max_model_len=config.model.max_model_len,
        max_num_seqs=scheduler.max_num_seqs,
        max_batch_tkv_limit=scheduler.max_batch_tkv_limit,
        num_blocks=cache.num_blocks,
    )
