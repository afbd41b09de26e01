"""Stage 1a, the join: latent shards -> ``key, latents, drop_reason`` rows, through
``Dataset.map(num_proc=build.num_proc)``.

Each ``num_proc`` worker (forked by a clean fork server: :mod:`hf_pipeline.workers.pool`)
takes one shard at a time from the :class:`~hf_pipeline.stores.fetch.StagingClient` (downloads
run ahead in the builder), reads it with ``torch.load(weights_only=True)`` and validates it
(:func:`hf_pipeline.build.shards.read_shard`), converts the latents to the storage dtype
and marks rows with NaN/inf latents ``nonfinite_latents`` (or fails,
``data.on_bad_rows: fail``). A shard without rows adds none.

The join holds no captions and no token ids: the captions belong to the metadata and
its caption column (a part's ``text`` unit, :func:`hf_pipeline.build.parts.text_part`,
looks its keys up in the caption table), the token ids to the encoder; a part's
latents are shared by every caption column and every encoder
(:mod:`hf_pipeline.build.part_store`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dist.atomic import write_json_atomic
from hf_pipeline.build.accounting import FIRST_KEYS, NONFINITE
from hf_pipeline.stores.remote_file import RemoteFile

__all__ = [
    "JoinResult",
    "Storage",
    "check_workers_can_start",
    "check_one_dtype",
    "choose_storage",
    "convert_shards",
    "join_shards",
    "join_timeline",
    "shard_table",
    "summarize_precision",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Storage:
    """The latent storage dtype of one build.

    ``reference`` is the shard the dtype was read from when ``build.latent_dtype`` is
    ``source`` (then every shard must hold that dtype), else ``""``.
    """

    dtype: str
    reference: str = ""


def mixed_dtypes(dtype: str, storage: Storage, reference_is: str) -> str:
    """The message for a shard whose latents are ``dtype`` where ``build.latent_dtype:
    source`` took ``storage`` from ``storage.reference`` (``reference_is`` says which
    shard that is)."""
    return (
        f"latents are {dtype}, but {storage.reference} ({reference_is}) holds "
        f"{storage.dtype}; build.latent_dtype: source stores one dtype for all shards: "
        "set build.latent_dtype explicitly (float32 stores float16, bfloat16 and float32 "
        "exactly)"
    )


def check_one_dtype(parts: Sequence[Mapping[str, Any]], shards: Sequence[RemoteFile]) -> None:
    """Refuse parts whose latents were stored in different dtypes.

    Each part takes its dtype (``build.latent_dtype: source``) from its own first shard
    with rows, and its workers hold every shard of the part to it; across parts nothing
    did: a dtype change exactly at a part boundary (or a new part appended to stored
    ones) gave a cache of two column types that every reader refuses. Parts without rows
    store nothing and are left out.

    Args:
        parts: the parts' infos, in shard order (``latent_dtype``, ``shards``: how many,
            ``latent_dtype_shard``: the shard the dtype came from, absent in a part
            stored by a release before it: its first shard is named then).
        shards: the build's shards, in order (to name them by their location).

    Raises:
        CorruptShardError: at the first part whose dtype differs from the first part
            with rows, naming a shard of each dtype.
    """
    from hf_pipeline.errors import CorruptShardError

    by_name = {f.name: f for f in shards}
    first: Storage | None = None
    start = 0
    for info in parts:
        count = int(info.get("shards", 0))
        has_rows = bool((info.get("precision") or {}).get("source_dtypes")) or bool(
            info.get("rows_in")
        )
        if has_rows and info.get("latent_dtype"):
            name = info.get("latent_dtype_shard") or (
                shards[start].name if start < len(shards) else ""
            )
            here = Storage(info["latent_dtype"], reference=name)
            if first is None:
                first = here
            elif here.dtype != first.dtype:
                where = by_name[name].url if name in by_name else name
                raise CorruptShardError(
                    where, mixed_dtypes(here.dtype, first, "the first shard with rows of the input")
                )
        start += count


def summarize_precision(parts: list[dict[str, Any]], storage: str) -> dict[str, Any]:
    """The report's ``precision`` block from the per-shard files of the convert workers."""
    from hf_pipeline.cache.precision import PrecisionLoss, is_exact

    by_dtype: dict[str, int] = {}
    loss = PrecisionLoss()
    for part in parts:
        if not part["source_dtype"]:  # a shard without rows: no dtype, no values
            continue
        by_dtype[part["source_dtype"]] = by_dtype.get(part["source_dtype"], 0) + 1
        counts = {k: v for k, v in part.items() if k not in ("source_dtype", "timing")}
        loss = loss + PrecisionLoss(**counts)
    sources = sorted(by_dtype)
    return {
        "source_dtype": sources[0] if len(sources) == 1 else ("mixed" if sources else ""),
        "source_dtypes": by_dtype,
        "storage_dtype": storage,
        "lossy": not all(is_exact(d, storage) for d in sources),
        **loss.as_dict(),
    }


