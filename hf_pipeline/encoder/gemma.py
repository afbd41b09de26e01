"""A gemma-3 text decoder in torch alone: the COYO encoder without transformers (internal).

Importing transformers' modeling stack for gemma-3 (``AutoModel``: ``modeling_utils``,
``torch.distributed.tensor`` with sympy, the masking and generation utilities) took
4.1 s of interpreter time in an append build on a 16-CPU H200 host, beside the join, on
the path to the first embedding (issue 26: a 10% append waited 10.1 s for its encoder).
:class:`GemmaModel` here computes what transformers' ``Gemma3TextModel`` computes with
SDPA attention for the encoder's forward (no cache, positions from 0): the scaled word
embeddings, each layer's four RMSNorms (``x * (1 + w)`` in float32), q/k norms, rotary
positions per layer type (local and global bases), causal attention (a sliding window on
the sliding layers, as a mask from ``sliding_window`` tokens on; grouped key/value heads
through SDPA's ``enable_gqa`` without a mask, repeated with one, as transformers does),
the gated tanh-GELU MLP, the final norm; the same operations in the same order, and its
state-dict keys, so it loads the same ``model.safetensors`` (``Gemma3ForCausalLM``'s
``model.`` prefix and its ``lm_head`` left out). It keeps the shape
:class:`hf_pipeline.encoder.model.TextEncoder` relies on: ``model(input_ids=...)``
returning ``.last_hidden_state``, ``model.config.hidden_size`` and attention modules
marked ``is_causal`` (the encoder then runs it without the padding mask).

:func:`inspect_config` decides whether a folder loads here: a ``gemma3_text`` config
(causal, no logit soft-capping, no attention bias, ``gelu_pytorch_tanh``, default rotary
positions in either config format: ``rope_parameters`` or the older ``rope_theta`` /
``rope_local_base_freq``; no quantization) and one ``model.safetensors`` holding exactly
the text model's tensors, of the shapes the config implies, in a float dtype. Anything
else is a reason string: the caller loads with transformers instead.

This module imports torch and safetensors: import it where an encoder is built.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from hf_pipeline.encoder.native import (
    WEIGHTS,
    EncoderOutput,
    Invalid,
    NativeModel,
    bounded_float,
    bounded_sizes,
    embedding,
    kind_problem,
    linear,
    map_weights,
)

__all__ = ["GemmaConfig", "GemmaModel", "NativeGemma", "inspect_config"]

SLIDING, FULL = "sliding_attention", "full_attention"
#: ``architectures`` whose checkpoints hold the text model (a head, if any, left out).
_ARCHITECTURES = frozenset({"Gemma3ForCausalLM", "Gemma3TextModel"})
#: transformers' defaults for what a gemma-3 text config may leave out.
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """What :class:`GemmaModel` takes of a gemma-3 text ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    rms_norm_eps: float
    query_pre_attn_scalar: float
    #: Each layer's attention: :data:`SLIDING` or :data:`FULL`.
    layer_types: tuple[str, ...]
    #: The rotary base of each layer type.
    rope_theta: tuple[tuple[str, float], ...]
    #: As transformers' config says it (TextEncoder's tests read it).
    _attn_implementation: str = "sdpa"


