"""The build in parts: contiguous shard ranges, each joined and embedded on its own.

A *part* is a contiguous range of the shard list (content-defined boundaries, and its
own identity: :mod:`hf_pipeline.build.part_store`, which stores built parts for every
later cache). :func:`join_part` runs its join (:mod:`hf_pipeline.build.convert`,
``num_proc`` workers), :func:`text_part` looks its keys' captions up (in this process,
from the key column only: no latent byte read) and :func:`embed_part` runs its
embedding (:mod:`hf_pipeline.build.embed_stage`, the accelerator), each into a folder of
its own::

    <join>/rows/data*.arrow              key, latents, drop_reason (nonfinite_latents)
    <text>/captions/data.arrow           caption, drop_reason (every reason before
                                         duplicates: the latents', then the caption's)
    <tokens>/tokens/data*.arrow          input_ids of the kept captions (the ``num_proc``
                                         workers: :mod:`hf_pipeline.build.tokens`)
    <embed>/embeddings/data*.arrow       embedding, input_ids, drop_reason (duplicates
                                         within the part)

and :func:`assemble` turns the parts, in shard order, into the ``converted`` stage:
the duplicate pass across parts (the first finite occurrence in global shard order
wins, as with one part), the final drop reason of every row (``reasons.arrow``) and
the stage's report info. The latents are never copied: the assembly hard-links the
parts' published files into ``converted/parts/part-NNNNN/`` (``rows/``, ``captions/``,
``embeddings/``, row-aligned).

Every way of cutting the input gives the same cache: same kept keys in the same
order, byte-identical latents and captions; the embeddings differ only by float noise
(the encoder batches rows differently).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hf_pipeline.build.accounting import (
    DUPLICATE,
    KEEP,
    NONFINITE,
    ReasonCodes,
    bad_rows_summary,
    keep_mask,
    later_duplicates,
)

__all__ = [
    "REASONS_FILE",
    "BuildStopped",
    "JoinedPart",
    "PartPlan",
    "StoppableProbe",
    "assemble",
    "embed_part",
    "join_info",
    "join_part",
    "latent_bytes",
    "part_files",
    "read_column",
    "read_token_ids",
    "read_keys",
    "text_part",
    "write_kept_indices",
]

log = logging.getLogger(__name__)

#: The final drop reason of every row of the stage, in row order (one string column).
REASONS_FILE = "reasons.arrow"
_PARTS = "parts"
#: Caption bytes of one record batch of a ``text`` unit at most (a caption alone may
#: exceed it, up to data.max_caption_bytes' bound): far below the 2 GiB of a string array.
_WRITE_BYTES = 256 * 2**20
#: What the build report lists of each part (``join``, the encoder wait and its
#: loading: where the part's time went; absent from parts published before them).
_PART_REPORT = (
    "shards", "rows_in", "builder", "seconds_convert", "seconds_text", "seconds_embed",
    "seconds_encoder_wait", "encoder_load", "join", "tokens", "embed", "wall", "id", "reused",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """Part ``index`` covers shards ``start`` to ``stop`` (exclusive) of the shard list."""

    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"


@dataclasses.dataclass(frozen=True)
class JoinedPart:
    """A part whose join is done (:func:`join_part`), waiting for :func:`embed_part`."""

    out_dir: Path
    shards: int
    joined: Any  # hf_pipeline.build.convert.JoinResult
    seconds_convert: float
    fingerprint: str
    join_wall: tuple[float, float]  # wall clock (start, end) of the join


def join_part(
    *,
    cfg,
    source,
    shards: Sequence[Any],
    probe,
    out_dir: Path,
    fingerprint: str,
    progress: bool,
) -> JoinedPart:
    """Join one part's ``shards`` into ``out_dir`` (the ``num_proc`` workers)."""
    from hf_pipeline.build.convert import join_shards

    t0, wall0 = time.monotonic(), time.time()
    joined = join_shards(
        cfg=cfg,
        source=source,
        shards=shards,
        probe=probe,
        out_file=out_dir / "rows" / "data.arrow",
        work_dir=out_dir / "_work",
        fingerprint=fingerprint,
        progress=progress,
    )
    shutil.rmtree(out_dir / "_work", ignore_errors=True)
    seconds = round(time.monotonic() - t0, 3)
    return JoinedPart(out_dir, len(shards), joined, seconds, fingerprint, (wall0, time.time()))


