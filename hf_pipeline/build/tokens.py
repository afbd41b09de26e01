"""Stage 1b, the token ids: a part's captions -> ``input_ids``, by the ``num_proc`` workers.

A part's token ids are a store unit of their own (``tokens-<part>-<captions>-<tokenizer>``,
:mod:`hf_pipeline.build.part_store`): they depend on the captions (the part's ``text``
unit) and on the tokenizer with its ``max_length`` (:func:`~hf_pipeline.build.part_store.tokenizer_key`),
not on the encoder's weights. So an encoder with the same tokenizer reuses them, and
another tokenizer or ``max_length`` recomputes them alone.

:func:`tokenize_part` runs a ``Dataset.map(num_proc=build.num_proc)`` over the captions
file: each worker (forked by the build's clean fork server,
:mod:`hf_pipeline.workers.pool`) tokenizes a contiguous slice of the rows with the
tokenizer's Rust backend (:class:`~hf_pipeline.encoder.model.WorkerTokenizer`, from the
:class:`~hf_pipeline.encoder.model.TokenizerSpec` the builder exported). Why workers
and not threads of the builder: the builder's process runs the encoder's thread and the
next part's join on every CPU at once; 16 tokenizing threads there made a 1M-row
embed stage 0.17x its bare forward on a 16-CPU H200 host (docs/performance.md). The
embedding's thread calls it just before a part's embedding, while the main loop joins the
next part (called between two joins, on the main loop, it kept a 1M-row build's joins
waiting 26 s).

The file, row-aligned with the captions: ``input_ids`` (``list<int32>``), the ids of
every row whose pre-duplicate reason is kept, an empty list elsewhere. The embedding
(:func:`hf_pipeline.build.embed_stage.embed_joined_rows`) encodes the rows that stay
kept after duplicates and writes their ids beside the embeddings, as before.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from dist.atomic import write_json_atomic
from hf_pipeline.build.accounting import keep_mask
from hf_pipeline.build.embed_stage import tokenize_kept
from hf_pipeline.encoder.model import TokenizerSpec, WorkerTokenizer

__all__ = ["TOKENS_FILE", "tokenize_part", "tokenize_rows"]

#: The unit's file, under its folder (``tokens/data*.arrow`` with ``num_proc`` workers).
TOKENS_FILE = Path("tokens") / "data.arrow"

#: The worker's tokenizers, by spec (a worker of the pool tokenizes many batches).
_LOADED: dict[Any, Any] = {}


def _tokenizer(tokenizer):
    """A callable tokenizer: ``tokenizer`` itself, or (a spec) this process's
    :class:`~hf_pipeline.encoder.model.WorkerTokenizer` of it."""
    if not isinstance(tokenizer, TokenizerSpec):
        return tokenizer
    if tokenizer not in _LOADED:
        _LOADED[tokenizer] = WorkerTokenizer(tokenizer)
    return _LOADED[tokenizer]


def tokenize_rows(
    captions: pa.Array, reasons: pa.Array, indices: list[int], *, tokenizer, probe, timing_dir: str
) -> pa.Table:
    """``datasets.map`` function (Arrow format, in the ``num_proc`` workers): the token ids
    of the batch's kept rows (``reasons`` empty), an empty list for the others. Writes
    one small timing file (pid, wall-clock start and end, rows) per batch into
    ``timing_dir``; ``probe`` stops a builder that lost its lease at the next batch."""
    probe.check()
    t0 = time.time()  # wall clock: the timeline compares processes
    if isinstance(reasons, pa.ChunkedArray):
        reasons = reasons.combine_chunks()
    ids = tokenize_kept(captions, keep_mask(reasons), _tokenizer(tokenizer), threads=1)
    if len(indices):
        write_json_atomic(
            Path(timing_dir) / f"{indices[0]:012d}.json",
            {"pid": os.getpid(), "start": t0, "end": time.time(), "rows": len(indices)},
            durable=False,
        )
    return pa.table({"input_ids": ids})


def tokenize_part(
    caption_files: Sequence[Path],
    *,
    tokenizer,
    num_proc: int,
    probe,
    out_dir: Path,
    fingerprint: str,
    batch_rows: int,
    writer_batch_size: int,
) -> dict[str, Any]:
    """Tokenize a part's captions (its ``text`` unit's published ``caption_files``) into
    ``out_dir/tokens/`` with ``num_proc`` worker processes.

    Args:
        tokenizer: a :class:`~hf_pipeline.encoder.model.TokenizerSpec` (loaded in each
            worker), or a tokenizer without a Rust backend (called in this process:
            it cannot be handed to a worker).
        num_proc: workers at most (``build.num_proc``); at most one per row.
        probe: a :class:`dist.lease.LeaseProbe` checked every batch.
        fingerprint: used for the ``datasets`` cache fingerprint.
        batch_rows: rows per tokenizer call.

    Returns:
        The unit's timeline: ``rows``, ``num_proc``, ``worker_pids`` (the processes
        that tokenized), ``worker_busy_seconds`` and ``seconds_tokenize`` (the wall).
    """
    import shutil

    from datasets import Dataset, Features, List, Value, concatenate_datasets

    from hf_pipeline.build.convert import check_workers_can_start

    t0 = time.monotonic()
    parts = [Dataset.from_file(str(f)) for f in caption_files]
    rows = concatenate_datasets(parts) if len(parts) != 1 else parts[0]
    features = Features({"input_ids": List(Value("int32"))})
    out = out_dir / TOKENS_FILE
    work = out_dir / "_work"
    probe.check()  # never re-create a lost lease's folder
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    in_workers = isinstance(tokenizer, TokenizerSpec)
    procs = max(1, min(num_proc, len(rows))) if in_workers else 1
    if len(rows) == 0:
        # datasets' map writes no file for no rows; the unit still needs its (empty) file.
        from datasets.arrow_writer import ArrowWriter

        with ArrowWriter(features=features, path=str(out)) as writer:
            writer.finalize()
    else:
        if procs > 1:
            check_workers_can_start(procs)
        rows.with_format("arrow").map(
            tokenize_rows,
            batched=True,
            batch_size=max(1, batch_rows),
            with_indices=True,
            input_columns=["caption", "drop_reason"],
            remove_columns=rows.column_names,
            num_proc=procs if procs > 1 else None,
            writer_batch_size=writer_batch_size,
            features=features,
            fn_kwargs={"tokenizer": tokenizer, "probe": probe, "timing_dir": str(work)},
            cache_file_name=str(out),
            new_fingerprint=f"{fingerprint}-tokens",
            keep_in_memory=False,
            desc="Tokenize captions",
        )
    times = [json.loads(p.read_text()) for p in sorted(work.glob("*.json"))]
    shutil.rmtree(work, ignore_errors=True)
    return {
        "rows": len(rows),
        "num_proc": procs,
        "worker_pids": sorted({int(t["pid"]) for t in times}),
        "worker_busy_seconds": round(sum(t["end"] - t["start"] for t in times), 3),
        "seconds_tokenize": round(time.monotonic() - t0, 3),
    }
