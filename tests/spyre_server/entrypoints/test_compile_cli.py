"""``spyre-server compile`` and ``serve --require-precompiled`` (spyre_server/entrypoints/cli.py,
spyre_server/model/spyre/precompiled.py), in this process, on a tiny checkpoint:

- inductor: compile fills inductor's graph cache and the catalog; a start that requires them
  finds every graph there; another configuration is refused before the model loads;
- eager, the cpu backend, no cache directory, no catalog: refused with a message, before the
  model loads;
- sendnn, with a stand-in for torch_sendnn (which is not on PyPI): what our side hands it, as
  the reference stack does (sendnn-inference 2.6.3): the cache variables and FLEX_DEVICE=COMPILE
  with the sendnn_compile_only backend to compile, DISABLE_COMPILATION=true to require, the
  warm-up in its warmup_mode, and a start refused when the stand-in refuses to compile. The
  stand-in checks our plumbing, not the card.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spyre_server.entrypoints import cli
from spyre_server.entrypoints import serve as serve_module
from spyre_server.model.spyre.precompiled import CATALOG
from tests.conformance.checkpoints import ARCHITECTURES, build_checkpoint

# serve() keeps its bound socket to the end of the process (the CLI exits right after); in this
# process, the garbage collector closes it and warns.
_SOCKET_LEFT_OPEN = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

VARIABLES = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCH_SENDNN_CACHE_ENABLE",
    "TORCH_SENDNN_CACHE_DIR",
    "FLEX_DEVICE",
    "DISABLE_COMPILATION",
    "VLLM_DT_CHUNK_LEN",
    "VLLM_DT_MAX_CONTEXT_LEN",
    "VLLM_DT_MAX_BATCH_SIZE",
    "VLLM_DT_MAX_BATCH_TKV_LIMIT",
    "COMPILATION_MODE",
    "FLEX_OVERWRITE_NMB_FRAME",
)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The variables compile and serve set are restored afterwards, and so are torch's threads."""
    import torch

    for name in list(os.environ):
        if name.startswith("SPYRE_SERVER_") or name in VARIABLES:
            monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    path = tmp_path_factory.mktemp("compile") / "llama"
    return build_checkpoint(ARCHITECTURES["llama"], path, smollm2_path)


def config_file(tmp_path: Path, compile_backend: str, **model: Any) -> Path:
    lines = [
        "model:",
        "  backend: spyre",
        f"  compile_backend: {compile_backend}",
        "  dtype: float32",
        "  max_model_len: 256",
        *(f"  {key}: {value}" for key, value in model.items()),
        "scheduler:",
        "  chunk_size: 128",
        "  max_num_seqs: 2",
        "server:",
        "  log_level: warning",
    ]
    path = tmp_path / f"{compile_backend}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


