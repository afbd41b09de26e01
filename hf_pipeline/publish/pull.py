"""Pull a published cache instead of building it (``build.pull_from``).

:func:`pulled_stages` wraps the build's stages for :func:`dist.coordinator.ensure_built`,
so nothing of the protocol changes: the process that would build (rank 0, or local rank
0 with ``coord.scope: node``) runs the stage builds, the others wait exactly as for a
build. Each wrapped build asks the store once per run (the first stage's build does)
whether ``<pull_from>/<name>-<fingerprint>/`` holds a complete published cache
(:func:`hf_pipeline.publish.find.find_published`). If not, it says so in one log line and
builds as usual. If so, each stage's build downloads the files that stage's published
marker lists into the lease's own stage folder (``ctx.tmp_dir``), at the same paths
inside the stage folder, and returns the published marker's ``info`` (plus
:data:`PULLED_FROM`); the coordinator then describes the folder and publishes the local
marker like any other. Waiting ranks never talk to the store.

Downloads are :func:`~hf_pipeline.stores.staging.stage_file` calls, as for the shards:
``data.download_workers`` in parallel, each bounded by ``data.file_timeout`` and retried
``data.max_retries`` times, verified against the store's checksum, and staged in
``<cache root>/.staging/pull-<fingerprint>/`` under the file's published path: a
SIGKILLed pull resumes there (verified files are kept, a partial one continues by
range) whatever lease runs next; a pull refused for what it fetched (below) removes
it, kept only for transient failures (a store that did not answer, a kill). The pull
marks that folder first (:data:`dist.layout.WORK_MARK`: the cache it is for, its owner,
the entries it writes): ``status`` lists it, and ``clean`` removes it once no live
builder holds that cache's lease (a pull SIGKILLed and never run again). Then each
file is checked against what was published — its whole-file crc32c against the
manifest (before the download when the store's own checksum can be compared), its
size and edge checksum against its marker, and its whole-file xxh3_128 against the
marker's ``whole_checksum`` (markers of schema 2) — and
hard-linked (copied where links fail) into the stage folder. The build report is
checked (:func:`hf_pipeline.cache.layout.read_report_file`: its keys' types and bounds,
its rows adding up) before its stage is published. A file that does not match
is refused with :class:`~hf_pipeline.errors.CacheFormatError` naming it; nothing of the
stage is published. The staging folder is removed once the last stage is in place.

Content-addressed: before a file is downloaded, the complete caches under the same
cache root are searched for a file their markers list with the published size and
``whole_checksum`` (a cache sharing parts with the published one, an older copy of it).
Such a file is hard-linked into the stage folder instead (never through a symlink:
``link`` does not follow one, the path is checked with :func:`dist.safepath.join_under`),
and the *linked* file is then checked as a download is (size, edge checksum, whole-file
xxh3_128 against the published marker): on any mismatch the link is removed and the
file downloaded. The stage's :data:`PULLED_FROM` says how many files and bytes were
linked and fetched.

A later stage is pulled only over earlier local stages of the same content as the
published ones (a stage built here before, e.g. by a run without ``pull_from``, is not
mixed with a published later stage: that stage is built here too).

Every path a published marker, the manifest or the store's listing holds is checked
(:mod:`dist.safepath`) before any filesystem call, and a published marker must name a
folder of its own stage and list only files inside it
(:func:`hf_pipeline.publish.find.find_published`): a pull writes only inside the lease's
stage folder and the staging folder. (:func:`local_relpath` still maps a file outside
its marker's folder to its whole cache-relative path, for local markers.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dist.atomic import create_new
from dist.checksums import ALGORITHM, whole_checksum
from dist.coordinator import Stage, StageContext
from dist.errors import ForeignCacheFolderError, LeaseLostError
from dist.layout import WORK_MARK, work_mark_bytes
from dist.markers import FileEntry, Marker, file_checksum
from dist.safepath import UnsafePathError, check_name, check_relpath, join_under
from hf_pipeline.cache.layout import (
    REPORT_NAME,
    REPORT_STAGE,
    STAGES,
    STAGING_DIR,
    read_report_file,
)
from hf_pipeline.errors import CacheFormatError
from hf_pipeline.publish.find import PublishedCache, find_published, store_checksum_checked
from hf_pipeline.publish.manifest import MANIFEST_NAME
from hf_pipeline.stores.base import Store
from hf_pipeline.stores.factory import open_store
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.retry import Cancelled, RetryPolicy
from hf_pipeline.stores.staging import StagingFolder, checksum_of, stage_file

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import Config, DataConfig

__all__ = ["PULLED_FROM", "local_relpath", "pulled_stages", "was_pulled"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
#: What a pull writes in its staging folder (besides its mark): the published metadata
#: and the staged files (:meth:`_Puller._mark`).
_STAGING_ENTRIES = ("files", "meta")

#: Key of a pulled stage's marker ``info``: ``{"url", "files", "bytes", "fetched_bytes",
#: "resumed_bytes", "linked_files", "linked_bytes", "seconds"}`` of the pull (the rest of
#: ``info`` is the published marker's); linked: hard-linked from a local complete cache.
PULLED_FROM = "pulled_from"


def was_pulled(marker: Marker) -> bool:
    """Whether the stage ``marker`` describes was downloaded, not built here."""
    return isinstance(marker.info.get(PULLED_FROM), Mapping)


def local_relpath(marker: Marker, path: str) -> str:
    """Where a file ``marker`` lists (``path``, relative to the cache folder) goes inside
    the stage folder: its path inside the marker's folder, or, for a file outside it,
    its whole cache-relative path.

    Raises:
        UnsafePathError: ``path`` or the result is not a plain relative path
            (``converted.x//abs/path`` would leave ``/abs/path``).
    """
    parts = check_relpath(path).split("/")
    inside = parts[0] == check_name(marker.directory) and len(parts) > 1
    return "/".join(parts[1:]) if inside else path


def _content(marker: Marker) -> dict[str, tuple[int, str]]:
    """A stage's files by their place inside the stage folder: what two builds of the
    same stage must agree on, whatever their folder names."""
    return {local_relpath(marker, e.path): (e.size, e.checksum) for e in marker.files}


def pulled_stages(
    cfg: Config,
    fingerprint: str,
    cache_dir: str | os.PathLike,
    stages: Sequence[Stage],
    *,
    url: str | None = None,
    policy: RetryPolicy | None = None,
) -> list[Stage]:
    """``stages`` (same names, same order) whose builds pull from ``url`` when it holds
    the published cache of ``fingerprint``, and run the given builds otherwise.

    No I/O here: the store is asked in the first stage build that runs.

    Args:
        cfg: the configuration (``data`` supplies retries, timeouts, parallelism).
        fingerprint: the cache identity.
        cache_dir: the local cache folder (its name is the published folder's name).
        stages: the build's stages.
        url: where caches are published (default ``cfg.build.pull_from``).
        policy: override the retry policy (tests).
    """
    cache_dir = Path(cache_dir)
    puller = _Puller(
        url=url or cfg.build.pull_from,
        cache_name=cache_dir.name,
        fingerprint=fingerprint,
        stage_names=tuple(s.name for s in stages),
        data_config=cfg.data,
        staging=cfg.cache_root / STAGING_DIR / f"pull-{fingerprint}",
        policy=policy,
        cache_root=cfg.cache_root,
    )
    return [Stage(name=s.name, build=puller.stage_build(s)) for s in stages]


@dataclasses.dataclass(frozen=True)
class _Job:
    """One published file to fetch into the stage folder.

    Attributes:
        entry: the published marker's entry (cache-relative path, size, edge checksum).
        file: the store's description of it (size, store checksum).
        place: its path inside the local stage folder.
        prechecked: the store's checksum equals the manifest's (so the verified
            download is the published content; else the crc32c is computed after it).
    """

    entry: FileEntry
    file: RemoteFile
    place: str
    prechecked: bool


class _Puller:
    """The remote cache (looked up once) and the download of one stage's files."""

    def __init__(
        self,
        *,
        url: str,
        cache_name: str,
        fingerprint: str,
        stage_names: tuple[str, ...],
        data_config: DataConfig,
        staging: Path,
        policy: RetryPolicy | None,
        cache_root: Path | None = None,
    ):
        self.url = url
        self.cache_name = cache_name
        self.fingerprint = fingerprint
        self.stage_names = stage_names
        self.data_config = data_config
        self.staging = Path(staging)
        self.policy = policy or RetryPolicy.from_config(data_config)
        self._lock = threading.Lock()
        self._looked_up = False
        self._store: Store | None = None
        self._remote: PublishedCache | None = None
        self.cache_root = None if cache_root is None else Path(cache_root)
        self._copies: dict[tuple[int, str], list[Path]] | None = None
        self._marked = False

    def stage_build(self, stage: Stage):
        def build(ctx: StageContext) -> Mapping[str, Any] | None:
            self._mark(ctx)
            remote = self._refusing(self._lookup, ctx)
            if remote is None:
                # Nothing to pull: what the lookup staged (and the mark) is of no use.
                ctx.check_ownership()
                self._remove_staging()
                return stage.build(ctx)
            for name, local in ctx.markers.items():
                if _content(local) != _content(remote.markers[name]):
                    logger.warning(
                        "%s: the local stage %r is not the published one; building stage %r "
                        "here too",
                        ctx.cache_dir,
                        name,
                        stage.name,
                    )
                    return stage.build(ctx)
            info = self._refusing(lambda: self._pull_stage(remote, stage.name, ctx), ctx)
            if stage.name == self.stage_names[-1]:
                ctx.check_ownership()  # never delete what a successor may be resuming from
                self._remove_staging()
            return info

        return build

    def _mark(self, ctx: StageContext) -> None:
        """Mark the staging folder as this pull's before anything is written in it
        (:func:`dist.layout.work_mark`): ``--status`` lists it, and ``--clean`` removes
        it (only the entries named here) once no live builder holds the cache's lease.
        Kept when there (a later lease of the cache resumes in it)."""
        if self._marked:
            return
        if self._linked_staging() is None:  # never mkdir through a link
            self.staging.mkdir(parents=True, exist_ok=True)
        link = self._linked_staging()
        if link is not None:
            raise ForeignCacheFolderError(
                f"{link}: a symlink (or not a folder) where a pull stages its downloads; "
                "a pull writes and later removes there, so it never follows a link: "
                "remove it (hf_pipeline makes the folder)",
                str(link),
            )
        create_new(
            self.staging / WORK_MARK,
            work_mark_bytes(
                cache=self.cache_name,
                fingerprint=self.fingerprint,
                entries=_STAGING_ENTRIES,
                lease_id=ctx.lease_id,
                host=socket.gethostname(),
                pid=os.getpid(),
            ),
        )
        self._marked = True

    def _linked_staging(self) -> Path | None:
        """``.staging`` or ``.staging/pull-<fingerprint>`` when either is a symlink or
        not a folder (by lstat): an adversarial tester linked one to a folder of theirs,
        and the pull wrote its downloads there and removed that folder's files."""
        for folder in (self.staging.parent, self.staging, self.files_dir, self.meta_dir):
            try:
                if not stat.S_ISDIR(os.lstat(folder).st_mode):
                    return folder
            except FileNotFoundError:
                continue
        return None

    @property
    def files_dir(self) -> Path:
        """Where the published files are staged (``join_under`` checks what is below it,
        not it: :meth:`_linked_staging` does; a linked ``files`` took the downloads out)."""
        return self.staging / "files"

    @property
    def meta_dir(self) -> Path:
        """Where the markers and manifest are staged (checked as :attr:`files_dir`)."""
        return self.staging / "meta"

    def _remove_staging(self) -> None:
        """Remove this pull's staging folder: a real folder under a real ``.staging``
        only (a link in their place is left alone, never followed)."""
        if self._linked_staging() is None:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _refusing(self, step: Callable[[], _T], ctx: StageContext) -> _T:
        """``step()``; when it refuses the published cache (CacheFormatError), this pull's
        staging folder is removed first.

        What was staged is this pull's own writes (the lease is still ours: checked), of
        no use to a later pull, which must fetch a fixed store afresh. A transient failure
        (a store that did not answer, a kill) keeps it: the next pull resumes there.
        """
        try:
            return step()
        except CacheFormatError:
            with contextlib.suppress(LeaseLostError):  # a successor's now: left to it
                ctx.check_ownership()
                self._remove_staging()
            raise

    def _lookup(self) -> PublishedCache | None:
        with self._lock:
            if not self._looked_up:
                self._store = open_store(self.url, data_config=self.data_config, policy=self.policy)
                remote, why = find_published(
                    self._store,
                    self.cache_name,
                    self.fingerprint,
                    self.stage_names,
                    meta_dir=self.meta_dir,
                )
                if remote is None:
                    logger.warning(
                        "no published cache of %s at %s (%s): building it",
                        self.fingerprint,
                        self.url,
                        why,
                    )
                else:
                    logger.info("pulling the published cache %s", remote.url)
                self._remote, self._looked_up = remote, True
            return self._remote

    def _pull_stage(self, remote: PublishedCache, stage: str, ctx: StageContext) -> dict[str, Any]:
        marker = remote.markers[stage]
        try:
            places = [local_relpath(marker, e.path) for e in marker.files]
        except UnsafePathError as e:  # find_published checked them: never reached today
            raise CacheFormatError(remote.file_url(f"{stage}.json"), str(e)) from None
        if len(set(places)) != len(places):
            raise CacheFormatError(
                remote.file_url(f"{stage}.json"), "lists two files for one place in its folder"
            )
        jobs = [
            _Job(
                entry=entry,
                file=remote.files[entry.path],
                place=place,
                prechecked=store_checksum_checked(
                    remote.manifest.files[entry.path], remote.files[entry.path]
                ),
            )
            for entry, place in zip(marker.files, places, strict=True)
        ]
        t0 = time.monotonic()
        stats = FetchStats()
        linked = _Linked()
        stop = threading.Event()
        workers = max(1, min(self.data_config.download_workers, len(jobs) or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="hf_pipeline-pull") as pool:
            futures = [
                pool.submit(self._fetch, remote, stage, job, ctx, stop, stats, linked)
                for job in jobs
            ]
            try:
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
                    for f in done:
                        f.result()  # the first failure, raised here
                    ctx.check_ownership()
            except BaseException:
                stop.set()  # the others abandon their downloads (Cancelled) at once
                for f in futures:
                    f.cancel()
                raise
        if stage == REPORT_STAGE:
            # Checked before the stage is published: every later run on this root reads
            # (and prints) it, so a forged one would break them all.
            where = remote.file_url(f"{marker.directory}/{REPORT_NAME}")
            try:
                read_report_file(Path(ctx.tmp_dir) / REPORT_NAME)
            except FileNotFoundError:
                raise CacheFormatError(
                    where, f"missing: {stage}.json lists no build report"
                ) from None
            except CacheFormatError as e:
                raise CacheFormatError(where, e.reason) from None
        got = stats.as_dict()
        seconds = time.monotonic() - t0
        size = sum(e.size for e in marker.files)
        logger.info(
            "pulled stage %s: %d files, %.1f MB in %.1f s (%.1f MB fetched, %.1f MB resumed, "
            "%d files / %.1f MB linked from local caches)",
            stage, len(jobs), size / 1e6, seconds, got["bytes"] / 1e6,
            got["resumed_bytes"] / 1e6, linked.files, linked.bytes / 1e6,
        )  # fmt: skip
        return {
            **marker.info,
            PULLED_FROM: {
                "url": remote.url,
                "lease_id": marker.lease_id,
                "files": len(jobs),
                "bytes": size,
                "fetched_files": len(jobs) - linked.files,
                "fetched_bytes": got["bytes"],
                "resumed_bytes": got["resumed_bytes"],
                "linked_files": linked.files,
                "linked_bytes": linked.bytes,
                "seconds": round(seconds, 3),
            },
        }

    def _fetch(
        self,
        remote: PublishedCache,
        stage: str,
        job: _Job,
        ctx: StageContext,
        stop: threading.Event,
        stats: FetchStats,
        linked: _Linked,
    ) -> None:
        """Link one file from a local cache, or stage it (verified, resumable), check it
        and link it into the stage folder. Runs in a download thread."""
        assert self._store is not None
        if self._link_local_copy(job, ctx, linked):
            return
        # Staged under its published path: a later lease (after a kill) finds it there.
        try:
            folder = StagingFolder(
                join_under(self.files_dir, job.entry.path).parent, base=self.files_dir
            )
        except UnsafePathError as e:  # a symlink in the staging folder
            raise CacheFormatError(str(self.staging), str(e)) from None
        try:
            path = stage_file(self._store.source, job.file, folder, self.policy, stats, stop=stop)
        except Cancelled:
            return
        problem = ""
        if not job.prechecked:
            want = remote.manifest.files[job.entry.path].crc32c
            got = checksum_of(path, "crc32c")
            if got != want:
                problem = f"crc32c {got}, but {MANIFEST_NAME} says {want}"
        if not problem and file_checksum(path, job.entry.size) != job.entry.checksum:
            problem = f"its first/last MiB do not match the checksum {stage}.json lists"
        if not problem and job.entry.whole_checksum:
            # The manifest's crc32c and the store's can both be rewritten with the file;
            # the published marker's whole-file checksum is the builder's own word.
            _, whole = whole_checksum(path)
            if whole != job.entry.whole_checksum:
                # The bytes are the manifest's: the publisher's marker disagrees with the
                # data it uploaded (a damaged cache published by a release that did not
                # compare them), or both were rewritten in the store.
                problem = (
                    f"{ALGORITHM} {whole}, but {stage}.json lists {job.entry.whole_checksum} "
                    f"(its crc32c is {MANIFEST_NAME}'s: published from a damaged cache, or "
                    "changed in the store; publish it again from a cache that `hf-pipeline "
                    "verify` passes)"
                )
        if problem:
            folder.remove(job.file)  # a fixed store is fetched afresh, never trusted from here
            raise CacheFormatError(job.file.url, f"does not match what was published: {problem}")
        try:
            dest = join_under(ctx.tmp_dir, job.place)  # inside the stage folder, no symlink
        except UnsafePathError as e:
            raise CacheFormatError(str(ctx.tmp_dir), str(e)) from None
        dest.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(path, dest)

    def _local_copies(self) -> dict[tuple[int, str], list[Path]]:
        """``{(size, whole_checksum): [paths]}`` of the files the complete caches under
        the cache root list (read once per pull; only files a valid marker lists)."""
        from dist.coordinator import complete_markers
        from dist.layout import cache_mark

        with self._lock:
            if self._copies is not None:
                return self._copies
            copies: dict[tuple[int, str], list[Path]] = {}
            try:
                entries = sorted(self.cache_root.iterdir()) if self.cache_root else []
            except OSError:
                entries = []
            for cache in entries:
                fingerprint = cache_mark(cache)  # None: a dot folder, a symlink, not a cache
                if fingerprint is None:
                    continue
                markers = complete_markers(cache, fingerprint, STAGES)
                for marker in (markers or {}).values():
                    for e in marker.files:
                        if e.whole_checksum:
                            with contextlib.suppress(UnsafePathError):
                                path = join_under(cache, e.path)
                                copies.setdefault((e.size, e.whole_checksum), []).append(path)
            self._copies = copies
            return copies

    def _link_local_copy(self, job: _Job, ctx: StageContext, linked: _Linked) -> bool:
        """Hard-link a local file of the published content into place; False: none (or
        none that checks out), download it."""
        entry = job.entry
        if not entry.whole_checksum or self.cache_root is None:
            return False
        candidates = self._local_copies().get((entry.size, entry.whole_checksum), [])
        if not candidates:
            return False
        try:
            dest = join_under(ctx.tmp_dir, job.place)
        except UnsafePathError as e:
            raise CacheFormatError(str(ctx.tmp_dir), str(e)) from None
        dest.parent.mkdir(parents=True, exist_ok=True)
        for src in candidates:
            try:
                # follow_symlinks=False: a link placed in a cache is linked as a link
                # (then refused below), never followed to whatever it names.
                os.link(src, dest, follow_symlinks=False)
            except OSError:
                continue
            # What is checked is the inode now in place, not the path it came from (a
            # file swapped between a check and the link would otherwise pass).
            problem = _linked_problem(dest, entry)
            if not problem:
                linked.add(entry.size)
                return True
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
            logger.warning("local copy %s not used for %s: %s", src, job.file.url, problem)
        return False


class _Linked:
    """Files and bytes linked from local caches (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files = 0
        self.bytes = 0

    def add(self, size: int) -> None:
        with self._lock:
            self.files += 1
            self.bytes += size


def _linked_problem(path: Path, entry: FileEntry) -> str:
    """Why the file at ``path`` is not the content ``entry`` lists ("" when it is)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != entry.size:
            return f"{st.st_size} bytes, not {entry.size}"
        if file_checksum(path, entry.size) != entry.checksum:
            return "its first/last MiB do not match the published marker"
        _, whole = whole_checksum(path)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if whole != entry.whole_checksum:
        return f"{ALGORITHM} {whole}, not {entry.whole_checksum}"
    return ""


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK):
            raise
        # A filesystem without hard links: the bytes once more.
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        shutil.copyfile(src, dest)
