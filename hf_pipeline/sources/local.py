"""A local folder of shards, or a glob: files are read in place, never copied."""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_pipeline.errors import SourceError
from hf_pipeline.remote_file import RemoteFile
from hf_pipeline.sources.base import GLOB_CHARS, SHARD_SUFFIX, Source

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
        st = path.stat()
        return RemoteFile(
            name=path.name, url=str(path.resolve()), size=st.st_size, etag=str(st.st_mtime_ns)
        )

    def list_shard_folder(self) -> list[RemoteFile]:
        if not GLOB_CHARS.search(os.path.expanduser(self.location)) and not self._folder.is_dir():
            raise SourceError(self.location, "folder does not exist")
        files, unreadable = [], []
        for p in sorted(glob.glob(self._glob)):
            if os.path.isfile(p):
                files.append(self._file(Path(p)))
            elif os.path.islink(p):
                # isfile() is False for a link to nothing or a loop: a shard that is
                # named but cannot be read must never vanish from the build silently.
                why = _broken_link(p)
                if why:
                    unreadable.append((os.path.basename(p), os.path.abspath(p), why))
        self._unreadable = unreadable
        return files

    def unreadable_shards(self) -> list[tuple[str, str, str]]:
        return list(self._unreadable)

    def metadata_folders(self) -> Iterator[list[RemoteFile]]:
        for folder in (self._folder, self._folder.parent):
            if folder.is_dir():
                yield [self._file(p) for p in folder.iterdir() if p.is_file()]

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


def _broken_link(path: str) -> str:
    """Why the symlink ``path`` cannot be read as a file, or "" (it points to a folder)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"dangling symlink (its target {target} does not exist)"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop (the link resolves to itself)"
        return f"unreadable symlink ({exc.strerror or exc})"
    return ""
