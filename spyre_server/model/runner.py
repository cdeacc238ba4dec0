"""The runner contract: execute one scheduler step on an fms model and sample (DESIGN §2, §3).

A runner does exactly what the step says and holds no scheduling state. Its backend decides how:
``cpu`` (cpu_backend.py) computes only the positions whose KV must be written, through our own
paged attention; ``spyre`` (spyre_backend.py) runs the fixed-shape programs a Spyre card runs.
Each declares what it computes of a prefill chunk (``prefill_compute``), and the scheduler's
cached-token accounting follows that declaration.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from fms.modules.attention import MultiHeadAttention

from scheduler import DecodeBatch, PrefillChunk, PrefillCompute, ScheduledStep
from spyre_server.sample.sampler import SamplingParams, SequenceSampling, TokenLogprobs, sample

SamplingInputs = Mapping[str, SamplingParams | SequenceSampling]
"""What the sampler needs of each request of a step, by request id."""

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, the key and value block tensors ``[num_blocks, block_size, kv_heads, head_dim]``."""


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def kv_cache_shape(model: torch.nn.Module) -> KVCacheShape:
    """Read layers, KV heads and head size off the model's attention modules."""
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no fms MultiHeadAttention modules")
    first = attentions[0]
    if first.emb_kq_per_head != first.emb_v_per_head:
        raise ValueError("key and value head sizes differ; the paged KV cache needs them equal")
    return KVCacheShape(len(attentions), first.kvheads, first.emb_kq_per_head)


def attention_window(model: torch.nn.Module, max_model_len: int) -> int | None:
    """The sliding window (in keys, HF transformers' ``sliding_window``) the runners apply to
    every layer of ``model``: its config's ``sliding_window``, on the layers its
    ``sliding_window_layers`` names (every layer where it names none); None without one, or
    when it is at least ``max_model_len`` (it then hides no key). A window on some layers only
    is a ValueError (loading refuses it first)."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is None or window >= max_model_len:
        return None
    layers = getattr(config, "sliding_window_layers", None)
    num_layers = kv_cache_shape(model).num_layers
    if layers is not None and len(layers) != num_layers:
        raise ValueError(
            f"a sliding window on {len(layers)} of {num_layers} layers: the runners apply one "
            "window to every layer"
        )
    return int(window)


def query_heads(model: torch.nn.Module) -> int:
    """The query heads of the model's first attention module."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            return int(module.nheads)
    raise ValueError(f"{type(model).__name__} has no fms MultiHeadAttention modules")


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    """For a prefill chunk with ``needs_prompt_logits``: the log-softmax of the logits at every
    position of the chunk, ``[len(step.positions), vocab]`` float32, in position order."""


@dataclass(frozen=True, slots=True, order=True)
class ProgramShape:
    """A compiled program: its kind and the shape of its token input."""

    kind: str
    """``prefill`` or ``decode``."""
    shape: str
    """``"{batch}x{tokens}"``: ``1x256`` for a 256-position prefill window, ``8x1`` for a
    decode batch of 8. The block-table width is a dynamic dimension of the same program, and
    so is a decode batch's size: one compiled graph serves every decode shape."""


@dataclass(frozen=True, slots=True)
class ProgramStats:
    """Fixed-shape programs of a backend that compiles them (``None`` for one that does not)."""

    warmed: frozenset[ProgramShape]
    """The step shapes the warmed-up graphs serve (empty before warm-up); a step outside is a
    bug."""
    num_steps: Mapping[ProgramShape, int]
    """Steps run per step shape since warm-up."""
    graphs: Mapping[str, int] = field(default_factory=dict)
    """Graphs compiled by the warm-up, per kind (``prefill``, ``decode``): what the compiler
    built. The dynamic dimensions make it one of each for every shape in ``warmed``."""
    graphs_after_warmup: int = 0
    """Graphs compiled after warm-up: a step no warmed graph served (0 when all is well)."""


class FatalRunnerError(RuntimeError):
    """The runner can run no further step (a tensor-parallel rank died or failed): the engine
    stops, where after any other step error it ends only the requests the step carried."""


