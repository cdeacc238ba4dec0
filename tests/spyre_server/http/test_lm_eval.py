"""A real client: lm-evaluation-harness 0.4.13 (``local-completions``) against a real server on
SmolLM2-135M-Instruct (float32), over the two small tasks in tests/data/lm_eval/ (multiple
choice by loglikelihood, and generate_until). The loglikelihoods must equal those of the same
harness run through its HF transformers backend on the prepared model folder, within
``TOLERANCE``.

lm-eval pulls many packages (datasets, evaluate, ...), so it lives in a throwaway venv, made
once and cached under the folder printed by the ``lm_eval_venv`` fixture (about 1.5 minutes to
make: torch 2.13.0 goes in first, so that pip never fetches a CUDA build, and transformers is
pinned to ours, so that both backends run the same HF code). Slow: about 5 minutes in all.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.spyre_server.http.helpers import Server

pytestmark = pytest.mark.slow

LM_EVAL = "lm-eval[api,hf]==0.4.13"
TASKS = Path(__file__).resolve().parents[2] / "data" / "lm_eval"
NAME = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-3
"""Per choice, in nats. Measured: at most 1.8e-5 apart (fms and HF transformers in float32)."""
RUN_TIMEOUT = 1800


@pytest.fixture(scope="session")
def lm_eval_venv() -> Path:
    """A venv with lm-eval, made once per machine and reused."""
    from spyre_server.model.store import default_cache_dir

    transformers = importlib.metadata.version("transformers")
    root = Path(default_cache_dir()).parent / f"lm-eval-0.4.13-transformers-{transformers}"
    print(f"\nlm-eval venv: {root}")
    python = root / "bin" / "python"
    done = root / ".installed"
    if not done.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=RUN_TIMEOUT)
        subprocess.run(
            [*pip, LM_EVAL, f"transformers=={transformers}"], check=True, timeout=RUN_TIMEOUT
        )
        done.write_text(LM_EVAL + "\n")
    return root


def run_lm_eval(venv: Path, out: Path, model: str, model_args: str, tasks: str) -> None:
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        str(venv / "bin" / "lm_eval"),
        *("--model", model, "--model_args", model_args, "--tasks", tasks),
        *("--include_path", ".", "--batch_size", "8", "--output_path", str(out)),
        "--log_samples",
    ]
    # The task YAMLs name their JSON files relative to their folder.
    result = subprocess.run(
        command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Traceback" not in result.stderr, result.stderr[-5000:]


def samples(out: Path, task: str) -> dict[int, dict[str, Any]]:
    [path] = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    docs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {d["doc_id"]: d for d in docs}


def loglikelihoods(doc: dict[str, Any]) -> list[float]:
    """One float per choice: ``resps`` is ``[[[loglikelihood, is_greedy]], ...]``."""
    return [float(resp[0][0]) for resp in doc["resps"]]


def test_lm_eval_local_completions_matches_its_hf_backend(
    lm_eval_venv: Path, smollm2_server: Server, smollm2_path: Path, tmp_path: Path
) -> None:
    ours, hf = tmp_path / "server", tmp_path / "hf"
    server_args = (
        f"model={NAME},base_url={smollm2_server.url}/v1/completions,tokenizer={smollm2_path},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    run_lm_eval(lm_eval_venv, ours, "local-completions", server_args, "spyre_mc,spyre_gen")
    run_lm_eval(lm_eval_venv, hf, "hf", f"pretrained={smollm2_path},dtype=float32", "spyre_mc")

    ours_mc, hf_mc = samples(ours, "spyre_mc"), samples(hf, "spyre_mc")
    assert sorted(ours_mc) == sorted(hf_mc) == list(range(32))
    worst = 0.0
    for doc_id, doc in ours_mc.items():
        got, expected = loglikelihoods(doc), loglikelihoods(hf_mc[doc_id])
        assert len(got) == len(expected) == 4
        worst = max(worst, *(abs(a - b) for a, b in zip(got, expected, strict=True)))
        assert got == pytest.approx(expected, abs=TOLERANCE), doc_id
        # the same choice wins, unless two choices are within the tolerance of each other
        ranked = sorted(expected, reverse=True)
        if ranked[0] - ranked[1] > 2 * TOLERANCE:
            assert got.index(max(got)) == expected.index(max(expected)), doc_id
    print(f"largest loglikelihood difference, server vs HF backend: {worst:.2e}")

    gen = samples(ours, "spyre_gen")
    assert sorted(gen) == list(range(20))
    for doc in gen.values():
        [text] = doc["filtered_resps"]
        assert isinstance(text, str) and text.strip(), doc  # greedy, stops at the newline
        assert "\n" not in text
