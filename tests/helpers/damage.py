"""Damage a file in place, as a disk fault or a stray write would (the integrity tests)."""

from __future__ import annotations

import os
from pathlib import Path


def flip_middle_bit(path: Path, mask: int = 0x40, *, keep_mtime: bool = False) -> os.stat_result:
    """XOR the byte in the middle of ``path`` with ``mask``, in place (the same inode);
    with ``keep_mtime`` its mtime is put back (``touch -r``: only the ctime moved).
    Returns the file's ``stat`` from before."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ mask]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return st
