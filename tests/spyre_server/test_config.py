"""Configuration (spyre_server/config.py) and the config-driven parts of loading.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from spyre_server.config import Config, ConfigError, load_config, parse_bytes
from spyre_server.engine.factory import build_engine
from spyre_server.model import loading
from spyre_server.model.loading import LoadedModel, ModelLoadError, num_kv_blocks
from spyre_server.model.runner import kv_cache_shape
from tests.spyre_server.conftest import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]


def write_yaml(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# --- defaults and sources -------------------------------------------------------------------------


def test_defaults() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert config.model.path is None
    assert config.model.dtype == "auto"
    assert config.model.max_model_len == 2048
    assert config.cache.block_size == 64
    assert config.cache.num_blocks is None
    assert config.cache.kv_cache_memory == "2GiB"
    assert config.cache.kv_cache_bytes == 2 * 2**30
    assert config.cache.enable_prefix_caching and config.cache.cache_decode_blocks
    assert config.cache.hash_seed is None
    assert config.scheduler.chunk_size == 256
    assert config.scheduler.max_num_seqs == 8
    assert config.scheduler.interleave is True
    assert config.server.port == 8000
    assert config.server.default_max_tokens == 256
    assert config.server.api_keys == []


def test_the_shipped_config_yaml_documents_every_key_with_its_default() -> None:
    path = REPO / "config.yaml"
    if not path.is_file():
        pytest.skip("no config.yaml at the repository root")
    assert load_config(path, environ={}) == Config()
    documented = yaml.safe_load(path.read_text())
    for section, model in Config.model_fields.items():
        assert section in documented
        assert model.annotation is not None
        assert set(documented[section]) == set(model.annotation.model_fields), section


def test_yaml_file(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
        model:
          max_model_len: 4096
          path: /models/granite
        cache:
          num_blocks: 100
          hash_seed: replica-set-1
        scheduler:
          chunk_size: 512
          interleave: false
        server:
          api_keys: [k1, k2]
        """.replace("\n        ", "\n"),
    )
    config = load_config(path, environ={})
    assert config.model.max_model_len == 4096
    assert config.model.path == Path("/models/granite")
    assert config.cache.num_blocks == 100
    assert config.cache.hash_seed == "replica-set-1"
    assert config.scheduler.chunk_size == 512
    assert config.scheduler.interleave is False
    assert config.server.api_keys == ["k1", "k2"]
    assert config.server.port == 8000  # untouched keys keep their defaults


def test_empty_yaml_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write_yaml(tmp_path, "# nothing\n"), environ={}) == Config()


def test_environment_override() -> None:
    config = load_config(
        environ={
            "SPYRE_SERVER_SCHEDULER__CHUNK_SIZE": "128",
            "SPYRE_SERVER_SERVER__API_KEYS": "[a, b]",
            "SPYRE_SERVER_CACHE__ENABLE_PREFIX_CACHING": "false",
            "SPYRE_SERVER_CACHE__KV_CACHE_MEMORY": "512MiB",
            "SPYRE_SERVER_MODEL__DTYPE": "float32",
            "HOME": "/root",  # other variables are ignored
            "SPYRE_SERVERLESS": "1",
        }
    )
    assert config.scheduler.chunk_size == 128
    assert config.server.api_keys == ["a", "b"]
    assert config.cache.enable_prefix_caching is False
    assert config.cache.kv_cache_bytes == 512 * 2**20
    assert config.model.dtype == "float32"


def test_empty_environment_value_means_null() -> None:
    config = load_config(
        environ={"SPYRE_SERVER_CACHE__NUM_BLOCKS": ""}, overrides={"cache.num_blocks": None}
    )
    assert config.cache.num_blocks is None
    config = load_config(environ={"SPYRE_SERVER_CACHE__NUM_BLOCKS": ""})
    assert config.cache.num_blocks is None


def test_process_environment_is_used_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPYRE_SERVER_SERVER__PORT", "9123")
    assert load_config().server.port == 9123


def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path, {"scheduler": {"chunk_size": 512, "max_num_seqs": 3}, "server": {"port": 1}}
    )
    env = {"SPYRE_SERVER_SCHEDULER__CHUNK_SIZE": "128", "SPYRE_SERVER_SERVER__PORT": "2"}
    overrides = {"scheduler.chunk_size": 192}

    assert load_config(path, environ={}).scheduler.chunk_size == 512
    both = load_config(path, environ=env)
    assert (both.scheduler.chunk_size, both.server.port) == (128, 2)
    assert both.scheduler.max_num_seqs == 3  # the file's other keys stay
    top = load_config(path, environ=env, overrides=overrides)
    assert (top.scheduler.chunk_size, top.server.port) == (192, 2)
    assert top.scheduler.max_num_seqs == 3


