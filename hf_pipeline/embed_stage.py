"""Stage 1c, the embedding: token ids of the joined rows -> one embedding per kept row.

``Dataset.map(batch_size=build.batch_size)`` in the building process, with the encoder
(:class:`hf_pipeline.embed.TextEncoder`) on the accelerator: one model, big batches.
Only rows that will be kept are encoded; a row that is a duplicate of an earlier key
gets its ``duplicate_key`` reason here. Writes ``embedding, drop_reason`` Arrow files
row-aligned with the joined rows (the 24 KB latents are never rewritten).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hf_pipeline.accounting import DUPLICATE, KEEP, ReasonCodes

__all__ = ["EMBED_ROWS_PER_CALL", "EmbedResult", "embed_joined_rows", "embed_rows"]

#: Rows handed to the encoder per map batch at least: its micro-batches (a token budget
#: of one padded width each) can only be as large as one width's share of a call, and
#: the accelerator is launch-bound on small ones (MiniLM wants ~4k rows a call, a
#: gemma-3-270m shape ~20k: benchmarks/bench_embed.py).
EMBED_ROWS_PER_CALL = 16384

log = logging.getLogger("hf_pipeline")


def embed_rows(
    input_ids,
    reasons,
    indices: list,
    *,
    probe,
    encoder,
    duplicate: np.ndarray,
) -> dict[str, Any]:
    """``datasets.map`` function (Arrow format): token ids -> embeddings (kept rows only)."""
    probe.check()  # a builder that lost its lease stops at the next batch
    idx = np.asarray(indices, dtype=np.int64)
    final = np.asarray(reasons.to_pylist(), dtype=object)  # one batch, not the table
    final[(final == KEEP) & duplicate[idx]] = DUPLICATE
    keep = np.flatnonzero(final == KEEP)
    emb = np.zeros((len(idx), encoder.dim), dtype=encoder.output_dtype)
    if len(keep):
        emb[keep] = encoder.encode_ids(input_ids.take(keep))
    return {"embedding": emb, "drop_reason": final.tolist()}


@dataclasses.dataclass(frozen=True)
class EmbedResult:
    """The embeddings written, their final drop reasons and the encoder's width."""

    embedded: Any
    reasons: ReasonCodes
    dim: int


def embed_joined_rows(
    rows, duplicate: np.ndarray, *, encoder, cfg, probe, out_file: Path, fingerprint: str
) -> EmbedResult:
    """Embed the kept rows of ``rows`` (the join's output) into ``out_file``.

    Args:
        rows: the joined rows (``datasets.Dataset`` with ``input_ids, drop_reason``).
        duplicate: True for rows whose key appeared in an earlier eligible row.
        encoder: the loaded :class:`hf_pipeline.embed.TextEncoder` (one per process:
            the model loads once for all parts).
        cfg: the :class:`hf_pipeline.config.Config` (encoder, batch sizes).
        probe: a :class:`dist.lease.LeaseProbe` checked every batch.
        out_file: where ``datasets`` writes ``embedding, drop_reason``.
        fingerprint: used for the ``datasets`` cache fingerprint.
    """
    from datasets import Features, List, Value

    emb_type = "float16" if cfg.encoder.output_dtype == "float16" else "float32"
    embedded = rows.with_format("arrow").map(
        embed_rows,
        batched=True,
        batch_size=max(cfg.build.batch_size, EMBED_ROWS_PER_CALL),
        writer_batch_size=cfg.build.writer_batch_size,
        input_columns=["input_ids", "drop_reason"],
        with_indices=True,
        remove_columns=rows.column_names,
        features=Features(
            {
                "embedding": List(Value(emb_type), length=encoder.dim),
                "drop_reason": Value("string"),
            }
        ),
        fn_kwargs={"probe": probe, "encoder": encoder, "duplicate": duplicate},
        cache_file_name=str(out_file),
        new_fingerprint=f"{fingerprint}-embeddings",
        keep_in_memory=False,
        desc="Embed captions",
    )
    return EmbedResult(
        embedded=embedded,
        reasons=ReasonCodes(embedded.data.column("drop_reason")),
        dim=encoder.dim,
    )
