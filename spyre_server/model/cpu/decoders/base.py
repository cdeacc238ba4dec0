"""What the cpu backend's decoders share: the families they know, the step's sizes and scalars,
a layer's parts bound once, the construction, the embedding at the start of a step and the
logits at its end.

A decoder runs a whole cpu step of an fms decoder-only model of a family it knows (``FAMILIES``)
without fms's module machinery, with the same ops in the same order as fms's forward over the
same modules, so that the logits and the KV writes are the same bits. Each decoder says which
models it covers (``unsupported_reason``, checked at construction), how it binds a layer's parts
(``Layer.of``) and how it runs the layers (``_residual_stream``); the base embeds the tokens and
turns the residual stream into the logits, with the family's scalars (``Scalars``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from fms.models.granite import Granite
from fms.models.llama import LLaMA
from fms.models.mistral import Mistral
from fms.models.qwen3 import Qwen3

from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding
from spyre_server.model.cpu.paged_attention import AttentionPlan, PagedAttentionKernel
from spyre_server.model.runner import KVCaches

Project = Callable[[torch.Tensor], torch.Tensor]
Module = torch.nn.Module

SumAcrossRanks = Callable[[torch.Tensor], torch.Tensor]
"""Tensor parallelism: replaces a contiguous tensor in place by its sum over the ranks and
returns it (``parallel.group.RankGroup.sum_``)."""

FAMILIES: tuple[type[Module], ...] = (LLaMA, Granite, Mistral, Qwen3)
"""The fms model classes whose forward the decoders reproduce (and their subclasses). Each runs
the same pre-norm block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``, every
attention through its position encoder and the paged-attention op with the step's plan (a
sliding window, where one applies, is the plan's), then the final norm and the LM head; Granite
adds the scalars ``Scalars`` holds. What else a family needs (Qwen3's per-head norms of the
queries and keys, unfused projections) each decoder's ``unsupported_reason`` checks."""


def family_reason(model: Module) -> str | None:
    """Why ``model`` is not of a family the decoders know, or None when it is."""
    if not isinstance(model, FAMILIES):
        *others, last = (f.__name__ for f in FAMILIES)
        return f"{type(model).__name__} is not fms's {', '.join(others)} or {last}"
    if model.config.p_dropout:
        return "the model has dropout"
    return None


@dataclass(frozen=True, slots=True)
class Scalars:
    """The scalars fms's Granite applies to the stream, as it applies them: the token embeddings
    times ``embedding``, each attention and feed-forward output times ``residual`` before its
    residual add (``output * residual + x``, two roundings), the logits divided by ``logits``.
    None where the family has no such op (fms's LLaMA, Mistral, Qwen3)."""

    embedding: float | None = None
    residual: float | None = None
    logits: float | None = None

    @classmethod
    def of(cls, model: Module) -> Scalars:
        if isinstance(model, Granite):
            config = model.config
            return cls(
                config.embedding_multiplier, config.residual_multiplier, config.logits_scaling
            )
        return cls()


N = TypeVar("N")
"""A norm as its decoder calls it."""
Q = TypeVar("Q")
"""A QKV projection as its decoder calls it."""
P = TypeVar("P")
"""A projection as its decoder calls it."""
F = TypeVar("F")
"""A feed-forward as its decoder calls it."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """The sizes a decoder step takes from a layer (the decoders run models whose layers all have
    one shape, which the aten decoder's ``unsupported_reason`` checks; the rotary embedding
    compares by identity)."""

    nheads: int
    kvheads: int
    head_dim: int
    hidden_dim: int
    mlp_dim: int
    scale_factor: float | None
    """As fms's attention holds it (None: ``1 / sqrt(head_dim)``)."""
    qkv_splits: tuple[int, ...]
    """The widths of the queries, keys and values in a fused QKV projection's output."""
    rope: FastRotaryEmbedding

    @classmethod
    def of_layer(cls, layer: Module) -> StepShape:
        attn = layer.attn
        kq, v = attn.emb_kq_per_head, attn.emb_v_per_head
        return cls(
            attn.nheads,
            attn.kvheads,
            kq,
            attn.emb_dim,
            layer.ff_sub_layer.hidden_dim,
            attn.scale_factor,
            (attn.nheads * kq, attn.kvheads * kq, attn.kvheads * v),
            attn.position_encoder,
        )

    @classmethod
    def of(cls, model: Module) -> StepShape:
        return cls.of_layer(model.base_model.layers[0])

    @property
    def scale(self) -> float:
        """The attention's scale as the paged-attention op hands it to a kernel."""
        return self.scale_factor if self.scale_factor is not None else 1 / math.sqrt(self.head_dim)