def test_config_is_immutable() -> None:
    config = load_config(environ={})
    with pytest.raises(ValueError):
        config.server.port = 1  # type: ignore[misc]


# --- errors name the key --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ({"file": {"modle": {"path": "x"}}}, "modle"),
        ({"file": {"model": {"max_len": 10}}}, "model.max_len"),
        ({"env": {"SPYRE_SERVER_CACHE__NUM_BLOCK": "5"}}, "cache.num_block"),
        ({"env": {"SPYRE_SERVER_SERVERS__PORT": "5"}}, "servers"),
        ({"overrides": {"scheduler.chunks": 5}}, "scheduler.chunks"),
        ({"overrides": {"port": 5}}, "port"),
    ],
)
def test_unknown_section_or_key(source: dict[str, Any], name: str, tmp_path: Path) -> None:
    path = write_yaml(tmp_path, source["file"]) if "file" in source else None
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_config(path, environ=source.get("env", {}), overrides=source.get("overrides"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scheduler.chunk_size", 100),  # not a multiple of 64
        ("scheduler.chunk_size", 0),
        ("cache.block_size", 32),  # Spyre requires 64
        ("cache.num_blocks", 1),  # block 0 is reserved
        ("cache.kv_cache_memory", "lots"),
        ("cache.kv_cache_memory", "2 GiBs"),
        ("model.dtype", "float16"),
        ("model.max_model_len", 0),
        ("model.max_model_len", "many"),
        ("model.num_threads", 0),
        ("model.linear_kernel", "mkl"),
        ("server.port", 70000),
        ("server.log_level", "verbose"),
        ("server.default_max_tokens", -1),
        ("scheduler.max_waiting", -1),
        ("scheduler.max_batch_tkv_limit", 0),
    ],
)
def test_invalid_values_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(environ={}, overrides={key: value})


def test_several_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides={"server.port": -1, "model.dtype": "fp8"})
    assert "server.port" in str(info.value) and "model.dtype" in str(info.value)


def test_invalid_environment_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.chunk_size"):
        load_config(environ={"SPYRE_SERVER_SCHEDULER__CHUNK_SIZE": "100"})


