"""Build the cache: join captions to latents -> embed -> filter, through ``datasets``.

Stages (each published atomically by :mod:`dist.coordinator`, with a marker):

1. ``converted``
   a. *convert* — ``Dataset.map(num_proc=build.num_proc, batch_size=1)`` over the
      shard list: each worker process reads one shard at a time
      (``torch.load(weights_only=True)``), joins captions by key with a vectorized
      ``searchsorted`` over a memory-mapped, key-sorted caption table, and writes
      ``key, latents, caption, drop_reason`` rows. A row with a NaN/inf latent is
      ``nonfinite_latents`` (or, with ``data.on_bad_rows: fail``, fails the build).
   b. duplicates — one NumPy pass over the key column marks all but the first
      occurrence of each key (among rows with finite latents).
   c. *embed* — ``Dataset.map(batch_size=build.batch_size)`` in THIS process with the
      encoder on the accelerator (one model, big batches); only rows that
      will be kept are encoded. Writes ``embedding, drop_reason``.
2. ``filtered`` — ``Dataset.filter(num_proc=...)`` on ``drop_reason == ""`` writes
   the kept row indices; the build report lands next to them.

Every latent row is either kept or counted under a reason; metadata rows with no
latents are counted as ``no_latents``.

The ``num_proc`` workers are spawned, never forked (:mod:`hf_pipeline.workers`): the
caller has usually initialised JAX or CUDA first and the build runs threads of its own,
so a fork could deadlock. Safe to call after ``jax.distributed.initialize()``; a
script that calls :func:`prepare_cache` needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dist.atomic import write_json_atomic
from hf_pipeline.cache import (
    DEMO_DATA_DIR,
    STAGES,
    STAGING_DIR,
    CacheLayout,
    compute_fingerprint,
)
from hf_pipeline.config import Config
from hf_pipeline.workers import check_not_bootstrapping, spawned_workers

__all__ = ["BuildResult", "REASONS", "prepare_cache", "resolve_inputs"]

log = logging.getLogger("hf_pipeline")

#: Why a latent row was not kept (plus ``no_latents`` for metadata rows). Each row
#: gets one: ``nonfinite_latents`` first, then the caption's reason, then duplicates.
REASONS = ("nonfinite_latents", "no_caption", "empty_caption", "duplicate_key")
_NONFINITE = REASONS[0]
#: How many offending keys the report (and a data.on_bad_rows: fail error) names.
_FIRST_KEYS = 10


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The resolved raw inputs of a build."""

    source: Any  # hf_pipeline.sources.Source
    shards: list  # list[RemoteFile]
    metadata: Any  # RemoteFile
    demo: Any = None


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """Where the cache is and what the build report says.

    Attributes:
        fingerprint: cache identity.
        cache_dir: the cache folder.
        report: the build report (``rows_in``, ``rows_out``, ``dropped``, ...).
        built: True when this process published at least one stage (a builder that
            lost its lease to another process reports False).
        seconds: wall time of :func:`prepare_cache` in this process.
        stage_dirs: the published folder of each stage, from the markers.
    """

    fingerprint: str
    cache_dir: Path
    report: dict
    built: bool
    seconds: float
    stage_dirs: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(self.cache_dir, dict(self.stage_dirs))

    def summary(self) -> dict[str, Any]:
        """The JSON summary of ``scripts/prebuild_cache.py --json``."""
        r = self.report
        return {
            "fingerprint": self.fingerprint,
            "cache_dir": str(self.cache_dir),
            "rows_in": r["rows_in"],
            "rows_out": r["rows_out"],
            "dropped": dict(r["dropped"]),
            # Metadata rows, not latent rows: outside the rows_in accounting.
            "duplicate_meta_rows": int(r["duplicate_meta_rows"]),
            "seconds": round(self.seconds, 3),
            "built": self.built,
        }


