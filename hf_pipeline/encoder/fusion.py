"""Fused bias + GELU for BERT-style encoders on CUDA (``encoder.fuse_gelu``).

A BERT layer's intermediate step is a biased ``Linear`` (384 -> 1536 wide in MiniLM)
followed by GELU. Run as two steps, the GELU is a separate pass over the widest
activation of the layer: 87 ms of a 0.62 s MiniLM ``encode_ids`` of 100k rows on an H100
(profiled). ``torch._addmm_activation(..., use_gelu=True)`` runs both as one cuBLASLt GEMM
whose epilogue adds the bias and applies GELU before the result is written: 0.66 ms
against 1.12 ms for ``torch.compile``'s GEMM + fused bias/GELU kernel on a
(262144 x 384) @ (384 x 1536) bf16 product (H100,
``benchmarks/results/embed_h100_fused_gelu_v01.json``).

cuBLASLt's GELU is the tanh form, where BERT's is the erf form: they differ by at most
4.7e-4 (at x = 2.7), about 6% of bfloat16's rounding step there (0.0078) and half of
float16's; so :class:`hf_pipeline.encoder.model.TextEncoder` fuses only in those dtypes, on
CUDA. On the CPU the same operation computes the erf form exactly: the module swap
itself is tested there.

It recognises transformers' BERT-style steps and the native BERT's
(:mod:`hf_pipeline.encoder.bert`); with the native model it imports no transformers.

This module imports torch: import it where an encoder is built, not at package import.
"""

from __future__ import annotations

import torch

__all__ = ["BiasGeluLinear", "fuse_bias_gelu"]


class BiasGeluLinear(torch.nn.Module):
    """``gelu(linear(x))`` of a biased ``torch.nn.Linear`` as one GEMM with a bias+GELU
    epilogue; shares (does not copy) the linear's parameters."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch._addmm_activation(self.bias, flat, self.weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], y.shape[-1])


def _is_erf_gelu(act) -> bool:
    """Whether ``act`` is exact (erf) GELU: ``torch.nn.GELU()`` or transformers'
    ``GELUActivation`` (its ``"gelu"`` activation), nothing else (``gelu_new`` and the
    other tanh or quick forms already differ from it, and are left alone)."""
    from hf_pipeline.encoder.bert import loaded_transformers_class

    if isinstance(act, torch.nn.GELU):
        return act.approximate == "none"
    theirs = loaded_transformers_class("activations", "GELUActivation")
    return (
        theirs is not None
        and type(act) is theirs
        and getattr(act, "act", None) is torch.nn.functional.gelu
    )


def _forward_is_berts(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is BERT's intermediate step, ``act(dense(x))``, to the
    bytecode (transformers copies it into RoBERTa, XLM-R, MPNet, ELECTRA...; a model whose
    forward does anything else between or around the two is left alone), or the native
    BERT's (:class:`hf_pipeline.encoder.bert.BertIntermediate`, the same step)."""
    from hf_pipeline.encoder.bert import BertIntermediate as NativeIntermediate
    from hf_pipeline.encoder.bert import loaded_transformers_class

    if type(module) is NativeIntermediate:
        return True
    theirs = loaded_transformers_class("models.bert.modeling_bert", "BertIntermediate")
    if theirs is None:  # no transformers module: nothing to compare to
        return False
    mine = getattr(type(module).forward, "__code__", None)
    berts = theirs.forward.__code__
    return mine is not None and (mine.co_code, mine.co_names) == (berts.co_code, berts.co_names)


def fuse_bias_gelu(model: torch.nn.Module) -> int:
    """Replace each BERT-style intermediate step of ``model`` (a module whose forward is
    BERT's ``intermediate_act_fn(dense(x))`` with a biased ``Linear`` and exact GELU) with
    a :class:`BiasGeluLinear` and an identity.

    Returns:
        How many were replaced (0: the model has none, e.g. gemma's gated MLP).
    """
    fused = 0
    for module in model.modules():
        dense = getattr(module, "dense", None)
        act = getattr(module, "intermediate_act_fn", None)
        if (
            _forward_is_berts(module)
            and type(dense) is torch.nn.Linear
            and dense.bias is not None
            and act is not None
            and _is_erf_gelu(act)
        ):
            module.dense = BiasGeluLinear(dense)
            module.intermediate_act_fn = torch.nn.Identity()
            fused += 1
    return fused