def join_timeline(
    shards: list[dict[str, Any]], start: float, end: float, *, tokenizer_wait: float = 0.0
) -> dict[str, Any]:
    """Where the join's wall time went, from the per-shard ``timing`` records.

    ``start``/``end`` (wall clock) bracket the ``Dataset.map`` call, ``tokenizer_wait``
    the wait for the builder's tokenizer at its start. The result says how long the
    workers took to start (``seconds_to_first_shard``: the pool spawns and the workers
    import their libraries; ``seconds_tokenizer_wait`` of it before they could have the
    tokenizer; ``first_shard_at``: when, wall clock), how long shards were being converted
    (``seconds_converting``, first shard start to last shard end), what followed the last
    shard (``seconds_after_last_shard``: the pool shuts down, ``datasets`` gathers the
    files), and the workers' busy time (``worker_busy_seconds``, summed over shards).
    """
    times = [s["timing"] for s in shards if "timing" in s]
    out: dict[str, Any] = {
        "seconds": round(end - start, 3),
        "workers": len({t["pid"] for t in times}),
        "seconds_tokenizer_wait": round(tokenizer_wait, 3),
    }
    if times:
        first = min(t["start"] for t in times)
        last = max(t["end"] for t in times)
        out |= {
            "seconds_to_first_shard": round(first - start, 3),
            "first_shard_at": round(first, 3),
            "seconds_converting": round(last - first, 3),
            "seconds_after_last_shard": round(end - last, 3),
            "worker_busy_seconds": round(sum(t["end"] - t["start"] for t in times), 3),
        }
    return out


def choose_storage(wanted: str, shards: Sequence[Any], client, timeout: float) -> Storage:
    """The storage dtype: explicit, or (``source``) the first readable shard's dtype.

    ``source`` reads the first non-empty shard's header here, before the workers start,
    because the Arrow column type must be fixed up front; the workers then check every
    shard (a shard without rows holds no dtype and is skipped by both).
    The shard comes through the run's staging client: local files are read in place,
    a remote one is downloaded by the fetcher (counted in the fetch stats, other
    shards downloading meanwhile) and left staged for the worker that converts it,
    which releases it.
    """
    from hf_pipeline.build.shards import shard_header

    if wanted != "source":
        return Storage(wanted)
    empty_dtype = None
    for f in shards:
        path = client.acquire(f, timeout=timeout)
        if path is None:  # skipped under on_missing="skip" (and recorded)
            continue
        rows, dtype = shard_header(path)
        if rows:
            assert dtype is not None  # shard_header: None only for shards without rows
            return Storage(dtype, reference=f.name)
        # A shard without rows has no latents to keep: the next shard decides. Only a
        # part of nothing but empty shards takes the dtype they were saved in (the
        # stage's column type comes from its first part).
        empty_dtype = empty_dtype or dtype
    # Every shard is missing (and skipped) or empty: nothing is stored; float32 holds anything.
    return Storage(empty_dtype or "float32")


#: A RemoteFile's fields: the shard table's columns.
_FILE_FIELDS = tuple(f.name for f in dataclasses.fields(RemoteFile))


def shard_table(shards: Sequence[RemoteFile]):
    """The join's input: a ``datasets.Dataset`` of one row per shard file, its
    :class:`~hf_pipeline.stores.remote_file.RemoteFile` fields as columns.

    ``Dataset.map(num_proc=K)`` gives each worker a contiguous slice of these rows, as
    Arrow; a map over the names with the files in ``fn_kwargs`` pickled the whole part's
    files into every worker's task, with dill's pure-Python pickler, in the builder's
    task thread (0.3 s of its interpreter lock a part at 5,500 shards on a 2-CPU VM).
    """
    from datasets import Dataset

    return Dataset.from_dict({k: [getattr(f, k) for f in shards] for k in _FILE_FIELDS})


