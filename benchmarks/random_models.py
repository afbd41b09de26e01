"""Random-weight encoders of the benchmarks' two shapes, saved with a borrowed tokenizer:
the architecture's speed without a download (the GPU hosts reach no model hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = ["save_random_model"]


def save_random_model(kind: Literal["minilm", "gemma"], folder: Path, tokenizer: str | Path):
    """Save a random-weight ``kind`` model (all-MiniLM-L6-v2 or gemma-3-270m shaped,
    seed 0) and the tokenizer from ``tokenizer`` into ``folder``; its config."""
    import torch
    from transformers import AutoModel, AutoTokenizer, BertConfig, Gemma3TextConfig

    if kind == "minilm":
        cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                         num_attention_heads=12, intermediate_size=1536,
                         max_position_embeddings=512)  # fmt: skip
    else:
        cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=256,
                               max_position_embeddings=32768)  # fmt: skip
    torch.manual_seed(0)
    AutoModel.from_config(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tokenizer)).save_pretrained(folder)
    return cfg