class ModelRunner(abc.ABC):
    """Runs steps; ``LocalModelRunner`` in this process, ``parallel.runner`` on ranks."""

    prefill_compute: ClassVar[PrefillCompute]
    supports_prompt_logits: ClassVar[bool]
    """Whether the backend can return the logits of every prompt position (echo + logprobs)."""
    supports_inference_mode: ClassVar[bool] = True
    """Whether the backend's steps may run under ``torch.inference_mode`` (else
    ``torch.no_grad``); ``grad_mode`` reads it."""

    def warm_up(self) -> None:  # noqa: B027  (most backends have nothing to prepare)
        """Prepare every program the server can issue, before the first request."""

    def program_stats(self) -> ProgramStats | None:
        return None

    def close(self) -> None:  # noqa: B027  (a runner in this process holds nothing to stop)
        """Stop what the runner started (its rank processes); no step runs afterwards."""

    def grad_mode(self) -> contextlib.AbstractContextManager[object]:
        """The autograd mode of every step and of the warm-up: the one place that decides it.
        ``torch.inference_mode`` where the backend supports it (cpu), else ``torch.no_grad``
        (spyre: the reference stack, sendnn-inference 2.6.3, runs every Spyre step and its
        warm-up under ``torch.no_grad``; its platform.py ``inference_mode``: "Spyre does not
        support torch.inference_mode")."""
        return torch.inference_mode() if self.supports_inference_mode else torch.no_grad()

    def execute(self, step: ScheduledStep, params: SamplingInputs) -> StepResult:
        """Run the step, write its KV, and sample a token for every row that must produce one."""
        logits = self.step_logits(step)
        with self.grad_mode():
            if logits is None:
                return StepResult({}, {})
            if isinstance(step, PrefillChunk) and step.needs_prompt_logits:
                return self._sample_with_prompt_logprobs(step, logits, params)
            if isinstance(step, PrefillChunk):
                return self._sample(logits, [step.request_id], [step.positions[-1] + 1], params)
            return self._sample(
                logits,
                [e.request_id for e in step.entries],
                [e.position + 1 for e in step.entries],
                params,
            )

    def step_logits(self, step: ScheduledStep) -> torch.Tensor | None:
        """Run the step's forward pass (writing its KV) and return the logits ``execute``
        samples from: of every position of a prefill chunk with ``needs_prompt_logits``
        (``[len(step.positions), vocab]``), else ``compute_logits``'. ``None`` where the step
        samples nothing."""
        with self.grad_mode():
            if isinstance(step, PrefillChunk) and step.needs_prompt_logits:
                return self._prompt_logits(step)
            return self.compute_logits(step)

    def compute_logits(self, step: ScheduledStep) -> torch.Tensor | None:
        """Run the step's forward pass (writing its KV) and return the logits ``[rows, vocab]``
        of the rows that must sample: the last prefill chunk's final position, or every decode
        entry in order. ``None`` for a prefill chunk that samples nothing."""
        with self.grad_mode():
            if isinstance(step, PrefillChunk):
                return self._prefill(step)
            return self._decode(step)

    def _sample_with_prompt_logprobs(
        self, step: PrefillChunk, logits: torch.Tensor, params: SamplingInputs
    ) -> StepResult:
        """A chunk whose every position's logits are wanted (``logits``, all of them)."""
        rows = torch.log_softmax(logits.float(), dim=-1)
        if not step.is_last_chunk:
            return StepResult({}, {}, {step.request_id: rows})
        result = self._sample(logits[-1:], [step.request_id], [step.positions[-1] + 1], params)
        return StepResult(result.sampled_token_ids, result.logprobs, {step.request_id: rows})

    @abc.abstractmethod
    def _prefill(self, step: PrefillChunk) -> torch.Tensor | None: ...

    def _prompt_logits(self, step: PrefillChunk) -> torch.Tensor | None:
        """Compute every position of the chunk (writing its KV) and return their logits
        ``[len(step.positions), vocab]``. Only for backends with ``supports_prompt_logits``."""
        raise NotImplementedError(f"{type(self).__name__} returns no prompt logits")

    @abc.abstractmethod
    def _decode(self, step: DecodeBatch) -> torch.Tensor | None: ...

    def _sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        positions: list[int],
        params: SamplingInputs,
    ) -> StepResult:
        result = sample(logits, [params[r] for r in request_ids], positions)
        logprobs = {
            r: lp for r, lp in zip(request_ids, result.logprobs, strict=True) if lp is not None
        }
        return StepResult(dict(zip(request_ids, result.token_ids, strict=True)), logprobs)


class LocalModelRunner(ModelRunner):
    """A runner whose model and KV cache live in this process."""

    def __init__(
        self, model: torch.nn.Module, *, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.model = model
        self.block_size = block_size
        shape = kv_cache_shape(model)
        self.kv_shape = shape
        # Zeros, not empty: masked-out keys are still multiplied by 0 and must not be NaN.
        self.kv_caches: KVCaches = [
            (
                torch.zeros(
                    num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype
                ),
                torch.zeros(
                    num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype
                ),
            )
            for _ in range(shape.num_layers)
        ]