class RMSNorm(torch.nn.Module):
    """gemma's RMSNorm: in float32, ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, then back
    to the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class GemmaAttention(torch.nn.Module):
    is_causal = True  # TextEncoder's _causal_decoder reads it

    def __init__(self, cfg: GemmaConfig, layer_type: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        )  # fmt: skip
        self.groups = self.heads // self.kv_heads
        self.scaling = cfg.query_pre_attn_scalar**-0.5
        self.layer_type = layer_type
        h = cfg.hidden_size
        self.q_proj = linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape).transpose(1, 2))
        k = self.k_norm(self.k_proj(x).view(shape).transpose(1, 2))
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        extra: dict[str, Any] = {}
        if self.groups > 1:
            if mask is None and self.head_dim <= 256:
                extra["enable_gqa"] = True  # as transformers' SDPA path does
            else:
                k = k.repeat_interleave(self.groups, dim=1)
                v = v.repeat_interleave(self.groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling,
            is_causal=mask is None and q.shape[2] > 1, **extra,
        )  # fmt: skip
        out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class GemmaMLP(torch.nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(h, i, bias=False)
        self.up_proj = linear(h, i, bias=False)
        self.down_proj = linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class GemmaLayer(torch.nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_type: str):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_type)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos, sin, mask):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(torch.nn.Module):
    """transformers' ``Gemma3TextModel`` (SDPA attention, inference, no cache) with its
    state-dict keys. Its parameters start uninitialised: load a state dict
    (:meth:`NativeGemma.load`); the rotary frequencies and the embedding scale are
    buffers outside the state dict, in float32 (as transformers keeps them)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(GemmaLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale, persistent=False)
        steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        for layer_type, base in cfg.rope_theta:
            self.register_buffer(f"{layer_type}_inv_freq", 1.0 / (base**steps), persistent=False)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The token embedding table (as transformers' models name it)."""
        return self.embed_tokens

    def _rotary(self, layer_type: str, tokens: int, device, dtype):
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        positions = torch.arange(tokens, device=device, dtype=torch.float32)
        freqs = positions[None, :, None] * inv_freq.to(device=device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _masks(self, tokens: int, device, attention_mask):
        """The attention mask of each layer type (True: attend), None where SDPA's causal
        kernel alone gives it: no padding mask and, for the sliding layers, fewer tokens
        than the window (transformers makes one from ``sliding_window`` tokens on)."""
        kinds = set(self.config.layer_types)
        if attention_mask is None and (SLIDING not in kinds or tokens < self.config.sliding_window):
            return dict.fromkeys(kinds)  # the encoder's case: no kernel launched for masks
        keep = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            keep = keep | ~keep.any(-1, keepdim=True)  # a row without any real token
            keep = keep[:, None, None, :]
        rows = torch.arange(tokens, device=device)
        causal = rows[None, :] <= rows[:, None]
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in kinds:
            mask = None
            if layer_type == SLIDING and tokens >= self.config.sliding_window:
                window = rows[None, :] > rows[:, None] - self.config.sliding_window
                mask = (causal & window)[None, None]
            if keep is not None:
                mask = (causal[None, None] if mask is None else mask) & keep
            masks[layer_type] = mask
        return masks

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> EncoderOutput:
        """``attention_mask``: ``(batch, tokens)``, nonzero for real tokens; padding keys
        are masked out of the attention (a row without any real token attends to every
        key before it). Positions count from 0 in every row."""
        x = self.embed_tokens(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)
        tokens = input_ids.shape[1]
        rotary = {
            t: self._rotary(t, tokens, x.device, x.dtype) for t in set(self.config.layer_types)
        }
        masks = self._masks(tokens, x.device, attention_mask)
        for layer, layer_type in zip(self.layers, self.config.layer_types, strict=True):
            cos, sin = rotary[layer_type]
            x = layer(x, cos, sin, masks[layer_type])
        return EncoderOutput(self.norm(x))


def _expected_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "norm.weight": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        shapes.update({
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,),
            f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i),
        })  # fmt: skip
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
            shapes[f"{p}{norm}.weight"] = (h,)
    return shapes


def _rope(raw: dict[str, Any]) -> tuple[tuple[str, float], ...] | str:
    """Each layer type's rotary base, from ``rope_parameters`` (transformers 5) or the
    older ``rope_theta`` / ``rope_local_base_freq`` with no ``rope_scaling``; only the
    default rotary type loads natively."""
    params = raw.get("rope_parameters")
    if params is None:
        if raw.get("rope_scaling") is not None:
            return "rope_scaling is set"
        params = {
            FULL: {"rope_type": "default", "rope_theta": raw.get("rope_theta", _DEFAULT_THETA[FULL])},
            SLIDING: {"rope_type": "default",
                      "rope_theta": raw.get("rope_local_base_freq", _DEFAULT_THETA[SLIDING])},
        }  # fmt: skip
    if not isinstance(params, dict) or set(params) != {FULL, SLIDING}:
        return f"rope_parameters {params!r} are not one per layer type"
    out = []
    for layer_type in (FULL, SLIDING):
        p = params[layer_type]
        if not isinstance(p, dict) or p.get("rope_type", "default") != "default":
            return f"rope_parameters[{layer_type!r}] is {p!r}, not the default rotary type"
        if set(p) - {"rope_type", "rope_theta"}:
            return f"rope_parameters[{layer_type!r}] has {sorted(set(p) - {'rope_type', 'rope_theta'})}"
        theta = bounded_float(p, "rope_theta", _DEFAULT_THETA[layer_type], 1, 1e12)
        if isinstance(theta, str):
            return Invalid(f"rope_parameters[{layer_type!r}]: {theta}")
        out.append((layer_type, theta))
    return tuple(out)


