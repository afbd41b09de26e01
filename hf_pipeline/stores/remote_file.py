"""What a store says about one file: name, location, size, version and checksum.

:class:`RemoteFile` is what a :class:`~hf_pipeline.stores.Source` lists, what
:mod:`hf_pipeline.stores.staging` verifies a download against and what the cache fingerprint
includes. It lives apart from the sources so that staging can use it without
depending on them (the sources depend on staging).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["ChecksumKind", "RemoteFile"]

#: The checksums stores publish: ``crc32c``/``md5`` (base64, GCS), ``sha256`` (hex, Hub
#: LFS files) and ``gitsha1`` (hex git blob id, small Hub files).
ChecksumKind = Literal["crc32c", "md5", "sha256", "gitsha1"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteFile:
    """One file of a source, as the store describes it.

    Attributes:
        name: base name (``"000000-000009.pt"``).
        url: full location (local path, ``gs://bucket/obj``,
            ``hf://datasets/org/repo@<commit>/path``).
        size: bytes.
        etag: the file's content identity, what the cache fingerprint includes: GCS
            md5 (crc32c for composite objects, which have none), Hub content hash (LFS
            sha256 or git blob id), local ``xxh3_128:<hex>`` of the bytes
            (:mod:`hf_pipeline.stores.identity`; ``""`` until it is computed).
        checksum: ``"<kind>:<value>"`` the download is verified against
            (``crc32c``/``md5`` base64 for GCS, ``sha256``/``gitsha1`` hex for the
            Hub), or ``""`` when the store offers none (local).
        version: the store's version token, not part of the identity (GCS
            generation, local ``mtime_ns``): what releases before content identity
            put in the fingerprint, read only to find a cache they built.
    """

    name: str
    url: str
    size: int
    etag: str = ""
    checksum: str = ""
    version: str = ""

    def identity(self) -> tuple[str, int, str]:
        """``(name, size, etag)`` for the cache fingerprint."""
        return (self.name, self.size, self.etag)

    def legacy_identity(self) -> tuple[str, int, str]:
        """``(name, size, version token)``: the identity releases before content
        identity fingerprinted (local ``mtime_ns``, GCS generation; the Hub's was
        already its content hash)."""
        return (self.name, self.size, self.version or self.etag)
