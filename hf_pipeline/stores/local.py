"""A local folder of shards, or a glob: files are read in place, never copied.

A listed file has no etag: its identity is its content (:mod:`hf_pipeline.stores.identity`).
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_pipeline.errors import SourceError
from hf_pipeline.stores.base import GLOB_CHARS, SHARD_SUFFIX, Source
from hf_pipeline.stores.remote_file import RemoteFile

__all__ = ["LocalSource"]


class LocalSource(Source, scheme=""):
    """A local folder of shards, or a glob. Files are read in place, never copied."""

    kind = "local"
    is_local = True

    def __init__(self, location: str, **kw: Any):
        super().__init__(location, **kw)
        loc = os.path.expanduser(location)
        self._glob = loc if GLOB_CHARS.search(loc) else os.path.join(loc, f"*{SHARD_SUFFIX}")
        self._folder = Path(loc).parent if GLOB_CHARS.search(loc) else Path(loc)
        if GLOB_CHARS.search(loc):
            self.name_glob = os.path.basename(loc)  # glob.glob does the matching
        self._unreadable: list[tuple[str, str, str]] = []

    @staticmethod
    def _file(path: Path) -> RemoteFile:
        # No etag yet: a local file's identity is its content, hashed (or found in the
        # content index) by hf_pipeline.stores.identity for the files a build uses,
        # never for every file a folder lists. The mtime is only the version token.
        st = path.stat()
        return RemoteFile(
            name=path.name, url=str(path.resolve()), size=st.st_size, version=str(st.st_mtime_ns)
        )

    def identity(self) -> list[tuple]:
        """``[(name, size, "xxh3_128:<hex>"), ...]`` of the shards: every byte hashed
        (no index; :func:`hf_pipeline.build.prepare.resolve_inputs` uses the cache
        root's)."""
        from hf_pipeline.stores.identity import ContentIndex, content_identities

        files, _ = content_identities(self.list_shards(), index=ContentIndex(None))
        return [f.identity() for f in files]

    def list_shard_folder(self) -> list[RemoteFile]:
        if not GLOB_CHARS.search(os.path.expanduser(self.location)) and not self._folder.is_dir():
            raise SourceError(self.location, "folder does not exist")
        files, unreadable = [], []
        for p in sorted(self._entries()):
            if os.path.isfile(p):
                files.append(self._file(Path(p)))
            else:
                # A shard that is named but cannot be read (a link to nothing, a folder,
                # a fifo) must never vanish from the build silently: it is a missing
                # shard, under data.on_missing.
                why = _not_a_file(p)
                unreadable.append((os.path.basename(p), os.path.abspath(p), why))
        self._unreadable = unreadable
        return files

    def _entries(self) -> list[str]:
        """The entries listed: what the glob matches, or every ``*.pt`` of the folder.

        A glob has the shell's rule (``*`` does not match a leading dot); a plain folder
        lists its hidden ``.*.pt`` entries too, as the GCS and Hub listings do, so they
        are refused with the other stray names rather than left out unseen.
        """
        if GLOB_CHARS.search(os.path.expanduser(self.location)):
            return glob.glob(self._glob)
        try:
            with os.scandir(self._folder) as it:
                return [e.path for e in it if e.name.endswith(SHARD_SUFFIX)]
        except OSError as exc:
            raise SourceError(self.location, f"cannot list folder: {exc.strerror or exc}") from None

    def unreadable_shards(self) -> list[tuple[str, str, str]]:
        return list(self._unreadable)

    # A local folder has no dataset root (as a repository or a bucket has): its parent
    # may hold anything (an old backup of the parquet), so only the shards' own folder.
    metadata_where = "next to the shards"

    def metadata_folders(self) -> Iterator[list[RemoteFile]]:
        if self._folder.is_dir():
            yield [self._file(p) for p in self._folder.iterdir() if p.is_file()]

    def owns(self, url: str) -> bool:
        return "://" not in url

    def stat(self, url: str) -> RemoteFile:
        p = Path(url).expanduser()
        if not p.is_file():
            raise SourceError(
                url, "is a directory, not a file" if p.is_dir() else "file does not exist"
            )
        return self._file(p)

    def direct_path(self, file: RemoteFile) -> Path | None:
        return Path(file.url)


_KINDS = {
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _not_a_file(path: str) -> str:
    """Why the listed entry ``path`` (``os.path.isfile`` False) cannot be read as a shard."""
    link = os.path.islink(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not link:  # gone since the listing
            return "vanished while the folder was listed"
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"dangling symlink (its target {target} does not exist)"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop (the link resolves to itself)"
        return f"unreadable {'symlink' if link else 'entry'} ({exc.strerror or exc})"
    if stat.S_ISDIR(mode):
        return f"a {'symlink to a ' if link else ''}directory, not a shard file"
    return f"not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'special file')})"