def latent_bytes(rows: int, storage_dtype: str) -> int:
    """The bytes of ``rows`` latent rows stored as ``storage_dtype``."""
    from hf_pipeline.cache.latents import LATENT_SHAPE

    itemsize = 2 if storage_dtype in ("float16", "bfloat16") else 4
    return int(rows) * int(np.prod(LATENT_SHAPE)) * itemsize


def join_info(part: JoinedPart) -> dict[str, Any]:
    """A joined part's info (JSON-able): what the join read, wrote and measured."""
    joined = part.joined
    keys = joined.rows.data.column("key").to_numpy()
    pre = ReasonCodes(joined.rows.data.column("drop_reason"))
    return {
        "shards": part.shards,
        "rows_in": int(len(keys)),
        "bad_rows": bad_rows_summary(keys, pre.mask(NONFINITE)),
        "fetch": joined.fetch,
        "precision": joined.precision,
        "latent_dtype": joined.storage.dtype,
        # The shard it came from under build.latent_dtype: source ("" otherwise), so
        # that parts of different dtypes can be refused naming one.
        "latent_dtype_shard": joined.storage.reference,
        "latent_bytes": latent_bytes(len(keys), joined.storage.dtype),
        "seconds_convert": part.seconds_convert,
        # The join's own timeline.
        "join": joined.timeline,
        "wall_join": list(part.join_wall),
        "num_proc": joined.num_proc,
    }


def text_part(
    rows_files: Sequence[Path], *, table, probe, out_dir: Path, batch_rows: int
) -> dict[str, Any]:
    """A part's captions (its ``text`` unit) into ``out_dir/captions/data.arrow``,
    row-aligned with its latents unit's ``rows_files``: ``caption`` (``""`` where there
    is none, or it is not UTF-8) and ``drop_reason`` (``nonfinite_latents`` from the
    rows, else the caption's reason, else kept; duplicates come later, with the
    embedding). Only the rows files' key and reason columns are read (memory-mapped):
    not one latent byte. Written in ``datasets``' format (``Dataset.from_file`` reads
    it), in record batches of ``batch_rows`` rows; ``probe`` is checked before each.

    Args:
        rows_files: the part's published latents files, in row order.
        table: the :class:`hf_pipeline.build.captions.CaptionTable`.

    Returns:
        The unit's info: ``rows_in``, ``pre_duplicate_reasons``, ``seconds_text``.
    """
    import pyarrow.compute as pc
    from datasets import Features, Value
    from datasets.arrow_writer import ArrowWriter

    from hf_pipeline.build.caption_bounds import byte_slices
    from hf_pipeline.build.captions import BAD_CAPTION_ENCODING, classify, reason_names

    t0 = time.monotonic()
    keys = read_keys(rows_files)
    latent_reasons = (
        _column(rows_files, "drop_reason") if rows_files else pa.chunked_array([], pa.string())
    )
    nonfinite = ReasonCodes(latent_reasons).mask(NONFINITE)
    caps, found = table.lookup(np.ascontiguousarray(keys, dtype=np.int64))
    codes = classify(caps, found)
    why = reason_names(codes).astype(object)
    why[nonfinite] = NONFINITE
    # "" where null or not UTF-8 (decoding one would raise): Arrow, no Python string per row.
    bad = pa.array(reason_names(codes) == BAD_CAPTION_ENCODING)
    caps = caps.cast(pa.large_binary()) if len(caps) else pa.array([], pa.large_binary())
    text = pc.if_else(bad, pa.scalar(None, caps.type), caps).fill_null(b"")
    lengths = pc.binary_length(text).to_numpy(zero_copy_only=False)
    text = text.cast(pa.large_string())  # 64-bit offsets until written: see below
    reasons = pa.array(why.tolist() if len(why) else [], pa.string())
    features = Features({"caption": Value("string"), "drop_reason": Value("string")})
    out = out_dir / "captions" / "data.arrow"
    probe.check()  # never re-create a lost lease's folder
    out.parent.mkdir(parents=True, exist_ok=True)
    with ArrowWriter(features=features, path=str(out)) as writer:
        step = max(1, batch_rows)
        for start in range(0, len(keys), step):
            probe.check()
            stop = min(start + step, len(keys))
            # `datasets`' string column has 32-bit offsets: a record batch of captions
            # near data.max_caption_bytes is cut by bytes too. Copied (concat) rather
            # than sliced: a slice's offsets beyond 2 GiB of the part do not cast.
            for lo, hi in byte_slices(lengths[start:stop], _WRITE_BYTES):
                piece = pa.concat_arrays([text[start + lo : start + hi]]).cast(pa.string())
                writer.write_table(
                    pa.table({"caption": piece, "drop_reason": reasons[start + lo : start + hi]})
                )
        writer.finalize()
    return {
        "rows_in": int(len(keys)),
        "pre_duplicate_reasons": ReasonCodes(reasons).counts(),
        "seconds_text": round(time.monotonic() - t0, 3),
    }


