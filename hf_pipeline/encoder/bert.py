"""A plain BERT encoder in torch alone: all-MiniLM-L6-v2 without transformers (internal).

Importing transformers' modeling stack (``AutoModel``: ``torch.distributed.tensor`` with
sympy, ``torch._dynamo``, sklearn) took 4-5 s of interpreter time in a fresh build on a
16-CPU H200 host, the critical path of its start (issue 28). A plain BERT is a few
modules: :class:`BertModel` here computes what transformers' ``BertModel`` computes with
SDPA attention (the same operations, in the same order: the embeddings equal to float32
rounding) and has its state-dict keys, so it loads the same ``model.safetensors``. It
keeps the shape :class:`hf_pipeline.encoder.model.TextEncoder` relies on:
``model.embeddings(input_ids=...)``, ``model.encoder(x).last_hidden_state``,
``model(input_ids=..., attention_mask=...)`` and ``model.config.hidden_size``; each
layer's ``intermediate`` has ``dense`` and ``intermediate_act_fn`` (``torch.nn.GELU()``),
which :func:`hf_pipeline.encoder.fusion.fuse_bias_gelu` fuses.

:func:`inspect_folder` decides whether a model folder loads here: a BERT config
(``model_type`` bert, absolute positions, ``gelu``, no decoder or cross-attention, no
quantization) and one ``model.safetensors`` whose tensors are exactly the encoder's (an
optional ``bert.`` prefix, an unused pooler, BertForMaskedLM's ``cls.`` head and the old
``position_ids`` buffer allowed), of the shapes the config implies, in a float dtype.
Anything else is a reason string: the caller loads with transformers instead. The files
are untrusted: ``config.json`` is read only up to :data:`MAX_CONFIG_BYTES`, sizes are
bounded, and weights are read only through ``safetensors`` (never a pickle).

This module imports torch and safetensors: import it where an encoder is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any

import torch

from hf_pipeline.encoder.native import (
    MAX_CONFIG_BYTES,
    WEIGHTS,
    EncoderOutput,
    NativeModel,
    bounded_float,
    bounded_sizes,
    kind_problem,
    map_weights,
    read_config,
)
from hf_pipeline.encoder.native import embedding as _embedding
from hf_pipeline.encoder.native import linear as _linear

__all__ = [
    "MAX_CONFIG_BYTES",
    "BertConfig",
    "BertModel",
    "NativeBert",
    "inspect_config",
    "inspect_folder",
    "loaded_transformers_class",
]

#: ``architectures`` whose checkpoints hold a plain BERT encoder (a head, if any, is
#: left out).
_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "BertForPreTraining"})
#: Tensors outside the encoder a BERT checkpoint may carry: heads this model does not
#: run (BertForMaskedLM/BertForPreTraining's ``cls.``) and the position ids buffer that
#: transformers < 4.31 saved.
_IGNORED_PREFIXES = ("cls.",)
_IGNORED = frozenset({"embeddings.position_ids"})


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """What :class:`BertModel` takes of a BERT ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    #: As transformers' config says it (TextEncoder's tests read it).
    _attn_implementation: str = "sdpa"


