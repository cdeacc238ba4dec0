"""Server configuration: one YAML file (config.yaml documents every key), overridden by environment
variables ``SPYRE_SERVER_<SECTION>__<KEY>`` and then by command-line flags.

Unknown keys and invalid values stop the start with a message naming the key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_model_len: int = Field(2048, gt=0)
    served_model_name: str | None = None
    num_threads: int | None = Field(None, gt=0)
    cache_dir: Path | None = None


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


class Config(_Section):
    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    server: ServerSection = ServerSection()


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
) -> Config:
    """File, then environment, then ``overrides`` (``{"server.port": 9000}``), validated once."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must be a mapping of sections")
        # A section with every key commented out reads as null: it means "all defaults".
        data = {k: ({} if v is None else v) for k, v in loaded.items()}
    env = os.environ if environ is None else environ
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, sep, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if not sep or not key:
            raise ConfigError(f"{name}: expected {ENV_PREFIX}<SECTION>__<KEY>")
        _set(data, section, key, _parse_env_value(raw), source=name)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        _set(data, section, key, value, source=dotted)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def _parse_env_value(raw: str) -> Any:
    """YAML scalars and lists (``8``, ``true``, ``[a, b]``, ``null``); anything that is not
    valid YAML is taken as the plain string."""
    if raw == "":
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _set(data: dict[str, Any], section: str, key: str, value: Any, *, source: str) -> None:
    if data.get(section) is None:
        data[section] = {}
    target = data[section]
    if not isinstance(target, dict):
        raise ConfigError(f"{source}: section {section!r} is not a mapping")
    target[key] = value