def embed_part(
    rows_files: Sequence[Path], caption_files: Sequence[Path], *, cfg, probe, encoder,
    out_dir: Path, fingerprint: str, on_phase=None, token_files: Sequence[Path] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Embed a part's captions (its ``text`` unit's published ``caption_files``; the keys
    from its latents unit's ``rows_files``, key column only) into
    ``out_dir/embeddings/`` (the accelerator); the embedding's info (JSON-able).
    ``on_phase``: see :func:`hf_pipeline.build.embed_stage.embed_joined_rows`.

    Args:
        encoder: the :class:`hf_pipeline.encoder.model.TextEncoder`, or a future of it
            (waited for here; a load error is raised).
        token_files: the part's ``tokens`` unit's published files
            (:mod:`hf_pipeline.build.tokens`); None: the captions are tokenized here.
    """
    from datasets import Dataset, concatenate_datasets

    from hf_pipeline.build.embed_stage import embed_joined_rows

    wall0 = time.time()
    parts = [Dataset.from_file(str(f)) for f in caption_files]
    rows = concatenate_datasets(parts) if len(parts) != 1 else parts[0]
    keys = read_keys(rows_files)
    if len(keys) != len(rows):
        raise ValueError(
            f"{caption_files[0] if caption_files else rows_files}: {len(rows)} caption rows "
            f"for {len(keys)} latent rows; they must be row-aligned"
        )
    pre = ReasonCodes(rows.data.column("drop_reason"))
    nonfinite = pre.mask(NONFINITE)
    input_ids = None
    if token_files is not None:
        input_ids = read_token_ids(token_files)
    t_wait = time.monotonic()
    if hasattr(encoder, "result"):  # a Future: waits here, re-raises a load error
        encoder = encoder.result()
    t1 = time.monotonic()
    embedded = embed_joined_rows(
        rows,
        later_duplicates(keys, eligible=~nonfinite),
        encoder=encoder,
        cfg=cfg,
        probe=probe,
        out_file=out_dir / "embeddings" / "data.arrow",
        fingerprint=fingerprint,
        reasons=pre,
        on_phase=on_phase,
        input_ids=input_ids,
    )
    return {
        "embed_dim": int(encoder.dim),
        "seconds_embed": round(time.monotonic() - t1, 3),
        # Where the embedding went: encoding, the map's writes, waits (and tokenizing,
        # without token_files).
        "embed": embedded.timeline,
        "seconds_encoder_wait": round(t1 - t_wait, 3),
        # Where the encoder's loading went (TextEncoder.load_seconds), this process's.
        "encoder_load": dict(getattr(encoder, "load_seconds", {})),
        "wall_embed": [wall0, time.time()],
    }


class StoppableProbe:
    """A lease probe that :meth:`stop` also ends: its next check (every embedding batch)
    raises :class:`BuildStopped`: a part's embedding on a thread stops with the build
    around it. Thread-safe."""

    def __init__(self, probe):
        self._probe = probe
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def check(self) -> None:
        if self._stopped.is_set():
            raise BuildStopped("the build stopped: its embedding stops too")
        self._probe.check()


class BuildStopped(RuntimeError):
    """Raised in a part's embedding once the build around it has stopped (and is
    failing with its own error: this one is not what the user sees)."""


def part_files(part_dir: Path, kind: str) -> list[Path]:
    """The Arrow files of ``kind`` (``"rows"``, ``"captions"`` or ``"embeddings"``) of
    one part, in order."""
    return sorted((part_dir / kind).glob("*.arrow"))


def read_keys(rows_files: Sequence[Path]) -> np.ndarray:
    """The key column of a part's rows files, in row order (memory-mapped: the latents
    are not read)."""
    return _column(rows_files, "key").to_numpy() if rows_files else np.zeros(0, np.int64)


def read_column(files: Sequence[Path], name: str) -> pa.ChunkedArray:
    """Column ``name`` of Arrow stream ``files``, in row order, memory-mapped: only that
    column's buffers are touched (the latents beside it are not read)."""
    return _column(files, name)


