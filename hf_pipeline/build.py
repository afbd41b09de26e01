"""Build the cache: join captions to latents -> embed -> filter, through ``datasets``.

:func:`prepare_cache` is what every rank calls: it resolves the inputs, computes the
fingerprint and runs the two stages through :func:`dist.coordinator.ensure_built`
(exactly one process builds; each stage is published with a marker):

1. ``converted``
   a. *join* (:mod:`hf_pipeline.convert`) — ``Dataset.map(num_proc=build.num_proc)``
      over the shard list: read and validate each shard, convert the latents to the
      storage dtype, join captions by key, tokenize, mark ``nonfinite_latents``.
   b. *duplicates* (:mod:`hf_pipeline.accounting`) — one NumPy pass over the key
      column marks all but the first occurrence of each key (among finite rows).
   c. *embed* (:mod:`hf_pipeline.embed_stage`) — ``Dataset.map`` in this process with
      the encoder on the accelerator; only rows that will be kept are encoded.
2. ``filtered`` — ``Dataset.filter`` on ``drop_reason == ""`` writes the kept row
   indices; the build report (:func:`hf_pipeline.accounting.build_report`) lands next
   to them.

Every latent row is either kept or counted under a reason; metadata rows with no
latents are counted as ``no_latents``.

The ``num_proc`` workers are spawned, never forked (:mod:`hf_pipeline.workers`): the
caller has usually initialised JAX or CUDA first and the build runs threads of its own,
so a fork could deadlock. Safe to call after ``jax.distributed.initialize()``; a
script that calls :func:`prepare_cache` needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dist.atomic import write_json_atomic
from hf_pipeline.accounting import (
    KEEP,
    NONFINITE,
    REASONS,
    ReasonCodes,
    bad_rows_summary,
    build_report,
    later_duplicates,
)
from hf_pipeline.cache import (
    DEMO_DATA_DIR,
    STAGES,
    STAGING_DIR,
    CacheLayout,
    compute_fingerprint,
)
from hf_pipeline.config import Config
from hf_pipeline.remote_file import RemoteFile
from hf_pipeline.workers import check_not_bootstrapping, spawned_workers

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.demo import DemoData
    from hf_pipeline.sources import Source

__all__ = ["BuildResult", "REASONS", "prepare_cache", "resolve_inputs"]

log = logging.getLogger("hf_pipeline")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The resolved raw inputs of a build.

    Attributes:
        source: where the shards live (listing done, identity known).
        shards: the shard files, in build order.
        metadata: the caption parquet.
        demo: the generated demo data when ``data.shards`` is ``demo``.
    """

    source: Source
    shards: list[RemoteFile]
    metadata: RemoteFile
    demo: DemoData | None = None

    def staged_in(self, staging_dir: str | os.PathLike) -> Inputs:
        """The same inputs, downloading into ``staging_dir``."""
        return dataclasses.replace(self, source=self.source.with_staging_dir(staging_dir))


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """Where the cache is and what the build report says.

    Attributes:
        fingerprint: cache identity.
        cache_dir: the cache folder.
        report: the build report (``rows_in``, ``rows_out``, ``dropped``, ...).
        built: True when this process built and published at least one stage (a
            builder that lost its lease to another process reports False).
        seconds: wall time of :func:`prepare_cache` in this process.
        stage_dirs: the published folder of each stage, from the markers.
        pulled: True when this process downloaded a stage from ``build.pull_from`` and
            published it here (``built`` stays False: nothing was built).
    """

    fingerprint: str
    cache_dir: Path
    report: dict
    built: bool
    seconds: float
    stage_dirs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pulled: bool = False

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
            "pulled": self.pulled,
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
        out = (
            cfg.cache_root
            / DEMO_DATA_DIR
            / (f"s{d.seed}-n{d.num_shards}x{d.samples_per_shard}-{d.latent_dtype}")
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
    # Until the fingerprint is known (prepare_cache then stages per identity): a folder
    # per location under this config's cache root.
    staging = cfg.data.staging_dir or (
        cfg.cache_root / STAGING_DIR / hashlib.sha1(shards_loc.encode()).hexdigest()[:16]
    )
    source = open_source(shards_loc, data_config=cfg.data, staging_dir=staging)
    shards = source.list_shards()
    metadata = source.find_metadata(meta_loc)
    return Inputs(source=source, shards=shards, metadata=metadata, demo=demo)


class _Builder:
    """The two stage functions, sharing the resolved inputs and the config."""

    def __init__(self, cfg: Config, inputs: Inputs, fingerprint: str, progress: bool):
        self.cfg = cfg
        self.inputs = inputs
        self.fingerprint = fingerprint
        self.progress = progress

    def converted(self, ctx) -> dict[str, Any]:
        """Stage 1: join (num_proc workers) -> duplicates -> embed (the accelerator)."""
        from hf_pipeline.captions import read_captions
        from hf_pipeline.convert import join_shards
        from hf_pipeline.embed_stage import embed_joined_rows

        cfg = self.cfg
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

        joined = join_shards(
            cfg=cfg,
            source=self.inputs.source,
            shards=self.inputs.shards,
            captions_path=captions_path,
            probe=ctx.probe,
            out_file=tmp / "rows" / "data.arrow",
            work_dir=work,
            fingerprint=self.fingerprint,
            progress=self.progress,
        )
        t_convert = time.monotonic() - t0

        keys = joined.rows.data.column("key").to_numpy()
        pre = ReasonCodes(joined.rows.data.column("drop_reason"))
        # A key's first row with finite latents wins: a NaN copy must not shadow a
        # good one (the key would vanish although usable latents exist).
        nonfinite = pre.mask(NONFINITE)
        duplicate = later_duplicates(keys, eligible=~nonfinite)
        no_latents = int(table.count_absent(np.unique(keys)))

        t1 = time.monotonic()
        embedded = embed_joined_rows(
            joined.rows,
            duplicate,
            cfg=cfg,
            probe=ctx.probe,
            out_file=tmp / "embeddings" / "data.arrow",
            fingerprint=self.fingerprint,
        )
        t_embed = time.monotonic() - t1
        shutil.rmtree(work, ignore_errors=True)
        return {
            "rows_in": int(len(keys)),
            "reasons": embedded.reasons.counts(),
            "pre_duplicate_reasons": pre.counts(),
            "no_latents": no_latents,
            "duplicate_meta_rows": int(getattr(table, "duplicate_meta_rows", 0)),
            "bad_rows": bad_rows_summary(keys, nonfinite),
            "embed_dim": int(embedded.dim),
            "shards": len(self.inputs.shards),
            "fetch": joined.fetch,
            "seconds_convert": round(t_convert, 3),
            "seconds_embed": round(t_embed, 3),
            "num_proc": joined.num_proc,
            # Readers view the latents column through this (bfloat16 is uint16 in Arrow).
            "latent_dtype": joined.storage.dtype,
            "precision": joined.precision,
        }

    def filtered(self, ctx) -> dict[str, Any]:
        """Stage 2: the kept-row indices and the build report."""
        from datasets import Dataset, concatenate_datasets

        build = self.cfg.build
        tmp = Path(ctx.tmp_dir)
        conv = Path(ctx.previous["converted"])
        layout = CacheLayout(Path(ctx.cache_dir), {"converted": conv.name})
        emb = concatenate_datasets(
            [Dataset.from_file(str(p)) for p in layout.embedding_files(conv)]
        )
        # One process: a trivial predicate does not pay for spawning a pool.
        kept = emb.filter(
            _keep_rows,
            input_columns=["drop_reason"],
            batched=True,
            batch_size=build.batch_size,
            writer_batch_size=build.writer_batch_size,
            cache_file_name=str(tmp / "indices.arrow"),
            new_fingerprint=f"{self.fingerprint}-filtered",
            keep_in_memory=False,
            desc="Filter",
        )
        report = build_report(
            fingerprint=self.fingerprint,
            cache_dir=str(ctx.cache_dir),
            rows_out=len(kept),
            converted=ctx.markers["converted"].info,
            builder={"host": socket.gethostname(), "pid": os.getpid()},
            config=self.cfg.to_dict(),
        )
        write_json_atomic(tmp / "report.json", report, indent=2, sort_keys=True, default=str)
        return {"rows_out": report["rows_out"], "dropped": report["dropped"]}


def _keep_rows(reasons: list) -> list[bool]:
    """``datasets.filter`` predicate: keep rows with no drop reason."""
    return [r == KEEP for r in reasons]


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
        inputs = inputs.staged_in(cfg.cache_root / STAGING_DIR / fingerprint)
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

    stages = [stage(STAGES[0], builder.converted), stage(STAGES[1], builder.filtered)]
    if cfg.build.pull_from:
        from hf_pipeline.pull import pulled_stages

        stages = pulled_stages(cfg, fingerprint, layout.root, stages)
    coord = cfg.coord
    from datasets import utils as ds_utils

    bars_were_on = ds_utils.is_progress_bar_enabled()
    if not progress:
        ds_utils.disable_progress_bars()
    try:
        markers = ensure_built(
            layout.root,
            fingerprint,
            stages,
            process=process,
            builder=default_builder(process, coord.scope),
            poll_interval=coord.poll_interval,
            max_wait=coord.max_wait,
            lease_timeout=coord.lease_timeout,
            heartbeat_interval=coord.heartbeat_interval,
            on_event=on_event,
        )
    finally:
        if bars_were_on and not progress:
            ds_utils.enable_progress_bars()
    from hf_pipeline.pull import was_pulled

    stage_dirs = {name: m.directory for name, m in markers.items()}
    layout = CacheLayout(layout.root, stage_dirs)
    # A lease of ours published a stage; a builder taken over (fenced) did not.
    ours = [m for m in markers.values() if m.lease_id in our_leases]
    return BuildResult(
        fingerprint=fingerprint,
        cache_dir=layout.root,
        report=layout.read_report(),
        built=any(not was_pulled(m) for m in ours),
        seconds=time.monotonic() - t0,
        stage_dirs=stage_dirs,
        pulled=any(was_pulled(m) for m in ours),
    )
