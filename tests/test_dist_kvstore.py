"""dist.kvstore's file store in a shared root: links put where its folders belong."""

from __future__ import annotations

import pytest

from dist.errors import ForeignCacheFolderError
from dist.kvstore import JOBS_DIR, FileJobStore
from tests.helpers.victims import Victim


def test_set_and_get_through_a_linked_root(tmp_path):
    real = tmp_path / "nfs"
    real.mkdir()
    root = tmp_path / "hf_home"
    root.symlink_to(real)  # the root may be a link (HF_HOME -> /mnt/nfs/...)
    store = FileJobStore(root / JOBS_DIR / "job-1", base=root)
    store.set("rank/0", b"{}")
    assert store.get("rank/0", timeout=1) == b"{}"
    assert (real / JOBS_DIR / "job-1").is_dir()


@pytest.mark.parametrize("level", [JOBS_DIR, f"{JOBS_DIR}/job-1"])
def test_a_symlinked_jobs_folder_is_refused_and_nothing_is_written_there(tmp_path, level):
    """`.jobs` (or a job's folder in it) linked to a folder of the user's: the ranks'
    posts were written there. Now refused in one line naming the link."""
    victim = Victim(tmp_path / "victim")
    root = tmp_path / "root"
    (root / level).parent.mkdir(parents=True, exist_ok=True)
    (root / level).symlink_to(victim.path)
    store = FileJobStore(root / JOBS_DIR / "job-1", base=root)
    with pytest.raises(ForeignCacheFolderError) as e:
        store.set("rank/0", b"{}")
    assert e.value.path == str(root / level)
    victim.assert_untouched()