def convert_shards(
    batch: Mapping[str, list],
    indices: list[int],
    *,
    probe,
    client,
    storage: Storage,
    precision_dir: str,
    fetch_timeout: float,
    on_bad_rows: str,
) -> dict[str, Any]:
    """``datasets.map`` function: shard files -> latent rows (key, latents, drop_reason).

    Runs in the ``num_proc`` workers. A batch is rows of the shard table
    (:func:`shard_table`: one :class:`~hf_pipeline.stores.remote_file.RemoteFile` a row), so a
    worker receives its own shards as Arrow rows; the other arguments, pickled with each
    worker's task, hold nothing that grows with the shard count.
    ``probe`` (:class:`dist.lease.LeaseProbe`) stops a builder that lost its lease at the
    next shard; ``precision_dir`` gets one small JSON per shard (what the storage cast
    changed), which :func:`summarize_precision` adds up.
    """
    from hf_pipeline.build.accounting import KEEP
    from hf_pipeline.build.shards import LATENT_SHAPE, read_shard
    from hf_pipeline.cache.precision import arrow_dtype, to_arrow
    from hf_pipeline.errors import CorruptShardError

    keys, latents, reasons = [], [], []
    for j, index in enumerate(indices):
        probe.check()
        t_start = time.time()  # wall clock: the timeline compares processes
        f = RemoteFile(**{k: batch[k][j] for k in _FILE_FIELDS})
        path = client.acquire(f, timeout=fetch_timeout)
        if path is None:  # skipped under on_missing="skip"; recorded by the fetcher
            continue
        try:
            shard = read_shard(path, dtype="source" if storage.reference else storage.dtype)
        finally:
            client.release(f)  # frees the staging slot even when the shard is corrupt
        if not shard.source_dtype:  # no rows (saved as any 0-row tensors): nothing to join
            _write_precision(precision_dir, index, shard, t_start)
            continue
        if storage.reference and shard.source_dtype != storage.dtype:
            raise CorruptShardError(
                str(path),
                mixed_dtypes(shard.source_dtype, storage, "the first shard with rows of its part"),
            )
        k, lat = shard.keys, to_arrow(shard.latents)
        bad = shard.nonfinite
        if bad.any():
            first = ", ".join(map(str, k[bad][:FIRST_KEYS].tolist()))
            if on_bad_rows == "fail":
                raise CorruptShardError(
                    f.url,
                    f"latents must be finite, got NaN/inf in {int(bad.sum())} of {len(k)} rows "
                    f"(first keys: {first}); data.on_bad_rows: drop builds without such rows",
                )
            log.warning(
                "%s: dropping %d row(s) with NaN/inf latents (first keys: %s)",
                f.name,
                int(bad.sum()),
                first,
            )
        # object dtype: a fixed-width str array would truncate the longer reason name.
        why = np.full(len(k), KEEP, dtype=object)
        why[bad] = NONFINITE
        _write_precision(precision_dir, index, shard, t_start)
        reasons.append(why)
        keys.append(k)
        latents.append(lat)
    if not keys:
        return {
            "key": np.zeros(0, np.int64),
            "latents": np.zeros((0, *LATENT_SHAPE), arrow_dtype(storage.dtype)),
            "drop_reason": [],
        }
    return {
        "key": np.concatenate(keys),
        "latents": np.concatenate(latents),
        "drop_reason": [str(r) for part in reasons for r in part],
    }


def _write_precision(precision_dir: str, index: int, shard, t_start: float) -> None:
    # One small file per shard: the builder adds them up for the report.
    write_json_atomic(
        Path(precision_dir) / f"{index:09d}.json",
        {
            "source_dtype": shard.source_dtype,
            **shard.loss.as_dict(),
            "timing": {"pid": os.getpid(), "start": t_start, "end": time.time()},
        },
        durable=False,
    )


@dataclasses.dataclass(frozen=True)
class JoinResult:
    """What the join wrote and measured.

    Attributes:
        rows: the joined rows (a memory-mapped ``datasets.Dataset``).
        storage: the latent storage dtype.
        precision: the report's ``precision`` block.
        fetch: the fetcher's stats (downloads, retries, skipped files).
        num_proc: workers used.
        timeline: where the wall time went (:func:`join_timeline`).
    """

    rows: Any
    storage: Storage
    precision: dict[str, Any]
    fetch: dict[str, Any]
    num_proc: int
    timeline: dict[str, Any] = dataclasses.field(default_factory=dict)


def check_workers_can_start(num_proc: int) -> None:
    """Refuse a join (or a tokenization, :mod:`hf_pipeline.build.tokens`) whose workers could not import the main program (they import it
    first; one read from standard input is no file), before anything starts: without
    this, each worker printed a FileNotFoundError and the build died on an EOFError."""
    from hf_pipeline.errors import ConfigError
    from hf_pipeline.workers.pool import unimportable_main

    path = unimportable_main()
    if path is not None:
        raise ConfigError(
            f"build.num_proc is {num_proc}: the join's worker processes import the main "
            f"program first, and {path!r} is not a file: run the build from a script "
            f'(under `if __name__ == "__main__":`), or set DATASET_NUM_PROC=1',
            field="build.num_proc",
        )


