"""What lives in a cache folder, and which folders of a cache root are caches.

One place for the naming rules that the protocol (:mod:`dist.coordinator`), the
inventory (:mod:`dist.inventory`) and readers share. A cache folder holds::

    <stage>.json                 marker of a published stage (dist.markers), created once,
                                 never overwritten (create-if-absent)
    <stage>.<lease id>/          the stage folder built under one lease; published when the
                                 marker names it, and then never changed or removed by a
                                 builder (only by ``prebuild_cache.py --clean``)
    <stage>/                     a stage folder published by hf_pipeline <= 0.1 (still read)
    <stage>.json.retired-<id>    a marker found invalid and moved aside by lease <id>
    lease, heartbeat-<id>.json   the builder's lease and heartbeat (dist.lease)
    failed-<id>.json             failure record of a lease whose build raised
    lease.<purpose>-*, *.trash-*, .<name>.<pid>.<rand>.tmp: bookkeeping in flight

A cache *root* (``$HF_HOME/datasets/hf_pipeline``) holds one folder per cache; anything
else there is a dot-folder (``.staging``, ``.demo-data``, ``.hub_listings``) and is
never a cache. A folder counts as a cache only if it holds a protocol file, so a stray
folder someone created is never listed or cleaned.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from dist.lease import LEASE_FILE

__all__ = [
    "StageDir",
    "is_cache_folder",
    "is_retired_marker",
    "marker_name",
    "parse_stage_dir",
    "retired_marker_name",
    "stage_dir_name",
]

_STAGE = r"[A-Za-z0-9][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*"
_STAGE_DIR = re.compile(rf"^(?P<stage>{_STAGE})\.(?P<lease>[0-9a-f]{{16}})$")
_LEGACY_TMP = re.compile(rf"^(?P<stage>{_STAGE})\.tmp-(?P<lease>[0-9A-Za-z]+)$")
_RETIRED = re.compile(rf"^(?P<stage>{_STAGE})\.json\.retired-[0-9a-f]+$")
_PROTOCOL_PREFIXES = (LEASE_FILE, "heartbeat-", "failed-")


@dataclasses.dataclass(frozen=True)
class StageDir:
    """A stage folder built under one lease (``converted.0123456789abcdef``)."""

    stage: str
    lease_id: str


def stage_dir_name(stage: str, lease_id: str) -> str:
    """The folder a lease builds ``stage`` in (and which its marker names if it wins)."""
    return f"{stage}.{lease_id}"


def parse_stage_dir(name: str) -> StageDir | None:
    """The stage and lease of a lease's stage folder name (also ``<stage>.tmp-<id>`` of
    hf_pipeline <= 0.1), else None."""
    m = _STAGE_DIR.match(name) or _LEGACY_TMP.match(name)
    return StageDir(m["stage"], m["lease"]) if m else None


def marker_name(stage: str) -> str:
    return f"{stage}.json"


def retired_marker_name(stage: str, lease_id: str) -> str:
    return f"{stage}.json.retired-{lease_id}"


def is_retired_marker(name: str) -> bool:
    return bool(_RETIRED.match(name))


def is_cache_folder(path: Path) -> bool:
    """Whether ``path`` (a folder directly under a cache root) is a cache: not hidden, and
    it holds a lease, heartbeat, failure record, stage folder or marker of one."""
    if path.name.startswith(".") or not path.is_dir():
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    entries = set(names)
    return any(
        n.startswith(_PROTOCOL_PREFIXES)
        or _RETIRED.match(n)
        or parse_stage_dir(n) is not None
        or (n.endswith(".json") and n[: -len(".json")] in entries)  # legacy <stage>/
        for n in names
    )