@pytest.mark.parametrize(
    "name", ["SPYRE_SERVER_PORT", "SPYRE_SERVER_SERVER__", "SPYRE_SERVER_SERVER_PORT"]
)
def test_malformed_environment_variable_name(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(environ={name: "1"})


@pytest.mark.parametrize("value", ["[unclosed", "*my-model"])
def test_environment_value_that_is_not_yaml(value: str) -> None:
    """BUG: load_config (config.py, ``yaml.safe_load(raw)`` in the environment loop) lets
    yaml.YAMLError escape for a value that is not valid YAML (``*my-model`` parses as an undefined
    alias, ``[unclosed`` as a broken flow sequence). The CLI only catches ConfigError, so the
    server dies with a YAML traceback that does not name the variable. Fix: catch
    yaml.YAMLError there and either keep the raw string or raise ConfigError naming the
    variable."""
    name = "SPYRE_SERVER_MODEL__SERVED_MODEL_NAME"
    try:
        config = load_config(environ={name: value})
    except ConfigError as exc:
        assert name in str(exc) or "model.served_model_name" in str(exc)
    else:
        assert config.model.served_model_name == value


@pytest.mark.parametrize(
    ("text", "problem"),
    [("model: [unclosed\n", "cannot read"), ("- a\n- b\n", "mapping"), ("just text\n", "mapping")],
)
def test_bad_config_file(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(write_yaml(tmp_path, text), environ={})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_env_into_a_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": 5})
    with pytest.raises(ConfigError, match="model"):
        load_config(path, environ={"SPYRE_SERVER_MODEL__PATH": "/x"})


# --- parse_bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1KiB", 1024),
        ("1TiB", 2**40),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("3MB", 3 * 10**6),
        ("4KB", 4000),
        ("1TB", 10**12),
        ("100B", 100),
        ("100", 100),
        ("  64 mib ", 64 * 2**20),  # case and spaces do not matter
        ("2gib", 2 * 2**30),
        ("0", 0),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2 GiBs", "1e9", "2Gi", "two GiB", "1,5GiB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


# --- loading: KV block count, dtype ---------------------------------------------------------------


def test_num_kv_blocks_from_the_memory_budget(micro_model: Any) -> None:
    shape = kv_cache_shape(micro_model)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (5, 2, 48)
    per_block_f32 = 2 * 5 * 64 * 2 * 48 * 4
    assert shape.bytes_per_block(64, torch.float32) == per_block_f32
    assert shape.bytes_per_block(64, torch.bfloat16) == per_block_f32 // 2

    config = load_config(environ={}, overrides={"cache.kv_cache_memory": f"{10 * per_block_f32}"})
    assert num_kv_blocks(config, micro_model, torch.float32) == 10
    assert num_kv_blocks(config, micro_model, torch.bfloat16) == 20
    config = load_config(
        environ={}, overrides={"cache.kv_cache_memory": f"{10 * per_block_f32 - 1}B"}
    )
    assert num_kv_blocks(config, micro_model, torch.float32) == 9  # whole blocks only
    config = load_config(environ={}, overrides={"cache.kv_cache_memory": "2GiB"})
    assert num_kv_blocks(config, micro_model, torch.float32) == 2 * 2**30 // per_block_f32


def test_num_kv_blocks_too_small_a_budget(micro_model: Any) -> None:
    config = load_config(environ={}, overrides={"cache.kv_cache_memory": "300KiB"})
    with pytest.raises(ModelLoadError, match="kv_cache_memory"):
        num_kv_blocks(config, micro_model, torch.float32)  # 1 block of 240 KiB


def test_num_blocks_overrides_the_memory_budget(micro_model: Any) -> None:
    config = load_config(
        environ={}, overrides={"cache.num_blocks": 7, "cache.kv_cache_memory": "1KiB"}
    )
    assert num_kv_blocks(config, micro_model, torch.float32) == 7


def test_build_engine_sizes_pool_and_kv_tensors(micro_model: Any) -> None:
    config = load_config(
        environ={},
        overrides={
            "cache.kv_cache_memory": "2400KiB",  # 10 float32 blocks of 240 KiB
            "scheduler.chunk_size": 128,
            "model.max_model_len": 512,
            "model.served_model_name": "tiny",
        },
    )
    loaded = LoadedModel(
        path=Path("micro"),
        name="micro",
        model=micro_model,
        tokenizer=ByteTokenizer(),
        dtype=torch.float32,
        eos_token_id=None,
        vocab_size=256,
    )
    engine = build_engine(config, loaded)
    assert engine.scheduler.pool.num_usable_blocks == 9  # block 0 is reserved
    assert engine.scheduler.config.chunk_size == 128
    assert engine.scheduler.config.max_model_len == 512
    assert len(engine.runner.kv_caches) == 5
    for keys, values in engine.runner.kv_caches:
        assert keys.shape == values.shape == (10, 64, 2, 48)
        assert keys.dtype == torch.float32
    assert engine.limits.vocab_size == 256
    assert engine.model_name == "tiny"


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loading.resolve_dtype("float32") is torch.float32
    assert loading.resolve_dtype("bfloat16") is torch.bfloat16
    for flags, expected in [
        ({"avx2", "amx_bf16"}, torch.bfloat16),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx2", "avx512f"}, torch.float32),
        (set(), torch.float32),
    ]:
        monkeypatch.setattr(loading, "cpu_flags", lambda flags=flags: flags)
        assert loading.resolve_dtype("auto") is expected


def test_cpu_flags_and_physical_cores_on_this_machine() -> None:
    flags = loading.cpu_flags()
    assert isinstance(flags, set)
    assert loading.physical_cores() >= 1


# --- where a bad value came from, and the nearest valid key ---------------------------------------


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"file": "model:\n  max_len: 10\n"},
            "unknown key model.max_len (from config file {path}); did you mean "
            "model.max_model_len?",
        ),
        (
            {"env": {"SPYRE_SERVER_CACHE__NUM_BLOCK": "5"}},
            "unknown key cache.num_block (from SPYRE_SERVER_CACHE__NUM_BLOCK); did you mean "
            "SPYRE_SERVER_CACHE__NUM_BLOCKS?",
        ),
        (
            {"env": {"SPYRE_SERVER_SERVERS__PORT": "5"}},
            "unknown section 'servers' (from SPYRE_SERVER_SERVERS__PORT); did you mean "
            "SPYRE_SERVER_SERVER__PORT?",
        ),
        (
            {"file": "modle:\n  path: /x\n"},
            "unknown section 'modle' (from config file {path}); did you mean model.path?",
        ),
        (
            {"overrides": {"scheduler.chunks": 5}},
            "unknown key scheduler.chunks; did you mean scheduler.chunk_size?",
        ),
        (
            {"env": {"SPYRE_SERVER_SERVER__LOGLEVEL": "info"}},
            "unknown key server.loglevel (from SPYRE_SERVER_SERVER__LOGLEVEL); did you mean "
            "SPYRE_SERVER_SERVER__LOG_LEVEL?",
        ),
        ({"overrides": {"cache.zzz": 1}}, "unknown key cache.zzz"),
    ],
)
def test_unknown_keys_name_their_source_and_the_nearest_valid_key(
    tmp_path: Path, source: dict[str, Any], message: str
) -> None:
    path = write_yaml(tmp_path, source["file"]) if "file" in source else None
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=source.get("env", {}), overrides=source.get("overrides"))
    assert str(info.value) == "invalid configuration: " + message.format(path=path)


