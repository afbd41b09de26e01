"""Build the cache: join captions to latents -> embed -> filter, through ``datasets``.

:func:`prepare_cache` is what every rank calls: it resolves the inputs, computes the
fingerprint and runs the two stages through :func:`dist.coordinator.ensure_built`
(exactly one process builds; each stage is published with a marker):

1. ``converted``
   a. *join* (:mod:`hf_pipeline.build.convert`) — ``Dataset.map(num_proc=build.num_proc)``
      over the shard list: read and validate each shard, convert the latents to the
      storage dtype, join captions by key, tokenize, mark ``nonfinite_latents``.
   b. *duplicates* (:mod:`hf_pipeline.build.accounting`) — one NumPy pass over the key
      column marks all but the first occurrence of each key (among finite rows).
   c. *embed* (:mod:`hf_pipeline.build.embed_stage`) — ``Dataset.map`` in this process with
      the encoder on the accelerator; only rows that will be kept are encoded.
2. ``filtered`` — the ids of the rows with ``drop_reason == ""``, written as
   ``Dataset.filter`` writes them (:func:`hf_pipeline.build.parts.write_kept_indices`); the
   build report (:func:`hf_pipeline.build.accounting.build_report`) lands next
   to them.

Every latent row is either kept or counted under a reason; metadata rows with no
latents are counted as ``no_latents``.

The ``num_proc`` workers come from a clean fork server of the build's own, never from a
fork of the caller (:mod:`hf_pipeline.workers.pool`): the caller has usually initialised JAX
or CUDA first and the build runs threads of its own, so a fork could deadlock. Safe to call after ``jax.distributed.initialize()``; a
script that calls :func:`prepare_cache` needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dist.atomic import write_json_atomic
from dist.layout import parse_stage_dir
from hf_pipeline.build.accounting import (
    REASONS,
    build_report,
)
from hf_pipeline.build.parts import REASONS_FILE
from hf_pipeline.cache.layout import (
    DEMO_DATA_DIR,
    STAGES,
    STAGING_DIR,
    CacheLayout,
    compute_fingerprint,
)
from hf_pipeline.config import Config
from hf_pipeline.errors import CacheFormatError
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.workers.pool import check_not_bootstrapping, clean_workers, quick_gil_handoff

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.demo.generate import DemoData
    from hf_pipeline.stores import Source

__all__ = [
    "BuildResult",
    "REASONS",
    "job_identity",
    "one_builder_part_shards",
    "prepare_cache",
    "resolve_inputs",
    "resolve_job_inputs",
]

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
        built: True when this process built and published at least one stage or, with
            ``build.parallel: ranks``, one part (a pulled stage is not built; a builder
            that lost its lease to another process reports False).
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
            "null_key_meta_rows": int(r.get("null_key_meta_rows", 0)),
            "seconds": round(self.seconds, 3),
            "built": self.built,
            "pulled": self.pulled,
        }


#: Demo datasets from this many rows on are generated by ``build.num_proc`` processes.
_PARALLEL_DEMO_ROWS = 100_000


def resolve_inputs(cfg: Config) -> Inputs:
    """List the shard files and find the metadata table (generating the demo if asked).

    Safe to call from every rank at once: demo generation is atomic and idempotent.
    """
    from hf_pipeline.stores import open_source

    demo = None
    shards_loc, meta_loc = cfg.data.shards, cfg.data.metadata
    if shards_loc == "demo":
        from hf_pipeline.demo.generate import generate_demo

        d = cfg.data.demo
        # Dot-folders beside the caches: never listed or cleaned as caches by dist.inventory.
        out = (
            cfg.cache_root
            / DEMO_DATA_DIR
            / (f"s{d.seed}-n{d.num_shards}x{d.samples_per_shard}-{d.latent_dtype}")
        )
        # A process per CPU costs ~3 s of start-up each: it pays from ~100k rows on
        # (36 s sequential on a GPU host's CPU), not for the small demos.
        big = d.num_shards * d.samples_per_shard >= _PARALLEL_DEMO_ROWS
        demo = generate_demo(
            out,
            num_shards=d.num_shards,
            samples_per_shard=d.samples_per_shard,
            seed=d.seed,
            latent_dtype=d.latent_dtype,
            num_proc=cfg.build.effective_num_proc if big else 1,
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


def _save_captions(cfg: Config, inputs: Inputs, path: Path):
    """Fetch the metadata parquet and write its key-sorted caption table at ``path``.

    Streamed and sorted in bounded memory (:func:`hf_pipeline.build.captions.write_sorted_captions`);
    the builder keeps only the memory map.
    """
    from hf_pipeline.build.captions import write_sorted_captions

    meta_path = inputs.source.fetch_one(inputs.metadata)
    table = write_sorted_captions(
        meta_path,
        str(path),
        key_column=cfg.data.key_column,
        caption_column=cfg.data.caption_column,
        num_proc=cfg.build.effective_num_proc,
    )
    log.info("captions: %d keys from %s", len(table), meta_path)
    return table


class _EncoderLoading:
    """This process's caption tokenizer and encoder, loading on a thread of their own
    from the start of the build: the tokenizer first, then the model (``.encoder``, a
    future), which is ready when the first embedding starts.

    The join's workers tokenize with :attr:`for_workers`: the tokenizer exported once
    per encoder and software stack under the cache root
    (:class:`hf_pipeline.encoder.model.ExportedTokenizers`), so the first shard does not
    wait for transformers' import and tokenizer (4-10 s on a GPU host beside 16
    starting workers: issue 28); the first build of an encoder exports it from the
    loaded tokenizer, and the loading thread checks that a kept one is still exactly
    what transformers makes of the model's files (else the build fails before anything
    is published).

    Measured on a 4xH100 host (1M rows): starting the model only after the caption
    table made the join's first shard later (4.6-7.5 s against 4.0 s), as its loading
    (imports, ``torch.compile``, the warm-up) then met the pool's start; the stages hand
    the GIL over within 1 ms instead (:func:`hf_pipeline.workers.pool.quick_gil_handoff`).

    What the loading thread imports is imported on the calling (main) thread first
    (:func:`_import_before_threads`): ``datasets`` reads ``transformers`` and ``torch``
    from ``sys.modules`` while it fingerprints, and ``dist`` reads ``torch.distributed``
    there; a module another thread is still importing is a partial one.

    A context manager: leaving it waits for the loading thread.
    """

    def __init__(self, cfg: Config, process, *, timeline=None, encoder_ident=None):
        from hf_pipeline.build.startup import StartupTimeline
        from hf_pipeline.encoder.model import (
            EXPORTED_TOKENIZERS_DIR,
            ExportedTokenizers,
            exported_tokenizer_key,
        )

        _import_before_threads(timeline)
        started = time.monotonic()
        self.timeline = timeline if timeline is not None else StartupTimeline()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hf_pipeline-encoder-load")
        self.tokenizer = self._pool.submit(self._load_tokenizer, cfg)
        kept = None
        if encoder_ident is not None:
            kept = (
                ExportedTokenizers(cfg.cache_root / EXPORTED_TOKENIZERS_DIR),
                exported_tokenizer_key(encoder_ident),
            )
        self.for_workers = _WorkersTokenizer(cfg, self.tokenizer, kept, self.timeline)
        self.encoder = self._pool.submit(
            _encoder, cfg, process, self.tokenizer, started, self.for_workers, self.timeline,
            encoder_ident,
        )  # fmt: skip

    def _load_tokenizer(self, cfg: Config):
        from hf_pipeline.encoder.model import CaptionTokenizer

        tokenizer = CaptionTokenizer(cfg.encoder)
        self.timeline.mark("tokenizer")
        return tokenizer

    def __enter__(self) -> _EncoderLoading:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)


def _import_before_threads(timeline=None) -> None:
    """Import on this (the main) thread what the build's threads import: torch (and
    ``torch.distributed``, which transformers imports) and transformers' tokenizer base
    class. Another thread's import in progress leaves a partial module in
    ``sys.modules``, where ``datasets``' pickler (``transformers.PreTrainedTokenizerBase``)
    and the doorbell (``torch.distributed.is_available``) look: seen on a 4xH200 host,
    ``no torch.distributed doorbell, polling only: partially initialized module
    'torch.distributed' has no attribute 'is_available'`` (issue 28). The main thread
    needs torch before the join anyway (the first shard's header, the device); the
    fork server imports its own meanwhile."""
    import torch
    import torch.distributed  # noqa: F401
    from transformers import PreTrainedTokenizerBase  # noqa: F401

    del torch
    if timeline is not None:
        timeline.mark("imports")


class _WorkersTokenizer:
    """What the join's workers tokenize with (:func:`hf_pipeline.build.convert.worker_tokenizer`
    calls :meth:`export`): the kept export of this encoder when there is one, else the
    loading tokenizer's export (then kept for the next build). Thread-safe."""

    def __init__(self, cfg: Config, tokenizer, kept, timeline):
        self._cfg = cfg
        self._tokenizer = tokenizer  # a Future of the CaptionTokenizer
        self._kept = kept  # (ExportedTokenizers, key) or None
        self._timeline = timeline
        self._lock = threading.Lock()
        #: The kept spec the workers were given (None: theirs came from the tokenizer).
        self.from_kept = None

    def _load_kept(self):
        if self._kept is None:
            return None
        exported, key = self._kept
        return exported.load(key, max_length=self._cfg.encoder.max_length)

    def export(self, folder):
        """The workers' :class:`hf_pipeline.encoder.model.TokenizerSpec` (or None: no
        Rust backend, the workers load the tokenizer themselves)."""
        self._timeline.mark("join_map")
        with self._lock:
            spec = self.from_kept or self._load_kept()
            if spec is not None:
                self.from_kept = spec
                self._timeline.note("worker_tokenizer", "kept")
            else:
                spec = self._tokenizer.result().export(folder)  # re-raises a load error
                self._timeline.note("worker_tokenizer", "none" if spec is None else "exported")
                if spec is not None and self._kept is not None:
                    exported, key = self._kept
                    exported.save(key, spec)
        self._timeline.mark("worker_tokenizer")
        return spec