class BertEmbeddings(torch.nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = _embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = _embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = torch.nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # transformers' order: words + token type (0 for every token), then positions.
        words = self.word_embeddings(input_ids)
        embeddings = words + self.token_type_embeddings.weight[0]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        embeddings = embeddings + self.position_embeddings(positions)
        return self.LayerNorm(embeddings)


class BertSelfAttention(torch.nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.head_size = cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_size**-0.5
        self.query = _linear(cfg.hidden_size, cfg.hidden_size)
        self.key = _linear(cfg.hidden_size, cfg.hidden_size)
        self.value = _linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        shape = (*x.shape[:-1], self.heads, self.head_size)
        q = self.query(x).view(shape).transpose(1, 2)
        k = self.key(x).view(shape).transpose(1, 2)
        v = self.value(x).view(shape).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling
        )
        return out.transpose(1, 2).reshape(x.shape).contiguous()


class BertSelfOutput(torch.nn.Module):
    """``LayerNorm(dense(x) + residual)``: after the attention, and (``wide``) after the
    intermediate step."""

    def __init__(self, cfg: BertConfig, *, wide: bool = False):
        super().__init__()
        width = cfg.intermediate_size if wide else cfg.hidden_size
        self.dense = _linear(width, cfg.hidden_size)
        self.LayerNorm = torch.nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(torch.nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(torch.nn.Module):
    """``gelu(dense(x))``: :func:`hf_pipeline.encoder.fusion.fuse_bias_gelu` replaces
    ``dense`` by a one-GEMM bias+GELU and ``intermediate_act_fn`` by an identity."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.intermediate_act_fn: torch.nn.Module = torch.nn.GELU()  # exact (erf)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


class BertLayer(torch.nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, wide=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(torch.nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = torch.nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(
        self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None
    ) -> EncoderOutput:
        """``mask``: None (every token attends to every token) or a boolean
        ``(batch, 1, 1, tokens)`` (True: a key to attend to), as :class:`BertModel` makes."""
        for layer in self.layer:
            hidden_states = layer(hidden_states, mask)
        return EncoderOutput(hidden_states)


class BertPooler(torch.nn.Module):
    """Kept for the checkpoint's keys; the encoder's pooling never runs it."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size)


class BertModel(torch.nn.Module):
    """transformers' ``BertModel`` (SDPA attention, inference) with its state-dict keys;
    the pooler only when the checkpoint has one (it is never run). Its parameters start
    uninitialised: load a state dict (:meth:`NativeBert.load`)."""

    def __init__(self, cfg: BertConfig, *, pooler: bool = False):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if pooler else None

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The token embedding table (as transformers' models name it)."""
        return self.embeddings.word_embeddings

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> EncoderOutput:
        """``attention_mask``: ``(batch, tokens)``, nonzero for real tokens; padding keys
        are masked out of the attention. A row without any real token attends to every
        key (finite values where transformers' mask gives the same garbage or NaN; the
        encoder's pooling gives such a row zeros either way)."""
        mask = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            keep = keep | ~keep.any(-1, keepdim=True)
            mask = keep[:, None, None, :]
        return self.encoder(self.embeddings(input_ids=input_ids), mask)


def _expected_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (cfg.vocab_size, h),
        "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{n}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (h, h)
            shapes[f"{p}attention.self.{name}.bias"] = (h,)
        shapes[f"{p}attention.output.dense.weight"] = (h, h)
        shapes[f"{p}intermediate.dense.weight"] = (i, h)
        shapes[f"{p}intermediate.dense.bias"] = (i,)
        shapes[f"{p}output.dense.weight"] = (h, i)
        for norm in ("attention.output.dense.bias", "output.dense.bias",
                     "attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
                     "output.LayerNorm.weight", "output.LayerNorm.bias"):  # fmt: skip
            shapes[p + norm] = (h,)
    return shapes


def _config(raw: Any) -> BertConfig | str:
    """The :class:`BertConfig` of a parsed ``config.json``, or why it is not a plain BERT."""
    kind = kind_problem(raw, "bert", _ARCHITECTURES, "a plain BERT's",
                        ("is_decoder", "add_cross_attention"))  # fmt: skip
    if kind is not None:
        return kind
    if raw.get("position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type is {raw.get('position_embedding_type')!r}"
    if raw.get("hidden_act", "gelu") != "gelu":
        return f"hidden_act is {raw.get('hidden_act')!r}, not 'gelu'"
    if raw.get("quantization_config") is not None:
        return "it is quantized"
    defaults = {"type_vocab_size": 2, "max_position_embeddings": 512}
    sizes = bounded_sizes(raw, ("vocab_size", "hidden_size", "num_hidden_layers",
                                "num_attention_heads", "intermediate_size",
                                "max_position_embeddings", "type_vocab_size"), defaults)  # fmt: skip
    if isinstance(sizes, str):
        return sizes
    if sizes["hidden_size"] % sizes["num_attention_heads"]:
        return "hidden_size is not a multiple of num_attention_heads"
    eps = bounded_float(raw, "layer_norm_eps", 1e-12, 0, 1)
    if isinstance(eps, str):
        return eps
    return BertConfig(**sizes, layer_norm_eps=eps)


@dataclasses.dataclass(frozen=True)
class NativeBert(NativeModel):
    """A folder that loads as :class:`BertModel` (a ``bert.`` prefix kept in ``names``)."""

    config: BertConfig

    def _model(self) -> BertModel:
        return BertModel(self.config, pooler="pooler.dense.weight" in self.names)


def inspect_folder(folder: str | Path) -> NativeBert | str:
    """A :class:`NativeBert` for ``folder`` when it is a plain BERT whose
    ``model.safetensors`` maps cleanly onto :class:`BertModel`; else why not (one line,
    naming the file and, for a tensor, its name). Reads ``config.json`` and the weights
    file's header only."""
    folder = Path(folder)
    read = read_config(folder)
    if isinstance(read, str):
        return read
    return inspect_config(folder, *read)


def inspect_config(folder: Path, cfg_path: Path, raw: Any) -> NativeBert | str:
    """:func:`inspect_folder` of a folder whose ``config.json`` (at ``cfg_path``) parsed
    as ``raw``."""
    cfg = _config(raw)
    if isinstance(cfg, str):
        return f"{cfg_path}: {cfg}"
    weights = folder / WEIGHTS
    h = cfg.hidden_size
    names = map_weights(
        weights, _expected_shapes(cfg), prefix="bert.", what="a BERT encoder's",
        skip=lambda key: key.startswith(_IGNORED_PREFIXES)
        or key.removeprefix("bert.") in _IGNORED,
        optional={"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,)},
    )  # fmt: skip
    if isinstance(names, str):
        return str(names)  # every reason falls back to transformers for BERT, as before
    if ("pooler.dense.weight" in names) != ("pooler.dense.bias" in names):
        return f"{weights}: the pooler's weight or bias is missing"
    return NativeBert(cfg, weights, names)


def loaded_transformers_class(module: str, name: str) -> Any:
    """``transformers.<module>.<name>`` (``BertModel``, ``GELUActivation``...) when
    transformers is imported already, else None (also when it has no such name).

    For comparing a model's modules with transformers' own: a model built by
    transformers imported it, so where it is not imported the model holds none of its
    classes, and nothing here imports it (seconds of a fresh process, issue 28)."""
    if "transformers" not in sys.modules:
        return None
    try:
        return getattr(importlib.import_module(f"transformers.{module}"), name, None)
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
