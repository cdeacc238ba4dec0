"""The conformance matrix (issue 30): which architecture runs on which backend, decoder path and
dtype, and what the suite expects of it there.

Every case is checked against HF transformers' own greedy decoding of the same checkpoint
(``checkpoints.py``); test_conformance.py is parametrized from ``CASES``. Expectations:

- ``exact`` (float32): our greedy tokens are HF's float32 greedy tokens, and the chosen tokens'
  logprobs are within ``FLOAT32_LOGPROB_TOL`` of HF's;
- ``tolerance`` (bfloat16): the chosen tokens' logprobs are within a tolerance of HF's bfloat16
  ones, the tolerance derived from HF's own bfloat16-vs-float32 spread on the same tokens
  (``BF16_SPREAD_FACTOR``), and every chosen token is within it of HF float32's best;
- ``refused``: the start fails with ``ModelLoadError`` naming the architecture or setting.

Every served case also promises that a prefix-cache hit (the same prompts sent again) and a
server with ``cache.enable_prefix_caching: false`` give the same tokens as the first run.

``KNOWN`` lists what fails today (each a failure observed with this suite, the mismatch in the
reason); the tests mark those checks ``xfail(strict=True)``, so fixing one makes the case XPASS,
which fails the run until the entry is removed here. The flash path's bfloat16 re-runs are the
exception (``strict=False``): its kernels are not row-invariant, so whether a cache hit changes a
token depends on the CPU they run on.

``markdown_table()`` renders the "Supported models" table from this matrix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tests.conformance.checkpoints import ARCHITECTURES

Check = Literal["tokens", "cache_hit", "caching_off", "refusal"]
Expect = Literal["exact", "tolerance", "refused"]
Dtype = Literal["float32", "bfloat16"]
Decoder = Literal["native", "native-bf16", "aten", "fms", "spyre"]
"""What runs a step: our native float32 decoder, our native bfloat16 decoder, our aten decoder,
fms's forward with our paged-attention op (cpu backend), or fms's forward compiled as the card's
programs with fms's ``spyre_paged_attn`` (spyre backend)."""

SERVED_CHECKS: tuple[Check, ...] = ("tokens", "cache_hit", "caching_off")

FLOAT32_LOGPROB_TOL = 1e-3
"""Float32: our chosen tokens' logprobs against HF's. Two float32 implementations of a 2-layer
model differ by rounding only (observed: below 2e-5); a wrong multiplier, logits scaling or
softmax is off by far more."""

BF16_SPREAD_FACTOR = 2.0
BF16_MIN_TOL = 0.02
"""Bfloat16: tolerance = max(BF16_SPREAD_FACTOR x HF's own bfloat16-vs-float32 spread of the
chosen tokens' logprobs on the same checkpoint and tokens, BF16_MIN_TOL) nats. Our bfloat16
rounds in other places than HF's, so its error is of the size of HF's own, not equal to it."""


@dataclass(frozen=True)
class Path:
    """A way of running the model, forced by configuration."""

    name: str
    backend: Literal["cpu", "spyre"]
    overrides: Mapping[str, Any]
    description: str


PATHS: dict[str, Path] = {
    p.name: p
    for p in [
        Path("auto", "cpu", {}, "cpu backend, model.linear_kernel and attention_kernel auto"),
        Path(
            "aten-linear",
            "cpu",
            {"model.linear_kernel": "aten"},
            "cpu backend, model.linear_kernel: aten (F.linear), attention_kernel auto",
        ),
        Path(
            "flash",
            "cpu",
            {"model.linear_kernel": "onednn", "model.attention_kernel": "flash"},
            "cpu backend, model.linear_kernel: onednn, attention_kernel: flash (SDPA)",
        ),
        Path(
            "eager",
            "spyre",
            {"model.backend": "spyre", "model.compile_backend": "eager"},
            "spyre backend, the card's programs compiled with torch.compile's eager backend",
        ),
    ]
}


@dataclass(frozen=True)
class Known:
    """A check that fails today: ``reason`` (observed) and the exception it fails with.
    ``strict``: it fails on every CPU (a fix makes it XPASS, which fails the run); False where
    whether it fails depends on the CPU's kernels (a kernel that is not row-invariant may or
    may not change a token: oneDNN and SDPA pick other code on AMX than on AVX2)."""

    reason: str
    raises: str = "AssertionError"
    strict: bool = True