def _encoder(
    cfg: Config, process, tokenizer, started: float, for_workers=None, timeline=None,
    encoder_ident=None,
):  # fmt: skip
    """The encoder of this process: with ``build.parallel: ranks`` and ``device: auto``,
    each rank of a node on its own GPU (``cuda:<local rank>``). Its ``load_seconds``
    also count the ``tokenizer`` loaded before it and the loading's whole span since
    ``started`` (``ready``).

    Raises:
        RuntimeError: the kept tokenizer export the workers used is not what the
            tokenizer exports now (nothing is then published).
    """
    tokenizer_seconds = time.monotonic() - started  # the tokenizer loaded first
    from hf_pipeline.encoder.model import ExportedTokenizers, TextEncoder, describe_device

    loaded = tokenizer.result()
    if for_workers is not None and for_workers.from_kept is not None:
        if not ExportedTokenizers.matches(for_workers.from_kept, loaded):
            raise RuntimeError(
                f"the kept tokenizer export {for_workers.from_kept.path} is not what "
                f"{cfg.encoder.model!r}'s tokenizer exports: remove that folder and build again"
            )
    enc_cfg = dataclasses.replace(cfg.encoder, device=_encoder_device(cfg, process))
    encoder = TextEncoder(enc_cfg, tokenizer=loaded)
    # While the join runs: the first batches then run at full speed. A compiled encoder
    # is compiled once per job and software stack: the first process shares its
    # artifacts through the cache root, the others load them (CompileArtifacts).
    shared = None
    if encoder_ident is not None:
        from hf_pipeline.encoder.model import (
            COMPILE_ARTIFACTS_DIR,
            CompileArtifacts,
            compile_artifacts_key,
        )

        key = compile_artifacts_key(enc_cfg, encoder_ident, encoder.device)
        shared = CompileArtifacts(cfg.cache_root / COMPILE_ARTIFACTS_DIR, key)
    encoder.warm_up_shared(shared)
    encoder.load_seconds = {
        "tokenizer": round(tokenizer_seconds, 3),
        **encoder.load_seconds,
        "ready": round(time.monotonic() - started, 3),
    }
    if timeline is not None:
        timeline.mark("encoder")
    log.info(
        "encoder %s (dim %d) on %s", enc_cfg.model, encoder.dim, describe_device(encoder.device)
    )
    return encoder