def _column(files: Sequence[Path], name: str) -> pa.ChunkedArray:
    chunks, typ = [], pa.string() if name == "drop_reason" else None
    for path in files:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        chunks.extend(table.column(name).chunks)
        typ = typ or table.schema.field(name).type  # files of empty shards: no chunk
    return pa.chunked_array(chunks, type=typ)


def assemble(
    stage_dir: Path,
    parts: Sequence[tuple[Sequence[Path], Mapping[str, Any]]],
    *,
    table,
    probe=None,
) -> dict[str, Any]:
    """Assemble ``parts``, in shard order, into the ``converted`` stage.

    Args:
        stage_dir: the stage folder being built; the parts end up in
            ``stage_dir/parts/part-NNNNN/``.
        parts: each part's published folders (its join's, holding ``rows/``, its
            text's, holding ``captions/``, and its embedding's, holding
            ``embeddings/``), whose files are hard-linked in (never a copy of the
            latents), and its info (:func:`join_info`, :func:`text_part` and
            :func:`embed_part`'s together).
        table: the caption table (for ``no_latents``).
        probe: checked before anything is written (a lost lease writes nothing).

    Returns:
        The ``converted`` stage info (the report's inputs).
    """
    t0 = time.monotonic()
    if probe is not None:
        probe.check()  # the parts were built by threads that may outlive a lost lease
    placed = []
    for i, (folders, _) in enumerate(parts):
        target = stage_dir / _PARTS / f"part-{i:05d}"
        for folder in folders:
            _link_tree(folder, target)
        placed.append(target)
    rows_files = [f for d in placed for f in part_files(d, "rows")]
    caption_files = [f for d in placed for f in part_files(d, "captions")]
    emb_files = [f for d in placed for f in part_files(d, "embeddings")]
    keys = read_keys(rows_files)
    # Every reason before duplicates (the latents', then the caption's): the captions'.
    pre = ReasonCodes(_column(caption_files, "drop_reason")) if caption_files else None
    final = ReasonCodes(_column(emb_files, "drop_reason")) if emb_files else None
    if pre is not None and final is not None:
        # Across parts: the first finite occurrence of a key in global shard order wins.
        nonfinite = pre.mask(NONFINITE)
        dup = later_duplicates(keys, eligible=~nonfinite)
        final.codes[(final.codes == final.code(KEEP)) & dup] = final.code(DUPLICATE)
        reasons = pa.DictionaryArray.from_arrays(
            pa.array(final.codes.astype(np.int32)), pa.array(final.names, pa.string())
        ).cast(pa.string())
    else:
        nonfinite = np.zeros(0, dtype=bool)
        reasons = pa.array([], pa.string())
    _write_reasons(stage_dir / REASONS_FILE, reasons)
    infos = [info for _, info in parts]
    counts = final.counts() if final is not None else {}
    return {
        "rows_in": int(len(keys)),
        "reasons": counts,
        "pre_duplicate_reasons": pre.counts() if pre is not None else {},
        "no_latents": int(table.count_absent(keys)),
        "duplicate_meta_rows": int(getattr(table, "duplicate_meta_rows", 0)),
        "null_key_meta_rows": int(getattr(table, "null_key_rows", 0)),
        "bad_rows": bad_rows_summary(keys, nonfinite),
        "embed_dim": int(max((i["embed_dim"] for i in infos), default=0)),
        "shards": sum(int(i["shards"]) for i in infos),
        "parts": [{k: i.get(k) for k in _PART_REPORT if k in i} for i in infos],
        "fetch": _merge_fetch([i.get("fetch", {}) for i in infos]),
        "seconds_convert": round(sum(float(i["seconds_convert"]) for i in infos), 3),
        "seconds_text": round(sum(float(i.get("seconds_text", 0)) for i in infos), 3),
        # The parts' token ids (their tokens units, by the workers; 0 where reused).
        "seconds_tokenize": round(
            sum(float((i.get("tokens") or {}).get("seconds_tokenize", 0)) for i in infos), 3
        ),
        "seconds_embed": round(sum(float(i["seconds_embed"]) for i in infos), 3),
        "num_proc": int(max((i["num_proc"] for i in infos), default=1)),
        "latent_dtype": infos[0]["latent_dtype"] if infos else "float32",
        "precision": _combine_precision([i["precision"] for i in infos]),
        "seconds_assemble": round(time.monotonic() - t0, 3),
    }