def resolve_inputs(cfg: Config) -> Inputs:
    """List the shard files and find the metadata table (generating the demo if asked).

    Safe to call from every rank at once: demo generation is atomic and idempotent.
    """
    from hf_pipeline.sources import open_source

    demo = None
    shards_loc, meta_loc = cfg.data.shards, cfg.data.metadata
    if shards_loc == "demo":
        from hf_pipeline.demo import generate_demo

        d = cfg.data.demo
        # Dot-folders beside the caches: never listed or cleaned as caches by dist.inventory.
        out = cfg.cache_root / DEMO_DATA_DIR / (
            f"s{d.seed}-n{d.num_shards}x{d.samples_per_shard}-{d.latent_dtype}"
        )
        demo = generate_demo(
            out,
            num_shards=d.num_shards,
            samples_per_shard=d.samples_per_shard,
            seed=d.seed,
            latent_dtype=d.latent_dtype,
        )
        shards_loc = str(Path(demo.shard_paths[0]).parent)
        meta_loc = str(demo.metadata_path)
    # Under this config's cache root, keyed by location; prepare_cache narrows it to one
    # folder per fingerprint once the inputs (and so the fingerprint) are known.
    staging = cfg.data.staging_dir or (
        cfg.cache_root / STAGING_DIR / hashlib.sha1(shards_loc.encode()).hexdigest()[:16]
    )
    source = open_source(shards_loc, data_config=cfg.data, staging_dir=staging)
    shards = source.list_shards()
    metadata = source.find_metadata(meta_loc)
    return Inputs(source=source, shards=shards, metadata=metadata, demo=demo)


# --------------------------------------------------------------------------- stage 1


@dataclasses.dataclass(frozen=True)
class _Storage:
    """The latent storage dtype of one build.

    ``reference`` is the shard the dtype was read from when ``build.latent_dtype`` is
    ``source`` (then every shard must hold that dtype), else ``""``.
    """

    dtype: str
    reference: str = ""


def _precision_summary(parts: list[dict[str, Any]], storage: str) -> dict[str, Any]:
    """The report's ``precision`` block from the per-shard files of the convert workers."""
    from hf_pipeline.precision import PrecisionLoss, is_exact

    by_dtype: dict[str, int] = {}
    loss = PrecisionLoss()
    for part in parts:
        by_dtype[part["source_dtype"]] = by_dtype.get(part["source_dtype"], 0) + 1
        loss = loss + PrecisionLoss(**{k: v for k, v in part.items() if k != "source_dtype"})
    sources = sorted(by_dtype)
    return {
        "source_dtype": sources[0] if len(sources) == 1 else ("mixed" if sources else ""),
        "source_dtypes": by_dtype,
        "storage_dtype": storage,
        "lossy": not all(is_exact(d, storage) for d in sources),
        **loss.as_dict(),
    }


_CAPTIONS: dict[str, Any] = {}
_TOKENIZERS: dict[Any, Any] = {}


def _captions(path: str):
    # One memory-mapped caption table per worker process (opened lazily, by path).
    table = _CAPTIONS.get(path)
    if table is None:
        from hf_pipeline.captions import CaptionTable

        table = _CAPTIONS[path] = CaptionTable.open(path)
    return table


def _tokenizer(cfg):
    # One tokenizer per worker process, loaded there. The workers already run
    # in parallel, so each tokenizes on one thread (no oversubscription).
    tok = _TOKENIZERS.get(cfg)
    if tok is None:
        from hf_pipeline.embed import CaptionTokenizer

        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        tok = _TOKENIZERS[cfg] = CaptionTokenizer(cfg)
    return tok


def _die_with_builder() -> None:
    """In a process forked during a build (the ``num_proc`` pool): die with the builder.

    A SIGKILLed builder cannot shut its pool down; without this its workers linger
    (seen: 75 s and more), holding shards, staging slots and memory. Runs right after
    ``fork`` (``os.register_at_fork``), before the worker takes its first task.
    """
    parent = _BUILDING.get("pid")
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the builder died before the call: nobody will signal us
        os._exit(1)


#: ``{"pid": builder pid}`` while this process builds (read by the at-fork hook).
_BUILDING: dict[str, int] = {}
os.register_at_fork(after_in_child=_die_with_builder)


@contextlib.contextmanager
def _building():
    """Processes forked inside this block die with this one (see _die_with_builder)."""
    _BUILDING["pid"] = os.getpid()
    try:
        yield
    finally:
        _BUILDING.pop("pid", None)