@dataclass(frozen=True)
class Case:
    arch: str
    path: str
    dtype: Dtype
    decoder: Decoder | None
    """What the configuration makes run the steps (asserted); None for refused cases."""
    expect: Expect
    known: Mapping[Check, Known] = field(default_factory=dict)
    refusal_names: tuple[str, ...] = ()
    """For ``refused``: the error names one of these (the architecture or the setting)."""

    @property
    def backend(self) -> str:
        return PATHS[self.path].backend

    @property
    def id(self) -> str:
        return f"{self.arch}-{self.path}-{self.dtype}"

    @property
    def checks(self) -> tuple[Check, ...]:
        return ("refusal",) if self.expect == "refused" else SERVED_CHECKS


LLAMA_LIKE = ("llama", "llama3", "llama3-hub", "rope-linear", "rope-yarn", "rope-longrope")
"""Loaded as fms's LLaMA: our native and aten decoders cover them."""
FMS_FORWARD = (
    "granite",
    "mistral",
    "mistral-swa",
    "mixtral",
    "mixtral-kv8",
    "gpt-bigcode",
    "qwen3",
)
"""Loaded as other fms classes: Granite and Mistral step on our native and aten decoders, with
the cpu paths of fms's LLaMA (``NATIVE_DECODER_FAMILIES``), Qwen3 on the aten decoder
(``ATEN_DECODER_FAMILIES``), the others through fms's forward."""
NATIVE_DECODER_FAMILIES = ("granite", "mistral", "mistral-swa")
"""Loaded as fms's Granite or Mistral: the decoders cover them as they cover fms's LLaMA."""
ATEN_DECODER_FAMILIES = ("qwen3",)
"""Loaded as fms's Qwen3 (unfused projections, per-head query and key norms): the aten decoder
runs its steps on every cpu path."""
REFUSED = {
    "qwen2": ("Qwen2ForCausalLM",),
    "rope-dynamic": ("dynamic",),
    "llama-missing-tensor": ("post_attention_layernorm", "ff_ln"),
    "llama-extra-tensor": ("lm_head.bias",),
}
"""Must not start, and the error names one of these: fms has no Qwen2 mapping; dynamic NTK
scaling rotates a cached prefix differently as the sequence grows (HF recomputes it at every
length), so no KV cache can give HF's tokens; loading is strict (every tensor of the checkpoint
consumed, every parameter filled: the HF key, or fms's name for it)."""

CPU_DECODERS: dict[tuple[str, Dtype], Decoder] = {
    ("auto", "float32"): "native",
    ("aten-linear", "float32"): "aten",
    ("flash", "float32"): "aten",
    ("auto", "bfloat16"): "native-bf16",
    ("flash", "bfloat16"): "native-bf16",
}
"""The decoder each cpu path gets for fms's LLaMA, Granite and Mistral (``prepare.cpu_decoder``).
In bfloat16 on a CPU with AVX2 and FMA every path gets the native bfloat16 decoder: the aten
decoder cannot be forced by configuration there, nor fms's forward for these in any dtype."""


NOT_ROW_INVARIANT = (
    "the flash path's kernels are not row-invariant in bfloat16 (oneDNN's linear sums a one-row "
    "step in another order; SDPA's flash kernel splits a row's keys by the step's context "
    "length), so a prefix-cache hit or caching off can change (on some CPUs; observed on AVX2 "
    "and AVX-512 without AMX) "
)


def _rerun(answer: str, *checks: Check) -> dict[Check, Known]:
    return {c: Known(NOT_ROW_INVARIANT + answer, strict=False) for c in checks}


KNOWN: dict[tuple[str, str, str], dict[Check, Known]] = {
    ("rope-linear", "flash", "bfloat16"): _rerun(
        "the 450-token prompt's answer from token 2 (native bfloat16 decoder)", "caching_off"
    ),
    ("rope-longrope", "flash", "bfloat16"): _rerun(
        "the 450-token prompt's answer from token 5 (native bfloat16 decoder)", "cache_hit"
    ),
    ("mistral", "flash", "bfloat16"): _rerun(
        "the 700-token prompt's answer from token 1 (native bfloat16 decoder)", "cache_hit"
    ),
    ("mistral-swa", "flash", "bfloat16"): _rerun(
        "the 450-token prompt's answer from token 6 (native bfloat16 decoder)", "caching_off"
    ),
    ("mixtral", "flash", "bfloat16"): _rerun(
        "the 700-token prompt's answer from token 4 (fms's forward)", "cache_hit"
    )
    | _rerun("the 450-token prompt's answer from token 6 (fms's forward)", "caching_off"),
    ("qwen3", "flash", "bfloat16"): _rerun(
        "the 450-token prompt's answer from token 4 (aten decoder)", "cache_hit", "caching_off"
    ),
}
"""(arch, path, dtype) -> what fails today, as observed; "*" matches every path or dtype. A
check failing with another exception than ``AssertionError`` names it (``Known(reason,
"ModelLoadError")`` for a checkpoint that does not load)."""


