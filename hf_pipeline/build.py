"""Build the cache: join captions to latents -> embed -> filter, through ``datasets``.

Stages (each published atomically by :mod:`dist.coordinator`, with a marker):

1. ``converted``
   a. *convert* — ``Dataset.map(num_proc=build.num_proc, batch_size=1)`` over the
      shard list: each worker process reads one shard at a time
      (``torch.load(weights_only=True)``), joins captions by key with a vectorized
      ``searchsorted`` over a memory-mapped, key-sorted caption table, and writes
      ``key, latents, caption, drop_reason`` rows.
   b. duplicates — one NumPy pass over the key column marks all but the first
      occurrence of each key.
   c. *embed* — ``Dataset.map(batch_size=build.batch_size)`` in THIS process with the
      encoder on the accelerator (CUDA does not survive ``fork``); only rows that
      will be kept are encoded. Writes ``embedding, drop_reason``.
2. ``filtered`` — ``Dataset.filter(num_proc=...)`` on ``drop_reason == ""`` writes
   the kept row indices; the build report lands next to them.

Every latent row is either kept or counted under a reason; metadata rows with no
latents are counted as ``no_latents``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
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

__all__ = ["BuildResult", "REASONS", "prepare_cache", "resolve_inputs"]

log = logging.getLogger("hf_pipeline")

#: Why a latent row was not kept (plus ``no_latents`` for metadata rows).
REASONS = ("no_caption", "empty_caption", "duplicate_key")


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


_CAPTIONS: dict[str, Any] = {}
_TOKENIZERS: dict[Any, Any] = {}


def _captions(path: str):
    # One memory-mapped caption table per worker process (opened lazily after fork).
    table = _CAPTIONS.get(path)
    if table is None:
        from hf_pipeline.captions import CaptionTable

        table = _CAPTIONS[path] = CaptionTable.open(path)
    return table


def _tokenizer(cfg):
    # One tokenizer per worker process, loaded after the fork. The workers already run
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
    *,
    probe,
    client,
    files: Mapping[str, Any],
    captions_path: str,
    latent_dtype: str,
    fetch_timeout: float,
    encoder,
) -> dict[str, Any]:
    """``datasets.map`` function: shard file names -> joined, tokenized latent rows.

    ``probe`` (:class:`dist.lease.LeaseProbe`) stops a builder that lost its lease at the
    next shard.
    """
    from hf_pipeline.captions import classify, reason_names
    from hf_pipeline.shards import LATENT_SHAPE, load_shard

    table = _captions(captions_path)
    tokenizer = _tokenizer(encoder)
    keys, latents, captions, reasons, token_ids = [], [], [], [], []
    for name in batch["shard"]:
        probe.check()
        f = files[name]
        path = client.acquire(f, timeout=fetch_timeout)
        if path is None:  # skipped under on_missing="skip"; recorded by the fetcher
            continue
        try:
            k, lat = load_shard(path, dtype=latent_dtype)
        finally:
            client.release(f)  # frees the staging slot even when the shard is corrupt
        caps, found = table.lookup(k)
        why = reason_names(classify(caps, found))
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
            "latents": np.zeros((0, *LATENT_SHAPE), latent_dtype),
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

        from hf_pipeline.captions import write_sorted_captions
        from hf_pipeline.embed import TextEncoder, describe_device
        from hf_pipeline.fetch import Prefetcher
        from hf_pipeline.shards import LATENT_SHAPE

        cfg, b = self.cfg, self.cfg.build
        tmp = Path(ctx.tmp_dir)
        work = tmp / "_work"
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()

        meta_path = self.inputs.source.fetch_one(self.inputs.metadata)
        captions_path = str(work / "captions.arrow")
        # Streamed and sorted in bounded memory; the builder keeps only the memory map.
        table = write_sorted_captions(
            meta_path,
            captions_path,
            key_column=cfg.data.key_column,
            caption_column=cfg.data.caption_column,
            num_proc=b.effective_num_proc,
        )
        log.info("captions: %d keys from %s", len(table), meta_path)

        shards = self.inputs.shards
        num_proc = max(1, min(b.effective_num_proc, len(shards)))
        files = {f.name: f for f in shards}
        features = Features(
            {
                "key": Value("int64"),
                "latents": Array4D(LATENT_SHAPE, b.latent_dtype),
                "caption": Value("string"),
                "drop_reason": Value("string"),
                "input_ids": List(Value("int32")),
            }
        )
        shard_ds = Dataset.from_dict({"shard": [f.name for f in shards]})
        with _building(), Prefetcher(
            self.inputs.source, shards, data_config=cfg.data, num_workers=num_proc,
            progress=self.progress,
        ) as prefetch:
            rows = shard_ds.map(
                _convert_shards,
                batched=True,
                batch_size=1,
                num_proc=num_proc if num_proc > 1 else None,
                writer_batch_size=b.writer_batch_size,
                features=features,
                remove_columns=["shard"],
                fn_kwargs={
                    "probe": ctx.probe,
                    "client": prefetch.client(),
                    "files": files,
                    "captions_path": captions_path,
                    "latent_dtype": b.latent_dtype,
                    "fetch_timeout": cfg.data.file_timeout * (cfg.data.max_retries + 1),
                    "encoder": cfg.encoder,
                },
                cache_file_name=str(tmp / "rows" / "data.arrow"),
                new_fingerprint=f"{self.fingerprint}-rows",
                keep_in_memory=False,
                desc="Join + tokenize captions",
            )
            fetch_stats = prefetch.stats()
        t_convert = time.monotonic() - t0

        keys = rows.data.column("key").to_numpy()
        pre = np.asarray(rows.data.column("drop_reason").to_pylist(), dtype=object)
        duplicate = _first_occurrence_mask(keys)
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
            "embed_dim": int(embed_dim),
            "shards": len(shards),
            "fetch": fetch_stats,
            "seconds_convert": round(t_convert, 3),
            "seconds_embed": round(t_embed, 3),
            "num_proc": num_proc,
        }

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
            "skipped_files": skipped,
            "fetch": conv_info.get("fetch", {}),
            "seconds_convert": conv_info["seconds_convert"],
            "seconds_embed": conv_info["seconds_embed"],
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