def _convert_shards(
    batch: Mapping[str, list],
    indices: list[int],
    *,
    probe,
    client,
    files: Mapping[str, Any],
    captions_path: str,
    storage: _Storage,
    precision_dir: str,
    fetch_timeout: float,
    encoder,
    on_bad_rows: str,
) -> dict[str, Any]:
    """``datasets.map`` function: shard file names -> joined, tokenized latent rows.

    ``probe`` (:class:`dist.lease.LeaseProbe`) stops a builder that lost its lease at the
    next shard.
    """
    from hf_pipeline.captions import classify, reason_names
    from hf_pipeline.errors import CorruptShardError
    from hf_pipeline.precision import arrow_dtype, to_arrow
    from hf_pipeline.shards import LATENT_SHAPE, read_shard

    table = _captions(captions_path)
    tokenizer = _tokenizer(encoder)
    keys, latents, captions, reasons, token_ids = [], [], [], [], []
    for index, name in zip(indices, batch["shard"], strict=True):
        probe.check()
        f = files[name]
        path = client.acquire(f, timeout=fetch_timeout)
        if path is None:  # skipped under on_missing="skip"; recorded by the fetcher
            continue
        try:
            shard = read_shard(path, dtype="source" if storage.reference else storage.dtype)
        finally:
            client.release(f)  # frees the staging slot even when the shard is corrupt
        if storage.reference and shard.source_dtype != storage.dtype:
            raise CorruptShardError(
                str(path),
                f"latents are {shard.source_dtype}, but the first shard "
                f"{storage.reference} holds {storage.dtype}; build.latent_dtype: source "
                "stores one dtype for all shards: set build.latent_dtype explicitly "
                "(float32 stores float16, bfloat16 and float32 exactly)",
            )
        # One small file per shard: the builder adds them up for the report.
        write_json_atomic(
            Path(precision_dir) / f"{index:09d}.json",
            {"source_dtype": shard.source_dtype, **shard.loss.as_dict()},
            durable=False,
        )
        k, lat = shard.keys, to_arrow(shard.latents)
        bad = shard.nonfinite
        if bad.any():
            first = ", ".join(map(str, k[bad][:_FIRST_KEYS].tolist()))
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
        caps, found = table.lookup(k)
        # object dtype: a fixed-width str array would truncate the longer reason names.
        why = reason_names(classify(caps, found)).astype(object)
        why[bad] = _NONFINITE
        texts = caps.fill_null("").to_pylist()
        ids: list[list[int]] = [[] for _ in texts]
        keep = np.flatnonzero(why == "")
        for i, seq in zip(keep, tokenizer([texts[i] for i in keep]), strict=True):
            ids[i] = seq
        reasons.append(why)
        captions.append(texts)
        token_ids.append(ids)
        keys.append(k)
        latents.append(lat)
    if not keys:
        return {
            "key": np.zeros(0, np.int64),
            "latents": np.zeros((0, *LATENT_SHAPE), arrow_dtype(storage.dtype)),
            "caption": [],
            "drop_reason": [],
            "input_ids": [],
        }
    return {
        "key": np.concatenate(keys),
        "latents": np.concatenate(latents),
        "caption": [c for part in captions for c in part],
        "drop_reason": [str(r) for part in reasons for r in part],
        "input_ids": [x for part in token_ids for x in part],
    }