def _merge_fetch(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The parts' fetch stats together. Listing and metadata retries are counters of
    the source (each part's stats repeat them): the largest, not the sum."""
    from hf_pipeline.stores.fetch_stats import merge_fetch_stats

    merged = merge_fetch_stats(list(parts))
    for key in ("listing_retries", "metadata_retries", "prefetch_ahead"):
        merged[key] = max((int(p.get(key, 0)) for p in parts), default=0)
    return merged


def _combine_precision(blocks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One ``precision`` block from the parts' blocks (counts added, dtypes merged)."""
    if not blocks:
        return {}
    by_dtype: dict[str, int] = {}
    for b in blocks:
        for dtype, n in b.get("source_dtypes", {}).items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + int(n)
    sources = sorted(by_dtype)
    counted = ("values", "changed", "flushed_to_zero", "beyond_1ulp")
    return {
        "source_dtype": sources[0] if len(sources) == 1 else ("mixed" if sources else ""),
        "source_dtypes": by_dtype,
        "storage_dtype": blocks[0]["storage_dtype"],
        "lossy": any(b.get("lossy") for b in blocks),
        **{k: sum(int(b.get(k, 0)) for b in blocks) for k in counted},
    }


def _write_reasons(path: Path, reasons: pa.Array | pa.ChunkedArray) -> None:
    table = pa.table({"drop_reason": reasons})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 20)


#: The ``indices`` file's schema as ``datasets``' filter writes it (its features in the
#: ``huggingface`` metadata), so that ``datasets.Dataset.from_file`` reads it too.
_INDICES_FEATURES = {"indices": {"dtype": "uint64", "_type": "Value"}}


def write_kept_indices(
    reason_files: Sequence[Path], out: Path, *, fingerprint: str, batch_rows: int
) -> int:
    """The filter: write the row ids (uint64, in row order) whose ``drop_reason`` is
    empty, read from ``reason_files`` (Arrow streams with a ``drop_reason`` column, in
    row order), to ``out`` in record batches of at most ``batch_rows`` rows.

    The file ``datasets.Dataset.filter`` writes, one record batch of the reasons at a
    time: memory does not grow with the rows, and no Python object is made per row
    (``benchmarks/bench_filter.py``: 3.2x faster than that filter at 5M rows).

    Returns:
        The number of rows kept.
    """
    meta = {"info": {"features": _INDICES_FEATURES}, "fingerprint": fingerprint}
    schema = pa.schema([("indices", pa.uint64())], metadata={"huggingface": json.dumps(meta)})
    kept = offset = 0
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for path in reason_files:
            with pa.memory_map(str(path)) as source:
                for batch in pa.ipc.open_stream(source):
                    rows = np.flatnonzero(keep_mask(batch.column("drop_reason")))
                    rows = rows.astype(np.uint64)
                    rows += np.uint64(offset)
                    for start in range(0, len(rows), batch_rows):
                        chunk = pa.array(rows[start : start + batch_rows], pa.uint64())
                        writer.write_batch(pa.record_batch([chunk], schema=schema))
                    kept += len(rows)
                    offset += batch.num_rows
    return kept


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of ``src`` into ``dst`` (same relative paths)."""
    for dirpath, _, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.link(Path(dirpath) / name, dst / rel / name)


def read_token_ids(files: Sequence[Path]) -> pa.Array:
    """The ``input_ids`` of a tokens unit's ``files``, in row order, as one array
    (memory-mapped values, one copy of the offsets when there are several files)."""
    if not files:
        return pa.array([], pa.list_(pa.int32()))
    ids = read_column(files, "input_ids")
    return ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