class Started:
    """Stands in for uvicorn: the server was built (warm-up included) and would now serve."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.apps: list[Any] = []
        started = self

        def run(self: Any, sockets: Any = None) -> None:
            started.apps.append(self.config.app)

        monkeypatch.setattr(serve_module.DrainingServer, "run", run)

    @property
    def runner(self) -> Any:
        (app,) = self.apps
        return app.state.server.engine.core.runner


def serve_argv(checkpoint: Path, config: Path, *extra: str) -> list[str]:
    where = ["--host", "127.0.0.1", "--port", "0"]
    return ["serve", str(checkpoint), "--config", str(config), *where, *extra]


def as_a_new_process() -> None:
    """Forget the graphs dynamo traced here (and what it learnt from them about dynamic
    dimensions), as a server started after ``compile`` knows nothing of its graphs."""
    import torch

    torch._dynamo.reset()


# --- inductor: the whole cycle --------------------------------------------------------------------


@_SOCKET_LEFT_OPEN
@pytest.mark.slow
def test_compile_then_a_start_that_requires_the_programs_finds_them(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = tmp_path / "graphs"
    config = config_file(tmp_path, "inductor")
    # The command as a user runs it, in a process of its own.
    argv = ["compile", str(checkpoint), "--config", str(config), "--graph-cache-dir", str(cache)]
    done = subprocess.run(
        [str(Path(sys.executable).parent / "spyre-server"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in VARIABLES},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"compiled 1 prefill and 1 decode graph(s) (inductor) into {cache}" in done.stderr
    (entry,) = json.loads((cache / CATALOG).read_text())
    assert entry["data"] | {"TORCH_VERSION": "-"} == {
        "MODEL_NAME": str(checkpoint),
        "NUM_AIUS": 1,
        "VLLM_DT_MAX_CONTEXT_LEN": 256,
        "VLLM_DT_MAX_BATCH_SIZE": 2,
        "VLLM_DT_CHUNK_LEN": 128,
        "VLLM_DT_MAX_BATCH_TKV_LIMIT": 512,
        "COMPILE_BACKEND": "inductor",
        "DTYPE": "float32",
        "TORCH_VERSION": "-",
    }
    assert (cache / "fxgraph").is_dir()  # inductor's compiled graphs

    started = Started(monkeypatch)
    as_a_new_process()
    argv = serve_argv(checkpoint, config, "--graph-cache-dir", str(cache), "--require-precompiled")
    code, err = run(argv, capsys)
    assert code == 0, err
    counts = started.runner.warmup_graph_cache
    assert (counts.hits, counts.misses, counts.bypasses) == (2, 0, 0)
    assert started.runner.program_stats().graphs == {"prefill": 1, "decode": 1}

    # Another configuration: refused before the model loads.
    monkeypatch.setattr(serve_module, "load_model", _must_not_load)
    code, err = run([*argv, "--max-model-len", "512"], capsys)
    assert code == 2
    assert "no program in the graph cache" in err and "VLLM_DT_MAX_CONTEXT_LEN 512" in err
    assert "its catalog lists: NUM_AIUS 1, VLLM_DT_MAX_CONTEXT_LEN 256" in err


def _must_not_load(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the model was loaded")


# --- refused before anything loads ----------------------------------------------------------------


@_SOCKET_LEFT_OPEN
@pytest.mark.parametrize(
    ("command", "backend", "extra", "message"),
    [
        ("compile", "eager", [], "compile_backend eager keeps no compiled programs"),
        ("serve", "eager", ["--require-precompiled"], "compile_backend eager keeps no compiled"),
        ("compile", "inductor", ["--require-precompiled"], "require_precompiled is for serving"),
        ("compile", "inductor", ["--no-cache"], "spyre-server compile needs a graph cache"),
        ("serve", "inductor", ["--require-precompiled"], "is not a directory"),
        ("serve", "inductor", ["--require-precompiled", "--empty-cache"], "has no catalog"),
        ("serve", "cpu", ["--require-precompiled"], "is for model.backend spyre"),
        ("compile", "cpu", [], "is for model.backend spyre"),
    ],
)
def test_what_cannot_have_precompiled_programs_is_refused_before_loading(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    backend: str,
    extra: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(serve_module, "load_model", _must_not_load)
    monkeypatch.setattr("spyre_server.model.loading.load_model", _must_not_load)
    cache = tmp_path / "graphs"
    argv = [command, str(tmp_path / "no-such-model")]
    if backend == "cpu":
        config = config_file(tmp_path, "inductor")
        argv += ["--config", str(config)]
        monkeypatch.setenv("SPYRE_SERVER_MODEL__BACKEND", "cpu")
    else:
        argv += ["--config", str(config_file(tmp_path, backend))]
    if "--no-cache" not in extra:
        argv += ["--graph-cache-dir", str(cache)]
    if "--empty-cache" in extra:
        cache.mkdir()
    argv += [e for e in extra if e not in ("--no-cache", "--empty-cache")]
    if command == "serve":
        argv += ["--host", "127.0.0.1", "--port", "0"]
    code, err = run(argv, capsys)
    assert code == 2, err
    assert message in err
    assert "no-such-model" not in err  # refused before the model was looked at


# --- sendnn, with a stand-in for torch_sendnn -----------------------------------------------------


class FakeSendnn:
    """torch_sendnn as the reference uses it: ``warmup_mode()``, the dynamo backends ``sendnn``
    and ``sendnn_compile_only``, a graph cache keyed by the graph and the VLLM_DT_* limits it
    read, and ``DISABLE_COMPILATION=true`` refusing to compile what the cache lacks
    ("Compilation disabled")."""

    LIMITS = ("VLLM_DT_CHUNK_LEN", "VLLM_DT_MAX_CONTEXT_LEN", "VLLM_DT_MAX_BATCH_SIZE")

    def __init__(self) -> None:
        self.compiles: list[dict[str, Any]] = []
        self.in_warmup = False
        self.module = types.ModuleType("torch_sendnn")
        self.module.warmup_mode = self.warmup_mode  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def warmup_mode(self) -> Iterator[None]:
        self.in_warmup = True
        try:
            yield
        finally:
            self.in_warmup = False

    def backend(self, name: str) -> Callable[..., Any]:
        def compile_graph(graph: Any, example_inputs: Any, options: Any = None) -> Any:
            env = {k: os.environ.get(k) for k in VARIABLES}
            key = hashlib.sha256(
                (graph.code + "".join(str(env[k]) for k in self.LIMITS)).encode()
            ).hexdigest()
            cached = Path(env["TORCH_SENDNN_CACHE_DIR"] or "/nonexistent") / f"{key}.program"
            self.compiles.append(
                {"backend": name, "options": options, "env": env, "warmup": self.in_warmup}
            )
            if not cached.exists():
                if env["DISABLE_COMPILATION"] == "true":
                    raise RuntimeError("Compilation disabled")
                if env["TORCH_SENDNN_CACHE_ENABLE"] == "1":
                    cached.write_text("a program")
            return graph.forward

        return compile_graph


@pytest.fixture
def fake_sendnn(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSendnn]:
    from torch._dynamo.backends import registry

    fake = FakeSendnn()
    monkeypatch.setitem(sys.modules, "torch_sendnn", fake.module)
    for name in ("sendnn", "sendnn_compile_only"):  # as torch_sendnn registers them
        monkeypatch.setitem(registry._BACKENDS, name, None)
        monkeypatch.setitem(registry._COMPILER_FNS, name, fake.backend(name))
    yield fake


@_SOCKET_LEFT_OPEN
@pytest.mark.slow
def test_sendnn_gets_the_references_settings_to_compile_and_to_require(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fake_sendnn: FakeSendnn,
) -> None:
    cache = tmp_path / "graphs"
    config = config_file(tmp_path, "sendnn", allow_unverified_config="true")
    as_a_new_process()
    code, err = run(
        ["compile", str(checkpoint), "--config", str(config), "--graph-cache-dir", str(cache)],
        capsys,
    )
    assert code == 0, err
    assert len(fake_sendnn.compiles) == 2  # one prefill graph, one decode graph
    for compiled in fake_sendnn.compiles:
        assert compiled["backend"] == "sendnn_compile_only"
        assert compiled["options"] == {"sendnn.dynamic": True}
        assert compiled["warmup"]
        assert compiled["env"]["FLEX_DEVICE"] == "COMPILE"
        assert compiled["env"]["TORCH_SENDNN_CACHE_ENABLE"] == "1"
        assert compiled["env"]["TORCH_SENDNN_CACHE_DIR"] == str(cache)
        assert compiled["env"]["DISABLE_COMPILATION"] is None
    assert len(list(cache.glob("*.program"))) == 2
    assert json.loads((cache / CATALOG).read_text())[0]["data"]["COMPILE_BACKEND"] == "sendnn"

    started = Started(monkeypatch)
    fake_sendnn.compiles.clear()
    monkeypatch.delenv("FLEX_DEVICE")
    as_a_new_process()
    argv = serve_argv(checkpoint, config, "--graph-cache-dir", str(cache), "--require-precompiled")
    code, err = run(argv, capsys)
    assert code == 0, err
    assert [c["backend"] for c in fake_sendnn.compiles] == ["sendnn", "sendnn"]
    for compiled in fake_sendnn.compiles:
        assert compiled["env"]["DISABLE_COMPILATION"] == "true"
        assert compiled["env"]["FLEX_DEVICE"] is None
        assert compiled["options"] == {"sendnn.dynamic": True}
    assert len(started.apps) == 1

    # Another max_model_len: the reference only warns about the catalog; torch_sendnn then
    # refuses to compile the programs its cache lacks, and the start fails.
    code, err = run([*argv, "--max-model-len", "512"], capsys)
    assert code == 2
    assert "the warm-up failed, so the graph cache" in err
    assert "Compilation disabled" in err
    assert len(started.apps) == 1

    # What the reference refuses before anything compiles: no catalog, the cache not enabled.
    (cache / CATALOG).unlink()
    code, err = run(argv, capsys)
    assert code == 2 and "has no catalog" in err
    monkeypatch.setenv("TORCH_SENDNN_CACHE_DIR", str(cache))
    monkeypatch.delenv("TORCH_SENDNN_CACHE_ENABLE")  # set by the runs above
    without_dir = serve_argv(checkpoint, config, "--require-precompiled")
    code, err = run(without_dir, capsys)
    assert code == 2 and "TORCH_SENDNN_CACHE_ENABLE=1" in err


def test_compile_help_has_no_markup_and_names_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["compile", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: spyre-server compile")
    assert "`" not in text
    flat = " ".join(text.split())
    assert "--graph-cache-dir DIR" in flat and "--require-precompiled" in flat
    assert "sendnn_compile_only" in flat


def test_a_matching_entry_of_another_model_or_version_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As the reference (compilation_utils.py): the model name and the versions are not part of
    the match; it warns, [PRECOMPILED_WARN], when they differ."""
    import torch

    from scheduler import SchedulerConfig
    from spyre_server.config import load_config
    from spyre_server.model.spyre.precompiled import (
        catalog_entry,
        prepare_graph_cache,
        write_catalog,
    )

    settings = {"model.backend": "spyre", "model.compile_backend": "inductor"}
    settings |= {"model.graph_cache_dir": str(tmp_path), "model.path": "/models/a"}
    compiled = load_config(environ={}, overrides=settings)
    limits = SchedulerConfig(chunk_size=256, max_num_seqs=4, max_model_len=1024)
    entry = catalog_entry(compiled, limits, torch.float32)
    entry["spyre_server_version"] = "0.0.1"
    write_catalog(tmp_path, entry)
    settings |= {"model.path": "/models/b", "model.require_precompiled": True}
    serving = load_config(environ={}, overrides=settings)
    environment = prepare_graph_cache(serving, limits, torch.float32, compile_only=False)
    assert environment == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    warnings = [r.getMessage() for r in caplog.records if "[PRECOMPILED_WARN]" in r.getMessage()]
    assert any("'/models/a', this server loads '/models/b'" in w for w in warnings), warnings
    assert any("spyre_server_version 0.0.1" in w for w in warnings), warnings
