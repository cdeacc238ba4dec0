"""``spyre-server serve``: its flags and the keys they set, the precedence of file, environment and
flags, the help texts, a port in use, Ctrl-C (spyre_server/entrypoints/cli.py, serve_flags.py)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from spyre_server.config import Config
from spyre_server.entrypoints import cli
from spyre_server.entrypoints.serve_flags import FLAGS

# serve() keeps its bound socket to the end of the process (the CLI exits right after a failed
# start); in this process, the garbage collector closes it and warns.
_SOCKET_LEFT_OPEN = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Captured:
    """Stands in for cli._serve: records the configuration serve would have run with."""

    def __init__(self) -> None:
        self.configs: list[Config] = []

    def __call__(self, config: Config) -> int:
        self.configs.append(config)
        return 0

    @property
    def config(self) -> Config:
        assert len(self.configs) == 1
        return self.configs[0]


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    for name in list(os.environ):
        if name.startswith("SPYRE_SERVER_"):
            monkeypatch.delenv(name)
    fake = Captured()
    monkeypatch.setattr(cli, "_serve", fake)
    return fake


def serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["serve", *argv])
    return code, capsys.readouterr().err


# --- every flag sets its key ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "section", "key", "value"),
    [
        (["/models/granite"], "model", "path", Path("/models/granite")),
        (["--model", "/models/granite"], "model", "path", Path("/models/granite")),
        (["--host", "127.0.0.1"], "server", "host", "127.0.0.1"),
        (["--port", "9001"], "server", "port", 9001),
        (["--api-key", "k1"], "server", "api_keys", ["k1"]),
        (["--api-key", "k1", "--api-key", "k2"], "server", "api_keys", ["k1", "k2"]),
        (["--max-model-len", "4096"], "model", "max_model_len", 4096),
        (["--served-model-name", "granite"], "model", "served_model_name", "granite"),
        (["--dtype", "bfloat16"], "model", "dtype", "bfloat16"),
        (["--tensor-parallel-size", "4"], "model", "tensor_parallel_size", 4),
        (["--chat-template", "{{ messages }}"], "model", "chat_template", "{{ messages }}"),
        (["--chunk-size", "512"], "scheduler", "chunk_size", 512),
        (["--log-level", "WARNING"], "server", "log_level", "warning"),
        (["--log-level", "Debug"], "server", "log_level", "debug"),
        (["--allow-unverified-config"], "model", "allow_unverified_config", True),
        (["--graph-cache-dir", "/graphs"], "model", "graph_cache_dir", Path("/graphs")),
        (["--require-precompiled"], "model", "require_precompiled", True),
    ],
)
def test_each_flag_sets_its_key(
    captured: Captured,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    section: str,
    key: str,
    value: Any,
) -> None:
    code, err = serve(argv, capsys)
    assert (code, err) == (0, "")
    assert getattr(getattr(captured.config, section), key) == value
    untouched = Config().model_dump()
    untouched[section].pop(key)
    got = captured.config.model_dump()
    got[section].pop(key)
    assert got == untouched  # and nothing else


def test_every_flag_in_the_table_is_tested() -> None:
    tested = {"--model", "--host", "--port", "--api-key", "--max-model-len", "--served-model-name"}
    tested |= {"--dtype", "--tensor-parallel-size", "--chat-template", "--chunk-size"}
    tested |= {"--log-level"}
    tested |= {"--allow-unverified-config", "--graph-cache-dir", "--require-precompiled"}
    assert {flag.flag for flag in FLAGS} == tested


def test_a_flag_overrides_the_environment_which_overrides_the_file(
    captured: Captured,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "scheduler:\n  chunk_size: 512\n  max_num_seqs: 3\n"
        "server:\n  api_keys: [file-key]\n  log_level: error\n"
    )
    file_only = ["--config", str(config)]
    assert serve(file_only, capsys)[0] == 0
    monkeypatch.setenv("SPYRE_SERVER_SCHEDULER__CHUNK_SIZE", "192")
    monkeypatch.setenv("SPYRE_SERVER_SERVER__API_KEYS", "env-1,env-2")
    assert serve(file_only, capsys)[0] == 0
    flags = [*file_only, "--chunk-size", "128", "--api-key", "flag-key", "--log-level", "INFO"]
    assert serve(flags, capsys)[0] == 0

    seen = [
        (c.scheduler.chunk_size, c.server.api_keys, c.server.log_level, c.scheduler.max_num_seqs)
        for c in captured.configs
    ]
    assert seen == [
        (512, ["file-key"], "error", 3),
        (192, ["env-1", "env-2"], "error", 3),  # a list from the environment: comma-separated
        (128, ["flag-key"], "info", 3),  # --api-key replaces the list
    ]


def test_the_model_argument_and_model_flag_must_agree(
    captured: Captured, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(["/m/a", "--model", "/m/a"], capsys) == (0, "")
    code, err = serve(["/m/a", "--model", "/m/b"], capsys)
    assert code == 2
    assert err == (
        "spyre-server: error: two models given: /m/a (the MODEL argument) and /m/b (--model)\n"
    )
    assert len(captured.configs) == 1


# --- errors name the flag, the variable or the file -----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--chunk-size", "100"],
            {},
            "scheduler.chunk_size (from --chunk-size): Input should be a multiple of 64",
        ),
        (["--log-level", "loud"], {}, "server.log_level (from --log-level): Input should be"),
        (["--dtype", "fp8"], {}, "model.dtype (from --dtype): Input should be"),
        (
            ["--tensor-parallel-size", "0"],
            {},
            "model.tensor_parallel_size (from --tensor-parallel-size): Input should be greater",
        ),
        (
            [],
            {"SPYRE_SERVER_CACHE__NUM_BLOCKS": "1"},
            "cache.num_blocks (from SPYRE_SERVER_CACHE__NUM_BLOCKS): Input should be greater than "
            "or equal to 2",
        ),
        (
            [],
            {"SPYRE_SERVER_SCHEDULER__CHUNK_SIZ": "128"},
            "unknown key scheduler.chunk_siz (from SPYRE_SERVER_SCHEDULER__CHUNK_SIZ); "
            "did you mean SPYRE_SERVER_SCHEDULER__CHUNK_SIZE?",
        ),
        (
            ["--chat-template", "/no/such/template.jinja"],
            {},
            "model.chat_template (from --chat-template): Value error, "
            "'/no/such/template.jinja' is neither a readable file nor an inline Jinja template",
        ),
    ],
)
def test_bad_values_exit_2_naming_their_source(
    captured: Captured,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = serve(argv, capsys)
    assert code == 2
    assert err.startswith("spyre-server: error: invalid configuration: ")
    assert message in err
    assert captured.configs == []


def test_a_flag_that_is_not_a_number_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--port", "eighty"])
    assert info.value.code == 2
    assert "argument --port: invalid int value: 'eighty'" in capsys.readouterr().err


# --- help -----------------------------------------------------------------------------------------


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_serve_help_describes_every_flag_and_the_precedence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = help_text(["serve"], capsys)
    flat = " ".join(text.split())  # argparse wraps lines
    assert "a flag overrides the environment, which overrides the config file" in flat
    assert "SPYRE_SERVER_<SECTION>__<KEY>" in flat
    assert "comma-separated" in flat
    for flag in FLAGS:
        section, _, key = flag.key.partition(".")
        env = f"SPYRE_SERVER_{section.upper()}__{key.upper()}"
        assert f"{flag.flag} {flag.metavar}" in flat
        assert f"[{flag.key}, {env}]" in flat, flag.flag
    assert "MODEL HF-format model folder (model.path, SPYRE_SERVER_MODEL__PATH;" in flat
    defaults = Config()
    assert f"(default {defaults.scheduler.chunk_size})" in flat
    assert f"(default {defaults.model.max_model_len})" in flat
    assert "--config FILE" in flat


@pytest.mark.parametrize("argv", [[], ["prepare-model"], ["serve"], ["bench"]])
def test_help_has_no_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Help is plain text: no reST or Markdown literals (``x``, `x`) from docstrings."""
    text = help_text(argv, capsys)
    assert "`" not in text
    assert text.startswith("usage: spyre-server")


