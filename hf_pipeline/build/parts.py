"""The build in parts: contiguous shard ranges, each joined and embedded on its own.

A *part* is a contiguous range of the shard list. :func:`join_part` runs its join
(:mod:`hf_pipeline.build.convert`, ``num_proc`` workers) and :func:`embed_part` its embedding
(:mod:`hf_pipeline.build.embed_stage`, the accelerator) into a folder
(:func:`build_parts_overlapped` runs both for a list of parts)::

    <part>/rows/data*.arrow         key, latents, caption, drop_reason, input_ids
    <part>/embeddings/data*.arrow   embedding, drop_reason (duplicates within the part)

and :func:`assemble` turns the parts, in shard order, into the ``converted`` stage:
the duplicate pass across parts (the first finite occurrence in global shard order
wins, as with one part), the final drop reason of every row (``reasons.arrow``) and
the stage's report info. The latents are never copied: with ``build.parallel: ranks``
the parts are published by the ranks that built them (each under its own lease, see
:func:`hf_pipeline.build.prepare.prepare_cache`) and the assembly hard-links their files.

One builder builds its parts in order (one part, unless ``build.part_shards``,
``build.overlap_parts`` or the accelerator default cuts more; then
:func:`build_parts_overlapped` embeds a part while the next one joins). A rank's part
is built the same way, in overlapped *pieces* (``part-NNNNN/part.<lease>/part-MMMMM/``),
which the assembly takes as parts. Every way gives the same cache: same kept keys in
the same order, byte-identical latents and captions; the embeddings differ only by
float noise (the encoder batches rows differently).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # annotations only
    from concurrent.futures import Future

__all__ = [
    "REASONS_FILE",
    "JoinedPart",
    "PartPlan",
    "assemble",
    "build_parts_overlapped",
    "embed_part",
    "join_part",
    "part_files",
    "plan_parts",
    "write_kept_indices",
]

log = logging.getLogger("hf_pipeline")

#: The final drop reason of every row of the stage, in row order (one string column).
REASONS_FILE = "reasons.arrow"
_PARTS = "parts"
#: What the build report lists of each part (``join``, the encoder wait and its
#: loading: where the part's time went; absent from parts published before them).
_PART_REPORT = (
    "shards", "rows_in", "builder", "seconds_convert", "seconds_embed",
    "seconds_encoder_wait", "encoder_load", "join", "embed", "wall",
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


def plan_parts(num_shards: int, part_shards: int) -> list[PartPlan]:
    """Contiguous parts of ``part_shards`` shards (the last may be shorter).

    Args:
        num_shards: shards in the build.
        part_shards: shards per part; 0 means one part holding every shard.
    """
    if num_shards == 0:
        return [PartPlan(0, 0, 0)]
    size = part_shards if part_shards > 0 else num_shards
    return [
        PartPlan(i, start, min(num_shards, start + size))
        for i, start in enumerate(range(0, num_shards, size))
    ]


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
    captions_path: str,
    probe,
    out_dir: Path,
    fingerprint: str,
    progress: bool,
    tokenizer=None,
) -> JoinedPart:
    """Join one part's ``shards`` into ``out_dir`` (the ``num_proc`` workers)."""
    from hf_pipeline.build.convert import join_shards

    t0, wall0 = time.monotonic(), time.time()
    joined = join_shards(
        cfg=cfg,
        source=source,
        shards=shards,
        captions_path=captions_path,
        probe=probe,
        out_file=out_dir / "rows" / "data.arrow",
        work_dir=out_dir / "_work",
        fingerprint=fingerprint,
        progress=progress,
        tokenizer=tokenizer,
    )
    shutil.rmtree(out_dir / "_work", ignore_errors=True)
    seconds = round(time.monotonic() - t0, 3)
    return JoinedPart(out_dir, len(shards), joined, seconds, fingerprint, (wall0, time.time()))


def embed_part(part: JoinedPart, *, cfg, probe, encoder, on_phase=None) -> dict[str, Any]:
    """Embed a joined part (the accelerator); the part's info (JSON-able). ``on_phase``:
    see :func:`hf_pipeline.build.embed_stage.embed_joined_rows`."""
    from hf_pipeline.build.embed_stage import embed_joined_rows

    wall0 = time.time()
    joined = part.joined
    keys = joined.rows.data.column("key").to_numpy()
    pre = ReasonCodes(joined.rows.data.column("drop_reason"))
    nonfinite = pre.mask(NONFINITE)
    t_wait = time.monotonic()
    if hasattr(encoder, "result"):  # a Future: waits here, re-raises a load error
        encoder = encoder.result()
    t1 = time.monotonic()
    embedded = embed_joined_rows(
        joined.rows,
        later_duplicates(keys, eligible=~nonfinite),
        encoder=encoder,
        cfg=cfg,
        probe=probe,
        out_file=part.out_dir / "embeddings" / "data.arrow",
        fingerprint=part.fingerprint,
        reasons=pre,
        on_phase=on_phase,
    )
    return {
        "shards": part.shards,
        "rows_in": int(len(keys)),
        "pre_duplicate_reasons": pre.counts(),
        "bad_rows": bad_rows_summary(keys, nonfinite),
        "embed_dim": int(encoder.dim),
        "fetch": joined.fetch,
        "precision": joined.precision,
        "latent_dtype": joined.storage.dtype,
        "seconds_convert": part.seconds_convert,
        "seconds_embed": round(time.monotonic() - t1, 3),
        # Where the embedding went: encoding, the map's writes, either side waiting.
        "embed": embedded.timeline,
        # The join's own timeline, and the wait for the encoder loading beside it.
        "join": joined.timeline,
        "seconds_encoder_wait": round(t1 - t_wait, 3),
        # Where the encoder's loading went (TextEncoder.load_seconds), this process's.
        "encoder_load": dict(getattr(encoder, "load_seconds", {})),
        # Wall clock: with one builder in parts, a part's embedding overlaps the next join.
        "wall": {"join": list(part.join_wall), "embed": [wall0, time.time()]},
        "num_proc": joined.num_proc,
    }