def test_invalid_values_name_the_file_the_variable_or_the_flag(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": {"max_model_len": 0}})
    with pytest.raises(ConfigError) as info:
        load_config(
            path,
            environ={"SPYRE_SERVER_SERVER__PORT": "70000"},
            overrides={"scheduler.chunk_size": 100, "server.default_max_tokens": 0},
            override_sources={"scheduler.chunk_size": "--chunk-size"},
        )
    problems = str(info.value).removeprefix("invalid configuration: ").split("; ")
    assert problems == [
        "model.max_model_len (from config file " + str(path) + "): Input should be greater than 0",
        "scheduler.chunk_size (from --chunk-size): Input should be a multiple of 64",
        "server.port (from SPYRE_SERVER_SERVER__PORT): Input should be less than or equal to 65535",
        "server.default_max_tokens: Input should be greater than 0",  # no source given
    ]


def test_a_later_source_takes_over_the_blame(tmp_path: Path) -> None:
    """The error names where the value that was validated came from, not the first setter."""
    path = write_yaml(tmp_path, {"scheduler": {"chunk_size": 128}})
    with pytest.raises(ConfigError, match=r"\(from SPYRE_SERVER_SCHEDULER__CHUNK_SIZE\)"):
        load_config(path, environ={"SPYRE_SERVER_SCHEDULER__CHUNK_SIZE": "100"})


def test_an_override_without_a_section_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"^--port: expected <section>\.<key>, got 'port'$"):
        load_config(environ={}, overrides={"port": 1}, override_sources={"port": "--port"})


# --- environment values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "keys"),
    [
        ("k1,k2", ["k1", "k2"]),
        (" k1 , k2 ,", ["k1", "k2"]),  # spaces and an empty item are dropped
        ("only-one", ["only-one"]),
        ("[a, 'b,c']", ["a", "b,c"]),  # a YAML flow list, for a value holding a comma
        ("0x1F,010", ["0x1F", "010"]),  # items are text, never numbers
    ],
)
def test_a_list_from_the_environment(raw: str, keys: list[str]) -> None:
    config = load_config(environ={"SPYRE_SERVER_SERVER__API_KEYS": raw})
    assert config.server.api_keys == keys


@pytest.mark.parametrize("raw", ["010", "0x1F", "true", "null", "1e3"])
def test_a_text_key_from_the_environment_is_taken_as_it_is(raw: str) -> None:
    """YAML would turn 010 into 8, true into True and null into None."""
    config = load_config(environ={"SPYRE_SERVER_MODEL__SERVED_MODEL_NAME": raw})
    assert config.model.served_model_name == raw
    config = load_config(environ={"SPYRE_SERVER_MODEL__PATH": raw})
    assert config.model.path == Path(raw)


def test_typed_keys_from_the_environment_are_read_as_yaml() -> None:
    config = load_config(
        environ={
            "SPYRE_SERVER_CACHE__HASH_SEED": "42",  # int | str: a number stays a number
            "SPYRE_SERVER_SCHEDULER__INTERLEAVE": "false",
            "SPYRE_SERVER_SERVER__GRACEFUL_SHUTDOWN_SECONDS": "2.5",
        }
    )
    assert config.cache.hash_seed == 42
    assert config.scheduler.interleave is False
    assert config.server.graceful_shutdown_seconds == 2.5
    assert load_config(environ={"SPYRE_SERVER_CACHE__HASH_SEED": "fleet-a"}).cache.hash_seed == (
        "fleet-a"
    )


# --- log_level ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["DEBUG", "Debug", "debug"])
def test_log_level_is_case_insensitive(tmp_path: Path, value: str) -> None:
    assert load_config(environ={"SPYRE_SERVER_SERVER__LOG_LEVEL": value}).server.log_level == (
        "debug"
    )
    path = write_yaml(tmp_path, {"server": {"log_level": value}})
    assert load_config(path, environ={}).server.log_level == "debug"
    config = load_config(environ={}, overrides={"server.log_level": value})
    assert config.server.log_level == "debug"


# --- chat_template --------------------------------------------------------------------------------


def test_chat_template_file_or_inline(tmp_path: Path) -> None:
    from spyre_server.api.chat_template import load_chat_template

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    config = load_config(environ={}, overrides={"model.chat_template": str(path)})
    assert config.model.chat_template == str(path)  # the key keeps what the user wrote
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    assert load_chat_template("line one\nline two") == "line one\nline two"
    with pytest.raises(ValueError, match="neither a readable file nor an inline Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(
        ConfigError, match=r"model\.chat_template: .*missing\.jinja'.*\(No such file"
    ):
        load_config(environ={}, overrides={"model.chat_template": str(tmp_path / "missing.jinja")})