def _embed_rows(
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
    final = np.asarray(reasons.to_pylist(), dtype=object)
    final[(final == "") & duplicate[idx]] = "duplicate_key"
    keep = np.flatnonzero(final == "")
    emb = np.zeros((len(idx), encoder.dim), dtype=encoder.output_dtype)
    if len(keep):
        emb[keep] = encoder.encode_ids(input_ids.take(keep))
    return {"embedding": emb, "drop_reason": final.tolist()}


def _keep_rows(reasons: list) -> list[bool]:
    """``datasets.filter`` predicate: keep rows with no drop reason."""
    return [r == "" for r in reasons]


def _first_occurrence_mask(keys: np.ndarray) -> np.ndarray:
    """True for every row whose key appeared in an earlier row."""
    _, first = np.unique(keys, return_index=True)
    dup = np.ones(len(keys), dtype=bool)
    dup[first] = False
    return dup


def _count(values: np.ndarray) -> dict[str, int]:
    names, counts = np.unique(values.astype(str), return_counts=True)
    return {str(n): int(c) for n, c in zip(names, counts, strict=True)}


class _Builder:
    """The two stage functions, sharing the resolved inputs and the config."""

    def __init__(self, cfg: Config, inputs: Inputs, fingerprint: str, progress: bool):
        self.cfg = cfg
        self.inputs = inputs
        self.fingerprint = fingerprint
        self.progress = progress

    def converted(self, ctx) -> dict[str, Any]:
        from datasets import Array4D, Dataset, Features, List, Value

        from hf_pipeline.captions import read_captions
        from hf_pipeline.embed import TextEncoder, describe_device
        from hf_pipeline.fetch import ShardFetcher
        from hf_pipeline.precision import arrow_dtype
        from hf_pipeline.shards import LATENT_SHAPE

        cfg, b = self.cfg, self.cfg.build
        tmp = Path(ctx.tmp_dir)
        work = tmp / "_work"
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()

        meta_path = self.inputs.source.fetch_one(self.inputs.metadata)
        table = read_captions(
            meta_path, key_column=cfg.data.key_column, caption_column=cfg.data.caption_column
        )
        captions_path = str(work / "captions.arrow")
        table.save(captions_path)
        log.info("captions: %d keys from %s", len(table.keys), meta_path)

        shards = self.inputs.shards
        num_proc = max(1, min(b.effective_num_proc, len(shards)))
        files = {f.name: f for f in shards}
        precision_dir = work / "precision"
        precision_dir.mkdir()
        fetch_timeout = cfg.data.file_timeout * (cfg.data.max_retries + 1)
        shard_ds = Dataset.from_dict({"shard": [f.name for f in shards]})
        with _building(), ShardFetcher(
            self.inputs.source, shards, data_config=cfg.data, num_workers=num_proc,
            progress=self.progress,
        ) as prefetch:
            storage = self._storage(prefetch.client(), fetch_timeout)
            features = Features(
                {
                    "key": Value("int64"),
                    # Arrow has no bfloat16: its bits are stored as uint16 (see precision).
                    "latents": Array4D(LATENT_SHAPE, arrow_dtype(storage.dtype)),
                    "caption": Value("string"),
                    "drop_reason": Value("string"),
                    "input_ids": List(Value("int32")),
                }
            )
            rows = shard_ds.map(
                _convert_shards,
                batched=True,
                batch_size=1,
                with_indices=True,
                num_proc=num_proc if num_proc > 1 else None,
                writer_batch_size=b.writer_batch_size,
                features=features,
                remove_columns=["shard"],
                fn_kwargs={
                    "probe": ctx.probe,
                    "client": prefetch.client(),
                    "files": files,
                    "captions_path": captions_path,
                    "storage": storage,
                    "precision_dir": str(precision_dir),
                    "fetch_timeout": fetch_timeout,
                    "encoder": cfg.encoder,
                    "on_bad_rows": cfg.data.on_bad_rows,
                },
                cache_file_name=str(tmp / "rows" / "data.arrow"),
                new_fingerprint=f"{self.fingerprint}-rows",
                keep_in_memory=False,
                desc="Join + tokenize captions",
            )
            fetch_stats = prefetch.stats()
        t_convert = time.monotonic() - t0
        precision = _precision_summary(
            [json.loads(p.read_text()) for p in sorted(precision_dir.glob("*.json"))],
            storage.dtype,
        )
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

        keys = rows.data.column("key").to_numpy()
        pre = np.asarray(rows.data.column("drop_reason").to_pylist(), dtype=object)
        # A key's first row with finite latents wins: a NaN copy must not shadow a
        # good one (the key would vanish although usable latents exist).
        nonfinite = pre == _NONFINITE
        duplicate = np.zeros(len(keys), dtype=bool)
        duplicate[~nonfinite] = _first_occurrence_mask(keys[~nonfinite])
        bad_rows = {
            _NONFINITE: {
                "count": int(nonfinite.sum()),
                "first_keys": [int(x) for x in keys[nonfinite][:_FIRST_KEYS]],
            }
        }
        no_latents = int(table.count_absent(np.unique(keys)))

        t1 = time.monotonic()
        encoder = TextEncoder(cfg.encoder)
        log.info("encoder %s (dim %d) on %s", cfg.encoder.model, encoder.dim, describe_device())
        emb_type = "float16" if cfg.encoder.output_dtype == "float16" else "float32"
        embedded = rows.with_format("arrow").map(
            _embed_rows,
            batched=True,
            batch_size=b.batch_size,
            writer_batch_size=b.writer_batch_size,
            input_columns=["input_ids", "drop_reason"],
            with_indices=True,
            remove_columns=rows.column_names,
            features=Features(
                {
                    "embedding": List(Value(emb_type), length=encoder.dim),
                    "drop_reason": Value("string"),
                }
            ),
            fn_kwargs={"probe": ctx.probe, "encoder": encoder, "duplicate": duplicate},
            cache_file_name=str(tmp / "embeddings" / "data.arrow"),
            new_fingerprint=f"{self.fingerprint}-embeddings",
            keep_in_memory=False,
            desc="Embed captions",
        )
        final = np.asarray(embedded.data.column("drop_reason").to_pylist(), dtype=object)
        t_embed = time.monotonic() - t1
        embed_dim = encoder.dim
        del rows, embedded, encoder
        shutil.rmtree(work, ignore_errors=True)
        reasons = _count(final)
        return {
            "rows_in": int(len(keys)),
            "reasons": reasons,
            "pre_duplicate_reasons": _count(pre),
            "no_latents": no_latents,
            "duplicate_meta_rows": int(getattr(table, "duplicate_meta_rows", 0)),
            "bad_rows": bad_rows,
            "embed_dim": int(embed_dim),
            "shards": len(shards),
            "fetch": fetch_stats,
            "seconds_convert": round(t_convert, 3),
            "seconds_embed": round(t_embed, 3),
            "num_proc": num_proc,
            # Readers view the latents column through this (bfloat16 is uint16 in Arrow).
            "latent_dtype": storage.dtype,
            "precision": precision,
        }

    def _storage(self, client, timeout: float) -> _Storage:
        """The storage dtype: explicit, or (``source``) the first readable shard's dtype.

        ``source`` reads one shard's header here, before the workers start, because the
        Arrow column type must be fixed up front; the workers then check every shard.
        The shard comes through the run's staging client: local files are read in place,
        a remote one is downloaded by the prefetcher (counted in the fetch stats, other
        shards downloading meanwhile) and left staged for the worker that converts it,
        which releases it.
        """
        from hf_pipeline.shards import shard_latent_dtype

        wanted = self.cfg.build.latent_dtype
        if wanted != "source":
            return _Storage(wanted)
        for f in self.inputs.shards:
            path = client.acquire(f, timeout=timeout)
            if path is not None:  # None: skipped under on_missing="skip" (and recorded)
                return _Storage(shard_latent_dtype(path), reference=f.name)
        # Every shard is missing (and skipped): nothing is stored; float32 holds anything.
        return _Storage("float32")

    def filtered(self, ctx) -> dict[str, Any]:
        from datasets import Dataset, concatenate_datasets

        b = self.cfg.build
        tmp = Path(ctx.tmp_dir)
        conv = Path(ctx.previous["converted"])
        layout = CacheLayout(Path(ctx.cache_dir), {"converted": conv.name})
        emb = concatenate_datasets(
            [Dataset.from_file(str(p)) for p in layout.embedding_files(conv)]
        )
        num_proc = max(1, min(b.effective_num_proc, max(1, len(emb) // 1000)))
        with _building():
            kept = emb.filter(
                _keep_rows,
                input_columns=["drop_reason"],
                batched=True,
                batch_size=b.batch_size,
                num_proc=num_proc if num_proc > 1 else None,
                writer_batch_size=b.writer_batch_size,
                cache_file_name=str(tmp / "indices.arrow"),
                new_fingerprint=f"{self.fingerprint}-filtered",
                keep_in_memory=False,
                desc="Filter",
            )
        rows_out = len(kept)
        conv_info = ctx.markers["converted"].info
        dropped = {r: int(conv_info["reasons"].get(r, 0)) for r in REASONS}
        dropped["no_latents"] = int(conv_info["no_latents"])
        skipped = conv_info.get("fetch", {}).get("skipped", [])
        if skipped:
            dropped["missing_shard_files"] = len(skipped)
        report = {
            "fingerprint": self.fingerprint,
            "cache_dir": str(ctx.cache_dir),
            "rows_in": int(conv_info["rows_in"]),
            "rows_out": int(rows_out),
            "dropped": dropped,
            "embed_dim": conv_info["embed_dim"],
            "duplicate_meta_rows": conv_info["duplicate_meta_rows"],
            "bad_rows": conv_info.get("bad_rows", {}),
            "skipped_files": skipped,
            "fetch": conv_info.get("fetch", {}),
            "seconds_convert": conv_info["seconds_convert"],
            "seconds_embed": conv_info["seconds_embed"],
            # Absent when the converted stage was published by a release before it.
            "precision": conv_info.get("precision"),
            "builder": {"host": socket.gethostname(), "pid": os.getpid()},
            "config": self.cfg.to_dict(),
        }
        accounted = rows_out + sum(dropped[r] for r in REASONS)
        if accounted != report["rows_in"]:  # internal invariant, not input validation
            raise AssertionError(f"row accounting broken: {accounted} != {report['rows_in']}")
        write_json_atomic(tmp / "report.json", report, indent=2, sort_keys=True, default=str)
        return {"rows_out": int(rows_out), "dropped": dropped}


def prepare_cache(cfg: Config, *, process=None, progress: bool = True) -> BuildResult:
    """Find or build the cache for ``cfg``; every rank of a job calls this.

    One process builds (rank 0, or local rank 0 for ``coord.scope: node``); the
    others wait for the ``converted`` and ``filtered`` markers, then return. A dead
    builder is replaced (see :mod:`dist.coordinator`).

    Args:
        cfg: configuration.
        process: ``dist.env.ProcessInfo``; detected from the environment if None.
        progress: show progress bars.

    Returns:
        :class:`BuildResult` for the published cache.

    Raises:
        UserError subclasses for bad input; ``dist`` errors for coordination
        failures (timeout, failed builder, read-only cache without markers).
    """
    from dist.coordinator import Stage, default_builder, ensure_built
    from dist.env import detect
    from hf_pipeline.embed import encoder_identity

    check_not_bootstrapping()
    t0 = time.monotonic()
    process = process or detect()
    inputs = resolve_inputs(cfg)
    fingerprint = compute_fingerprint(
        cfg,
        [f.identity() for f in inputs.shards],
        inputs.metadata.identity(),
        encoder_identity(cfg.encoder),
    )
    layout = CacheLayout.for_config(cfg, fingerprint)
    if not cfg.data.staging_dir:
        # One staging folder per identity: two builds of the same source on one host
        # (different configs) must not delete each other's staged shards.
        inputs.source.staging_dir = cfg.cache_root / STAGING_DIR / fingerprint
    builder = _Builder(cfg, inputs, fingerprint, progress)
    our_leases: list[str] = []

    def on_event(name: str, fields: dict) -> None:
        if name == "claimed":
            our_leases.append(fields["lease_id"])

    def stage(name, fn):
        def run(ctx):
            log.info("building stage %s of %s", name, layout.root)
            with spawned_workers():  # the num_proc pools: see hf_pipeline.workers
                return fn(ctx)

        return Stage(name=name, build=run)

    c = cfg.coord
    from datasets import utils as ds_utils

    bars_were_on = ds_utils.is_progress_bar_enabled()
    if not progress:
        ds_utils.disable_progress_bars()
    try:
        markers = ensure_built(
            layout.root,
            fingerprint,
            [stage(STAGES[0], builder.converted), stage(STAGES[1], builder.filtered)],
            process=process,
            builder=default_builder(process, c.scope),
            poll_interval=c.poll_interval,
            max_wait=c.max_wait,
            lease_timeout=c.lease_timeout,
            heartbeat_interval=c.heartbeat_interval,
            on_event=on_event,
        )
    finally:
        if bars_were_on and not progress:
            ds_utils.enable_progress_bars()
    stage_dirs = {name: m.directory for name, m in markers.items()}
    layout = CacheLayout(layout.root, stage_dirs)
    return BuildResult(
        fingerprint=fingerprint,
        cache_dir=layout.root,
        report=layout.read_report(),
        # A lease of ours published a stage; a builder taken over (fenced) did not.
        built=any(m.lease_id in our_leases for m in markers.values()),
        seconds=time.monotonic() - t0,
        stage_dirs=stage_dirs,
    )