# --- a port in use --------------------------------------------------------------------------------


def test_a_port_in_use_fails_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from spyre_server.entrypoints import serve as serve_module

    def must_not_load(config: Config) -> None:
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(serve_module, "load", must_not_load)
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        port = other_server.getsockname()[1]
        code, err = serve(["--host", "127.0.0.1", "--port", str(port)], capsys)
    assert code == 2
    assert err == (
        f"spyre-server: error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another server is running there?)\n"
    )


@_SOCKET_LEFT_OPEN
def test_a_free_port_is_bound_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the model loads, the port is already this server's: nobody else can take it."""
    from spyre_server.config import load_config
    from spyre_server.entrypoints import serve as serve_module

    class Loaded(Exception):
        pass

    seen: list[int] = []

    def load(config: Config) -> None:
        with socket.socket() as rival, pytest.raises(OSError) as info:
            rival.bind(("127.0.0.1", port))
        seen.append(info.value.errno or 0)
        raise Loaded

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(serve_module, "load", load)
    config = load_config(environ={}, overrides={"server.host": "127.0.0.1", "server.port": port})
    with pytest.raises(Loaded):
        serve_module.serve(config)
    assert seen == [errno.EADDRINUSE]


# --- Ctrl-C ---------------------------------------------------------------------------------------


@_SOCKET_LEFT_OPEN
@pytest.mark.parametrize("where", ["load", "run"])
def test_ctrl_c_exits_0_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Ctrl-C while the model loads, or once uvicorn has drained and raised SIGINT again."""
    from spyre_server.entrypoints import serve as serve_module

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    if where == "load":
        monkeypatch.setattr(serve_module, "load", interrupt)
    else:
        monkeypatch.setattr(serve_module, "serve", interrupt)
    code, err = serve(["--host", "127.0.0.1", "--port", "0"], capsys)
    assert code == 0
    assert "Traceback" not in err