def _known(arch: str, path: str, dtype: str) -> dict[Check, Known]:
    found: dict[Check, Known] = {}
    for (a, p, d), checks in KNOWN.items():
        if a == arch and p in ("*", path) and d in ("*", dtype):
            found |= checks
    return found


SPYRE_BFLOAT16 = ("llama", *FMS_FORWARD)
"""The spyre backend in bfloat16 (each case costs two warm-ups): the default model's family and
every fms class; the rope variants share llama's programs (their float32 cases check the
rotation)."""


def _cases() -> Iterable[Case]:
    served_paths: dict[str, list[tuple[str, Dtype]]] = {}
    for arch in LLAMA_LIKE:
        served_paths[arch] = [*CPU_DECODERS, ("eager", "float32")]
    for arch in FMS_FORWARD:
        if arch in NATIVE_DECODER_FAMILIES:
            served_paths[arch] = [*CPU_DECODERS, ("eager", "float32")]
            continue
        served_paths[arch] = [
            ("auto", "float32"),
            ("flash", "float32"),
            ("auto", "bfloat16"),
            ("flash", "bfloat16"),
            ("eager", "float32"),
        ]
    for arch in SPYRE_BFLOAT16:
        served_paths[arch].append(("eager", "bfloat16"))
    for arch, paths in served_paths.items():
        for path, dtype in paths:
            if PATHS[path].backend == "spyre":
                decoder: Decoder = "spyre"
            elif arch in LLAMA_LIKE or arch in NATIVE_DECODER_FAMILIES:
                decoder = CPU_DECODERS[path, dtype]
            elif arch in ATEN_DECODER_FAMILIES:
                decoder = "aten"
            else:
                decoder = "fms"
            expect: Expect = "exact" if dtype == "float32" else "tolerance"
            yield Case(arch, path, dtype, decoder, expect, _known(arch, path, dtype))
    for arch, names in REFUSED.items():
        for path in ("auto", "eager"):
            yield Case(arch, path, "float32", None, "refused", _known(arch, path, "float32"), names)


CASES: tuple[Case, ...] = tuple(_cases())


def markdown_table(cases: Iterable[Case] = CASES) -> str:
    """The README's "Supported models" table: one row per architecture, one column per backend
    and dtype. A cell says what the suite checks there (``exact``, ``tolerance``, ``refused``,
    with the decoders it checks), or, while a check of it fails (``KNOWN``), what is wrong."""
    cases = list(cases)
    order = {("cpu", "float32"): 0, ("cpu", "bfloat16"): 1, ("spyre", "float32"): 2}
    columns = sorted({(c.backend, c.dtype) for c in cases}, key=lambda k: order.get(k, 3))
    header = ["architecture", "shaped like", *(f"{b} {d}" for b, d in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arch in dict.fromkeys(c.arch for c in cases):
        spec = ARCHITECTURES[arch]
        cells = [f"`{spec.architecture}` ({arch})", spec.shaped_like]
        for column in columns:
            here = [c for c in cases if c.arch == arch and (c.backend, c.dtype) == column]
            cells.append(_cell(here))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_PROBLEMS: dict[Check, str] = {
    "tokens": "wrong answers",
    "cache_hit": "a cache hit changes answers",
    "caching_off": "caching changes answers",
    "refusal": "not refused",
}


def _cell(cases: list[Case]) -> str:
    if not cases:
        return "-"
    expect = cases[0].expect
    decoders = sorted({c.decoder for c in cases if c.decoder is not None})
    done = expect + (f" ({', '.join(decoders)})" if decoders else "")
    problems: dict[str, dict[str, None]] = {}
    for case in cases:
        for check, known in case.known.items():
            loads = known.raises != "ModelLoadError"
            problems.setdefault(case.path, {})[_PROBLEMS[check] if loads else "does not load"] = (
                None
            )
    if not problems:
        return done
    if set(problems) == {c.path for c in cases}:
        every = {p: None for found in problems.values() for p in found}
        return f"**not yet**: {', '.join(every)} (issue 30; goal: {expect})"
    notes = "; ".join(f"**{path} path**: {', '.join(found)}" for path, found in problems.items())
    return f"{done}; {notes}"


if __name__ == "__main__":
    print(markdown_table(), end="")
