"""Random-weight encoders of the benchmarks' two shapes, saved with a borrowed tokenizer:
the architecture's speed without a download (the GPU hosts reach no model hub); and a
tiny BERT (2 layers of 32) for CPU runs whose subject is not the encoder (the 2-CPU VM's
``bench_evolve.py``: the joins, the assembly and the start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = [
    "add_random_model_options",
    "random_model",
    "random_model_option",
    "save_random_model",
]


def save_random_model(
    kind: Literal["minilm", "gemma", "tiny"], folder: Path, tokenizer: str | Path
):
    """Save a random-weight ``kind`` model (all-MiniLM-L6-v2 or gemma-3-270m shaped, or a
    tiny BERT: hidden 32, 2 layers, 2 heads; seed 0) and the tokenizer from ``tokenizer`` into ``folder``; its config."""
    import torch
    from transformers import AutoModel, AutoTokenizer, BertConfig, Gemma3TextConfig

    if kind == "minilm":
        cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                         num_attention_heads=12, intermediate_size=1536,
                         max_position_embeddings=512)  # fmt: skip
    elif kind == "tiny":
        cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64,
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


def add_random_model_options(ap) -> None:
    """``--random-minilm`` / ``--random-gemma`` / ``--random-tiny TOKENIZER_DIR`` (at most
    one) on ``ap``."""
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--random-minilm", default="", metavar="TOKENIZER_DIR",
                       help="a random-weight MiniLM with this tokenizer")  # fmt: skip
    group.add_argument("--random-gemma", default="", metavar="TOKENIZER_DIR",
                       help="a random-weight gemma-3-270m-shaped encoder (the issue's COYO "
                            "encoder; use --dtype bfloat16) with this tokenizer")  # fmt: skip
    group.add_argument("--random-tiny", default="", metavar="TOKENIZER_DIR",
                       help="a random-weight tiny BERT (hidden 32, 2 layers) with this "
                            "tokenizer: CPU runs about everything but the encoder")  # fmt: skip


def random_model_option(ap, args) -> tuple[str, str]:
    """``(kind, tokenizer folder)`` of the random-model option given (``("", "")``: none);
    ``ap.error`` when the folder is not one."""
    kind, tokenizer = next(
        (
            (k, t)
            for k, t in (
                ("minilm", args.random_minilm),
                ("gemma", args.random_gemma),
                ("tiny", args.random_tiny),
            )
            if t
        ),
        ("", ""),
    )
    if tokenizer and not Path(tokenizer).is_dir():
        ap.error(f"--random-{kind}: {tokenizer} is not a folder")
    return kind, tokenizer


def random_model(kind: str, folder: Path, tokenizer: str | Path) -> str:
    """``folder`` holding a random-weight ``kind`` model (made unless an earlier run left
    it there: the weights are seeded, so it is the same model)."""
    if not (folder / "config.json").is_file():
        save_random_model(kind, folder, tokenizer)
    return str(folder)
