"""A victim folder outside a cache root: what a link planted in a shared root aims at.

The security tests put a symlink where hf_pipeline keeps a folder of its own (or swap
one in while it runs) and check afterwards that the folder the link names is exactly
as it was: every entry, every byte, and every folder's mtime (a file made and removed
again still moves its folder's mtime, so "nothing written into it" is checked too).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Seconds the victim's old folder is back-dated by: older than any sweep's age limit.
OLD_S = 3 * 86400.0


def _snapshot(folder: Path) -> dict[str, object]:
    out: dict[str, object] = {".": os.lstat(folder).st_mtime_ns}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(folder).as_posix()
            st = os.lstat(p)
            if p.is_symlink():
                out[rel] = f"-> {os.readlink(p)}"
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = ("folder", st.st_mtime_ns)
    return out


class Victim:
    """A folder with a canary file and a day-old subfolder (what a sweep of old
    folders would take), snapshotted when made.

    Args:
        path: where to make it (must not exist), or an existing folder to watch as it is.
    """

    def __init__(self, path: Path):
        self.path = path
        if not path.exists():
            (path / "old").mkdir(parents=True)
            (path / "old" / "notes.txt").write_text("years of work")
            (path / "canary.txt").write_text("keep me")
            past = time.time() - OLD_S
            os.utime(path / "old", (past, past))
        self.before = _snapshot(path)

    def assert_untouched(self) -> None:
        """Nothing in it removed, replaced, added, or made and removed again."""
        after = _snapshot(self.path)
        assert after == self.before, {
            k: (self.before.get(k), after.get(k))
            for k in sorted(set(self.before) | set(after))
            if self.before.get(k) != after.get(k)
        }