def _config(raw: Any) -> GemmaConfig | str:
    """The :class:`GemmaConfig` of a parsed ``config.json``, or why it does not load here."""
    kind = kind_problem(raw, "gemma3_text", _ARCHITECTURES, "a gemma-3 text model's",
                        ("use_bidirectional_attention", "attention_bias"))  # fmt: skip
    if kind is not None:
        return kind
    for unset in ("attn_logit_softcapping", "quantization_config"):
        if raw.get(unset) is not None:
            return f"{unset} is set"
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"hidden_activation is {raw.get('hidden_activation')!r}, not 'gelu_pytorch_tanh'"
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window")  # fmt: skip
    absent = [n for n in names[:6] if n not in raw]
    if absent:  # transformers has defaults for them; an odd config, not a broken one
        return f"{absent[0]} is absent"
    sizes = bounded_sizes(raw, names, {"head_dim": 256, "sliding_window": 4096})
    if isinstance(sizes, str):
        return Invalid(sizes)
    if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
        return Invalid("num_attention_heads is not a multiple of num_key_value_heads")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        # Older configs give a pattern, which transformers versions have read from
        # different keys (sliding_window_pattern, _sliding_window_pattern): theirs to say.
        return "layer_types is absent (an older config: transformers derives the layers)"
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        return Invalid("layer_types is not a list of 'sliding_attention' / 'full_attention'")
    if len(layer_types) != sizes["num_hidden_layers"]:
        return Invalid(
            f"layer_types has {len(layer_types)} entries, not num_hidden_layers "
            f"({sizes['num_hidden_layers']})"
        )
    if not set(layer_types) <= {SLIDING, FULL}:
        other = sorted(set(layer_types) - {SLIDING, FULL})[0]
        return Invalid(
            f"layer_types holds {other[:40]!r}, not 'sliding_attention' / 'full_attention'"
        )
    rope = _rope(raw)
    if isinstance(rope, str):
        return rope
    eps = bounded_float(raw, "rms_norm_eps", 1e-6, 0, 1)
    scalar = bounded_float(raw, "query_pre_attn_scalar", 256, 0, 1e9)
    for value in (eps, scalar):
        if isinstance(value, str):
            return Invalid(value)
    assert isinstance(eps, float) and isinstance(scalar, float)
    return GemmaConfig(**sizes, rms_norm_eps=eps, query_pre_attn_scalar=scalar,
                       layer_types=tuple(layer_types), rope_theta=rope)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class NativeGemma(NativeModel):
    """A folder that loads as :class:`GemmaModel` (its rotary frequencies and embedding
    scale stay float32 buffers, as transformers keeps them)."""

    config: GemmaConfig

    def _model(self) -> GemmaModel:
        return GemmaModel(self.config)


def inspect_config(folder: Path, cfg_path: Path, raw: Any) -> NativeGemma | str:
    """A :class:`NativeGemma` for ``folder`` (whose ``config.json``, at ``cfg_path``,
    parsed as ``raw``) when it is a gemma-3 text model whose ``model.safetensors`` maps
    cleanly onto :class:`GemmaModel`; else why not (one line, naming the file and, for a
    tensor, its name; :class:`~hf_pipeline.encoder.native.Invalid` where the folder is a
    broken one of this kind, not another kind). Reads the weights file's header only."""
    cfg = _config(raw)
    if isinstance(cfg, str):
        return (Invalid if isinstance(cfg, Invalid) else str)(f"{cfg_path}: {cfg}")
    weights = folder / WEIGHTS
    names = map_weights(
        weights, _expected_shapes(cfg), prefix="model.", what="a gemma-3 text model's",
        skip=lambda key: key == "lm_head.weight",
    )  # fmt: skip
    if isinstance(names, str):
        return names
    return NativeGemma(cfg, weights, names)