@dataclass(frozen=True, slots=True)
class Layer(Generic[N, Q, P, F]):
    """A decoder layer (the block of a family in ``FAMILIES``) by the parts a step calls, each
    bound once as its decoder calls it: a bound forward (no module hooks) or what a native kernel
    takes."""

    attn_norm: N
    qkv: Q
    dense: P
    ff_norm: N
    feed_forward: F

    @classmethod
    def of(
        cls,
        layer: Module,
        norm: Callable[[Module], N],
        qkv: Callable[[Module], Q],
        projection: Callable[[Module], P],
        feed_forward: Callable[[Module], F],
    ) -> Layer[N, Q, P, F]:
        """``qkv`` binds the attention's ``in_proj``, the others their modules."""
        attn = layer.attn
        return cls(
            norm(layer.ln),
            qkv(attn.in_proj),
            projection(attn.dense),
            norm(layer.ff_ln),
            feed_forward(layer.ff_sub_layer),
        )


def bound_forward(module: Module) -> Project:
    """A module's forward, called without the module's ``__call__`` (and its hooks)."""
    return module.forward


@dataclass(frozen=True, slots=True)
class NormWeight:
    """An RMS norm as the native kernels take it: its weight's data pointer (into the tensor the
    model holds) and its epsilon."""

    weight: int
    eps: float

    @classmethod
    def of(cls, norm: Module) -> NormWeight:
        return cls(norm.weight.data_ptr(), norm.eps)


@dataclass(frozen=True, slots=True)
class Glu(Generic[P]):
    """A fused gated linear unit by its two projections: gate and up in one, then down."""

    gate_up: P
    down: P


def fused_qkv(projection: Callable[[Module], P]) -> Callable[[Module], P]:
    """Binds a fused QKV ``in_proj`` as its one projection, by ``projection``."""

    def bind(in_proj: Module) -> P:
        return projection(in_proj.qkv_fused)

    return bind


def fused_glu(projection: Callable[[Module], P]) -> Callable[[Module], Glu[P]]:
    """Binds a fused GLU (``wg1_fused`` and ``w2``) as its projections, each by ``projection``."""

    def bind(ff: Module) -> Glu[P]:
        return Glu(projection(ff.wg1_fused), projection(ff.w2))

    return bind


class Decoder(ABC, Generic[N, Q, P, F]):
    """``decoder(input_ids, position_ids, slot_mapping, plan, kv_caches, last_n_tokens)``: the
    logits of the last ``last_n_tokens`` positions of each row, as the model's forward with
    ``paged_attention_kwargs(slot_mapping, plan, attention)`` and ``use_cache=True`` computes
    them, writing the same KV; None for ``last_n_tokens`` 0 (the KV only: a chunk that samples
    nothing, whose LM head would be wasted).

    ``reduce``: on a rank of a tensor-parallel model (``parallel.shard``), the sum across the
    ranks that every attention output projection and feed-forward down projection needs before
    its residual add; None for a whole model.

    ``ValueError`` at construction when the decoder does not cover ``model`` (a
    ``cpu_inference_copy``), saying why."""

    def __init__(
        self,
        model: Module,
        attention: PagedAttentionKernel | None = None,
        reduce: SumAcrossRanks | None = None,
    ) -> None:
        if (reason := self._unsupported_reason(model)) is not None:
            raise ValueError(f"{type(self).__name__} cannot run this model: {reason}")
        self._model = model
        self._attention = attention
        self._reduce = reduce
        self._shape = StepShape.of(model)
        self._scalars = Scalars.of(model)
        self._layers = [self._layer(layer) for layer in model.base_model.layers]

    @staticmethod
    @abstractmethod
    def _unsupported_reason(model: Module) -> str | None:
        """Why the decoder cannot run ``model``, or None when it can."""

    @staticmethod
    @abstractmethod
    def _layer(layer: Module) -> Layer[N, Q, P, F]:
        """``layer``'s parts as the step calls them."""

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings, ``[batch, seq, hidden_dim]``, as the family's forward
        computes them: a new tensor (the decoders update the stream in place)."""
        x = self._model.base_model.embedding(input_ids)
        if self._scalars.embedding is not None:
            x = x * self._scalars.embedding
        return x

    @abstractmethod
    def _residual_stream(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        """The residual stream after the last layer, ``[batch, seq, hidden_dim]``, with every
        layer's KV written."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: KVCaches,
        last_n_tokens: int,
    ) -> torch.Tensor | None:
        x = self._residual_stream(input_ids, position_ids, slot_mapping, plan, kv_caches)
        if last_n_tokens == 0:
            return None
        seq = input_ids.shape[1]
        last = x[:, seq - last_n_tokens :]
        logits = self._model.head(self._model.base_model.dec_norm(last))
        if self._scalars.logits is not None:
            logits = logits / self._scalars.logits
        return logits
