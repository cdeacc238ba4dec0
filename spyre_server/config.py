"""Server configuration: one YAML file (config.yaml documents every key), overridden by environment
variables ``SPYRE_SERVER_<SECTION>__<KEY>`` and then by command-line flags.

Unknown keys and invalid values stop the start with a message naming the key, where it was set
(file, variable or flag) and, for a misspelt key, the nearest valid one.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from spyre_server.api.chat_template import load_chat_template

ENV_PREFIX = "SPYRE_SERVER_"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=True, coerce_numbers_to_str=True
    )


class ModelSection(_Section):
    path: Path | None = None
    backend: Literal["cpu", "spyre"] = "cpu"
    compile_backend: Literal["eager", "inductor", "sendnn"] = "sendnn"
    linear_kernel: Literal["auto", "native", "onednn", "aten"] = "auto"
    native_avx512: bool = True
    native_amx: bool = True
    attention_kernel: Literal["auto", "native", "amx", "avx512_bf16", "mixed", "flash"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(2048, gt=0)
    served_model_name: str | None = None
    num_threads: int | None = Field(None, gt=0)
    tensor_parallel_size: int = Field(1, ge=1)
    cache_dir: Path | None = None
    kernel_dir: Path | None = None
    chat_template: str | None = None
    allow_unverified_config: bool = False
    graph_cache_dir: Path | None = None
    require_precompiled: bool = False

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is not None:
            load_chat_template(value)  # fail at start, not at the first chat request
        return value

    @model_validator(mode="after")
    def _float16_is_for_spyre(self) -> ModelSection:
        if self.dtype == "float16" and self.backend == "cpu":
            raise ValueError(
                "model.dtype float16 is the Spyre card's precision (model.backend: spyre); "
                "the cpu backend takes auto, float32 or bfloat16"
            )
        return self


class CacheSection(_Section):
    block_size: Literal[64] = 64
    num_blocks: int | None = Field(None, ge=2)
    kv_cache_memory: str = "2GiB"
    enable_prefix_caching: bool = True
    cache_decode_blocks: bool = True
    hash_seed: int | str | None = None

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        parse_bytes(value)
        return value

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)


class SchedulerSection(_Section):
    chunk_size: int = Field(256, gt=0, multiple_of=64)
    max_num_seqs: int = Field(8, gt=0)
    max_batch_tkv_limit: int | None = Field(None, gt=0)
    interleave: bool = True
    max_waiting: int = Field(256, ge=1)


class ServerSection(_Section):
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: list[str] = []
    isolate_cache_per_api_key: bool = False
    metrics_require_auth: bool = False
    default_max_tokens: int = Field(256, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    graceful_shutdown_seconds: float = Field(20.0, gt=0)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class KVEventsSection(_Section):
    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"
    topic: str | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"(tcp|ipc|inproc)://\S+", value):
            raise ValueError(f"{value!r} is not a ZMQ address such as 'tcp://0.0.0.0:5557'")
        return value


class Config(_Section):
    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    server: ServerSection = ServerSection()
    kv_events: KVEventsSection = KVEventsSection()


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> 2147483648. Accepts B, KB/MB/GB/TB (powers of 10) and KiB..TiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size such as '2GiB' or '512MiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    override_sources: Mapping[str, str] | None = None,
) -> Config:
    """File, then environment, then ``overrides`` (``{"server.port": 9000}``), validated once.

    ``override_sources`` names where an override came from (``{"server.port": "--port"}``):
    every error names the file, environment variable or flag that set the key, and an unknown
    key or section comes with the nearest valid spelling."""
    data: dict[str, Any] = {}
    sources: dict[tuple[str, str], str] = {}
    if path is not None:
        data = _read_file(path)
        for section, values in data.items():
            for key in values if isinstance(values, dict) else ():
                sources[section, str(key)] = f"config file {path}"
    env = os.environ if environ is None else environ
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, sep, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if not sep or not key:
            raise ConfigError(f"{name}: expected {ENV_PREFIX}<SECTION>__<KEY>")
        _set(data, section, key, parse_env_value(raw, _annotation(section, key)), source=name)
        sources[section, key] = name
    for dotted, value in (overrides or {}).items():
        source = (override_sources or {}).get(dotted)
        section, sep, key = dotted.partition(".")
        if not sep or not key:
            raise ConfigError(f"{source or dotted}: expected <section>.<key>, got {dotted!r}")
        _set(data, section, key, value, source=source or dotted)
        if source is None:
            sources.pop((section, key), None)  # set by the caller: nothing to name
        else:
            sources[section, key] = source
    problems = _unknown_keys(data, sources)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems += [_describe(err, sources) for err in exc.errors() if err["type"] != _EXTRA]
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
    return config


_EXTRA = "extra_forbidden"  # reported by _unknown_keys, with a suggestion


def _read_file(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections")
    # A section with every key commented out reads as null: it means "all defaults".
    return {str(k): ({} if v is None else v) for k, v in loaded.items()}


def _sections() -> dict[str, type[BaseModel]]:
    out = {}
    for name, field in Config.model_fields.items():
        assert isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        out[name] = field.annotation
    return out


def _annotation(section: str, key: str) -> Any:
    """The type of ``section.key``; ``None`` for an unknown key."""
    model = _sections().get(section)
    field = model.model_fields.get(key) if model is not None else None
    return field.annotation if field is not None else None


def env_name(section: str, key: str) -> str:
    """``("scheduler", "chunk_size")`` -> ``SPYRE_SERVER_SCHEDULER__CHUNK_SIZE``."""
    return f"{ENV_PREFIX}{section.upper()}__{key.upper()}"


def _unknown_keys(data: Mapping[str, Any], sources: Mapping[tuple[str, str], str]) -> list[str]:
    """One problem per unknown section or key, with the nearest valid spelling."""
    sections = _sections()
    problems = []
    for section, values in data.items():
        keys = [str(k) for k in values] if isinstance(values, dict) else []
        if section not in sections:
            source = sources.get((section, keys[0])) if keys else None
            guess = _nearest(section, sections)
            hint = ""
            if guess is not None:
                valid = [k for k in keys if k in sections[guess].model_fields]
                hint = f"; did you mean {_spell(guess, valid[0] if valid else None, source)}?"
            problems.append(f"unknown section {section!r}{_from(source)}{hint}")
            continue
        for key in keys:
            if key in sections[section].model_fields:
                continue
            source = sources.get((section, key))
            guess = _nearest(key, sections[section].model_fields)
            hint = f"; did you mean {_spell(section, guess, source)}?" if guess else ""
            problems.append(f"unknown key {section}.{key}{_from(source)}{hint}")
    return problems


def _nearest(word: str, candidates: Mapping[str, Any]) -> str | None:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if not matches:  # a prefix or a part of the name: "max_len" -> "max_model_len"
        matches = [c for c in candidates if word and (c.startswith(word) or word in c)]
    return matches[0] if matches else None


def _spell(section: str, key: str | None, source: str | None) -> str:
    """How the user would write the suggestion: as an environment variable if they used one."""
    if key is None:
        return repr(section)
    if source is not None and source.startswith(ENV_PREFIX):
        return env_name(section, key)
    return f"{section}.{key}"


def _from(source: str | None) -> str:
    return f" (from {source})" if source else ""


def _describe(error: Any, sources: Mapping[tuple[str, str], str]) -> str:
    loc = [str(part) for part in error["loc"]]
    source = sources.get((loc[0], loc[1])) if len(loc) >= 2 else None
    return f"{'.'.join(loc)}{_from(source)}: {error['msg']}"


def parse_env_value(raw: str, annotation: Any = None) -> Any:
    """An environment variable's value for a key of type ``annotation``.

    Empty means null. A list takes comma-separated values (``a,b``) or a YAML flow sequence
    (``[a, "b,c"]``). A string or path key takes the text as it is (``010`` stays ``"010"``).
    Anything else is read as a YAML scalar (``8``, ``true``, ``2GiB``); text that is not valid
    YAML stays the plain string."""
    if raw == "":
        return None
    if _is_list(annotation) and not raw.lstrip().startswith("["):
        return [item.strip() for item in raw.split(",") if item.strip()]
    if _is_text(annotation):
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _union_args(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    return [a for a in args if a is not type(None)] or [annotation]


def _is_list(annotation: Any) -> bool:
    return any(typing.get_origin(a) is list for a in _union_args(annotation))


def _is_text(annotation: Any) -> bool:
    return annotation is not None and all(a in (str, Path) for a in _union_args(annotation))


def _set(data: dict[str, Any], section: str, key: str, value: Any, *, source: str) -> None:
    if data.get(section) is None:
        data[section] = {}
    target = data[section]
    if not isinstance(target, dict):
        raise ConfigError(f"{source}: section {section!r} is not a mapping")
    target[key] = value
