"""Cache identity (fingerprint) and on-disk layout; opening a built cache memory-mapped.

One cache is one folder ``<cache_root>/<name>-<fingerprint>/``:

```
converted/rows/data*.arrow        key, latents (Array4D 3x4x32x32), caption, drop_reason
converted/embeddings/data*.arrow  embedding (fixed-size list, D), drop_reason (final)
converted.json                    marker (dist.markers): files, sizes, row counts
filtered/indices*.arrow           uint64 physical row ids kept by the filter
filtered/report.json              the build report
filtered.json                     marker
```

All ``.arrow`` files are written by ``datasets`` (``Dataset.map``) or in its format
(the filter's indices), so a user can also open them with ``datasets``
(:func:`open_dataset`). A published cache
is never modified; a changed fingerprint means a new folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_pipeline.config import Config

__all__ = [
    "SCHEMA_VERSION",
    "STAGES",
    "DEMO_DATA_DIR",
    "HUB_LISTINGS_DIR",
    "STAGING_DIR",
    "CacheLayout",
    "compute_fingerprint",
    "open_dataset",
    "open_sample_source",
    "published_stage_dirs",
]

#: Folders of the cache root that are not caches. They start with a dot, so that
#: ``dist.inventory`` (``prebuild_cache.py --status/--clean``) never lists or cleans
#: them (see ``dist.layout``): staged downloads, the generated demo inputs, and the
#: Hub listing cache that offline rebuilds read.
STAGING_DIR = ".staging"
DEMO_DATA_DIR = ".demo-data"
HUB_LISTINGS_DIR = ".hub_listings"

#: Bump whenever the layout or the meaning of a column changes.
SCHEMA_VERSION = 1
#: Build stages, in order; each is published as a folder plus a marker.
STAGES = ("converted", "filtered")


def compute_fingerprint(
    cfg: Config,
    inputs: Sequence[Sequence[Any]],
    metadata: Sequence[Any],
    encoder: Mapping[str, Any],
) -> str:
    """The cache identity: 16 hex digits of a SHA-256 over everything that shapes the output.

    Args:
        cfg: the configuration; only output-changing fields are used (not num_proc,
            batch sizes or paths, which change speed and layout but not content).
        inputs: ``(name, size, etag)`` per shard file, in build order.
        metadata: ``(name, size, etag)`` of the caption parquet.
        encoder: :func:`hf_pipeline.embed.encoder_identity` of the encoder.

    Returns:
        The fingerprint string.
    """
    payload = {
        "schema": SCHEMA_VERSION,
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
    validated markers, as :class:`hf_pipeline.build.BuildResult` does); without it a
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
            return self.root / check_name(directory)
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
        return self.filtered / "report.json"

    def rows_files(self, converted: Path | None = None) -> list[Path]:
        """The joined rows' Arrow files, in row order (part by part)."""
        return self._part_files(converted or self.converted, "rows")

    def embedding_files(self, converted: Path | None = None) -> list[Path]:
        """The embedding files, row-aligned with :meth:`rows_files`."""
        return self._part_files(converted or self.converted, "embeddings")

    @staticmethod
    def _part_files(converted: Path, kind: str) -> list[Path]:
        # parts/part-NNNNN/<kind>/*.arrow (hf_pipeline 0.1: <kind>/*.arrow, one part)
        in_parts = sorted(converted.glob(f"parts/*/{kind}/*.arrow"))
        return in_parts or sorted(converted.joinpath(kind).glob("*.arrow"))

    def indices_files(self, filtered: Path | None = None) -> list[Path]:
        return sorted((filtered or self.filtered).glob("indices*.arrow"))

    def read_report(self) -> dict[str, Any]:
        """The build report (``report.json``); a pulled one came from a store: bounded.

        Raises:
            FileNotFoundError: no report.
            CacheFormatError: too large, too deep, malformed or not a JSON object.
        """
        from dist.markers import ForeignJSONError, load_json
        from hf_pipeline.errors import CacheFormatError

        try:
            report = load_json(self.report_path)
        except ForeignJSONError as e:
            raise CacheFormatError(e.path, e.reason) from None
        if not isinstance(report, dict):
            raise CacheFormatError(str(self.report_path), "not a JSON object")
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
                " (the file changed after it was published: run prebuild_cache.py --verify, "
                "then --clean, and build again)"
                if "checksum mismatch" in why
                else ""
            )
            raise CacheFormatError(str(path), f"not a trusted {stage} marker: {why}{hint}")
        done[stage] = marker
    if verify:
        from dist.inventory import VERIFY_RECORD, verify_findings

        found = verify_findings(root, done)
        if found:
            more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
            raise CacheFormatError(
                str(root / VERIFY_RECORD),
                f"{found[0]}{more}: this cache is corrupt (run prebuild_cache.py --clean, "
                "then build again)",
            )
    return {stage: m.directory for stage, m in done.items()}, fingerprint


def _checked(layout: CacheLayout, fingerprint: str | None) -> CacheLayout:
    """The layout that ``layout``'s markers name once :func:`published_stage_dirs` has
    checked them and every file they list: size, first and last MiB. Also for a layout
    from the build (its markers were checked for sizes only): a file damaged since its
    publication is refused here, not trained on."""
    stage_dirs, _ = published_stage_dirs(layout.root, fingerprint, verify=True)
    return CacheLayout(layout.root, stage_dirs)


def open_sample_source(layout: CacheLayout, fingerprint: str):
    """Memory-map a built cache for batch gathers (``hf_pipeline.mapped.SampleSource``).

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
    """
    from hf_pipeline.errors import CacheFormatError
    from hf_pipeline.mapped import SampleSource

    layout = _checked(layout, fingerprint)
    indices = layout.indices_files()
    if not indices:  # the filter writes one even when it keeps no row
        raise CacheFormatError(
            str(layout.filtered), "holds no filter indices (indices*.arrow): not a built cache"
        )
    rows = layout.rows_files()
    if not rows:  # the join writes one per part, empty or not
        raise CacheFormatError(
            str(layout.converted), "holds no rows files (rows/*.arrow): not a built cache"
        )
    try:
        precision = layout.read_report().get("precision") or {}
    except FileNotFoundError:
        precision = {}
    # Caches built before the report said so store float16/float32, read as they are.
    return SampleSource(
        rows,
        layout.embedding_files(),
        indices,
        fingerprint=fingerprint,
        latent_dtype=precision.get("storage_dtype"),
    )


def open_dataset(layout: CacheLayout):
    """The built cache as a plain ``datasets.Dataset`` (memory-mapped, filtered rows).

    Columns: key, latents, caption, input_ids (the caption's token ids), embedding.
    For inspection and for users who want ``datasets`` formatting; the training loader
    uses :func:`open_sample_source`. Arrow has no bfloat16: in a bfloat16 cache (report
    ``precision.storage_dtype``) ``latents`` holds the values' uint16 bits; view them with
    ``hf_pipeline.precision.from_arrow(array, "bfloat16")`` (no copy). The layout is
    checked as :func:`open_sample_source` checks it.
    """
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset, concatenate_datasets

    layout = _checked(layout, None)
    rows = concatenate_datasets([Dataset.from_file(str(p)) for p in layout.rows_files()])
    emb = concatenate_datasets([Dataset.from_file(str(p)) for p in layout.embedding_files()])
    full = concatenate_datasets(
        [rows.remove_columns("drop_reason"), emb.remove_columns("drop_reason")], axis=1
    )
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
