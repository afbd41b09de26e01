"""Stage 1c, the embedding: token ids of the joined rows' captions -> one embedding per
kept row.

``Dataset.map(batch_size=build.batch_size)`` in the building process, with the encoder
(:class:`hf_pipeline.encoder.model.TextEncoder`) on the accelerator: one model, big batches,
encoded by a thread a batch ahead of the map that writes them (:class:`EncodeAhead`).
Only rows that will be kept are encoded; a row that is a duplicate of an earlier key
gets its ``duplicate_key`` reason here. Writes ``embedding, input_ids, drop_reason``
Arrow files row-aligned with the joined rows (the 24 KB latents are never rewritten).

The token ids come from the part's ``tokens`` unit (:mod:`hf_pipeline.build.tokens`: the
``num_proc`` workers tokenize, keyed by the captions and the tokenizer, so an encoder with
the same tokenizer reuses them); called without them (``input_ids=None``), the captions
are tokenized here, on threads of this process (:func:`tokenize_kept`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_pipeline.build.accounting import DUPLICATE, KEEP, ReasonCodes, keep_mask

__all__ = [
    "EMBED_ROWS_PER_CALL",
    "EmbedResult",
    "EncodeAhead",
    "embed_joined_rows",
    "embed_rows",
    "only_rows",
    "tokenize_kept",
]

#: Captions per tokenizer call (a batch call runs in the tokenizer's Rust code).
_TOKENIZE_ROWS = 4096

#: Rows handed to the encoder per map batch at least: its micro-batches (a token budget
#: of one padded width each) can only be as large as one width's share of a call, and
#: the accelerator is launch-bound on small ones (MiniLM wants ~4k rows a call, a
#: gemma-3-270m shape ~20k: benchmarks/bench_embed.py).
EMBED_ROWS_PER_CALL = 16384

log = logging.getLogger(__name__)


def embed_rows(
    reasons,
    indices: list,
    *,
    probe,
    ahead: EncodeAhead,
    duplicate: np.ndarray,
    input_ids: pa.Array,
    on_phase=None,
) -> pa.Table:
    """``datasets.map`` function (Arrow format): the batch's final reasons, its token ids
    (``input_ids``: the part's, empty for rows not kept) and its embeddings from
    :class:`EncodeAhead` (kept rows; zeros elsewhere), as an Arrow table.
    ``on_phase("embedding")`` is called as the first batch starts."""
    probe.check()  # a builder that lost its lease stops at the next batch
    idx = np.asarray(indices, dtype=np.int64)
    if on_phase is not None and len(idx) and idx[0] == 0:
        on_phase("embedding")
    if isinstance(reasons, pa.ChunkedArray):
        reasons = reasons.combine_chunks()
    # In Arrow, not a Python string per row: this runs beside the encoder's thread,
    # whose kernel launches wait for the interpreter lock.
    final = pc.if_else(pa.array(keep_mask(reasons) & duplicate[idx]), DUPLICATE, reasons)
    emb = ahead.get(int(idx[0])) if len(idx) else np.zeros((0, ahead.dim), ahead.dtype)
    # Again after the wait for the encoder (seconds; a pause lands here): the map
    # creates the output folder and file after the first batch, and the lost lease's
    # folder may be gone by now (collected by its successor).
    probe.check()
    flat = pa.array(np.ascontiguousarray(emb).reshape(-1))  # no copy
    embedding = pa.FixedSizeListArray.from_arrays(flat, ahead.dim)
    ids = input_ids.slice(int(idx[0]), len(idx)) if len(idx) else input_ids.slice(0, 0)
    return pa.table({"embedding": embedding, "input_ids": ids, "drop_reason": final})


class EncodeAhead:
    """Encodes the kept rows of each map batch on a thread, one batch or two ahead of the
    ``datasets.map`` that writes them.

    The accelerator then runs while the map converts the previous batch's reasons and
    writes its Arrow rows, instead of idling through that and through each batch's
    final device sync; and the next batch is queued on it before the thread waits for
    the current one. Batches are ``batch_size`` consecutive rows, as the map's are;
    :meth:`get` returns them in order (and re-raises what the thread raised).
    :meth:`timeline` says where the stage's time went.
    """

    def __init__(self, encoder, input_ids, keep: np.ndarray, *, batch_size: int, probe):
        self.dim = int(encoder.dim)
        self.dtype = encoder.output_dtype
        self._encoder, self._ids, self._keep = encoder, input_ids, keep
        self._batch, self._probe = batch_size, probe
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        # Written by the thread (gather, encode, blocked, laps) or by the map (waited).
        self._batches, self._gather, self._encode, self._blocked = 0, 0.0, 0.0, 0.0
        self._waited = 0.0
        self._laps: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="hf_pipeline-embed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # One call in flight ahead: batch k+1 is prepared and queued on the device
        # (TextEncoder.submit_ids) before the thread waits for batch k's embeddings, so
        # the device does not idle through the host's share of each call.
        pending = None
        try:
            for start in range(0, len(self._keep), self._batch):
                self._probe.check()
                stop = min(start + self._batch, len(self._keep))
                rows = np.flatnonzero(self._keep[start:stop])
                job = None
                if len(rows):
                    t0 = time.monotonic()
                    ids = self._ids.slice(start, stop - start).take(pa.array(rows))
                    t1 = time.monotonic()
                    job = self._encoder.submit_ids(ids, laps=self._laps)
                    self._gather += t1 - t0
                    self._encode += time.monotonic() - t1
                    self._batches += 1
                if pending is not None and not self._deliver(*pending):
                    return
                pending = (start, stop, rows, job)
            if pending is not None:
                self._deliver(*pending)
        except BaseException as e:  # handed to the map, which raises it
            self._put((None, e))

    def _deliver(self, start: int, stop: int, rows: np.ndarray, job) -> bool:
        """Wait for a batch's embeddings and hand them to the map (False: stopped)."""
        emb = np.zeros((stop - start, self.dim), dtype=self.dtype)
        if job is not None:
            t0 = time.monotonic()
            emb[rows] = job.result()
            self._encode += time.monotonic() - t0
        t1 = time.monotonic()
        if not self._put((start, emb)):
            return False
        self._blocked += time.monotonic() - t1
        return True

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, start: int) -> np.ndarray:
        """The embeddings of the batch starting at row ``start`` (the next one)."""
        t0 = time.monotonic()
        first, value = self._queue.get()
        self._waited += time.monotonic() - t0
        if first is None:
            raise value
        if first != start:  # pragma: no cover - the map's batches are consecutive
            raise RuntimeError(f"embedding batch at row {first}, the map asked for {start}")
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def timeline(self) -> dict[str, Any]:
        """Where the stage's time went, in seconds (after :meth:`close`): the encoder
        thread's ``seconds_gather`` (the kept rows' ids), ``seconds_encode`` (its
        ``encode_ids`` calls, ``batches`` of them, split in ``encode``: their
        ``prepare``, ``launch`` and ``finish`` laps) and ``seconds_blocked`` (a batch
        encoded, waiting for the map to take it: writing is the slower side), and the
        map's ``seconds_waiting`` (for the encoder: encoding is the slower side)."""
        return {
            "batches": self._batches,
            "seconds_gather": round(self._gather, 3),
            "seconds_encode": round(self._encode, 3),
            "encode": {k: round(v, 3) for k, v in self._laps.items()},
            "seconds_blocked": round(self._blocked, 3),
            "seconds_waiting": round(self._waited, 3),
        }


