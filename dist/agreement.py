"""Before building, the ranks of one job agree on what they build.

Every rank posts ``{rank, world_size, values}`` (``values``: the cache fingerprint and
the config fields that must match, chosen by the caller) under one key of the job's
store (:mod:`dist.kvstore`), then reads every rank's post, with a deadline, and compares
each with rank 0's. The first difference, in rank order then field order, is raised as
:class:`RankDisagreementError` on every rank with the same line ("rank 1 has
world_size=2 but rank 0 has 4"), so no rank builds a cache the others do not use and
no rank retires the parts of a world it is not in.

Each post also names its writer (host, pid, process identity), and a rank that has read
what it needs of a round (or stopped reading: it raised) sets ``<key>/<n>/done-<rank>``.
:func:`job_folder_state` judges a job's folder of a file store (:class:`dist.kvstore.
FileJobStore`, ``<cache root>/.jobs/<id>/``) from them: *finished* when every rank of
every round said done (nobody reads it any more), *abandoned* when every rank that
posted provably exited (:func:`dist.lease.holder_exited`: same host, ``/proc``), else
*live* (a rank still runs, or runs where this host cannot tell).

This is not a barrier on the build: it only needs every rank to have *started*; a rank
that never posts makes the others fail after ``timeout`` naming it (a job whose ranks
never all start could not train either).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dist.env import EnvironmentConflictError
from dist.layout import parse_temp_name
from dist.lease import LeaseView, holder_exited, process_identity
from dist.markers import loads_finite

if TYPE_CHECKING:  # annotations only
    from dist.kvstore import FileJobStore, JobStore

__all__ = ["JobFolderState", "RankDisagreementError", "agree", "job_folder_state"]

_CALLS: dict[str, int] = {}  # agreements under each job key so far, this process


class RankDisagreementError(EnvironmentConflictError):
    """Two ranks of one job were started with a different world size or config.

    Attributes:
        rank: the rank that differs from rank 0 (-1 when built from the message alone,
            as torch's ``DataLoader`` re-raises a worker's exception).
        field: the field they differ on (``"world_size"``, ``"fingerprint"``,
            ``"encoder.max_length"``...).
    """

    input_error = True

    def __init__(self, message: str, rank: int = -1, field: str = ""):
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
    mine = {
        "rank": rank,
        "world_size": world_size,
        "values": dict(values),
        # Who posted: what lets --clean prove the job's folder abandoned (job_folder_state).
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "proc": process_identity(),
    }
    try:
        store.set(f"{base}/rank-{rank}", json.dumps(mine, sort_keys=True, default=str).encode())
    except FileExistsError as e:  # a store that refuses a second set (dist.kvstore.FileJobStore)
        raise RankDisagreementError(
            f"rank {rank} was already posted under job key {key!r} ({e.filename}): two "
            "processes with one rank, or a job id reused by another launch",
            rank,
            "rank",
        ) from e
    # This rank reads the round no more once checked (also when it raised): with every
    # rank's done, the job's folder is provably finished (job_folder_state).
    done = (f"{base}/done-{rank}", json.dumps({"rank": rank}).encode())
    try:
        _check_posts(store, key, base, world_size, timeout)
    except BaseException:
        # Best effort: the error being raised is the one to report (a store that went
        # away raises its own RuntimeError / OSError here).
        with contextlib.suppress(FileExistsError, OSError, RuntimeError):
            store.set(*done)
        raise
    with contextlib.suppress(FileExistsError):  # a reused job id: the post said so already
        store.set(*done)


def _check_posts(
    store: JobStore | FileJobStore, key: str, base: str, world_size: int, timeout: float
) -> None:
    """Read every rank's post of round ``base`` and compare it with rank 0's."""
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
            post = loads_finite(raw)
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


#: A file :class:`dist.kvstore.FileJobStore` writes for :func:`agree`: a rank's post or
#: its done (keys ``<key>/<n>/rank-<r>``; the store writes ``/`` as ``_``).
_POST_FILE = re.compile(
    r"^(?P<key>[A-Za-z0-9._-]+)_(?P<n>[0-9]{1,9})_(?P<kind>rank|done)-(?P<rank>[0-9]{1,9})$"
)
_MAX_POST_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFolderState:
    """What :func:`job_folder_state` found in a job's folder.

    Attributes:
        state: ``"finished"``, ``"abandoned"`` or ``"live"`` (the module docstring).
        rounds: agreement rounds posted there.
        members: ``(host, pid)`` of every rank that posted.
        foreign: entries that are not the agreement's files (never removed).
    """

    state: str
    rounds: int
    members: tuple[tuple[str, int], ...]
    foreign: tuple[str, ...]


#: The most ranks a job post may name: a post of world_size 10**12 made status and
#: clean build a set of that many ranks (an adversarial tester: a MemoryError).
MAX_WORLD_SIZE = 1 << 20


def _read_post(path: Path, rank: int, kind: str) -> dict[str, Any] | None:
    """The post (or done) at ``path`` if it is a regular file of exactly our shape."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_POST_BYTES:
            return None
        d = loads_finite(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or d.get("rank") != rank:
        return None
    if kind == "rank":
        ws = d.get("world_size")
        if type(ws) is not int or not rank < ws <= MAX_WORLD_SIZE:
            return None
        if not isinstance(d.get("values"), dict):
            return None
    return d


def job_folder_state(folder: str | os.PathLike[str]) -> JobFolderState | None:
    """How far the job whose file store is ``folder`` got; None when ``folder`` holds no
    post of :func:`agree` (not a job folder of ours). Reads only; never raises on what
    it finds (another host wrote it)."""
    folder = Path(folder)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    world: dict[tuple[str, int], int] = {}
    done: dict[tuple[str, int], set[int]] = {}
    members: dict[tuple[str, int], LeaseView | None] = {}
    foreign = []
    unknown_member = False
    for name in names:
        m = _POST_FILE.match(name)
        if m is None:
            inner = parse_temp_name(name)  # an interrupted post: ours if its name is
            if inner is None or _POST_FILE.match(inner) is None:
                foreign.append(name)
            continue
        rnd, rank = (m["key"], int(m["n"])), int(m["rank"])
        d = _read_post(folder / name, rank, m["kind"])
        if d is None:
            foreign.append(name)
        elif m["kind"] == "done":
            done.setdefault(rnd, set()).add(rank)
        else:
            world[rnd] = max(world.get(rnd, 0), d["world_size"])
            host, pid, proc = d.get("host"), d.get("pid"), d.get("proc")
            if isinstance(host, str) and type(pid) is int and isinstance(proc, dict):
                boot, ns, start = proc.get("boot"), proc.get("pidns"), proc.get("start")
                ident: tuple[str, str, int] | None = None
                if isinstance(boot, str) and isinstance(ns, str) and type(start) is int:
                    ident = (boot, ns, int(start))
                view = LeaseView("", None, host, pid, ident)
                members[(host, pid)] = view
            else:
                unknown_member = True  # a release before the writer was named
    if not world:
        return None
    # Counted, not a set of range(n): n is another process's word (bounded above too).
    finished = all(sum(1 for r in done.get(rnd, ()) if 0 <= r < n) == n for rnd, n in world.items())
    exited = not unknown_member and all(
        v is not None and holder_exited(v) for v in members.values()
    )
    return JobFolderState(
        state="finished" if finished else "abandoned" if exited else "live",
        rounds=len(world),
        members=tuple(sorted(members)),
        foreign=tuple(foreign),
    )
