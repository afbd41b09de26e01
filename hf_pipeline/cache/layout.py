"""Cache identity (fingerprint) and on-disk layout; opening a built cache memory-mapped.

One cache is one folder ``<cache_root>/<name>-<fingerprint>/``:

```
converted/parts/part-NNNNN/rows/data*.arrow        key, latents (Array4D 3x4x32x32),
                                                   drop_reason (the latents' own)
converted/parts/part-NNNNN/captions/data.arrow     caption, drop_reason (before
                                                   duplicates)
converted/parts/part-NNNNN/embeddings/data*.arrow  embedding (fixed-size list, D),
                                                   input_ids, drop_reason (within the part)
converted/reasons.arrow           the final drop reason of every row (across parts)
converted.json                    marker (dist.markers): files, sizes, row counts
filtered/indices*.arrow           uint64 physical row ids kept by the filter
filtered/report.json              the build report
filtered.json                     marker
```

The three groups of a part are row-aligned. All ``.arrow`` files are written by
``datasets`` (``Dataset.map``) or in its format (the captions, the filter's indices), so
a user can also open them with ``datasets`` (:func:`open_dataset`). A published cache
is never modified; a changed fingerprint means a new folder. The parts' files are hard
links to the part store (``<cache_root>/.parts/``, :mod:`hf_pipeline.build.part_store`),
shared with every other cache built from the same parts: the latents (``rows/``) with
every cache of the same shards, whatever its caption column or encoder.

Caches of :data:`SCHEMA_VERSION` 1 keep the caption in ``rows/`` (no ``captions/``);
every reader here reads both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from dist.kvstore import JOBS_DIR
from dist.safepath import own_folder
from hf_pipeline.config import Config

__all__ = [
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "STAGES",
    "DEMO_DATA_DIR",
    "HUB_LISTINGS_DIR",
    "STAGING_DIR",
    "CacheLayout",
    "DatasetLatents",
    "compute_fingerprint",
    "dataset_view_dir",
    "open_dataset",
    "open_sample_source",
    "published_stage_dirs",
]

#: Folders of the cache root that are not caches. They start with a dot, so that
#: ``dist.inventory`` (``prebuild_cache.py --status/--clean``) never lists or cleans
#: them as caches (see ``dist.layout``): staged downloads, the generated demo inputs,
#: the Hub listing cache that offline rebuilds read, the stored parts
#: (``hf_pipeline.build.part_store``), the content index
#: (``hf_pipeline.stores.identity``), compiled encoders' artifacts
#: (``hf_pipeline.encoder.model``) and tokenizer specs
#: (``hf_pipeline.build.tokenizer_store``).
STAGING_DIR = ".staging"
DEMO_DATA_DIR = ".demo-data"
HUB_LISTINGS_DIR = ".hub_listings"
PARTS_DIR = ".parts"
INDEX_DIR = ".content-index"
COMPILE_ARTIFACTS_DIR = ".compiled"
TOKENIZER_SPECS_DIR = ".tokenizers"
#: Every folder hf_pipeline keeps in a cache root besides the caches, and what it
#: holds: a command refuses one of them (or a folder inside one) as a cache root.
ROOT_FOLDERS: Mapping[str, str] = {
    STAGING_DIR: "staged downloads",
    DEMO_DATA_DIR: "the generated demo inputs",
    HUB_LISTINGS_DIR: "Hub listings",
    PARTS_DIR: "the stored parts",
    INDEX_DIR: "the content index",
    COMPILE_ARTIFACTS_DIR: "compiled encoders",
    TOKENIZER_SPECS_DIR: "tokenizer specs",
    JOBS_DIR: "parallel builds' job records",
}

#: Bump whenever the layout or the meaning of a column changes. 2: the captions left
#: ``rows/`` for a ``captions/`` group of their own (a release that reads 1 only would
#: find no caption in a cache of 2 under the same fingerprint). A cache of 1 is still
#: found (:data:`READABLE_SCHEMA_VERSIONS`) and read.
SCHEMA_VERSION = 2
#: The schema versions whose caches this release finds by fingerprint and reads.
READABLE_SCHEMA_VERSIONS = (1, 2)
#: Build stages, in order; each is published as a folder plus a marker.
STAGES = ("converted", "filtered")
#: The build report: ``<REPORT_STAGE>.<lease>/<REPORT_NAME>``.
REPORT_STAGE, REPORT_NAME = "filtered", "report.json"


def compute_fingerprint(
    cfg: Config,
    inputs: Sequence[Sequence[Any]],
    metadata: Sequence[Any],
    encoder: Mapping[str, Any],
    *,
    schema: int = SCHEMA_VERSION,
) -> str:
    """The cache identity: 16 hex digits of a SHA-256 over everything that shapes the output.

    Args:
        cfg: the configuration; only output-changing fields are used (not num_proc,
            batch sizes or paths, which change speed and layout but not content).
        inputs: ``(name, size, etag)`` per shard file, in build order.
        metadata: ``(name, size, etag)`` of the caption parquet.
        encoder: :func:`hf_pipeline.encoder.model.encoder_identity` of the encoder.
        schema: the layout version (another than :data:`SCHEMA_VERSION`: the identity
            an earlier release gave these inputs, one of :data:`READABLE_SCHEMA_VERSIONS`).

    Returns:
        The fingerprint string.
    """
    if schema not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(f"schema must be one of {READABLE_SCHEMA_VERSIONS}, got {schema}")
    payload = {
        "schema": schema,
        "inputs": [list(map(_plain, x)) for x in inputs],
        "metadata": list(map(_plain, metadata)),
        "key_column": cfg.data.key_column,
        "caption_column": cfg.data.caption_column,
        "on_missing": cfg.data.on_missing,
        "on_bad_rows": cfg.data.on_bad_rows,
        "latent_dtype": cfg.build.latent_dtype,
        "encoder": {k: _plain(v) for k, v in sorted(encoder.items())},
        "drop_rules": [
            "nonfinite_latents",
            "no_caption",
            "empty_caption",
            "duplicate_key:keep_first_finite",
        ],
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _plain(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Paths inside one cache folder.

    Each stage is published as the folder its marker names (``converted.<lease id>/``,
    see :mod:`dist.layout`). Pass ``stage_dirs`` (stage name -> folder name, from the
    validated markers, as :class:`hf_pipeline.build.prepare.BuildResult` does); without it a
    stage's folder is read from its marker file (leniently: the folder named by a
    marker that is missing or malformed is ``<root>/<stage>``).
    """

    root: Path
    stage_dirs: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))  # a str or os.PathLike too

    @classmethod
    def for_config(cls, cfg: Config, fingerprint: str) -> CacheLayout:
        return cls(cfg.cache_root / f"{cfg.name}-{fingerprint}")

    def stage_dir(self, stage: str) -> Path:
        """The published folder of ``stage``."""
        if stage in self.stage_dirs:
            return self.root / self.stage_dirs[stage]
        from dist.markers import read_json
        from dist.safepath import UnsafePathError, check_name

        marker = read_json(self.root / f"{stage}.json")
        directory = marker.get("directory") if isinstance(marker, dict) else None
        try:  # lenient, but never a folder outside the cache ("/etc", "../x")
            return self.root / check_name(directory if isinstance(directory, str) else "")
        except UnsafePathError:
            return self.root / stage

    @property
    def converted(self) -> Path:
        return self.stage_dir("converted")

    @property
    def filtered(self) -> Path:
        return self.stage_dir("filtered")

    @property
    def report_path(self) -> Path:
        return self.stage_dir(REPORT_STAGE) / REPORT_NAME

    def listed_files(self, stage: str) -> list[Path]:
        """The files that ``stage``'s marker lists, sorted: the only files a reader reads.

        A stage folder may hold files no marker lists (``datasets`` cache files written
        beside a rows file by an older ``open_dataset(...).filter``, a stray copy): they
        are never read.

        Raises:
            CacheFormatError: the marker is missing or malformed, or names another
                folder than this layout's (``stage_dirs``).
        """
        from dist.layout import marker_name
        from dist.markers import Marker, read_json
        from hf_pipeline.errors import CacheFormatError

        path = self.root / marker_name(stage)
        try:
            raw = read_json(path)  # None: missing or malformed
            if not isinstance(raw, Mapping):
                raise TypeError(f"not a JSON object ({type(raw).__name__})")
            marker = Marker.from_dict(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheFormatError(
                str(path), f"missing or malformed: cannot list the {stage} files ({exc})"
            ) from None
        folder = self.stage_dir(stage)
        if self.root / marker.directory != folder:
            raise CacheFormatError(
                str(path), f"names the folder {marker.directory!r}, not {folder.name!r}"
            )
        return sorted(self.root / f.path for f in marker.files)

    def rows_files(self, converted: Path | None = None) -> list[Path]:
        """The joined rows' Arrow files, in row order (part by part), as the marker lists them."""
        return self._part_files(converted or self.converted, "rows")

    def embedding_files(self, converted: Path | None = None) -> list[Path]:
        """The embedding files, row-aligned with :meth:`rows_files`."""
        return self._part_files(converted or self.converted, "embeddings")

    def caption_files(self, converted: Path | None = None) -> list[Path]:
        """The caption files, row-aligned with :meth:`rows_files` ([] in a cache of
        schema 1: its captions are in the rows files)."""
        return self._part_files(converted or self.converted, "captions")

    def _part_files(self, converted: Path, kind: str) -> list[Path]:
        # parts/part-NNNNN/<kind>/*.arrow (hf_pipeline 0.1: <kind>/*.arrow, one part)
        listed = [
            p.relative_to(converted)
            for p in self.listed_files("converted")
            if converted in p.parents
        ]
        arrow = [r for r in listed if r.suffix == ".arrow"]
        in_parts = [r for r in arrow if len(r.parts) == 4 and r.parts[::2] == ("parts", kind)]
        flat = [r for r in arrow if len(r.parts) == 2 and r.parts[0] == kind]
        return [converted / r for r in (in_parts or flat)]

    def indices_files(self, filtered: Path | None = None) -> list[Path]:
        """The filter's kept-row index files, as the ``filtered`` marker lists them."""
        filtered = filtered or self.filtered
        return [
            p
            for p in self.listed_files("filtered")
            if p.parent == filtered and p.name.startswith("indices") and p.suffix == ".arrow"
        ]

    def read_report(self) -> dict[str, Any]:
        """The build report (``report.json``), checked (:func:`read_report_file`).

        Raises:
            FileNotFoundError: no report.
            CacheFormatError: too large, too deep, malformed, or not a build report.
        """
        return read_report_file(self.report_path)


def read_report_file(path: Path) -> dict[str, Any]:
    """A build report file, checked: a pulled one came from a store (bounded, and of
    the shape :func:`hf_pipeline.build.accounting.report_problem` accepts, its rows
    adding up), so that what prints or sums it never meets a forged value.

    Raises:
        FileNotFoundError: no report.
        CacheFormatError: too large, too deep, malformed, or not a build report.
    """
    from dist.markers import ForeignJSONError, load_json
    from hf_pipeline.build.accounting import report_problem
    from hf_pipeline.errors import CacheFormatError

    try:
        report = load_json(path)
    except ForeignJSONError as e:
        raise CacheFormatError(e.path, e.reason) from None
    why = report_problem(report)
    if why:
        raise CacheFormatError(str(path), f"not a valid build report: {why}")
    return report


def published_stage_dirs(
    root: Path, fingerprint: str | None, *, verify: bool = False
) -> tuple[dict[str, str], str]:
    """The stage folders that the cache's valid markers name, and its fingerprint
    (``fingerprint``, or the one its first marker states when None).

    ``verify`` also checks every listed file's edge checksum (size, first and last MiB:
    2 MiB read per file; docs/integrity.md) and refuses a cache that
    ``prebuild_cache.py --verify`` found corrupt (:func:`dist.inventory.verify_findings`).

    Raises:
        CacheFormatError: a stage marker is missing or not trusted (naming the marker
            and why), or the markers state another fingerprint than ``fingerprint``.
    """
    from dist.layout import marker_name
    from dist.markers import check_marker, derived_from_problem, read_json
    from hf_pipeline.errors import CacheFormatError

    if not root.is_dir():
        raise CacheFormatError(str(root), "cache folder does not exist")
    if fingerprint is None:
        first = root / marker_name(STAGES[0])
        stated = read_json(first)
        if not isinstance(stated, dict) or not isinstance(stated.get("fingerprint"), str):
            raise CacheFormatError(
                str(first), "missing or malformed: not a built cache (build it first)"
            )
        fingerprint = stated["fingerprint"]
    if verify:
        # Before the files' checks: a file cut short would be named by its size alone.
        refuse_recorded_corrupt_first(root, fingerprint)
    done: dict = {}
    for stage in STAGES:
        path = root / marker_name(stage)
        marker, why = check_marker(
            path, fingerprint=fingerprint, base_dir=root, stage=stage, verify=verify
        )
        if marker is not None:
            why = derived_from_problem(marker, done)
        if why is not None:
            hint = (
                " (the file changed after it was published: run hf-pipeline verify "
                f"--cache-dir {root.parent}, then hf-pipeline clean --cache-dir {root.parent}, "
                "and build again)"
                if "checksum mismatch" in why
                else ""
            )
            raise CacheFormatError(str(path), f"not a trusted {stage} marker: {why}{hint}")
        done[stage] = marker
    return {stage: m.directory for stage, m in done.items()}, fingerprint


def refuse_recorded_corrupt(root: Path, done: Mapping[str, Any]) -> None:
    """Refuse the cache at ``root`` when ``--verify`` recorded its published stages
    (``done``: stage -> valid marker) corrupt (:func:`dist.inventory.verify_findings`).
    Readers and the build (which would otherwise report it "found") both ask here.

    Raises:
        CacheFormatError: naming the record, the first finding and how to clean.
    """
    from dist.inventory import VERIFY_RECORD, verify_findings
    from hf_pipeline.errors import CacheFormatError

    found = verify_findings(root, done)
    if found:
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise CacheFormatError(
            str(root / VERIFY_RECORD),
            f"{found[0]}{more}: this cache is corrupt (run hf-pipeline clean --cache-dir "
            f"{root.parent} or scripts/prebuild_cache.py --clean --cache-dir {root.parent}, "
            "then build again)",
        )


def refuse_recorded_corrupt_first(root: Path, fingerprint: str) -> None:
    """:func:`refuse_recorded_corrupt` before any file of the cache is checked: with
    the markers of ``fingerprint`` that parse, not only those whose files check out. A
    file ``--verify`` found cut short fails a marker's size check too, after which a
    build retired and rebuilt the stage (a reader named the size): the record is the
    answer, whoever opens the cache (docs/integrity.md). Reads the markers only while
    a record is there.

    Raises:
        CacheFormatError: as :func:`refuse_recorded_corrupt`.
    """
    from dist.inventory import VERIFY_RECORD
    from dist.layout import marker_name
    from dist.markers import parse_marker

    if not os.path.lexists(root / VERIFY_RECORD):
        return
    parsed = {}
    for stage in STAGES:
        marker, _ = parse_marker(root / marker_name(stage), fingerprint=fingerprint, stage=stage)
        if marker is not None:
            parsed[stage] = marker
    refuse_recorded_corrupt(root, parsed)


def _checked(layout: CacheLayout, fingerprint: str | None) -> CacheLayout:
    """The layout that ``layout``'s markers name once :func:`published_stage_dirs` has
    checked them and every file they list: size, first and last MiB. Also for a layout
    from the build (its markers were checked for sizes only): a file damaged since its
    publication is refused here, not trained on."""
    stage_dirs, _ = published_stage_dirs(layout.root, fingerprint, verify=True)
    return CacheLayout(layout.root, stage_dirs)


def _present(files: list[Path], folder: Path, what: str) -> list[Path]:
    """``files`` (a stage's listed files of one kind) if there are some and all exist.

    Raises:
        CacheFormatError: naming ``folder``: none listed, or a listed one is gone (a
            trusted layout is not re-checked against its marker).
    """
    from hf_pipeline.errors import CacheFormatError

    gone = [p for p in files if not p.is_file()]
    if not files or gone:  # the build writes at least one of each, empty or not
        why = f"{gone[0].name}, listed in its marker, is missing" if gone else "none listed"
        raise CacheFormatError(str(folder), f"holds no {what}: {why}")
    return files


def open_sample_source(
    layout: CacheLayout | str | os.PathLike[str], fingerprint: str | None = None
):
    """Memory-map a built cache for batch gathers (``hf_pipeline.read.mapped.SampleSource``).

    Opens files read-only; safe to call from any number of processes at once. The
    latents come in the cache's storage dtype, which the build report records (a
    bfloat16 cache's uint16 bits are read as ``ml_dtypes.bfloat16``).

    Every layout (``BuildResult.layout`` or ``CacheLayout(cache_dir)``) is checked first
    (:func:`published_stage_dirs` with ``verify``): both markers present, stating
    ``fingerprint``, and every file they list as they list it, its size and its first
    and last MiB (2 MiB read per file); else a :class:`CacheFormatError` names the
    marker, the file and why (a cache without its ``filtered`` stage opened as 0 rows; a
    byte changed in a file's first MiB was trained on). Whole files are checked by
    ``prebuild_cache.py --verify`` (docs/integrity.md).
    ``fingerprint=None``: the one the markers state (a folder opened by its path).
    Only the files the markers list are read.

    Args:
        layout: the cache, as a :class:`CacheLayout` or its folder (a str or
            ``os.PathLike``, as ``GrainSource`` takes).
        fingerprint: the fingerprint the markers must state; None: theirs.

    Raises:
        CacheFormatError: not a complete cache (names the marker or file and why).
        TypeError: ``layout`` is none of those types.
    """
    from hf_pipeline.read.mapped import SampleSource

    if isinstance(layout, (str, os.PathLike)):
        layout = CacheLayout(Path(layout))
    elif not isinstance(layout, CacheLayout):
        raise TypeError(
            "open_sample_source: layout must be a CacheLayout, a str or an os.PathLike, "
            f"got {type(layout).__name__}"
        )
    if fingerprint is None:
        stage_dirs, fingerprint = published_stage_dirs(layout.root, None)
        layout = layout if layout.stage_dirs else CacheLayout(layout.root, stage_dirs)
    layout = _checked(layout, fingerprint)
    indices = _present(layout.indices_files(), layout.filtered, "filter indices (indices*.arrow)")
    rows = _present(layout.rows_files(), layout.converted, "rows files (rows/*.arrow)")
    # Caches built before the report said so store float16/float32, read as they are.
    return SampleSource(
        rows,
        layout.embedding_files(),
        indices,
        fingerprint=fingerprint,
        latent_dtype=_storage_dtype(layout),
    )


#: ``open_dataset(latents=...)`` choices (None: floats, see :func:`open_dataset`).
DatasetLatents = Literal["float32", "stored"]
_DATASET_LATENTS = typing.get_args(DatasetLatents)
#: Folder (under ``datasets``' own cache, ``HF_DATASETS_CACHE``) of the per-user views.
DATASET_VIEWS_DIR = "hf_pipeline-views"


def dataset_view_dir(layout: CacheLayout, derived_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`open_dataset` puts the view of ``layout`` and ``datasets``' derived files.

    ``<derived_dir>/<cache folder name>-<8 hex digits of its real path>``; ``derived_dir``
    defaults to ``<HF_DATASETS_CACHE>/hf_pipeline-views`` (``datasets``' per-user cache).
    """
    base, rel = _view_place(layout, derived_dir)
    return base / rel


def _view_place(layout: CacheLayout, derived_dir: str | os.PathLike | None) -> tuple[Path, str]:
    """:func:`dataset_view_dir` as (the user's folder, the project's folders below it):
    ``derived_dir`` and the view's name, or ``HF_DATASETS_CACHE`` and
    ``hf_pipeline-views/<name>``."""
    import datasets

    real = os.path.realpath(layout.root)
    name = f"{layout.root.name}-{hashlib.sha256(real.encode()).hexdigest()[:8]}"
    if derived_dir is not None:
        return Path(derived_dir), name
    return Path(datasets.config.HF_DATASETS_CACHE), f"{DATASET_VIEWS_DIR}/{name}"


def _linked(view: Path, root: Path, files: Sequence[Path]) -> list[str]:
    """Symlinks in ``view`` to ``files`` (inside ``root``), same relative paths.

    ``datasets`` writes a dataset's derived files (``cache-*.arrow`` of ``.map``,
    ``.filter``, ``.sort``, ``.shuffle``, ``.select``...) beside the dataset's own files
    (``os.path.dirname(cache_files[0])``); opened through these links, they land in the
    view, never in the published cache. Reads go through the links to the same pages.
    """
    out = []
    for f in files:
        rel = f.relative_to(root)
        link = view / rel
        target = os.path.realpath(f)
        try:
            if os.readlink(link) == target:
                out.append(str(link))
                continue
        except OSError:  # absent (or not a link): make it
            pass
        # Real folders in the view: the links (and datasets' derived files) go there.
        own_folder(view, rel.parent.as_posix() if rel.parent.parts else "")
        # Another process may make the same link at once: each makes its own and renames
        # it into place (atomic), so a reader never sees a half-made or missing link.
        tmp = link.with_name(f".{link.name}.{os.getpid()}.{secrets.token_hex(4)}")
        os.symlink(target, tmp)
        os.replace(tmp, link)
        out.append(str(link))
    return out


def _bfloat16_to_float32(batch: dict[str, list]) -> dict[str, Any]:
    # bfloat16 is the top half of a float32: shifting the bits up is exact.
    import numpy as np

    bits = np.asarray(batch["latents"], dtype=np.uint16)
    return {"latents": (bits.astype(np.uint32) << 16).view(np.float32)}


def open_dataset(
    layout: CacheLayout,
    *,
    latents: DatasetLatents | None = None,
    derived_dir: str | os.PathLike | None = None,
):
    """The built cache as a plain ``datasets.Dataset`` (memory-mapped, filtered rows).

    Columns: key, latents, caption, input_ids (the caption's token ids), embedding
    (the caption from the ``captions/`` files, or from the rows files of a cache of
    schema 1).
    For inspection and for users who want ``datasets`` formatting; the training loader
    uses :func:`open_sample_source`. The rows are the files the markers list, nothing
    else in the folders. The layout is checked as :func:`open_sample_source` checks it.

    The published cache is never written: the dataset reads the cache's files through
    symlinks in a per-user folder (:func:`dataset_view_dir`), so the files that
    ``datasets`` derives with default arguments (``.map``, ``.filter``, ``.sort``,
    ``.shuffle``, ``.select``...: it puts them beside a dataset's own files) go there,
    even when the cache is read-only.

    Args:
        layout: the cache (``BuildResult.layout`` or ``CacheLayout(cache_dir)``).
        latents: ``None``: float values in every ``with_format`` (a float16 or float32
            cache as stored, no copy; a bfloat16 cache, which Arrow cannot hold, as
            float32 — exact — written once into the view folder, 2x the stored latents'
            size, and reused by later calls). ``"float32"``: float32 for any cache
            (same copy for float16 caches). ``"stored"``: the column as stored,
            no copy: uint16 bits in a bfloat16 cache
            (``bits.astype(np.uint16).view(ml_dtypes.bfloat16)`` views them).
        derived_dir: folder for the views (default ``<HF_DATASETS_CACHE>/hf_pipeline-views``);
            it must lie outside the cache.

    Raises:
        CacheFormatError: the cache's markers or files are not trusted.
        ValueError: an unknown ``latents``, or ``derived_dir`` inside the cache.
    """
    import numpy as np
    import pyarrow as pa
    from datasets import Array4D, Dataset, Features, concatenate_datasets

    if latents is not None and latents not in _DATASET_LATENTS:
        raise ValueError(f"latents must be None or one of {_DATASET_LATENTS}, got {latents!r}")
    layout = _checked(layout, None)
    view_base, view_rel = _view_place(layout, derived_dir)
    view = view_base / view_rel
    real_root = Path(os.path.realpath(layout.root))
    if Path(os.path.realpath(view)).is_relative_to(real_root):
        raise ValueError(f"derived_dir must lie outside the cache {layout.root}, got {view}")
    # The view and hf_pipeline-views are the project's folders, written into (links,
    # datasets' derived files): real folders, never a link someone put in a shared
    # HF_HOME (refused). derived_dir or HF_DATASETS_CACHE is the user's, a link or not.
    own_folder(view_base, view_rel)
    rows_files = _present(layout.rows_files(), layout.converted, "rows files (rows/*.arrow)")
    emb_files = layout.embedding_files()
    storage = _storage_dtype(layout)
    rows_parts = []
    for path in _linked(view, layout.root, rows_files):
        part = Dataset.from_file(path).remove_columns("drop_reason")
        stored = part.features["latents"]
        want = (
            "float32"
            if latents == "float32" or (latents is None and storage == "bfloat16")
            else None
        )
        if want is not None and stored.dtype != want:
            if storage == "bfloat16":
                convert = _bfloat16_to_float32
            else:  # float16 -> float32: exact

                def convert(batch):
                    return {"latents": np.asarray(batch["latents"], dtype=np.float32)}

            # Into the view folder (beside the linked file), reused while the file is.
            lat = part.select_columns(["latents"]).map(
                convert,
                batched=True,
                features=Features({"latents": Array4D(shape=stored.shape, dtype=want)}),
                desc=f"latents -> {want}",
            )
            others = [c for c in part.column_names if c != "latents"]
            part = concatenate_datasets([part.select_columns(others), lat], axis=1)
        rows_parts.append(part)
    rows = concatenate_datasets(rows_parts)
    columns = [rows]
    if "caption" not in rows.column_names:  # schema 2: the captions' own files
        cap_files = _present(
            layout.caption_files(), layout.converted, "caption files (captions/*.arrow)"
        )
        caps = concatenate_datasets(
            [Dataset.from_file(p) for p in _linked(view, layout.root, cap_files)]
        )
        columns.append(caps.select_columns(["caption"]))
    emb = concatenate_datasets(
        [Dataset.from_file(p) for p in _linked(view, layout.root, emb_files)]
    )
    # The token ids: in the embedding files (they belong to the encoder); in the rows
    # files of caches built before parts had their own identity.
    drop = ["drop_reason"] + (["input_ids"] if "input_ids" in rows.column_names else [])
    full = concatenate_datasets([*columns, emb.remove_columns(drop)], axis=1)
    full = full.select_columns(["key", "latents", "caption", "input_ids", "embedding"])
    idx_tables = [
        pa.ipc.open_stream(pa.memory_map(str(p))).read_all() for p in layout.indices_files()
    ]
    # The filter writes uint64 row ids; Dataset.select's contiguous fast path (kept rows
    # forming one run, e.g. nothing dropped) indexes with them and raises IndexError.
    indices = (
        np.concatenate([t.column("indices").to_numpy() for t in idx_tables]).astype(np.int64)
        if idx_tables
        else np.zeros(0, np.int64)
    )
    return full.select(indices)


def _storage_dtype(layout: CacheLayout) -> str | None:
    """The latents' storage dtype the build report records (None: caches built before it
    said; they store float16 or float32)."""
    try:
        return (layout.read_report().get("precision") or {}).get("storage_dtype")
    except FileNotFoundError:
        return None
