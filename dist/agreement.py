"""Before building, the ranks of one job agree on what they build.

Every rank posts ``{rank, world_size, values}`` (``values``: the cache fingerprint and
the config fields that must match, chosen by the caller) under one key of the job's
store (:mod:`dist.kvstore`), then reads every rank's post, with a deadline, and compares
each with rank 0's. The first difference, in rank order then field order, is raised as
:class:`RankDisagreementError` on every rank with the same line ("rank 1 has
world_size=2 but rank 0 has 4"), so no rank builds a cache the others do not use and
no rank retires the parts of a world it is not in.

This is not a barrier on the build: it only needs every rank to have *started*; a rank
that never posts makes the others fail after ``timeout`` naming it (a job whose ranks
never all start could not train either).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dist.env import EnvironmentConflictError

if TYPE_CHECKING:  # annotations only
    from dist.kvstore import FileJobStore, JobStore

__all__ = ["RankDisagreementError", "agree"]

_CALLS: dict[str, int] = {}  # agreements under each job key so far, this process


class RankDisagreementError(EnvironmentConflictError):
    """Two ranks of one job were started with a different world size or config.

    Attributes:
        rank: the rank that differs from rank 0.
        field: the field they differ on (``"world_size"``, ``"fingerprint"``,
            ``"encoder.max_length"``...).
    """

    input_error = True

    def __init__(self, message: str, rank: int, field: str):
        super().__init__(message)
        self.rank = int(rank)
        self.field = str(field)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.rank, self.field))


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _difference(post: Mapping[str, Any], ref: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    if post.get("world_size") != ref.get("world_size"):
        return "world_size", post.get("world_size"), ref.get("world_size")
    mine, theirs = post.get("values") or {}, ref.get("values") or {}
    for field in sorted(set(mine) | set(theirs)):
        if mine.get(field) != theirs.get(field):
            return field, mine.get(field), theirs.get(field)
    return None


def agree(
    store: JobStore | FileJobStore,
    *,
    key: str,
    rank: int,
    world_size: int,
    values: Mapping[str, Any],
    timeout: float,
) -> None:
    """Post this rank's view under ``key`` and check that every rank posted the same.

    Every rank of the job must call this the same number of times with the same
    ``key`` (the n-th call of each rank meets the n-th of the others).

    Args:
        store: the job's :class:`dist.kvstore.JobStore` (or a file store of the job).
        key: the job's agreement key (one per job, e.g. ``"hf_pipeline.agree"``).
        rank, world_size: this process's place in the job (``dist.env.detect``).
        values: JSON-able fields every rank must have equal (``fingerprint``, config
            fields by dotted name).
        timeout: seconds to wait, in all, for the other ranks' posts.

    Raises:
        RankDisagreementError: a rank's world size or a value differs from rank 0's
            (the same line on every rank).
        TimeoutError: a rank posted nothing within ``timeout`` (names it).
    """
    n = _CALLS[key] = _CALLS.get(key, 0) + 1
    base = f"{key}/{n}"
    mine = {"rank": rank, "world_size": world_size, "values": dict(values)}
    try:
        store.set(f"{base}/rank-{rank}", json.dumps(mine, sort_keys=True, default=str).encode())
    except FileExistsError as e:  # a store that refuses a second set (dist.kvstore.FileJobStore)
        raise RankDisagreementError(
            f"rank {rank} was already posted under job key {key!r} ({e.filename}): two "
            "processes with one rank, or a job id reused by another launch",
            rank,
            "rank",
        ) from e
    deadline = time.monotonic() + timeout
    ref: Mapping[str, Any] | None = None
    for r in range(world_size):
        try:
            raw = store.get(f"{base}/rank-{r}", timeout=max(0.001, deadline - time.monotonic()))
        except TimeoutError as e:
            raise TimeoutError(
                f"rank {r} of {world_size} did not say within {timeout:g}s which cache it "
                f"builds (job key {key!r}): was it started, with WORLD_SIZE={world_size}?"
            ) from e
        try:
            post = json.loads(raw)
            if not isinstance(post, dict):
                raise ValueError(f"a {type(post).__name__}")
        except ValueError as e:  # another program's key, or a torn write: not ours
            raise RankDisagreementError(
                f"rank {r} posted an unreadable agreement under job key {key!r} ({e})", r, "post"
            ) from e
        if ref is None:
            ref = post
            continue
        diff = _difference(post, ref)
        if diff is not None:
            field, theirs, first = diff
            raise RankDisagreementError(
                f"ranks disagree: rank {r} has {field}={_show(theirs)} but rank 0 has "
                f"{_show(first)}; start every rank with the same config and launcher",
                r,
                field,
            )
