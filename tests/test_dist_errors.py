"""dist's errors as a torch DataLoader worker hands them back: torch rebuilds a worker's
exception as ``type(e)(message)`` (one string) and raises RuntimeError when that call
fails, so a user's ``except CacheWaitTimeout`` would miss it. Each error keeps its type
and its message through that rebuild, and still pickles with all its attributes."""

from __future__ import annotations

import pickle

import pytest

from dist.agreement import RankDisagreementError
from dist.env import EnvironmentConflictError
from dist.errors import (
    BuildFailedError,
    CacheWaitTimeout,
    ForeignCacheFolderError,
    LeaseLostError,
    ReadOnlyCacheError,
)
from dist.markers import ForeignJSONError
from dist.safepath import UnsafePathError
from tests.helpers.reraise import worker_reraised

_ERRORS = [
    BuildFailedError("the builder failed: OSError: disk full", "/c/x", lease_id="l1", pid=7,
                     error_type="OSError", reason="disk full", input_error=True),
    CacheWaitTimeout("waited 600 s for /c/x/converted", "/c/x/converted"),
    ReadOnlyCacheError("cannot write /c/x", "/c/x"),
    ForeignCacheFolderError("/c/x holds another cache", "/c/x"),
    LeaseLostError("lease taken over", "/c/x", "l1"),
    EnvironmentConflictError("RANK=1 but SLURM_PROCID=0", ("RANK", "SLURM_PROCID")),
    RankDisagreementError("rank 1 has world size 3", 1, "world_size"),
    ForeignJSONError("/c/x/manifest.json", "nested deeper than 64"),
    UnsafePathError("../../etc/passwd", "leaves its folder"),
]  # fmt: skip


@pytest.mark.parametrize("error", _ERRORS, ids=lambda e: type(e).__name__)
def test_dist_errors_survive_torchs_worker_reraise(error):
    got = worker_reraised(error)
    assert isinstance(got, type(error)), repr(got)
    assert type(got) is type(error)
    assert str(error) in str(got)


@pytest.mark.parametrize("error", _ERRORS, ids=lambda e: type(e).__name__)
def test_dist_errors_pickle_whole(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)