@dataclasses.dataclass(frozen=True)
class EmbedResult:
    """The embeddings written, their final drop reasons, the encoder's width and where
    the time went (:meth:`EncodeAhead.timeline`)."""

    embedded: Any
    reasons: ReasonCodes
    dim: int
    timeline: dict[str, Any] = dataclasses.field(default_factory=dict)


def tokenize_kept(
    captions: pa.ChunkedArray | pa.Array, keep: np.ndarray, tokenizer, *, threads: int | None = None
) -> pa.Array:
    """The token ids of the ``keep`` rows' captions (``list<int32>``, one row per caption;
    an empty list for a row not kept), by ``tokenizer`` (a
    :class:`hf_pipeline.encoder.model.CaptionTokenizer`) in batches.

    The batches run on ``threads`` threads (default: the CPUs, at most 16) through the
    tokenizer's Rust backend (:class:`~hf_pipeline.encoder.model.WorkerTokenizer`: the same
    ids, one per thread), which releases the GIL: one thread calling transformers'
    tokenizer made a 1M-row embed stage 23x slower than its forward on an H200 host
    (benchmarks/NOTES.md). A tokenizer without a Rust backend is called as it is.
    """
    import itertools
    import os
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    if isinstance(captions, pa.ChunkedArray):
        captions = captions.combine_chunks()
    rows = np.flatnonzero(keep)
    chunks = [rows[start : start + _TOKENIZE_ROWS] for start in range(0, len(rows), _TOKENIZE_ROWS)]
    lengths = np.zeros(len(keep), dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="hf_pipeline-tok-") as folder:
        export = getattr(tokenizer, "export", None)
        spec = export(folder) if export is not None and len(chunks) > 1 else None
        local = threading.local()

        def encode(chunk: np.ndarray) -> list[list[int]]:
            texts = captions.take(pa.array(chunk)).to_pylist()
            if spec is None:
                return tokenizer(texts)
            if not hasattr(local, "tokenizer"):
                from hf_pipeline.encoder.model import WorkerTokenizer

                local.tokenizer = WorkerTokenizer(spec)  # one per thread: not thread-safe
            return local.tokenizer(texts)

        workers = max(1, min(threads or os.cpu_count() or 1, 16, len(chunks) or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="hf_pipeline-tokenize") as pool:
            done = list(pool.map(encode, chunks))  # in order
    for chunk, seqs in zip(chunks, done, strict=True):
        lengths[chunk] = [len(seq) for seq in seqs]
    offsets = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    flat = np.fromiter(
        itertools.chain.from_iterable(seq for seqs in done for seq in seqs), np.int32, count=total
    )
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat, pa.int32()))