def _encoder_device(cfg: Config, process) -> str:
    """``encoder.device``, or with ``build.parallel: ranks`` and ``device: auto`` on a
    CUDA host, this rank's own GPU (``cuda:<local rank>``)."""
    device = cfg.encoder.device
    if cfg.build.parallel == "ranks" and device == "auto" and process is not None:
        import torch

        if torch.cuda.is_available():
            device = f"cuda:{process.local_rank % torch.cuda.device_count()}"
    return device


class _Builder:
    """The stage functions, sharing the resolved inputs and the config.

    ``parts`` (``build.parallel: ranks``): the part folders and infos the ranks
    published, in shard order, and the caption table they used; the ``converted``
    stage then only assembles them. Otherwise it builds every part itself.
    """

    def __init__(
        self,
        cfg: Config,
        inputs: Inputs,
        fingerprint: str,
        progress: bool,
        *,
        process=None,
        parts: list[tuple[Path, dict]] | None = None,
        captions_path: Path | None = None,
        captions_seconds: float | None = None,
        loading: _EncoderLoading | None = None,
        startup=None,
    ):
        self.cfg = cfg
        self.inputs = inputs
        self.fingerprint = fingerprint
        self.progress = progress
        self.process = process
        self.parts = parts
        self.captions_path = captions_path
        self.captions_seconds = captions_seconds
        self.loading = loading  # started by prepare_cache (None: started by the stage)
        self.startup = startup  # prepare_cache's StartupTimeline (None: not reported)

    def converted(self, ctx) -> dict[str, Any]:
        """Stage 1: per part, join (num_proc workers) and embed (the accelerator); then
        the duplicates across parts and the final drop reasons (:mod:`hf_pipeline.build.parts`)."""
        from hf_pipeline.build.captions import CaptionTable
        from hf_pipeline.build.parts import assemble

        tmp = Path(ctx.tmp_dir)
        if self.parts is not None:  # built by the ranks: hard-link their files in
            table = CaptionTable.open(str(self.captions_path))
            info = assemble(tmp, self.parts, table=table, link_from=True, probe=ctx.probe)
            return {**info, "seconds_captions": self.captions_seconds, **self._startup(info)}
        work = tmp / "_work"
        work.mkdir(parents=True, exist_ok=True)
        shards = self.inputs.shards
        # The model loads (disk, then the accelerator) while the caption table is written
        # and the num_proc workers join: it is ready when the first embedding starts.
        with _loading(self.loading, self.cfg, self.process) as loading:
            t_captions = time.monotonic()
            table = _save_captions(self.cfg, self.inputs, work / "captions.arrow")
            seconds_captions = round(time.monotonic() - t_captions, 3)
            built = _build_in_parts(
                self.cfg, shards=shards, out_dir=tmp / "parts", fingerprint=self.fingerprint,
                part_shards=one_builder_part_shards(self.cfg, len(shards)), probe=ctx.probe,
                on_phase=ctx.set_phase,
                loading=loading, source=self.inputs.source,
                captions_path=work / "captions.arrow", progress=self.progress,
            )  # fmt: skip
        info = assemble(tmp, built, table=table, link_from=False, probe=ctx.probe)
        shutil.rmtree(work, ignore_errors=True)
        return {**info, "seconds_captions": seconds_captions, **self._startup(info)}

    def _startup(self, info: Mapping[str, Any]) -> dict[str, Any]:
        """``{"startup": ...}``: this process's start-up timeline
        (:class:`hf_pipeline.build.startup.StartupTimeline`) with its first join's first
        shard, for the report; ``{}`` when not timed."""
        if self.startup is None:
            return {}
        join_map = self.startup.at("join_map")
        parts = info.get("parts") or []
        first = (parts[0].get("join") or {}).get("seconds_to_first_shard") if parts else None
        if join_map is not None and first is not None:
            # The join's clock starts where it hands the workers their tokenizer.
            self.startup.mark("first_shard", at=join_map + float(first))
        return {"startup": self.startup.as_dict()}

    def filtered(self, ctx) -> dict[str, Any]:
        """Stage 2: the kept-row indices and the build report."""
        from hf_pipeline.build.parts import write_kept_indices

        tmp = Path(ctx.tmp_dir)
        conv = Path(ctx.previous["converted"])
        ctx.check_ownership()
        if (conv / REASONS_FILE).exists():  # the final reasons, across parts
            reason_files = [conv / REASONS_FILE]
        else:  # published by hf_pipeline 0.1: in the embedding files
            layout = CacheLayout(Path(ctx.cache_dir), {"converted": conv.name})
            reason_files = layout.embedding_files(conv)
        rows_out = write_kept_indices(
            reason_files, tmp / "indices.arrow", fingerprint=f"{self.fingerprint}-filtered",
            batch_rows=self.cfg.build.writer_batch_size,
        )  # fmt: skip
        report = build_report(
            fingerprint=self.fingerprint,
            cache_dir=str(ctx.cache_dir),
            rows_out=rows_out,
            converted=ctx.markers["converted"].info,
            builder=_me(),
            config=self.cfg.to_dict(),
        )
        write_json_atomic(tmp / "report.json", report, indent=2, sort_keys=True, default=str)
        if not rows_out:
            dropped = ", ".join(f"{k} {v}" for k, v in report["dropped"].items() if v)
            log.warning(
                "the cache keeps no rows (%d latent rows in; dropped: %s): there is nothing "
                "to train on; check data.shards, data.metadata and data.caption_column",
                report["rows_in"], dropped or "none",
            )  # fmt: skip
        return {"rows_out": report["rows_out"], "dropped": report["dropped"]}


