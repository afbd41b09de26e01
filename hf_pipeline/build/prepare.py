"""Build the cache: join captions to latents -> embed -> filter, through ``datasets``.

:func:`prepare_cache` is what every rank calls: it resolves the inputs, computes the
fingerprint and runs the two stages through :func:`dist.coordinator.ensure_built`
(exactly one process builds; each stage is published with a marker):

1. ``converted``, from parts (content-defined shard ranges with their own identity,
   stored under ``<cache_root>/.parts/`` for every later cache:
   :mod:`hf_pipeline.build.part_store`); only the parts not stored yet are built:
   a. *join* (:mod:`hf_pipeline.build.convert`) — ``Dataset.map(num_proc=build.num_proc)``
      over a part's shards: read and validate each shard, convert the latents to the
      storage dtype, mark ``nonfinite_latents``. Stored per part: every caption column
      and encoder reuses it.
   a'. *captions* (:func:`hf_pipeline.build.parts.text_part`) — the part's stored keys
      looked up in the caption table (no latent byte read). Stored per (part, caption
      table): a new caption column re-joins only these.
   b. *duplicates* (:mod:`hf_pipeline.build.accounting`) — one NumPy pass over the key
      column marks all but the first occurrence of each key (among finite rows).
   b'. *tokens* (:mod:`hf_pipeline.build.tokens`) — the captions' token ids, by the
      ``num_proc`` workers, only where the part's embedding is missing. Stored per
      (part's captions, tokenizer and ``max_length``): an encoder with the same
      tokenizer reuses them.
   c. *embed* (:mod:`hf_pipeline.build.embed_stage`) — ``Dataset.map`` in this process
      with the encoder on the accelerator over the stored token ids; only rows that will
      be kept are encoded. Stored per (part's captions, encoder): a new encoder reuses
      the rest.
   d. *assembly* (:func:`hf_pipeline.build.parts.assemble`) — hard-links every part's
      files into the stage and marks duplicates across parts.
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
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import CancelledError, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dist.atomic import write_json_atomic
from dist.safepath import own_folder
from hf_pipeline.build.accounting import (
    REASONS,
    build_report,
)
from hf_pipeline.build.parts import REASONS_FILE
from hf_pipeline.cache.layout import (
    DEMO_DATA_DIR,
    SCHEMA_VERSION,
    STAGES,
    CacheLayout,
    compute_fingerprint,
    refuse_recorded_corrupt,
    refuse_recorded_corrupt_first,
)
from hf_pipeline.config import Config
from hf_pipeline.errors import CacheFormatError
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.workers.pool import check_not_bootstrapping, clean_workers, quick_gil_handoff

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future as _Future

    from hf_pipeline.demo.generate import DemoData
    from hf_pipeline.stores import Source
    from hf_pipeline.stores.identity import HashStats, StatKey

__all__ = [
    "BuildResult",
    "REASONS",
    "job_identity",
    "prepare_cache",
    "resolve_inputs",
    "resolve_job_inputs",
]

log = logging.getLogger(__name__)

#: How many parts' token ids may be made ahead of the embedding: part k+1's and part
#: k+2's are tokenized while part k embeds (a re-embedding joins nothing, so without
#: this its wall was the sum of tokenizing and embedding). Bounded, so that the
#: tokenizing workers do not run far ahead, competing for the CPUs with the joins of a
#: scratch build.
TOKENS_LOOKAHEAD = 2


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The resolved raw inputs of a build.

    Attributes:
        source: where the shards live (listing done, identity known).
        shards: the shard files, in build order.
        metadata: the caption parquet.
        demo: the generated demo data when ``data.shards`` is ``demo``.
        hashing: what finding the local inputs' content identities cost
            (:class:`hf_pipeline.stores.identity.HashStats`; None: no local input).
    """

    source: Source
    shards: list[RemoteFile]
    metadata: RemoteFile
    demo: DemoData | None = None
    hashing: HashStats | None = None

    def staged_in(self, staging_dir: str | os.PathLike, *, base: str | os.PathLike) -> Inputs:
        """The same inputs, downloading into ``staging_dir`` (below ``base``, the cache
        root: :meth:`hf_pipeline.stores.Source.with_staging_dir`)."""
        return dataclasses.replace(
            self, source=self.source.with_staging_dir(staging_dir, base=base)
        )


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
        hashing: :meth:`hf_pipeline.stores.identity.HashStats.as_dict` of this
            process's identification of the local inputs (``{}``: none were local).
        metadata: the location of the caption parquet this process resolved.
    """

    fingerprint: str
    cache_dir: Path
    report: dict
    built: bool
    seconds: float
    stage_dirs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pulled: bool = False
    hashing: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    metadata: str = ""

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
            "hashing": dict(self.hashing),
            # The caption parquet this run resolved (discovered or data.metadata).
            "metadata": self.metadata,
            # What this run reused and built: the report's block when it built the
            # cache, zeros when it found or pulled it (it read and wrote nothing; the
            # cache's report.json keeps what its own build did).
            "reuse": (
                dict(r.get("reuse") or {})
                if self.built and not self.pulled
                else dict.fromkeys(r.get("reuse") or {}, 0)
            ),
        }


#: Demo datasets from this many rows on are generated by ``build.num_proc`` processes.
_PARALLEL_DEMO_ROWS = 100_000


def resolve_inputs(
    cfg: Config, *, progress: bool = False, known: Mapping[StatKey, str] | None = None
) -> Inputs:
    """List the shard files and find the metadata table (generating the demo if asked).

    Local files (shards, metadata) get their content identity
    (:func:`hf_pipeline.stores.identity.content_identities`): from the cache root's
    content index, else from ``known`` (the job's resolver's digests), else hashed
    (a tqdm bar with ``progress``); what that cost is ``Inputs.hashing`` and one log line.

    Safe to call from every rank at once: demo generation is atomic and idempotent, the
    index is replaced atomically.
    """
    from hf_pipeline.stores import open_source
    from hf_pipeline.stores.base import staging_place
    from hf_pipeline.stores.identity import INDEX_DIR, ContentIndex, content_identities, is_local

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
        try:
            # Real folders: the demo is written (and a loser's copy removed) there, so a
            # link someone put in the shared root is refused, never written through.
            own_folder(cfg.cache_root, DEMO_DATA_DIR)
            own_folder(cfg.cache_root, f"{DEMO_DATA_DIR}/{out.name}", create=False)
            demo = generate_demo(
                out,
                num_shards=d.num_shards,
                samples_per_shard=d.samples_per_shard,
                seed=d.seed,
                latent_dtype=d.latent_dtype,
                num_proc=cfg.build.effective_num_proc if big else 1,
            )
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # A read-only root without the demo's data: what the coordinator says of a
            # read-only root without a cache (the raw OSError named a temp file).
            from dist.coordinator import readonly_error

            raise readonly_error(
                cfg.cache_root, f" (the demo's data is generated in {DEMO_DATA_DIR}/ there)"
            ) from None
        shards_loc = str(Path(demo.shard_paths[0]).parent)
        meta_loc = str(demo.metadata_path)
    # Until the fingerprint is known (prepare_cache then stages per identity): a folder
    # per location under this config's cache root.
    staging_dir, staging_base = staging_place(shards_loc, cfg.data.staging_dir, cfg.cache_root)
    source = open_source(
        shards_loc, data_config=cfg.data, staging_dir=staging_dir, staging_base=staging_base
    )
    shards = source.list_shards()
    metadata = source.find_metadata(meta_loc)
    hashing = None
    if any(is_local(f) for f in [*shards, metadata]):
        files, hashing = content_identities(
            [*shards, metadata],
            index=ContentIndex(cfg.cache_root / INDEX_DIR),
            known=known,
            progress=progress,
        )
        shards, metadata = files[:-1], files[-1]
        log.info(
            "input identity: %d local files, %d from the index, %d hashed (%.2f GB in %.2f s, "
            "%.2f GB/s)",
            hashing.files, hashing.index_hits, hashing.hashed_files,
            hashing.hashed_bytes / 1e9, hashing.seconds, hashing.gb_per_s,
        )  # fmt: skip
    # Which parquet the captions come from, said once (discovery may have chosen it).
    log.info("metadata: %s", metadata.url)
    return Inputs(source=source, shards=shards, metadata=metadata, demo=demo, hashing=hashing)


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
        max_caption_bytes=cfg.data.max_caption_bytes,
    )
    log.info("captions: %d keys from %s", len(table), meta_path)
    return table


class _EncoderLoading:
    """This process's caption tokenizer and encoder, loading on a thread of their own:
    the tokenizer first, then the model (``.encoder``, a future), ready for the first
    embedding.

    With ``after`` (a :class:`~hf_pipeline.build.startup.StartupTimeline` event: the
    build's ``join_map``), the thread imports transformers at once if the build needs it
    (see below; beside the caption table, which runs mostly in Arrow's C++), then waits
    for that event, or for the first ask for ``.encoder``, whichever comes first (at
    most ``coord.max_wait``), before it loads the tokenizer and the model (their
    imports, transformers' modeling stack with ``torch._dynamo``, scipy and sympy, are
    most of the loading; a native model needs none of them): until the
    join's workers run, the main thread has the interpreter to itself. Without
    ``after`` it all loads at once, transformers imported on the calling thread first.
    Leaving the block before the loading began cancels it (a build that failed, or
    never needed the model, does not wait for one).

    Why transformers itself is imported before the join, and not beside it:
    ``datasets``' fingerprinting (every ``Dataset`` made, every ``map``'s start and
    end) asks ``"transformers" in sys.modules``, then ``import transformers`` and reads
    ``transformers.PreTrainedTokenizerBase``. While another thread runs transformers'
    ``__init__``, that import waits for it and then returns the module object it found
    first, which the ``__init__`` replaced in ``sys.modules`` by its lazy module: the
    attribute is missing (``AttributeError: module 'transformers' has no attribute
    'PreTrainedTokenizerBase'``, seen on the 2-CPU VM when the import started with the
    join). So every use of ``datasets`` here waits for that import first: the join at
    its start (``join_map`` runs :meth:`_fence` on the main thread) and the embedding
    when it asks for ``.encoder``. What the main thread and the loading thread both
    import otherwise (torch, ``torch.distributed``, ``datasets``) is imported on the
    calling (main) thread before the thread starts (:func:`_import_before_threads`).

    A build that needs no transformers imports none, and then nothing waits
    (:meth:`_needs_transformers`): when the model loads natively (a plain BERT such as
    all-MiniLM-L6-v2: :func:`hf_pipeline.encoder.model.native_model`, decided on the
    calling thread from the folder's config and weights header, milliseconds) and the
    tokenizer is found without it (looked up on the loading thread, where the fence
    waits for the answer). Otherwise (a tokenizer that is not BERT's and not in the
    store, or another model) it is imported as described above.

    The tokenizer is found without transformers (:meth:`found_tokenizer`) in the model
    folder itself when the model loads natively and the folder holds BERT's fast
    tokenizer (:mod:`hf_pipeline.encoder.bert_tokenizer`: all-MiniLM-L6-v2, on a cold
    root too), else in the cache root's tokenizer store when an earlier build saved
    this one (:mod:`hf_pipeline.build.tokenizer_store`): then the tokens start without
    waiting for any of this, and the model loads with that spec's pad id (no
    transformers tokenizer is loaded at all).

    A context manager: leaving it waits for the loading thread.
    """

    def __init__(
        self, cfg: Config, process, *, timeline=None, encoder_ident=None, after: str | None = None
    ):
        from hf_pipeline.build.startup import StartupTimeline
        from hf_pipeline.encoder.model import native_model

        self.timeline = timeline if timeline is not None else StartupTimeline()
        self._cfg, self._encoder_ident = cfg, encoder_ident
        self._store_lock = threading.Lock()
        self._store_looked = False
        self._store_key: str | None = None
        self._stored = None  # the StoredTokenizer found, or None
        self._private: str | None = None  # the found backend's copy, removed on leaving
        # Whether this build imports transformers (None: if no tokenizer is found without it).
        # Decided once, here (the main thread imports its modules); the encoder loads by
        # this decision, so it cannot differ from the one the fence was set by.
        native = self._native = native_model(cfg.encoder)
        self._needs: bool | None = None if not isinstance(native, str) else True
        if isinstance(native, str):
            log.debug("encoder: transformers loads the model: %s", native)
        _import_before_threads(timeline, transformers=after is None and self._needs_transformers())
        self._max_wait = cfg.coord.max_wait
        self._imported = threading.Event()  # set: transformers' import ended (or skipped)
        self._go = threading.Event()  # set: load (the event, an ask, or leaving)
        self._left_unused = False  # the block ended before anything asked to load
        self._started = time.monotonic()  # when the loading began (after the wait)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hf_pipeline-encoder-load")
        if after is None:
            self._imported.set()
            self._go.set()
        else:
            self._pool.submit(self._import_transformers)
            self.timeline.when(after, self._fence)
        self.tokenizer = self._pool.submit(self._load_tokenizer, cfg)
        self._encoder = self._pool.submit(self._load_encoder, cfg, process, encoder_ident)

    @property
    def encoder(self) -> _Future:
        """The encoder (a future). Asking starts the loading if it still waits, and
        waits for transformers' import (see the class docstring)."""
        self._fence()
        return self._encoder

    def _fence(self) -> None:
        """Let the loading go on, and wait until transformers is imported whole: after
        this, ``datasets`` may fingerprint on this thread.

        Raises:
            TimeoutError: the import took more than ``coord.max_wait``.
        """
        self._go.set()
        if not self._imported.wait(timeout=self._max_wait):
            raise TimeoutError(
                f"the encoder's loading thread did not import transformers within "
                f"coord.max_wait ({self._max_wait:.0f} s)"
            )

    def _needs_transformers(self) -> bool:
        """Whether this build imports transformers at all: for the tokenizer (not found
        without it: :meth:`found_tokenizer`) or for the model (not one that loads natively:
        :func:`hf_pipeline.encoder.model.native_model`). Decided once, before anything
        imports it: without it, ``datasets`` never looks for it (no fence needed)."""
        if self._needs is None:
            self._needs = self.found_tokenizer() is None
        return self._needs

    def _import_transformers(self) -> None:
        try:
            if self._needs_transformers():
                # What datasets' pickler reads (see the class docstring).
                from transformers import PreTrainedTokenizerBase  # noqa: F401

                self.timeline.mark("transformers")
        finally:  # a failed import is not in sys.modules: nothing half-made is left
            self._imported.set()

    def _load_tokenizer(self, cfg: Config):
        if not self._go.wait(timeout=self._max_wait):
            log.info("encoder: nothing asked for it in %.0f s; loading it", self._max_wait)
        if self._left_unused:
            raise CancelledError("the build ended before it needed the encoder")
        self._started = time.monotonic()
        self.timeline.mark("encoder_loading")
        from hf_pipeline.encoder.model import CaptionTokenizer, WorkerTokenizer

        stored = self.found_tokenizer()
        if stored is not None:  # the same ids and pad id, without transformers
            return WorkerTokenizer(stored.spec)
        tokenizer = CaptionTokenizer(cfg.encoder)
        self.timeline.mark("tokenizer")
        self.timeline.note("tokenizer", "transformers")
        return tokenizer

    def found_tokenizer(self):
        """The :class:`~hf_pipeline.build.tokenizer_store.StoredTokenizer` of this config
        found without transformers, or None (then the tokenizer loads through
        transformers, and :meth:`save_tokenizer` stores it). With the model loading
        natively, the model folder's own tokenizer when it is BERT's
        (:func:`~hf_pipeline.build.tokenizer_store.folder_tokenizer`: nothing stored,
        nothing to store); else the one an earlier build saved under the cache root.
        Looked up once, by whichever thread asks first; thread-safe."""
        with self._store_lock:
            if not self._store_looked:
                self._store_looked = True
                self._stored, source = self._find_tokenizer()
                if self._stored is not None:
                    self.timeline.mark("tokenizer")
                    self.timeline.note("tokenizer", source)
            return self._stored

    def _find_tokenizer(self):
        """:meth:`found_tokenizer`'s look-up: (the tokenizer or None, where it came from)."""
        import tempfile

        from hf_pipeline.build.tokenizer_store import (
            TOKENIZER_SPECS_DIR,
            TokenizerSpecStore,
            folder_tokenizer,
            store_key,
        )

        self._private = tempfile.mkdtemp(prefix="hf_pipeline-tokenizer-")
        if not isinstance(self._native, str):  # the same decision as the model's
            found = folder_tokenizer(self._cfg.encoder, self._private)
            if not isinstance(found, str):
                return found, "native"
            log.info("tokenizer: not read natively: %s", found)
        self._store_key = store_key(self._cfg.encoder, self._encoder_ident)
        if self._store_key is None:
            return None, None
        store = TokenizerSpecStore(self._cfg.cache_root / TOKENIZER_SPECS_DIR)
        stored = store.load(self._store_key, self._private, max_length=self._cfg.encoder.max_length)
        return stored, "store"

    def save_tokenizer(self, spec, tokenizer_key: str) -> None:
        """Store ``spec`` (exported from the tokenizer transformers loaded, whose token
        units' key is ``tokenizer_key``) for later builds, when it has a store key and
        its files did not change while it loaded."""
        from hf_pipeline.build.tokenizer_store import (
            TOKENIZER_SPECS_DIR,
            TokenizerSpecStore,
            store_key,
        )

        self.found_tokenizer()  # the key from before the load
        if self._store_key is None or spec is None:
            return
        if store_key(self._cfg.encoder, self._encoder_ident) != self._store_key:
            log.info("tokenizer store: the tokenizer's files changed while it loaded: not saved")
            return
        store = TokenizerSpecStore(self._cfg.cache_root / TOKENIZER_SPECS_DIR)
        self.timeline.note("tokenizer_saved", store.save(self._store_key, spec, tokenizer_key))

    def _load_encoder(self, cfg: Config, process, encoder_ident):
        return _encoder(
            cfg, process, self.tokenizer, self._started, self.timeline, encoder_ident,
            native=self._native,
        )  # fmt: skip

    def __enter__(self) -> _EncoderLoading:
        return self

    def __exit__(self, *exc) -> None:
        if not self._go.is_set():
            self._left_unused = True
            self._go.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._private is not None:
            import shutil

            shutil.rmtree(self._private, ignore_errors=True)


def _import_before_threads(timeline=None, *, transformers: bool = True) -> None:
    """Import on this (the main) thread what the build's threads and the main thread
    both import or read from ``sys.modules``: torch (which the join needs anyway, for
    the first shard's header), ``torch.distributed``, ``datasets`` and, with
    ``transformers``, transformers' tokenizer base class (without: the loading thread
    imports it, and the join waits for it, see :class:`_EncoderLoading`). Another
    thread's import in progress leaves a partial module in ``sys.modules``, where the
    doorbell looks (``torch.distributed.is_available``): seen on a 4xH200 host, ``no
    torch.distributed doorbell, polling only: partially initialized module
    'torch.distributed' has no attribute 'is_available'`` (issue 28). The fork server
    imports its own meanwhile."""
    import datasets
    import torch
    import torch.distributed  # noqa: F401

    if transformers:
        from transformers import PreTrainedTokenizerBase  # noqa: F401

    del torch, datasets
    if timeline is not None:
        timeline.mark("imports")


def _encoder(
    cfg: Config, process, tokenizer, started: float, timeline=None, encoder_ident=None,
    *, native=None,
):  # fmt: skip
    """The encoder of this process: with ``build.parallel: ranks`` and ``device: auto``,
    each rank of a node on its own GPU (``cuda:<local rank>``). Its ``load_seconds``
    also count the ``tokenizer`` loaded before it and the loading's whole span since
    ``started`` (``ready``)."""
    tokenizer_seconds = time.monotonic() - started  # the tokenizer loaded first
    from hf_pipeline.encoder.model import TextEncoder, check_folder_unchanged, describe_device

    enc_cfg = dataclasses.replace(cfg.encoder, device=_encoder_device(cfg, process))
    encoder = TextEncoder(enc_cfg, tokenizer=tokenizer.result(), native=native)
    check_folder_unchanged(enc_cfg)  # what loaded is what the fingerprint names
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

        key = compile_artifacts_key(enc_cfg, encoder_ident, encoder.device, backend=encoder.backend)
        shared = CompileArtifacts(cfg.cache_root / COMPILE_ARTIFACTS_DIR, key)
    encoder.warm_up_shared(shared)
    encoder.load_seconds = {
        "tokenizer": round(tokenizer_seconds, 3),
        **encoder.load_seconds,
        "ready": round(time.monotonic() - started, 3),
    }
    if timeline is not None:
        timeline.note("encoder_backend", encoder.backend)
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

    ``parts`` (``build.parallel: ranks``): the parts the ranks built or found
    (:func:`_ensure_parts`); the ``converted`` stage then only assembles them. Otherwise
    it finds or builds every part itself, with the coordinator's ``timing``.
    """

    def __init__(
        self,
        cfg: Config,
        inputs: Inputs,
        fingerprint: str,
        progress: bool,
        *,
        process=None,
        parts: BuiltParts | None = None,
        timing: Mapping[str, Any] | None = None,
        loading: _EncoderLoading | None = None,
        startup=None,
        encoder_ident: Mapping[str, Any],
    ):
        self.cfg = cfg
        self.encoder_ident = encoder_ident  # the build's, resolved once
        self.inputs = inputs
        self.fingerprint = fingerprint
        self.progress = progress
        self.process = process
        self.parts = parts
        self.timing = dict(timing or {})
        self.loading = loading  # started by prepare_cache (None: by _ensure_parts)
        self.startup = startup  # prepare_cache's StartupTimeline (None: not reported)

    def converted(self, ctx) -> dict[str, Any]:
        """Stage 1: the parts (built by the ranks, or here: only those the store does not
        hold yet, :func:`_ensure_parts`), assembled: hard links, the duplicates across
        parts and the final drop reasons (:mod:`hf_pipeline.build.parts`)."""
        from hf_pipeline.build.captions import CaptionTable
        from hf_pipeline.build.convert import check_one_dtype
        from hf_pipeline.build.linked import (
            check_linked,
            linked_files,
            recorded_entries,
            remember_linked,
        )
        from hf_pipeline.build.parts import assemble
        from hf_pipeline.stores.identity import INDEX_DIR, ContentIndex

        tmp = Path(ctx.tmp_dir)
        built = self.parts
        if built is None:  # one builder: every part is ours
            built = _ensure_parts(
                self.cfg, self.inputs, self.fingerprint, self.process, self.progress,
                self.timing, count=1, me=0, on_phase=ctx.set_phase, loading=self.loading,
                startup=self.startup, encoder_ident=self.encoder_ident,
            )  # fmt: skip
        ctx.check_ownership()
        # Each part kept its own shards to one dtype; across parts, checked here.
        check_one_dtype([i for _, i in built.parts], self.inputs.shards)
        table = CaptionTable.open(str(built.captions_path))
        # The linked files go into the marker as their units recorded them, never as a
        # checksum of what the disk holds now; the units this run did not make are
        # checked first (a part damaged since it was published is refused here): read
        # whole unless the content index vouches for their stat (hf_pipeline.build.linked).
        reused = [
            folder
            for folders, part in built.parts
            for folder, unit in zip(folders, ("join", "text", "embed"), strict=True)
            if (part.get("reused") or {}).get(unit) is not False
        ]
        files = linked_files(tmp, Path(ctx.cache_dir), built.parts, reused=reused)
        index = ContentIndex(self.cfg.cache_root / INDEX_DIR)
        checked = check_linked(files, index=index)
        info = assemble(tmp, built.parts, table=table, probe=ctx.probe)
        remember_linked(files, checked, index=index)
        ctx.recorded.update(recorded_entries(files))
        startup = {} if self.startup is None else {"startup": self.startup.as_dict()}
        return {
            **info, "seconds_captions": built.captions_seconds,
            "reuse": {**built.reuse, **checked.report()}, **startup,
            "metadata": self.inputs.metadata.url,
        }  # fmt: skip

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


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


_RESOLUTIONS: dict[str, int] = {}  # resolutions of each config so far, this process

#: The config fields every rank of a job must have equal (:func:`_agree`): what the
#: cache holds, how the ranks split the build, and the sample order and model they
#: train. Not the per-host ones (paths, worker counts, devices, prefetching): node-local
#: copies and caches legitimately differ.
_AGREED_FIELDS = (
    "name",
    *(f"data.{f}" for f in ("key_column", "caption_column", "max_caption_bytes", "on_missing",
                            "on_bad_rows", "demo")),
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
    from dist.kvstore import JOBS_DIR, FileJobStore, launch_job_id, launch_store

    if process.world_size <= 1:
        return None
    store = launch_store()
    if store is not None:
        return store
    job = launch_job_id()
    if job is None or cfg.coord.scope != "shared":
        return None
    return FileJobStore(
        cfg.cache_root / JOBS_DIR / job, poll_interval=cfg.coord.poll_interval, base=cfg.cache_root
    )


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


def job_identity(cfg: Config, process, *, progress: bool = False) -> tuple[Inputs, str]:
    """The inputs and the cache fingerprint of this job, agreed on by its ranks.

    With a job store (:func:`_agreement_store`) the ranks first agree on their world
    size and config (a rank with another config would otherwise wait for inputs under a
    key nobody sets), then rank 0 resolves the inputs for all
    (:func:`resolve_job_inputs`), then they agree on the fingerprint (node-local copies
    of the inputs may differ). A cache built by a release before content identity
    (:func:`_earlier_release_fingerprint`) is found under its old fingerprint.

    Raises:
        dist.agreement.RankDisagreementError: the ranks differ (on every rank).
    """
    inputs, fingerprint, _ = _job_identity(cfg, process, progress=progress)
    return inputs, fingerprint


def _job_identity(
    cfg: Config, process, *, progress: bool = False
) -> tuple[Inputs, str, dict[str, Any]]:
    """:func:`job_identity`, and the encoder's identity."""
    store = _agreement_store(cfg, process)
    if store is not None:
        _agree(cfg, process, store)
    inputs, encoder = resolve_job_inputs(cfg, process, progress=progress)
    fingerprint = compute_fingerprint(
        cfg, [f.identity() for f in inputs.shards], inputs.metadata.identity(), encoder
    )
    fingerprint = _earlier_release_fingerprint(cfg, inputs, encoder, fingerprint)
    if store is not None:
        _agree(cfg, process, store, fingerprint=fingerprint)
    return inputs, fingerprint, dict(encoder)


def _earlier_release_fingerprint(
    cfg: Config, inputs: Inputs, encoder: Mapping[str, Any], fingerprint: str
) -> str:
    """``fingerprint``, or the fingerprint an earlier release gave these inputs when
    only that one names a complete cache under the cache root.

    Releases before content identity fingerprinted local files by their mtime and GCS
    objects by their generation (:meth:`RemoteFile.legacy_identity`); releases before
    the captions had files of their own fingerprinted under schema 1
    (:data:`hf_pipeline.cache.layout.SCHEMA_VERSION`). Such a cache holds these very
    inputs (as long as those tokens did not change, a touch, a re-upload) and every
    reader reads its layout, so an upgrade reuses it rather than rebuilding; a new
    identity (a touch, another caption column) is then built once under the current
    fingerprint, which then stays.
    """
    from dist.coordinator import complete_markers
    from dist.layout import marker_name

    # Markers present: the content cache (ensure_built checks them); only their absence
    # (the first start after an upgrade, or a new identity) is worth a look further.
    here = CacheLayout.for_config(cfg, fingerprint).root
    if all((here / marker_name(s)).exists() for s in STAGES):
        return fingerprint
    from hf_pipeline.encoder.model import earlier_encoder_identity

    shards, meta = [f.identity() for f in inputs.shards], inputs.metadata.identity()
    legacy = [f.legacy_identity() for f in inputs.shards], inputs.metadata.legacy_identity()
    encoders: list[tuple[Mapping[str, Any], int | None]] = [(encoder, None)]
    older = earlier_encoder_identity(cfg.encoder)
    if older is not None:  # a local model folder: its path and names/sizes, then
        encoders.append(older)
    candidates = {
        compute_fingerprint(cfg, *ids, enc, schema=schema): changed
        for enc, changed in encoders
        for schema in ((1, SCHEMA_VERSION) if changed is not None else (1,))
        for ids in ((shards, meta), legacy)
    }
    first = next(iter(candidates))
    for earlier, model_changed in candidates.items():  # Hub: their identity was their content
        if earlier == fingerprint:
            continue
        markers = complete_markers(CacheLayout.for_config(cfg, earlier).root, earlier, STAGES)
        if markers and model_changed is not None and model_changed >= _built_ns(markers):
            log.info(
                "not using the cache %s of an earlier release: a file of the model folder "
                "changed since it was built (its embeddings may not be this model's)",
                CacheLayout.for_config(cfg, earlier).root,
            )
            continue
        if markers:
            log.info(
                "using the cache %s built by an earlier release (fingerprint of schema 1%s; "
                "the current fingerprint is %s)",
                CacheLayout.for_config(cfg, earlier).root,
                ", over mtimes/generations" if earlier != first else "", fingerprint,
            )  # fmt: skip
            return earlier
    return fingerprint


def _built_ns(markers: Mapping[str, Any]) -> int:
    """When the build of a cache with these markers started (ns since the epoch)."""
    return int(min(m.started_at for m in markers.values()) * 1e9)


def resolve_job_inputs(
    cfg: Config, process, *, progress: bool = False
) -> tuple[Inputs, dict[str, Any]]:
    """The inputs and the encoder's identity, resolved by one rank for the whole job.

    With a remote source (``hf://``, ``gs://``) and a job store (an initialised
    ``torch.distributed`` or ``jax.distributed`` job, or torchrun's agent store: see
    :func:`dist.kvstore.launch_store`), global rank 0 lists the shards, finds the metadata and
    resolves the revisions, and shares the result (with its error, if it failed) through
    the job's key-value store: 800 ranks make one set of Hub/GCS API calls, not 800 (the
    Hub answers a stampede with 429s), and every rank computes the same fingerprint.
    Local folders (and the demo) are resolved by each rank: no API calls, and a
    node-local copy is what that rank reads. Their content is hashed once per job: with
    a job store, rank 0 resolves first and shares its digests (JSON) by the files'
    stat; another rank takes a digest for a file of the very same stat, from the cache
    root's content index or from rank 0, and hashes only what neither knows (a
    node-local copy). Without a job store each rank consults the index itself.
    """
    from dist.kvstore import JobStore, launch_store

    remote = cfg.data.shards.startswith(("hf://", "gs://"))
    store = launch_store() if process.world_size > 1 else None
    if not isinstance(store, JobStore):
        return resolve_inputs(cfg, progress=progress), _encoder_identity(cfg)
    # The fields the ranks agreed on, and the source: not the per-host paths (a
    # node-local cache_dir must not keep its ranks from meeting rank 0's key).
    config_key = hashlib.sha256(
        json.dumps([_agreed_config(cfg), cfg.data.shards, cfg.data.metadata], default=str).encode()
    ).hexdigest()[:16]
    # Every rank makes the same sequence of prepare_cache calls: the n-th call of one
    # config reads the n-th resolution, never a stale one.
    n = _RESOLUTIONS[config_key] = _RESOLUTIONS.get(config_key, 0) + 1
    if not remote:
        return _local_job_inputs(cfg, process, store, f"{config_key}/{n}", progress), (
            _encoder_identity(cfg)
        )
    key = f"hf_pipeline.inputs/{config_key}/{n}"
    if process.rank == 0:
        try:
            resolved = (resolve_inputs(cfg, progress=progress), _encoder_identity(cfg))
        except Exception as e:
            store.set(key, pickle.dumps(("error", e)))
            raise
        store.set(key, pickle.dumps(("ok", resolved)))
        return resolved
    # Sent by rank 0 of this very job through its own store: trusted like our own code.
    kind, value = pickle.loads(store.get(key, timeout=cfg.coord.max_wait))
    if kind == "error":
        raise value
    inputs, encoder = value
    return dataclasses.replace(inputs, hashing=None), encoder  # rank 0 hashed, not this one


def _encoder_identity(cfg: Config) -> dict[str, Any]:
    """The encoder's identity, a local model folder's file digests remembered by the
    cache root's content index (:func:`hf_pipeline.encoder.model.encoder_identity`)."""
    from hf_pipeline.encoder.model import encoder_identity
    from hf_pipeline.stores.identity import INDEX_DIR

    return encoder_identity(cfg.encoder, cfg.cache_root / INDEX_DIR)


def _local_job_inputs(cfg: Config, process, store, key: str, progress: bool) -> Inputs:
    """Local inputs, hashed by rank 0 for the job (:func:`resolve_job_inputs`)."""
    from dist.markers import ForeignJSONError, parse_json
    from hf_pipeline.stores.identity import digests_of

    key = f"hf_pipeline.digests/{key}"
    if process.rank == 0:
        try:
            inputs = resolve_inputs(cfg, progress=progress)
        except Exception as e:
            store.set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            raise
        digests = digests_of([*inputs.shards, inputs.metadata])
        store.set(key, json.dumps({"digests": [[*k, v] for k, v in digests.items()]}).encode())
        return inputs
    raw = store.get(key, timeout=cfg.coord.max_wait)
    known: dict[StatKey, str] = {}
    try:
        doc = parse_json(raw, path=f"job store key {key}")
    except ForeignJSONError as e:
        log.warning("%s: hashing the inputs here", e)
        doc = {}
    listed = doc.get("digests") if isinstance(doc, dict) else None
    for row in listed if isinstance(listed, list) else []:
        if (
            isinstance(row, list) and len(row) == 7 and isinstance(row[0], str)
            and all(type(v) is int for v in row[1:6])
            and isinstance(row[6], str) and re.fullmatch(r"[0-9a-f]{32}", row[6])
        ):  # fmt: skip
            known[(row[0], row[1], row[2], row[3], row[4], row[5])] = row[6]
    # Rank 0's error: this rank resolves alone and raises its own (typed) error.
    return resolve_inputs(cfg, progress=False, known=known)


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


@dataclasses.dataclass(frozen=True)
class BuiltParts:
    """Every part of a build, found in the store or built (:func:`_ensure_parts`).

    Attributes:
        parts: each part's published folders (join, text, embedding) and info, in shard
            order (what :func:`hf_pipeline.build.parts.assemble` takes).
        captions_path: the caption table the parts' captions came from.
        captions_seconds: the seconds its builder took to write it.
        reuse: the report's ``reuse`` block (:func:`_reuse`).
        markers: the parts' markers (joins, texts and embeddings).
    """

    parts: list[tuple[tuple[Path, ...], dict[str, Any]]]
    captions_path: Path
    captions_seconds: float | None
    reuse: dict[str, Any]
    markers: list[Any]


def _built(marker, fingerprint: str, since: float) -> bool:
    """Whether this run built a stored unit: its marker says it was built for
    ``fingerprint`` and published since ``since`` (the wall clock when this run began
    looking at the store). A unit built for the same fingerprint by an earlier run (a
    cache removed by ``hf-pipeline clean`` and built again, or an attempt that died)
    was reused by this one: it read no shard and wrote no byte of it."""
    return marker.info.get("built_for") == fingerprint and marker.finished_at >= since


def _reuse(
    fingerprint: str,
    since: float,
    joins: list,
    texts: list,
    embeds: list,
    tokens: list | None = None,
) -> dict[str, Any]:
    """What this run reused from the part store and what it wrote: a stored unit is
    *built* when this run made it (:func:`_built`; by this process or by another rank
    of the build), else *reused*. The joins built are the only ones that read latent
    shards and write latent bytes; a text built re-joined a part's captions (from its
    stored keys). ``tokens``: the token ids units of the parts whose embedding was
    missing (the others need none)."""

    built_joins = [m for m in joins if _built(m, fingerprint, since)]
    counts: dict[str, int] = {}
    for kind, markers in (("texts", texts), ("tokens", tokens or []), ("embeddings", embeds)):
        built = sum(_built(m, fingerprint, since) for m in markers)
        counts |= {f"{kind}_built": built, f"{kind}_reused": len(markers) - built}
    return {
        "parts": len(joins),
        "joins_built": len(built_joins),
        "joins_reused": len(joins) - len(built_joins),
        **counts,
        "shards_read": sum(int(m.info.get("shards", 0)) for m in built_joins),
        "latent_bytes_written": sum(int(m.info.get("latent_bytes", 0)) for m in built_joins),
    }


def _short(unit_id: str) -> str:
    """A unit's ``datasets`` fingerprint prefix: ``datasets`` refuses one longer than 64
    characters, suffixes included (``-rows_00000_of_00016`` with ``num_proc`` workers)."""
    return hashlib.sha256(unit_id.encode()).hexdigest()[:32]


def _stored_text(part, table, rows_files):
    """``part`` with the captions to use: the ``text`` unit stored under this build's
    caption table, else one stored under another whose marker's ``captions_digest``
    equals the digest of the part's keys (``rows_files``, its published latents: the key
    column only) in ``table`` (the same captions: the same rows), else (none) this
    build's, to be built."""
    from dist.coordinator import complete_markers as unit_markers
    from hf_pipeline.build.part_store import caption_digest
    from hf_pipeline.build.parts import read_keys

    if unit_markers(part.text_dir, part.text_id, ["text"]) is not None:
        return part
    digest = None
    for folder in sorted(part.store.glob(f"text-{part.part}-*")):
        captions = folder.name[len(f"text-{part.part}-") :]
        other = dataclasses.replace(part, captions=captions)
        markers = unit_markers(folder, other.text_id, ["text"]) if folder.is_dir() else None
        if markers is None:
            continue
        if digest is None:
            digest = caption_digest(table, read_keys(rows_files))
        if markers["text"].info.get("captions_digest") == digest:
            return other
    return part


def _derivable_tokens(part, family: str, max_length: int) -> Iterator[tuple[Path, int]]:
    """The stored token ids of ``part``'s captions by the same tokenizer (``family``:
    :func:`hf_pipeline.build.tokens.tokenizer_family`) at another ``max_length``, best
    first, as (published folder, its ``max_length``): a longer one (every row derives
    from it: the shortest of those), else the longest shorter one (the rows it may have
    cut are tokenized again). Each is read whole against its marker before it is
    yielded (:func:`dist.inventory.verify_cache`): the derived ids are copied from it,
    and a flip past its first and last MiB, which the edge check of a reused unit
    misses, went into the new cache (outside tester); a damaged one is skipped."""
    from dist.coordinator import complete_markers as unit_markers
    from dist.inventory import verify_cache

    found: list[tuple[Path, int, str]] = []
    for folder in sorted(part.store.glob(f"tokens-{part.text_id}-*")):
        unit_id = folder.name[len("tokens-") :]
        if folder == part.tokens_dir or not folder.is_dir():
            continue
        markers = unit_markers(folder, unit_id, ["tokens"])
        if markers is None:
            continue
        info = markers["tokens"].info.get("tokens")
        if not isinstance(info, dict) or info.get("family") != family:
            continue
        length = info.get("max_length")
        if not isinstance(length, int) or isinstance(length, bool) or length == max_length:
            continue
        found.append((folder, length, markers["tokens"].directory))
    # Longer ones first, each side nearest first.
    for folder, length, directory in sorted(
        found, key=lambda f: (f[1] < max_length, abs(f[1] - max_length))
    ):
        problems = verify_cache(folder, ["tokens"]).problems
        if problems:
            log.warning("%s: not deriving token ids from it (%s)", folder, problems[0])
            continue
        yield folder / directory, length


def _planned_parts(
    cfg: Config, inputs: Inputs, encoder_ident: Mapping[str, Any]
) -> tuple[list[Any], bool]:
    """The parts of the build (:func:`hf_pipeline.build.part_store.stored_parts`), and
    whether some embedding is not stored under this caption table yet (else no model
    is needed)."""
    from dist.coordinator import complete_markers as unit_markers
    from hf_pipeline.build.part_store import stored_parts

    planned = stored_parts(
        cfg, shards=inputs.shards, metadata=inputs.metadata.identity(),
        encoder=encoder_ident,
    )  # fmt: skip
    return planned, any(unit_markers(p.embed_dir, p.embed_id, ["embed"]) is None for p in planned)


def _check_reused(
    unit_dir: Path, unit_id: str, kind: str, marker, fingerprint: str, since: float
) -> None:
    """A stored unit this build did not make is checked before it goes into a new cache:
    each listed file's size and its first and last MiB against the unit's marker
    (``dist.markers.file_checksum``; a flip deep inside a larger file is left to
    ``hf-pipeline verify`` of the caches that link it). A unit damaged on disk since it
    was published would otherwise be linked as it is, and the new cache's marker would
    certify the damaged bytes.

    Raises:
        CacheFormatError: the unit's files differ from its marker.
    """
    from dist.layout import marker_name
    from dist.markers import check_marker

    if _built(marker, fingerprint, since):
        return  # made by this run: described as it was published
    path = unit_dir / marker_name(kind)
    _, why = check_marker(path, fingerprint=unit_id, base_dir=unit_dir, stage=kind, verify=True)
    if why is not None:
        raise CacheFormatError(
            str(path),
            f"the stored part {unit_dir.name} is damaged ({why}); every cache "
            "that links it is too (`hf-pipeline verify` marks them): build again, "
            "the build retires a damaged stored part and builds that part anew",
        )


def _ensure_parts(
    cfg, inputs, fingerprint, process, progress, timing, *, count: int, me: int, on_phase=None,
    loading: _EncoderLoading | None = None, startup=None, encoder_ident: Mapping[str, Any],
    since: float | None = None,
) -> BuiltParts:  # fmt: skip
    """Find or build every part of the build in the part store
    (:mod:`hf_pipeline.build.part_store`): the caption table, then per part its join
    (latents), its text (captions, from the join's keys), its token ids (where its
    embedding is missing: the tokenizer then loads first) and its embedding, each a
    cache unit of its own built through
    :func:`dist.coordinator.ensure_built`. ``count`` builders share the work (``me`` is
    this one; 1 and 0 for one builder): each claims its own parts at once
    (``index % count == me``), then waits for the others and takes over a unit whose
    builder died (only that unit is redone). A unit already stored is reused as it is.

    The embedding of part k runs on a thread while part k+1 joins (the accelerator
    and the ``num_proc`` workers at once); the token ids of the parts after it (at most
    :data:`TOKENS_LOOKAHEAD`) are made on a thread of their own meanwhile. A failure of
    any of the three stops the others (at their next batch) and is raised. The model
    loads only when some embedding is missing, the join workers' fork server starts
    only when some join is. ``loading``:
    the encoder :func:`prepare_cache` started loading early (it ends it), used when
    some embedding is missing; ``startup``: its timeline, where the first join marks
    ``join_map`` and ``first_shard``. ``since``: the wall clock when the job began
    (:func:`prepare_cache`, before its ranks agree), else now: a unit published for this
    fingerprint from then on was built by this run (:func:`_built`), by this rank or by
    another rank of the job.
    """
    from concurrent.futures import FIRST_EXCEPTION, Future
    from concurrent.futures import wait as wait_futures

    from dist.coordinator import complete_markers as unit_markers
    from dist.coordinator import ensure_built, retire_damaged
    from hf_pipeline.build.captions import CaptionTable
    from hf_pipeline.build.part_store import (
        caption_digest,
        captions_id,
        store_dir,
        tokenizer_key,
    )
    from hf_pipeline.build.parts import (
        BuildStopped,
        StoppableProbe,
        embed_part,
        join_info,
        join_part,
        part_files,
        read_keys,
        text_part,
    )
    from hf_pipeline.build.tokens import (
        TokenizerPool,
        derive_part,
        tokenize_part,
        tokenizer_family,
    )
    from hf_pipeline.encoder.model import TokenizerSpec

    # Units published from now on for this fingerprint were built by this run (_built).
    since = time.time() if since is None else since
    store = store_dir(cfg.cache_root)
    # A real folder: a link someone put in the shared root would take the parts (and
    # the coordinator's removals in them) to its target.
    own_folder(cfg.cache_root, store.name)
    shards = inputs.shards
    planned, need_embed = _planned_parts(cfg, inputs, encoder_ident)
    with contextlib.ExitStack() as stack:
        # The fork server of the joins' workers imports its libraries, and the model
        # loads, while the caption table is written (or waited for).
        stack.enter_context(clean_workers())
        # The encoder: the one prepare_cache started loading early (it ends it), else
        # loading from the start when an embedding is missing at once, else from the
        # first one found missing later (a unit stored when planned, then found invalid).
        stack_lock = threading.Lock()

        def enter(context):
            """``stack.enter_context``, from any thread (the tokens' thread starts the
            pool, the embedding's may start the encoder's loading)."""
            with stack_lock:
                return stack.enter_context(context)

        early = loading
        box: list[_EncoderLoading | None] = [None]
        if need_embed:
            box[0] = early if early is not None else enter(_EncoderLoading(cfg, process))
        loading_lock = threading.Lock()

        def encoder():
            """The encoder (a future) of the loading in ``box``, started on first need."""
            with loading_lock:
                if box[0] is None:
                    box[0] = early if early is not None else enter(_EncoderLoading(cfg, process))
                return box[0].encoder

        tokenizing: dict[str, Any] = {}  # the tokenizer's key and what the workers load

        def tokenizer() -> tuple[str, Any]:
            """The tokenizer's key and what :func:`tokenize_part` takes (a spec the
            workers load; the tokenizer itself without a Rust backend): the one found
            without transformers (the model folder's, or the one an earlier build
            stored under the cache root), at once; else exported once from the
            loading's tokenizer (loaded before the model), and stored."""
            if not tokenizing:
                import tempfile

                if box[0] is None:
                    encoder()  # starts the loading (nothing else to look the tokenizer up in)
                assert box[0] is not None
                stored = box[0].found_tokenizer()
                if stored is not None:  # no wait for transformers (issue 28)
                    tokenizing.update(key=stored.key, spec=stored.spec)
                    return tokenizing["key"], tokenizing["spec"]
                encoder()  # starts the loading if it still waits (the tokenizer first)
                tok = box[0].tokenizer.result(timeout=cfg.coord.max_wait)
                folder = enter(tempfile.TemporaryDirectory(prefix="hf_pipeline-tokenizer-"))
                spec = tok.export(folder)
                tokenizing.update(key=tokenizer_key(tok), spec=spec if spec is not None else tok)
                box[0].save_tokenizer(spec, tokenizing["key"])
            return tokenizing["key"], tokenizing["spec"]

        def token_pool() -> TokenizerPool | None:
            """The build's tokenizing workers, started for the first part whose token
            ids are missing and reused by every later one (their tokenizer loaded once
            each); stopped when this function ends. None with ``num_proc`` 1 or a
            tokenizer no worker can load (it runs on the tokens' thread). Called on the
            tokens' thread only, as :func:`tokenizer` is."""
            if "pool" not in tokenizing:
                from hf_pipeline.build.convert import check_workers_can_start
                from hf_pipeline.encoder.model import TokenizerSpec

                spec, procs = tokenizer()[1], cfg.build.effective_num_proc
                tokenizing["pool"] = None
                if isinstance(spec, TokenizerSpec) and procs > 1:
                    check_workers_can_start(procs)
                    tokenizing["pool"] = enter(TokenizerPool(spec, num_proc=procs))
                    if box[0] is not None:
                        box[0].timeline.mark("tokens_pool")
            return tokenizing["pool"]

        def captions(ctx):
            t0 = time.monotonic()
            table = _save_captions(cfg, inputs, Path(ctx.tmp_dir) / "captions.arrow")
            return {"keys": len(table), "seconds": round(time.monotonic() - t0, 3)}

        cid = captions_id(cfg, inputs.metadata.identity())
        for attempt in range(2):
            cap = ensure_built(
                store / f"captions-{cid}", cid, [_stage("captions", captions, pools=False)],
                builder=me == 0, **timing,
            )["captions"]  # fmt: skip
            captions_path = store / f"captions-{cid}" / cap.directory / "captions.arrow"
            if attempt == 0 and not captions_path.is_file():
                # Removed since it was found (`hf-pipeline clean` that looked before this
                # build took its lease, or by hand): found again, or built again. Once
                # open, the table is memory-mapped and a removal no longer matters.
                log.warning(
                    "the caption table %s was removed while this build ran (by "
                    "`hf-pipeline clean` or by hand): building it again", captions_path.parent,
                )  # fmt: skip
                continue
            break
        table = CaptionTable.open(str(captions_path))

        def join_builder(part):
            def build(ctx):
                t_join = time.time()
                if startup is not None:
                    startup.mark("join_map", at=t_join)
                joined = join_part(
                    cfg=cfg, probe=ctx.probe, source=inputs.source,
                    shards=shards[part.plan.start : part.plan.stop],
                    out_dir=Path(ctx.tmp_dir), fingerprint=_short(part.join_id),
                    progress=progress,
                )  # fmt: skip
                first = joined.joined.timeline.get("first_shard_at")
                if startup is not None and first is not None:
                    # The first worker's first shard (wall clock, as the timeline).
                    startup.mark("first_shard", at=float(first))
                return {**join_info(joined), "builder": _me(), "built_for": fingerprint}

            return build

        def text_builder(part, join_folder: Path):
            def build(ctx):
                rows = part_files(join_folder, "rows")
                info = text_part(
                    rows, table=table, probe=ctx.probe, out_dir=Path(ctx.tmp_dir),
                    batch_rows=cfg.build.writer_batch_size,
                )  # fmt: skip
                return {
                    **info, "builder": _me(), "built_for": fingerprint,
                    # What a later build with other metadata compares (_stored_text).
                    "captions_digest": caption_digest(table, read_keys(rows)),
                    # What --clean keeps while this text is in use (dist.inventory).
                    "uses": [part.join_dir.name, f"captions-{cid}"],
                }  # fmt: skip

            return build

        stoppable: list[StoppableProbe] = []  # what the build stops when it fails
        stopped = threading.Event()  # set when it fails

        def stoppable_probe(ctx) -> StoppableProbe:
            """The unit's lease probe, which the build's failure also stops (one that
            began after the failure was seen: at once)."""
            probe = StoppableProbe(ctx.probe)
            stoppable.append(probe)
            if stopped.is_set():
                probe.stop()
            return probe

        def tokens_builder(part, text_folder: Path):
            def build(ctx):
                wall0 = time.time()  # wall clock: the timeline compares processes
                probe = stoppable_probe(ctx)
                spec = tokenizer()[1]
                captions = part_files(text_folder, "captions")
                info, family = None, None
                if isinstance(spec, TokenizerSpec):  # another max_length: derived
                    family = tokenizer_family(spec)
                    for folder, length in _derivable_tokens(part, family, spec.max_length):
                        info = derive_part(
                            part_files(folder, "tokens"), length, captions, spec=spec,
                            probe=probe, out_dir=Path(ctx.tmp_dir),
                            writer_batch_size=cfg.build.writer_batch_size,
                            threads=cfg.build.effective_num_proc,
                        )  # fmt: skip
                        if info is not None:
                            info["derived_from"] = folder.parent.name
                            break
                if info is None:
                    info = tokenize_part(
                        captions, tokenizer=spec,
                        pool=token_pool(), probe=probe, out_dir=Path(ctx.tmp_dir),
                        batch_rows=cfg.build.writer_batch_size,
                        writer_batch_size=cfg.build.writer_batch_size,
                        timeout=cfg.coord.max_wait,
                    )  # fmt: skip
                if family is not None:  # what a later max_length derives its ids from
                    info.update(family=family, max_length=int(spec.max_length))
                return {
                    "tokens": info, "builder": _me(), "built_for": fingerprint,
                    "uses": [part.text_dir.name], "wall_tokens": [wall0, time.time()],
                }  # fmt: skip

            return build

        def embed_builder(part, join_folder: Path, text_folder: Path, tokens_folder: Path | None):
            def build(ctx):
                probe = stoppable_probe(ctx)
                info = embed_part(
                    part_files(join_folder, "rows"), part_files(text_folder, "captions"),
                    cfg=cfg, probe=probe, encoder=encoder(), out_dir=Path(ctx.tmp_dir),
                    fingerprint=_short(part.embed_id),
                    on_phase=on_phase or ctx.set_phase,
                    token_files=(
                        part_files(tokens_folder, "tokens") if tokens_folder is not None else None
                    ),
                )  # fmt: skip
                uses = [part.text_dir.name]
                if tokens_folder is not None:  # what --clean keeps while this is in use
                    uses.append(part.tokens_dir.name)
                return {**info, "builder": _me(), "built_for": fingerprint, "uses": uses}

            return build

        def unit(kind: str, unit_dir: Path, unit_id: str, build, ours: bool):
            """A store unit's marker, built here or found (:func:`_check_reused` first
            when an earlier build made it). A stored unit found damaged is retired and
            built again (once), as a unit with a missing file is: the damage costs its
            own part, not the store (outside tester: the old advice, verify then clean,
            removed every intact part of the caches that linked it)."""
            stage = [_stage(kind, build, pools=False)]
            marker = ensure_built(unit_dir, unit_id, stage, builder=ours, **timing)[kind]
            if _retired_damaged(unit_dir, unit_id, kind, marker):
                marker = ensure_built(unit_dir, unit_id, stage, builder=ours, **timing)[kind]
                _check_reused(unit_dir, unit_id, kind, marker, fingerprint, since)
            return marker

        checked: dict[Path, str] = {}  # unit folder -> the published folder found sound

        def _retired_damaged(unit_dir: Path, unit_id: str, kind: str, marker) -> bool:
            """Check a stored unit as :func:`_check_reused` does; retire it when damaged
            (True). A sound one is remembered in ``checked`` (not read again)."""
            if _built(marker, fingerprint, since):
                return False  # made by this run: described as it was published
            why = retire_damaged(unit_dir, unit_id, kind)
            if why is None:
                checked[unit_dir] = marker.directory
            elif not (unit_dir / marker.directory).is_dir():
                # Its whole folder is gone: removed since this build found it, not damaged
                # (no complete cache linked it, or `clean` would have kept it).
                log.warning(
                    "the stored part %s was removed while this build ran (by `hf-pipeline "
                    "clean` or by hand): building it again", unit_dir.name,
                )  # fmt: skip
            else:
                log.warning(
                    "the stored part %s is damaged (%s): building it again; the caches "
                    "that link its files are damaged too (`hf-pipeline verify` marks them)",
                    unit_dir.name, why,
                )  # fmt: skip
            return why is not None

        # The tokens' thread takes a slot before a part's token ids, the embedding's
        # thread gives it back as that part's embedding starts: the token ids run at
        # most TOKENS_LOOKAHEAD parts ahead (both threads take the parts in one order).
        ahead = threading.Semaphore(TOKENS_LOOKAHEAD)

        def unless_stopped(wait, what: str):
            """``wait(timeout)`` (true once done) until it is done or the build stops:
            each wait here ends with the work it waits for, which ends or raises (a
            failure anywhere stops the rest: ``stopped``)."""
            while not wait(0.1):
                if stopped.is_set():
                    raise BuildStopped(f"the build stopped: {what} stops too")

        def tokens_of(part, text_folder: Path, ours: bool):
            """On the tokens' thread: the part's token ids (its unit), and the part with
            the tokenizer's key (the text it uses)."""
            unless_stopped(lambda t: ahead.acquire(timeout=t), "tokenizing")
            part = used[part.plan.index] = dataclasses.replace(part, tokenizer=tokenizer()[0])
            km = tokens[part.plan.index] = unit(
                "tokens", part.tokens_dir, part.tokens_id, tokens_builder(part, text_folder), ours
            )
            return part, km

        def tokens_then_embed(
            tokens_done: Future, join_folder: Path, text_folder: Path, ours: bool
        ):
            """On the embedding's thread: the part's token ids (made on the tokens'
            thread: ``tokens_done``, its error raised here), then its embedding."""
            unless_stopped(
                lambda t: not wait_futures([tokens_done], timeout=t).not_done, "embedding"
            )
            part, km = tokens_done.result()
            ahead.release()  # those TOKENS_LOOKAHEAD parts on may start
            build_embed = _stage(
                "embed",
                embed_builder(part, join_folder, text_folder, part.tokens_dir / km.directory),
                pools=False,
            )
            return ensure_built(
                part.embed_dir, part.embed_id, [build_embed], builder=ours, **timing
            )

        mine = [p for p in planned if p.plan.index % count == me]
        joins: dict[int, Any] = {}
        texts: dict[int, Any] = {}
        tokens: dict[int, Any] = {}  # the parts whose embedding was missing
        used: dict[int, Any] = {}  # each part with the text it uses (_stored_text)
        embeds: dict[int, Future] = {}
        tokenized: dict[int, Future] = {}
        embedder = ThreadPoolExecutor(1, thread_name_prefix="hf_pipeline-embed-parts")
        tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="hf_pipeline-tokens-parts")
        try:
            for part in mine + [p for p in planned if p.plan.index % count != me]:
                for done in [f for f in [*tokenized.values(), *embeds.values()] if f.done()]:
                    done.result()  # a part's token ids or embedding failed: stop joining
                ours = part in mine
                jm = joins[part.plan.index] = unit(
                    "join", part.join_dir, part.join_id, join_builder(part), ours
                )
                join_folder = part.join_dir / jm.directory
                # The captions: in this process, from the stored keys (no latent byte read).
                part = used[part.plan.index] = _stored_text(
                    part, table, part_files(join_folder, "rows")
                )
                tm = texts[part.plan.index] = unit(
                    "text", part.text_dir, part.text_id, text_builder(part, join_folder), ours
                )
                text_folder = part.text_dir / tm.directory
                stored = unit_markers(part.embed_dir, part.embed_id, ["embed"])
                if stored is not None and _retired_damaged(
                    part.embed_dir, part.embed_id, "embed", stored["embed"]
                ):
                    stored = None  # damaged: retired, its token ids and embedding again
                if stored is not None:
                    # Stored (and found again by ensure_built): its tokens are not needed.
                    # Should ensure_built find it invalid after all, the embedding
                    # tokenizes its captions itself (the same ids).
                    build_embed = _stage(
                        "embed", embed_builder(part, join_folder, text_folder, None), pools=False
                    )
                    embeds[part.plan.index] = embedder.submit(
                        ensure_built, part.embed_dir, part.embed_id, [build_embed],
                        builder=ours, **timing,
                    )  # fmt: skip
                else:
                    # The token ids (by the num_proc workers) on the tokens' thread, then
                    # the embedding on its own: the next part's join does not wait for
                    # them (tokenizing between two joins, on the main loop, cost a
                    # 1M-row MiniLM build 26 s of its 65 s on a 16-CPU H200 host), nor
                    # does the embedding of the part before (on the embedding's thread
                    # too, a re-embedding, which joins nothing, took the sum of both).
                    done = tokenized[part.plan.index] = tokenizer_thread.submit(
                        tokens_of, part, text_folder, ours
                    )
                    embeds[part.plan.index] = embedder.submit(
                        tokens_then_embed, done, join_folder, text_folder, ours
                    )

            # The first failure of either thread, as it happens (not in part order).
            pending: set[Future] = {*tokenized.values(), *embeds.values()}
            while pending:
                finished, pending = wait_futures(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
                for f in finished:
                    f.result()
            emb = {i: f.result()["embed"] for i, f in embeds.items()}
            for p in (used[q.plan.index] for q in planned):  # with the text it uses
                if checked.get(p.embed_dir) != emb[p.plan.index].directory:
                    _check_reused(
                        p.embed_dir, p.embed_id, "embed", emb[p.plan.index], fingerprint, since
                    )
        except BaseException:
            # Ctrl-C or a failed join, tokenizing or embedding: the token ids and the
            # embedding in flight stop at their next batch, the waits at once.
            stopped.set()
            for probe in list(stoppable):
                probe.stop()
            raise
        finally:
            for f in [*tokenized.values(), *embeds.values()]:
                f.cancel()
            # Both threads end before the stack closes the pool and the encoder.
            tokenizer_thread.shutdown(wait=True)
            embedder.shutdown(wait=True)
    parts: list[tuple[tuple[Path, ...], dict[str, Any]]] = []
    for p in (used[p.plan.index] for p in planned):
        j, t, e = joins[p.plan.index], texts[p.plan.index], emb[p.plan.index]
        k = tokens.get(p.plan.index)
        info = {**j.info, **t.info, **e.info, "id": p.join_id}
        # Its tokenizing's timeline where this build made its token ids (else null).
        made = k is not None and _built(k, fingerprint, since)
        info["tokens"] = k.info.get("tokens") if k is not None and made else None
        info["wall"] = {
            "join": j.info.get("wall_join"),
            "tokens": k.info.get("wall_tokens") if k is not None and made else None,
            "embed": e.info.get("wall_embed"),
        }
        info["reused"] = {
            unit: not _built(m, fingerprint, since) if m is not None else None
            for unit, m in (("join", j), ("text", t), ("tokens", k), ("embed", e))
        }
        folders: tuple[Path, ...] = (
            p.join_dir / j.directory, p.text_dir / t.directory, p.embed_dir / e.directory,
        )  # fmt: skip
        parts.append((folders, info))
    joins_list = [joins[p.plan.index] for p in planned]
    texts_list = [texts[p.plan.index] for p in planned]
    embeds_list = [emb[p.plan.index] for p in planned]
    tokens_list = [tokens[p.plan.index] for p in planned if p.plan.index in tokens]
    return BuiltParts(
        parts=parts,
        captions_path=captions_path,
        captions_seconds=cap.info.get("seconds"),
        reuse=_reuse(fingerprint, since, joins_list, texts_list, embeds_list, tokens_list),
        markers=[cap, *joins_list, *texts_list, *tokens_list, *embeds_list],
    )


class _QuietBars:
    """``datasets``' progress bars off from this call's first build on, when
    ``progress`` is False, and back on at its end (:meth:`restore`) if they were.

    Not before: a cache found (an index hit) builds nothing and needs no ``datasets``,
    whose import (``pandas``, ``huggingface_hub``, ``fsspec`` with it) was most of such
    a start (3 of 4 s on 2 loaded CPUs). Thread-safe.
    """

    def __init__(self, progress: bool):
        self._progress = progress
        self._were_on: bool | None = None  # None: not switched off (yet)
        self._lock = threading.Lock()

    def quiet(self) -> None:
        """Switch them off (once) unless ``progress``: a build starts."""
        if self._progress:
            return
        with self._lock:
            if self._were_on is None:
                from datasets import utils as ds_utils

                self._were_on = ds_utils.is_progress_bar_enabled()
                ds_utils.disable_progress_bars()

    def building(self, build):
        """``build`` (a stage's), switching them off first."""

        def run(ctx):
            self.quiet()
            return build(ctx)

        return run

    def restore(self) -> None:
        """Back on if :meth:`quiet` switched them off."""
        with self._lock:
            if self._were_on:
                from datasets import utils as ds_utils

                ds_utils.enable_progress_bars()
            self._were_on = None


def _published_of_name(cfg: Config) -> bool:
    """Whether a cache of ``cfg.name`` under the cache root has a ``filtered`` marker
    (any fingerprint; a listing only, nothing trusted from it)."""
    from dist.layout import marker_name

    try:
        return any(cfg.cache_root.glob(f"{glob.escape(cfg.name)}-*/{marker_name(STAGES[-1])}"))
    except OSError:
        return False


def _start_early(
    stack: contextlib.ExitStack, cfg: Config, process, startup, encoder_ident, *, joins: bool
):
    """Start, in ``stack`` (which :func:`prepare_cache` began with the workers' fork
    server), what the join's first shard and the first embedding need beside the
    workers: the main thread's imports and the encoder's loading thread, with the
    GIL handed over quickly (:func:`hf_pipeline.workers.pool.quick_gil_handoff`).
    Returns the :class:`_EncoderLoading` (:func:`_ensure_parts` embeds with it). With
    ``joins`` (some join is to be built), the loading waits for the first join's start
    (``join_map``) or the first ask for the encoder: the first shard does not wait for
    transformers.

    With ``build.parallel: ranks`` and ``device: auto`` on a CUDA host, this thread's
    current device becomes the rank's own (``cuda:<local rank>``) first: what torch
    releases on it at the end (the encoder's CUDA graphs, its page-locked buffers) then
    goes to that GPU, not GPU 0 (issue 28: ranks 1-3 opened a context on GPU 0 while
    exiting).
    """
    stack.enter_context(quick_gil_handoff())
    loading = stack.enter_context(
        _EncoderLoading(
            cfg, process, timeline=startup, encoder_ident=encoder_ident,
            after="join_map" if joins else None,
        )
    )  # fmt: skip
    _own_device(_encoder_device(cfg, process))
    return loading


def _some_join_missing(planned) -> bool:
    """Whether some of the ``planned`` parts has no join stored under its own id (one
    stored under other captions may still serve: then the loading waits for nothing
    more than the first ask for the encoder)."""
    from dist.coordinator import complete_markers as unit_markers

    return any(unit_markers(p.join_dir, p.join_id, ["join"]) is None for p in planned)


def _own_device(device: str) -> None:
    """Make ``device`` (``cuda:<n>``) this thread's current CUDA device; nothing for a
    device without an index or off CUDA."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(device)


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
        CacheFormatError: the cache found is one ``--verify`` recorded corrupt.
    """
    from dist.coordinator import complete_markers, default_builder, ensure_built
    from dist.env import detect
    from hf_pipeline.build.startup import StartupTimeline

    check_not_bootstrapping()
    t0 = time.monotonic()
    # With parallel: ranks, a part published for this fingerprint from now on was built
    # by this job: taken before the ranks agree (_agree waits for every rank), so a part
    # another rank finished before this one reached the part store still counts as built
    # by this job, not as reused (a rank that started late saw 7 reused of 6).
    started = time.time()
    startup = StartupTimeline()
    process = process or detect()
    ranks = cfg.build.parallel == "ranks" and not cfg.build.pull_from  # a pull downloads
    # What the join's first shard needs starts first (issue 28: it waited seconds): in
    # a process that may join shards, the fork server of the join's workers (its own
    # process imports their libraries) while the inputs are listed; stopped at once
    # if the cache turns out to be there (else with this call). Not where a cache of
    # this config's name is published already: most likely the one wanted, found
    # without the server's start (a second of CPU); if not (an append), it starts as
    # soon as the identity says a join is missing, still before the imports.
    early = contextlib.ExitStack()
    may_join = (
        not cfg.build.pull_from
        and cfg.build.effective_num_proc > 1
        and (ranks or default_builder(process, cfg.coord.scope))
    )
    workers_started = may_join and not _published_of_name(cfg)
    if workers_started:
        early.enter_context(clean_workers())
        startup.mark("workers_starting")
    try:
        inputs, fingerprint, encoder_ident = _job_identity(cfg, process, progress=progress)
        layout = CacheLayout.for_config(cfg, fingerprint)
        # Before anything may build: a stage --verify recorded corrupt is refused, not
        # rebuilt (a file cut short fails the build's size check, which retires it).
        refuse_recorded_corrupt_first(layout.root, fingerprint)
    except BaseException:
        early.close()
        raise
    startup.mark("identity")
    # One staging folder per identity: two builds of the same source on one host
    # (different configs) must not delete each other's staged shards, and two sources
    # whose files have the same names must not take each other's (a shared
    # data.staging_dir had both builds wait forever for a file the other had replaced).
    from hf_pipeline.stores.base import staging_root

    root, base = staging_root(cfg.data.staging_dir, cfg.cache_root)
    inputs = inputs.staged_in(root / fingerprint, base=base)
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
    bars = _QuietBars(progress)
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
        # The model loads early only when some embedding is missing from the part store;
        # after the first join's start when some join is missing too.
        planned, embeds = _planned_parts(cfg, inputs, encoder_ident) if joins else ([], False)
        join_missing = _some_join_missing(planned)
        if join_missing and may_join and not workers_started:
            # A cache of this name is published, and this one joins (an append): on 2
            # CPUs its first shard waited 3.5 s for a server started at the first join.
            early.enter_context(clean_workers())
            startup.mark("workers_starting")
        loading = (
            _start_early(early, cfg, process, startup, encoder_ident, joins=join_missing)
            if embeds
            else None
        )
        parts = None
        if ranks and complete_markers(layout.root, fingerprint, STAGES) is None:
            local = cfg.coord.scope == "node"
            bars.quiet()
            parts = _ensure_parts(
                cfg, inputs, fingerprint, process, progress, timing,
                count=process.local_world_size if local else process.world_size,
                me=process.local_rank if local else process.rank,
                loading=loading, startup=startup if loading is not None else None,
                encoder_ident=encoder_ident, since=started,
            )  # fmt: skip
        builder = _Builder(
            cfg, inputs, fingerprint, progress, process=process, parts=parts, timing=timing,
            loading=loading, startup=startup if loading is not None else None,
            encoder_ident=encoder_ident,
        )  # fmt: skip
        stages = [
            # converted assembles parts (their joins start their own pools); the filter
            # is in-process.
            _stage(STAGES[0], bars.building(builder.converted), pools=False),
            _stage(STAGES[1], bars.building(builder.filtered), pools=False),
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
            errno.ENOSPC, f"{exc.strerror or exc} while building the cache in", str(layout.root)
        ) from exc
    finally:
        early.close()
        bars.restore()
    from hf_pipeline.publish.pull import was_pulled

    # Found, but recorded corrupt by --verify: refused here as every reader would.
    refuse_recorded_corrupt(layout.root, markers)
    stage_dirs = {name: m.directory for name, m in markers.items()}
    layout = CacheLayout(layout.root, stage_dirs)
    # A lease of ours published a stage (or a part); a builder taken over did not.
    ours = [m for m in markers.values() if m.lease_id in our_leases]
    # With parallel: ranks, a part (its join or its embedding) published by a lease of ours.
    our_parts = [m for m in (parts.markers if parts else []) if m.lease_id in our_leases]
    return BuildResult(
        fingerprint=fingerprint,
        cache_dir=layout.root,
        report=layout.read_report(),
        built=any(not was_pulled(m) for m in ours) or bool(our_parts),
        seconds=time.monotonic() - t0,
        stage_dirs=stage_dirs,
        pulled=any(was_pulled(m) for m in ours),
        hashing=inputs.hashing.as_dict() if inputs.hashing is not None else {},
        metadata=inputs.metadata.url,
    )