def embed_joined_rows(
    rows,
    duplicate: np.ndarray,
    *,
    encoder,
    cfg,
    probe,
    out_file: Path,
    fingerprint: str,
    reasons: ReasonCodes | None = None,
    on_phase: Callable[[str], None] | None = None,
    input_ids: pa.Array | None = None,
) -> EmbedResult:
    """Embed the kept rows of ``rows`` (the join's output) into ``out_file``.

    Args:
        rows: the joined rows (``datasets.Dataset`` with ``caption, drop_reason``).
        duplicate: True for rows whose key appeared in an earlier eligible row.
        encoder: the loaded :class:`hf_pipeline.encoder.model.TextEncoder` (one per process:
            the model loads once for all parts).
        cfg: the :class:`hf_pipeline.config.Config` (encoder, batch sizes).
        probe: a :class:`dist.lease.LeaseProbe` checked every batch.
        out_file: where ``datasets`` writes ``embedding, input_ids, drop_reason``.
        fingerprint: used for the ``datasets`` cache fingerprint.
        reasons: the join's ``drop_reason`` column as codes, when the caller has them.
        on_phase: told ``"embedding"`` as the first batch starts (the builder's
            heartbeat phase: :meth:`dist.coordinator.StageContext.set_phase`).
        input_ids: the rows' token ids, row-aligned (the part's ``tokens`` unit: at
            least every kept row's); None: tokenized here (the timeline then says how
            long, ``seconds_tokenize``).
    """
    from datasets import Dataset, Features, List, Value

    emb_type = "float16" if cfg.encoder.output_dtype == "float16" else "float32"
    features = Features(
        {
            "embedding": List(Value(emb_type), length=encoder.dim),
            "input_ids": List(Value("int32")),
            "drop_reason": Value("string"),
        }
    )
    if len(rows) == 0:
        # A part of empty shards: datasets' map returns an empty dataset without the
        # new columns and writes no file; the part still needs its (empty) file.
        from datasets.arrow_writer import ArrowWriter

        probe.check()  # never re-create a lost lease's folder
        Path(out_file).parent.mkdir(parents=True, exist_ok=True)
        with ArrowWriter(features=features, path=str(out_file)) as writer:
            writer.finalize()
        embedded = Dataset.from_file(str(out_file))
        return EmbedResult(embedded, ReasonCodes(embedded.data.column("drop_reason")), encoder.dim)
    batch_size = max(cfg.build.batch_size, EMBED_ROWS_PER_CALL)
    if reasons is None:
        reasons = ReasonCodes(rows.data.column("drop_reason"))
    keep = reasons.mask(KEEP) & ~duplicate
    tokenized: dict[str, float] = {}
    if input_ids is None:
        t_tok = time.monotonic()
        input_ids = tokenize_kept(rows.data.column("caption"), keep, encoder.tokenizer)
        tokenized["seconds_tokenize"] = round(time.monotonic() - t_tok, 3)
    else:
        if len(input_ids) != len(rows):
            raise ValueError(
                f"{out_file}: {len(input_ids)} token id rows for {len(rows)} caption rows; "
                "they must be row-aligned"
            )
        # The ids of the rows encoded, empty elsewhere (duplicates within the part
        # included): the column a tokenization here writes.
        input_ids = only_rows(input_ids, keep)
    probe.check()
    ahead = EncodeAhead(encoder, input_ids, keep, batch_size=batch_size, probe=probe)
    try:
        embedded = rows.with_format("arrow").map(
            embed_rows,
            batched=True,
            batch_size=batch_size,
            writer_batch_size=cfg.build.writer_batch_size,
            input_columns=["drop_reason"],  # the token ids are read by EncodeAhead
            with_indices=True,
            remove_columns=rows.column_names,
            features=features,
            fn_kwargs={
                "probe": probe,
                "ahead": ahead,
                "duplicate": duplicate,
                "input_ids": input_ids,
                "on_phase": on_phase,
            },
            cache_file_name=str(out_file),
            new_fingerprint=f"{fingerprint}-embeddings",
            keep_in_memory=False,
            desc="Embed captions",
        )
    finally:
        ahead.close()
    return EmbedResult(
        embedded=embedded,
        reasons=ReasonCodes(embedded.data.column("drop_reason")),
        dim=encoder.dim,
        timeline={**ahead.timeline(), **tokenized},
    )


def only_rows(ids: pa.Array, keep: np.ndarray) -> pa.Array:
    """``ids`` with an empty list in every row where ``keep`` is False."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(ids).fill_null(0).to_numpy(zero_copy_only=False).copy()
    lengths[~keep] = 0
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = ids.filter(pa.array(keep)).flatten()
    return pa.ListArray.from_arrays(pa.array(offsets), values)