#: Pieces of a builder's part on an accelerator when ``build.overlap_parts`` is 0: the
#: embedding of a piece overlaps the join of the next, so 4 pieces hide up to 3/4 of
#: the shorter of the two. Only when each piece still gives every worker a shard (a
#: piece's pool starts again and waits for its slowest worker): measured on an H200 host
#: with 16 workers, 100 shards (100k rows) built in 7.6-7.8 s in 4 parts of 25 against
#: 8.0-8.9 s in one (benchmarks/results/build_gpu_h200_100k_parts_overlap.json). On the
#: CPU the model already uses every core: one piece.
_OVERLAP_PARTS = 4


def overlap_part_shards(cfg: Config, num_shards: int) -> int:
    """The shards per overlapped piece of a builder's ``num_shards`` shards (0: one
    piece): ``build.overlap_parts`` pieces when set, else 4 when the encoder runs on an
    accelerator and each piece still gives every ``num_proc`` worker a shard."""
    if cfg.build.overlap_parts:
        return 0 if cfg.build.overlap_parts == 1 else -(-num_shards // cfg.build.overlap_parts)
    if num_shards < _OVERLAP_PARTS * cfg.build.effective_num_proc:
        return 0
    device = cfg.encoder.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return 0 if device == "cpu" else -(-num_shards // _OVERLAP_PARTS)


def one_builder_part_shards(cfg: Config, num_shards: int) -> int:
    """The shards per part of one builder (0: one part): ``build.part_shards`` when set,
    else :func:`overlap_part_shards`."""
    return cfg.build.part_shards or overlap_part_shards(cfg, num_shards)


def _build_in_parts(
    cfg: Config, *, shards, part_shards: int, out_dir: Path, fingerprint: str, probe,
    loading: _EncoderLoading, source, captions_path: Path, progress: bool, on_phase=None,
) -> list[tuple[Path, dict[str, Any]]]:  # fmt: skip
    """``shards`` built in parts of ``part_shards`` (:func:`hf_pipeline.build.parts.plan_parts`)
    into ``out_dir/part-NNNNN/``, the embedding of each overlapping the join of the next
    (:func:`hf_pipeline.build.parts.build_parts_overlapped`); ``[(folder, info)]`` in shard
    order, each info naming its builder."""
    from hf_pipeline.build.parts import build_parts_overlapped, plan_parts

    plans = plan_parts(len(shards), part_shards)
    folders = [out_dir / plan.name for plan in plans]
    infos = build_parts_overlapped(
        [
            {
                "shards": shards[plan.start : plan.stop],
                "out_dir": folder,
                "fingerprint": f"{fingerprint}-{plan.name}",
            }
            for plan, folder in zip(plans, folders, strict=True)
        ],
        cfg=cfg,
        probe=probe,
        encoder=loading.encoder,
        on_phase=on_phase,
        join_kw={
            "source": source,
            "captions_path": str(captions_path),
            "progress": progress,
            "tokenizer": loading.for_workers,
        },
    )
    return [(f, {**i, "builder": _me()}) for f, i in zip(folders, infos, strict=True)]


_PIECE_DIR = re.compile(r"part-\d{5}")


def _pieces(unit: Path, info: Mapping[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """A rank's published part as the pieces it was built in: ``[(folder, info)]``."""
    pieces = info.get("pieces")
    if not (
        isinstance(pieces, list)
        and pieces
        and all(isinstance(p, dict) and _PIECE_DIR.fullmatch(str(p.get("dir"))) for p in pieces)
    ):
        raise CacheFormatError(str(unit), "the part's marker does not list its pieces")
    return [(unit / p["dir"], dict(p)) for p in pieces]


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


_RESOLUTIONS: dict[str, int] = {}  # resolutions of each config so far, this process

#: The config fields every rank of a job must have equal (:func:`_agree`): what the
#: cache holds, how the ranks split the build, and the sample order and model they
#: train. Not the per-host ones (paths, worker counts, devices, prefetching): node-local
#: copies and caches legitimately differ.
_AGREED_FIELDS = (
    "name",
    *(f"data.{f}" for f in ("key_column", "caption_column", "on_missing", "on_bad_rows", "demo")),
    *(f"encoder.{f}" for f in ("model", "revision", "max_length", "dtype", "output_dtype",
                               "normalize")),
    *(f"build.{f}" for f in ("latent_dtype", "parallel", "part_shards", "pull_from")),
    "coord.scope",
    *(f"loader.{f}" for f in ("global_batch_size", "seed", "crop", "shuffle", "partition",
                              "block_size", "window_blocks", "drop_last", "latents_dtype")),
    *(f"train.{f}" for f in ("steps", "learning_rate", "hidden", "seed")),
)  # fmt: skip


def _agreed_config(cfg: Config) -> dict[str, Any]:
    """The :data:`_AGREED_FIELDS` of ``cfg`` by dotted name (JSON-able values)."""
    d, out = cfg.to_dict(), {}
    for name in _AGREED_FIELDS:
        value: Any = d
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[name] = json.loads(json.dumps(value, default=str))
    return out


def _agreement_store(cfg: Config, process):
    """The store the ranks agree through (None: no job store, no agreement): the job's
    (:func:`dist.kvstore.launch_store`), else, when the launcher names the job and the
    ranks share the cache root, a folder of the job's own under it."""
    from dist.kvstore import FileJobStore, launch_job_id, launch_store

    if process.world_size <= 1:
        return None
    store = launch_store()
    if store is not None:
        return store
    job = launch_job_id()
    if job is None or cfg.coord.scope != "shared":
        return None
    return FileJobStore(cfg.cache_root / _JOBS_DIR / job, poll_interval=cfg.coord.poll_interval)


#: Under the cache root: one folder per launch (its id) holding the ranks' agreement.
_JOBS_DIR = ".jobs"


def _agree(cfg: Config, process, store, **values: Any) -> None:
    """Every rank checks that all ranks have its world size, config (and ``values``:
    the fingerprint): else :class:`dist.agreement.RankDisagreementError` (exit 2) on
    every rank, before anything is built."""
    from dist.agreement import agree

    try:
        agree(
            store, key="hf_pipeline.agree", rank=process.rank, world_size=process.world_size,
            values={**_agreed_config(cfg), **values}, timeout=cfg.coord.max_wait,
        )  # fmt: skip
    except OSError as e:
        # A read-only cache root (a published cache mounted ro) must still load: the
        # ranks' own folder there cannot be written, so they go unchecked, as before.
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        log.warning("ranks not checked for agreement: cannot write %s (%s)", e.filename, e.strerror)


def job_identity(cfg: Config, process) -> tuple[Inputs, str]:
    """The inputs and the cache fingerprint of this job, agreed on by its ranks.

    With a job store (:func:`_agreement_store`) the ranks first agree on their world
    size and config (a rank with another config would otherwise wait for inputs under a
    key nobody sets), then rank 0 resolves the inputs for all
    (:func:`resolve_job_inputs`), then they agree on the fingerprint (node-local copies
    of the inputs may differ).

    Raises:
        dist.agreement.RankDisagreementError: the ranks differ (on every rank).
    """
    inputs, fingerprint, _ = _job_identity(cfg, process)
    return inputs, fingerprint


def _job_identity(cfg: Config, process) -> tuple[Inputs, str, dict[str, Any]]:
    """:func:`job_identity`, and the encoder's identity."""
    store = _agreement_store(cfg, process)
    if store is not None:
        _agree(cfg, process, store)
    inputs, encoder = resolve_job_inputs(cfg, process)
    fingerprint = compute_fingerprint(
        cfg, [f.identity() for f in inputs.shards], inputs.metadata.identity(), encoder
    )
    if store is not None:
        _agree(cfg, process, store, fingerprint=fingerprint)
    return inputs, fingerprint, encoder


def resolve_job_inputs(cfg: Config, process) -> tuple[Inputs, dict[str, Any]]:
    """The inputs and the encoder's identity, resolved by one rank for the whole job.

    With a remote source (``hf://``, ``gs://``) and a job store (an initialised
    ``torch.distributed`` or ``jax.distributed`` job, or torchrun's agent store: see
    :func:`dist.kvstore.launch_store`), global rank 0 lists the shards, finds the metadata and
    resolves the revisions, and shares the result (with its error, if it failed) through
    the job's key-value store: 800 ranks make one set of Hub/GCS API calls, not 800 (the
    Hub answers a stampede with 429s), and every rank computes the same fingerprint.
    Local folders (and the demo) are resolved by each rank: no API calls, and a
    node-local copy is what that rank reads.
    """
    from dist.kvstore import JobStore, launch_store
    from hf_pipeline.encoder.model import encoder_identity

    remote = cfg.data.shards.startswith(("hf://", "gs://"))
    store = launch_store() if remote and process.world_size > 1 else None
    if not isinstance(store, JobStore):
        return resolve_inputs(cfg), encoder_identity(cfg.encoder)
    # The fields the ranks agreed on, and the source: not the per-host paths (a
    # node-local cache_dir must not keep its ranks from meeting rank 0's key).
    config_key = hashlib.sha256(
        json.dumps([_agreed_config(cfg), cfg.data.shards, cfg.data.metadata], default=str).encode()
    ).hexdigest()[:16]
    # Every rank makes the same sequence of prepare_cache calls: the n-th call of one
    # config reads the n-th resolution, never a stale one.
    n = _RESOLUTIONS[config_key] = _RESOLUTIONS.get(config_key, 0) + 1
    key = f"hf_pipeline.inputs/{config_key}/{n}"
    if process.rank == 0:
        try:
            resolved = (resolve_inputs(cfg), encoder_identity(cfg.encoder))
        except Exception as e:
            store.set(key, pickle.dumps(("error", e)))
            raise
        store.set(key, pickle.dumps(("ok", resolved)))
        return resolved
    # Sent by rank 0 of this very job through its own store: trusted like our own code.
    kind, value = pickle.loads(store.get(key, timeout=cfg.coord.max_wait))
    if kind == "error":
        raise value
    return value


def _stage(name: str, fn, *, pools: bool = True):
    """A coordinator Stage running ``fn``; with ``pools`` (the stage joins shards), its
    ``num_proc`` pools start from a fork server of the stage's own. A stage without
    pools starts no server (its imports would cost seconds of CPU for nothing). Every
    stage runs with a short switch interval (:func:`hf_pipeline.workers.pool.quick_gil_handoff`:
    the encoder loads on a thread beside it)."""
    from dist.coordinator import Stage

    def run(ctx):
        log.info("building stage %s of %s", name, ctx.cache_dir)
        with contextlib.ExitStack() as stack:
            stack.enter_context(quick_gil_handoff())
            if pools:  # the num_proc pools: see hf_pipeline.workers.pool
                stack.enter_context(clean_workers())
            return fn(ctx)

    return Stage(name=name, build=run)


def _build_parts_together(
    cfg, inputs, fingerprint, layout, process, progress, timing, loading=None
):
    """``build.parallel: ranks``: every rank (of the job, or of the node with
    ``coord.scope: node``) builds its share of the parts on its own accelerator.

    Each part, and the caption table before them, is its own cache unit under
    ``<cache>/parts/``, built through :func:`dist.coordinator.ensure_built` under its
    builder's lease: a rank claims its own parts at once, then waits for the others
    and takes over a part whose builder died (only that part is redone). A rank builds
    its part as one builder does, in overlapped pieces (:func:`overlap_part_shards`),
    which its marker lists.

    Returns:
        Every piece of the published parts ``[(folder, info)]`` in shard order (the
        assembly takes them as parts), the caption table, and the seconds its builder
        took to write it (None from a release before them).
    """
    from dist.coordinator import ensure_built
    from hf_pipeline.build.parts import plan_parts

    local = cfg.coord.scope == "node"
    count = process.local_world_size if local else process.world_size
    me = process.local_rank if local else process.rank
    root = layout.root / "parts"
    root.mkdir(parents=True, exist_ok=True)
    # The fork server of the parts' join workers imports its libraries, and the model
    # loads, while the caption table is written (or waited for).
    with clean_workers(), _loading(loading, cfg, process) as loading:

        def captions(ctx):
            t0 = time.monotonic()
            table = _save_captions(cfg, inputs, Path(ctx.tmp_dir) / "captions.arrow")
            return {"keys": len(table), "seconds": round(time.monotonic() - t0, 3)}

        cap = ensure_built(
            root / "captions", f"{fingerprint}.captions", [_stage("captions", captions, pools=False)],
            builder=me == 0, **timing,
        )["captions"]  # fmt: skip
        captions_path = root / "captions" / cap.directory / "captions.arrow"
        shards = inputs.shards
        plans = plan_parts(len(shards), cfg.build.part_shards or -(-len(shards) // max(1, count)))

        def part_builder(plan):
            def build(ctx):
                part = shards[plan.start : plan.stop]
                pieces = _build_in_parts(
                    cfg, shards=part, part_shards=overlap_part_shards(cfg, len(part)),
                    out_dir=Path(ctx.tmp_dir), fingerprint=f"{fingerprint}-{plan.name}",
                    probe=ctx.probe, loading=loading, source=inputs.source,
                    captions_path=captions_path, progress=progress, on_phase=ctx.set_phase,
                )  # fmt: skip
                return {"pieces": [{**info, "dir": f.name} for f, info in pieces]}

            return build

        mine = [p for p in plans if p.index % count == me]
        published = {}
        for plan in mine + [p for p in plans if p.index % count != me]:
            # ".pieces": a part of an earlier release (no pieces) is never taken for one.
            marker = ensure_built(
                root / plan.name, f"{fingerprint}.{plan.name}.of{len(plans)}.pieces",
                [_stage("part", part_builder(plan))], builder=plan in mine, **timing,
            )["part"]  # fmt: skip
            published[plan.index] = _pieces(root / plan.name / marker.directory, marker.info)
    parts = [piece for p in plans for piece in published[p.index]]
    return parts, captions_path, cap.info.get("seconds")


def _published_of_name(cfg: Config) -> bool:
    """Whether a cache of ``cfg.name`` under the cache root has a ``filtered`` marker
    (any fingerprint; a listing only, nothing trusted from it)."""
    from dist.layout import marker_name

    try:
        return any(cfg.cache_root.glob(f"{glob.escape(cfg.name)}-*/{marker_name(STAGES[-1])}"))
    except OSError:
        return False


def _start_early(stack: contextlib.ExitStack, cfg: Config, process, startup, encoder_ident):
    """Start, in ``stack`` (which :func:`prepare_cache` began with the workers' fork
    server), what the join's first shard and the first embedding need beside the
    workers: the main thread's imports and the encoder's loading thread, with the
    GIL handed over quickly (:func:`hf_pipeline.workers.pool.quick_gil_handoff`).
    Returns the :class:`_EncoderLoading`.

    With ``build.parallel: ranks`` and ``device: auto`` on a CUDA host, this thread's
    current device becomes the rank's own (``cuda:<local rank>``) first: what torch
    releases on it at the end (the encoder's CUDA graphs, its page-locked buffers) then
    goes to that GPU, not GPU 0 (issue 28: ranks 1-3 opened a context on GPU 0 while
    exiting).
    """
    stack.enter_context(quick_gil_handoff())
    loading = stack.enter_context(
        _EncoderLoading(cfg, process, timeline=startup, encoder_ident=encoder_ident)
    )
    _own_device(_encoder_device(cfg, process))
    return loading


def _own_device(device: str) -> None:
    """Make ``device`` (``cuda:<n>``) this thread's current CUDA device; nothing for a
    device without an index or off CUDA."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(device)


def _loading(loading: _EncoderLoading | None, cfg: Config, process):
    """``loading`` (started by :func:`prepare_cache`, which ends it) or a new one."""
    if loading is not None:
        return contextlib.nullcontext(loading)
    return _EncoderLoading(cfg, process)


def _folder_lease(folder: Path) -> str:
    """The lease of a published part folder (``part.<lease>``: its name parses)."""
    parsed = parse_stage_dir(folder.name)
    assert parsed is not None  # the builders named it with stage_dir_name
    return parsed.lease_id


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
        UserError: bad input (its subclasses name the file or field).
        CacheWaitTimeout: the cache was not ready within ``coord.max_wait``.
        BuildFailedError: the builder failed (its error, shared with every rank).
        ReadOnlyCacheError: a read-only cache root without the markers.
    """
    from dist.coordinator import complete_markers, default_builder, ensure_built
    from dist.env import detect
    from hf_pipeline.build.startup import StartupTimeline

    check_not_bootstrapping()
    t0 = time.monotonic()
    startup = StartupTimeline()
    process = process or detect()
    ranks = cfg.build.parallel == "ranks" and not cfg.build.pull_from  # a pull downloads
    # What the join's first shard needs starts first (issue 28: it waited seconds): in
    # a process that may join shards, the fork server of the join's workers (its own
    # process imports their libraries) while the inputs are listed; stopped at once
    # if the cache turns out to be there (else with this call). Not where a cache of
    # this config's name is published already: most likely the one wanted, found
    # without the server's start (a second of CPU).
    early = contextlib.ExitStack()
    if (
        not cfg.build.pull_from
        and cfg.build.effective_num_proc > 1
        and (ranks or default_builder(process, cfg.coord.scope))
        and not _published_of_name(cfg)
    ):
        early.enter_context(clean_workers())
        startup.mark("workers_starting")
    try:
        inputs, fingerprint, encoder_ident = _job_identity(cfg, process)
    except BaseException:
        early.close()
        raise
    startup.mark("identity")
    layout = CacheLayout.for_config(cfg, fingerprint)
    if not cfg.data.staging_dir:
        # One staging folder per identity: two builds of the same source on one host
        # (different configs) must not delete each other's staged shards.
        inputs = inputs.staged_in(cfg.cache_root / STAGING_DIR / fingerprint)
    our_leases: list[str] = []

    def on_event(name: str, fields: dict) -> None:
        if name == "claimed":
            our_leases.append(fields["lease_id"])

    coord = cfg.coord
    timing = {
        "poll_interval": coord.poll_interval,
        "max_wait": coord.max_wait,
        "lease_timeout": coord.lease_timeout,
        "heartbeat_interval": coord.heartbeat_interval,
        "on_event": on_event,
        "process": process,
    }
    from datasets import utils as ds_utils

    bars_were_on = ds_utils.is_progress_bar_enabled()
    if not progress:
        ds_utils.disable_progress_bars()
    try:
        # Whether this process joins shards: then the encoder starts loading now, and
        # the workers' fork server goes on (see _start_early); else it stops.
        joins = (
            not cfg.build.pull_from
            and complete_markers(layout.root, fingerprint, STAGES[:1]) is None
            and (ranks or default_builder(process, coord.scope))
        )
        if not joins:
            early.close()
        loading = _start_early(early, cfg, process, startup, encoder_ident) if joins else None
        parts = captions = captions_seconds = None
        if ranks and complete_markers(layout.root, fingerprint, STAGES) is None:
            parts, captions, captions_seconds = _build_parts_together(
                cfg, inputs, fingerprint, layout, process, progress, timing, loading
            )
        builder = _Builder(
            cfg, inputs, fingerprint, progress, process=process, parts=parts,
            captions_path=captions, captions_seconds=captions_seconds,
            loading=loading, startup=startup if loading is not None else None,
        )  # fmt: skip
        stages = [
            # With the ranks' parts, converted only assembles them; the filter is in-process.
            _stage(STAGES[0], builder.converted, pools=parts is None),
            _stage(STAGES[1], builder.filtered, pools=False),
        ]
        if cfg.build.pull_from:
            from hf_pipeline.publish.pull import pulled_stages

            stages = pulled_stages(cfg, fingerprint, layout.root, stages)
        markers = ensure_built(
            layout.root,
            fingerprint,
            stages,
            builder=default_builder(process, coord.scope),
            **timing,
        )
    except OSError as exc:
        if exc.errno != errno.ENOSPC or exc.filename:
            raise
        # A full disk mid-write names no file (datasets' writers, shutil): name the cache.
        raise OSError(
            errno.ENOSPC, f"{exc.strerror or exc} (building the cache in)", str(layout.root)
        ) from exc
    finally:
        early.close()
        if bars_were_on and not progress:
            ds_utils.enable_progress_bars()
    from hf_pipeline.publish.pull import was_pulled

    stage_dirs = {name: m.directory for name, m in markers.items()}
    layout = CacheLayout(layout.root, stage_dirs)
    # A lease of ours published a stage (or a part); a builder taken over did not.
    ours = [m for m in markers.values() if m.lease_id in our_leases]
    # A piece lies in its part's published folder (part.<lease>/part-NNNNN).
    our_parts = [f for f, _ in parts or [] if _folder_lease(f.parent) in our_leases]
    return BuildResult(
        fingerprint=fingerprint,
        cache_dir=layout.root,
        report=layout.read_report(),
        built=any(not was_pulled(m) for m in ours) or bool(our_parts),
        seconds=time.monotonic() - t0,
        stage_dirs=stage_dirs,
        pulled=any(was_pulled(m) for m in ours),
    )