@contextlib.contextmanager
def _ctrl_c_kept():
    """Keep a Ctrl-C that arrives during ``Dataset.map(num_proc)`` a KeyboardInterrupt.

    ``datasets``' pool loop (``iflatmap_unordered``) waits on its workers' results in a
    ``finally``: a KeyboardInterrupt there came out as multiprocess's ``TimeoutError``
    (a traceback, exit 1), and one at another instant was lost with the map finishing
    (exit 0: seen in a test). On the main thread, a SIGINT during the block is recorded
    and raised as KeyboardInterrupt when the block ends, however it ends.

    A process started with SIGINT ignored (``nohup``, ``cmd &`` in a script) keeps
    ignoring it here as everywhere else in the build: this block overrode it, so such a
    build stopped at a Ctrl-C during the join only.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    seen: list[bool] = []

    def on_sigint(signum, frame):
        seen.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except BaseException:
        if seen:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen:
        raise KeyboardInterrupt


def join_shards(
    *,
    cfg,
    source,
    shards: Sequence[Any],
    probe,
    out_file: Path,
    work_dir: Path,
    fingerprint: str,
    progress: bool,
) -> JoinResult:
    """Run the join over ``shards`` into ``out_file`` (Arrow) with ``build.num_proc`` workers.

    Args:
        cfg: the :class:`hf_pipeline.config.Config`.
        source: the :class:`hf_pipeline.stores.Source` the shards come from.
        shards: the shard files (``RemoteFile``), in build order.
        probe: a :class:`dist.lease.LeaseProbe` (workers stop when the lease is lost).
        out_file: where ``datasets`` writes the rows.
        work_dir: scratch folder (per-shard precision files).
        fingerprint: used for the ``datasets`` cache fingerprint.
        progress: show the fetcher's progress bar.
    """
    from datasets import Array4D, Features, Value

    from hf_pipeline.cache.latents import LATENT_SHAPE
    from hf_pipeline.cache.precision import arrow_dtype
    from hf_pipeline.stores.fetch import ShardFetcher

    build = cfg.build
    num_proc = max(1, min(build.effective_num_proc, len(shards)))
    if num_proc > 1:
        check_workers_can_start(num_proc)
    precision_dir = work_dir / "precision"
    precision_dir.mkdir(parents=True, exist_ok=True)
    fetch_timeout = cfg.data.file_timeout * (cfg.data.max_retries + 1)
    table = shard_table(shards)
    with ShardFetcher(
        source, shards, data_config=cfg.data, num_workers=num_proc, progress=progress
    ) as fetcher:
        storage = choose_storage(build.latent_dtype, shards, fetcher.client(), fetch_timeout)
        features = Features(
            {
                "key": Value("int64"),
                # Arrow has no bfloat16: its bits are stored as uint16 (see precision).
                "latents": Array4D(LATENT_SHAPE, arrow_dtype(storage.dtype)),
                "drop_reason": Value("string"),
            }
        )
        t_map = time.time()
        with _ctrl_c_kept():
            rows = table.map(
                convert_shards,
                batched=True,
                batch_size=1,
                with_indices=True,
                num_proc=num_proc if num_proc > 1 else None,
                writer_batch_size=build.writer_batch_size,
                features=features,
                remove_columns=table.column_names,
                fn_kwargs={
                    "probe": probe,
                    "client": fetcher.client(),
                    "storage": storage,
                    "precision_dir": str(precision_dir),
                    "fetch_timeout": fetch_timeout,
                    "on_bad_rows": cfg.data.on_bad_rows,
                },
                cache_file_name=str(out_file),
                new_fingerprint=f"{fingerprint}-rows",
                keep_in_memory=False,
                desc="Join shards",
            )
        t_done = time.time()
        fetch_stats = fetcher.stats()
    per_shard = [json.loads(p.read_text()) for p in sorted(precision_dir.glob("*.json"))]
    precision = summarize_precision(per_shard, storage.dtype)
    if precision["lossy"]:
        log.warning(
            "build.latent_dtype %s is lossy for %s latents: %d of %d values changed, "
            "%d flushed to zero, %d beyond 1 ulp of %s (build.latent_dtype: source "
            "stores them exactly)",
            storage.dtype,
            precision["source_dtype"],
            precision["changed"],
            precision["values"],
            precision["flushed_to_zero"],
            precision["beyond_1ulp"],
            storage.dtype,
        )
    return JoinResult(
        rows=rows,
        storage=storage,
        precision=precision,
        fetch=fetch_stats,
        num_proc=num_proc,
        timeline=join_timeline(per_shard, t_map, t_done),
    )