def build_parts_overlapped(
    parts: Sequence[Mapping[str, Any]],
    *,
    cfg,
    probe,
    encoder,
    join_kw: Mapping[str, Any],
    on_phase: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Join and embed ``parts`` into their folders, in order, the embedding of part k
    (the accelerator, on a thread) overlapping the join of part k+1 (the ``num_proc``
    workers). One part is built the same way: joined, then embedded.

    Args:
        parts: each part's own :func:`join_part` keyword arguments, in shard order:
            ``shards`` (its shard files, in build order), ``out_dir`` (its folder,
            created) and ``fingerprint`` (the ``datasets`` cache fingerprint prefix).
        cfg: the :class:`hf_pipeline.config.Config`.
        probe: a :class:`dist.lease.LeaseProbe` (the work stops when the lease is lost).
        encoder: the :class:`hf_pipeline.encoder.model.TextEncoder` (one per process), or a
            future of it (loading in the background while the first part joins).
        join_kw: the :func:`join_part` keyword arguments common to every part:
            ``source`` (where the shards come from), ``captions_path`` (the saved,
            key-sorted caption table), ``progress`` (the fetcher's progress bar) and
            ``tokenizer`` (the encoder's :class:`hf_pipeline.encoder.model.CaptionTokenizer` or a
            future of it: the join workers tokenize with it; None: loaded for the join).
        on_phase: told the builder's phase (``"embedding"``) for its heartbeat.

    Returns:
        Each part's info, in order. The first failure (join or embedding) stops the
        rest and is raised once the embedding in flight has ended.
    """
    from concurrent.futures import ThreadPoolExecutor

    embedder = ThreadPoolExecutor(1, thread_name_prefix="hf_pipeline-embed-parts")
    embed_probe = _StoppableProbe(probe)
    pending: list[Future[Any]] = []
    try:
        for part_kw in parts:
            for done in [f for f in pending if f.done()]:
                done.result()  # an embedding failed: stop joining
            joined = join_part(cfg=cfg, probe=probe, **join_kw, **part_kw)
            pending.append(
                embedder.submit(
                    embed_part,
                    joined,
                    cfg=cfg,
                    probe=embed_probe,
                    encoder=encoder,
                    on_phase=on_phase,
                )  # fmt: skip
            )
        return [f.result() for f in pending]
    except BaseException:
        # Ctrl-C or a failed join: the embedding in flight stops at its next batch (it
        # ran to the end of its part, minutes with one part of a big build).
        embed_probe.stop()
        raise
    finally:
        for f in pending:
            f.cancel()
        embedder.shutdown(wait=True)


class _StoppableProbe:
    """The lease probe of the part embeddings, which :meth:`stop` also ends: their next
    check (every embedding batch) raises :class:`BuildStopped`. Thread-safe."""

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
    """The Arrow files of ``kind`` (``"rows"`` or ``"embeddings"``) of one part, in order."""
    return sorted((part_dir / kind).glob("*.arrow"))


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
    parts: Sequence[tuple[Path, Mapping[str, Any]]],
    *,
    table,
    link_from: bool,
    probe=None,
) -> dict[str, Any]:
    """Assemble ``parts`` (folder, info), in shard order, into the ``converted`` stage.

    Args:
        stage_dir: the stage folder being built; the parts end up in
            ``stage_dir/parts/part-NNNNN/``.
        parts: each part's folder and :func:`embed_part` info.
        table: the caption table (for ``no_latents``).
        link_from: the part folders are elsewhere (published by other leases): hard-link
            their files in (never a copy of the latents); else they already are in place.
        probe: checked before anything is written (a lost lease writes nothing).

    Returns:
        The ``converted`` stage info (the report's inputs).
    """
    t0 = time.monotonic()
    if probe is not None:
        probe.check()  # the parts were built by threads that may outlive a lost lease
    placed = []
    for i, (folder, _) in enumerate(parts):
        target = stage_dir / _PARTS / f"part-{i:05d}"
        if link_from:
            _link_tree(folder, target)
        placed.append(target)
    rows_files = [f for d in placed for f in part_files(d, "rows")]
    emb_files = [f for d in placed for f in part_files(d, "embeddings")]
    keys = _column(rows_files, "key").to_numpy() if rows_files else np.zeros(0, np.int64)
    pre = ReasonCodes(_column(rows_files, "drop_reason")) if rows_files else None
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
