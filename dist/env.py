"""Who am I: rank, world size, local rank and node of this process.

:func:`detect` reads everything at call time (never at import time) and picks the first
source that is available, in this order:

1. explicit keyword arguments to :func:`detect` (each one overrides the field it names;
   the other fields come from the sources below);
2. an initialised ``torch.distributed`` process group (``get_rank``/``get_world_size``);
3. an initialised ``jax.distributed`` client (``jax.process_index``/``process_count``);
4. torchrun variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK`` (node);
5. SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
   ``SLURM_NTASKS_PER_NODE``;
6. Open MPI: ``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``;
7. PMI (MPICH, Intel MPI): ``PMI_RANK``, ``PMI_SIZE``;
8. a single process (rank 0 of 1).

torch and jax are consulted only when the program has already imported them (we look
in ``sys.modules``; importing either just to ask would cost seconds and may grab an
accelerator). JAX runs one process per host, so for source 3 the local fields come
from the launcher variables when they agree on the world size, else local rank 0 of 1
and node = rank.

Launchers nest (torchrun inside a SLURM allocation sets both ``WORLD_SIZE=16`` and
``SLURM_NTASKS=2``), so two variable families that describe *different* worlds are not
an error: the higher-precedence one wins. Two families that describe the *same* world
size but give this process different ranks are contradictory, and :func:`detect`
raises :class:`EnvironmentConflictError` naming both variables.

When a launcher gives no local information (plain ``RANK``/``WORLD_SIZE``, PMI), all
processes are assumed to be on one node: local rank = rank, node 0.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "EnvironmentConflictError",
    "ProcessInfo",
    "check_coordinator_port",
    "detect",
    "imported_module",
    "jax_initialize_args",
]


class EnvironmentConflictError(ValueError):
    """Two launchers' variables disagree, or a variable is not a valid integer.

    Attributes:
        variables: the names of the variables involved.
    """

    def __init__(self, message: str, variables: tuple[str, ...] = ()):
        super().__init__(message)
        self.variables = tuple(variables)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.variables))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    """Where this process sits in the job. Immutable; safe to share between threads.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: rank among the processes of this node.
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        source: where the values came from (``"explicit"``, ``"torch.distributed"``,
            ``"jax.distributed"``, ``"torchrun"``, ``"slurm"``, ``"openmpi"``, ``"pmi"``,
            ``"single"``).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    source: str = "single"

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size", "node_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(
                f"local_world_size must be in [1, world_size={self.world_size}], "
                f"got {self.local_world_size}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, local_world_size={self.local_world_size}), "
                f"got {self.local_rank}"
            )
        if self.node_rank < 0:
            raise ValueError(f"node_rank must be >= 0, got {self.node_rank}")

    @property
    def is_main(self) -> bool:
        """True for global rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True for local rank 0 (one per node)."""
        return self.local_rank == 0


# One launcher family: (source, rank var, size var, local rank var, local size var, node var)
_FAMILIES: tuple[tuple[str, str, str, str | None, str | None, str | None], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    (
        "slurm",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NODEID",
    ),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        None,
    ),
    ("pmi", "PMI_RANK", "PMI_SIZE", None, None, None),
)


def _int_var(environ: Mapping[str, str], name: str | None, *, leading: bool = False) -> int | None:
    if name is None:
        return None
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if leading:
        # SLURM_NTASKS_PER_NODE may read "4(x2)" or "4,2": the first count is ours when
        # the allocation is homogeneous, which is the only case we can use anyway.
        digits = ""
        for ch in text:
            if not ch.isdigit():
                break
            digits += ch
        text = digits or text
    try:
        return int(text)
    except ValueError:
        raise EnvironmentConflictError(
            f"environment variable {name}={raw!r} is not an integer", (name,)
        ) from None


@dataclasses.dataclass(frozen=True)
class _Reading:
    source: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    node_rank: int | None
    rank_var: str
    size_var: str


def _read_family(
    environ: Mapping[str, str], family: tuple[str, str, str, str | None, str | None, str | None]
) -> _Reading | None:
    source, rank_var, size_var, lrank_var, lsize_var, node_var = family
    rank = _int_var(environ, rank_var)
    size = _int_var(environ, size_var)
    if rank is None or size is None:
        if (rank is None) != (size is None):  # half a launcher: likely a broken job script
            have, missing = (rank_var, size_var) if size is None else (size_var, rank_var)
            logger.warning(
                "%s is set but %s is not: the %s variables are ignored (this process runs "
                "as rank 0 of 1 unless another launcher's variables say otherwise)",
                have, missing, source,
            )  # fmt: skip
        return None
    return _Reading(
        source=source,
        rank=rank,
        world_size=size,
        local_rank=_int_var(environ, lrank_var),
        local_world_size=_int_var(environ, lsize_var, leading=source == "slurm"),
        node_rank=_int_var(environ, node_var),
        rank_var=rank_var,
        size_var=size_var,
    )


def _env_readings(environ: Mapping[str, str]) -> list[_Reading]:
    readings = [r for fam in _FAMILIES if (r := _read_family(environ, fam)) is not None]
    # Same world size but a different rank for this process: one of them is lying.
    for i, a in enumerate(readings):
        for b in readings[i + 1 :]:
            if a.world_size == b.world_size and a.rank != b.rank:
                raise EnvironmentConflictError(
                    f"contradictory rank: {a.rank_var}={a.rank} ({a.source}) but "
                    f"{b.rank_var}={b.rank} ({b.source}) with the same world size "
                    f"{a.world_size}; unset one of them or pass rank= explicitly",
                    (a.rank_var, b.rank_var),
                )
    return readings


def imported_module(name: str) -> Any | None:
    """The module ``name`` if the program has imported it whole, else None.

    Not one that a thread is still importing: ``sys.modules`` holds a module from the
    start of its import, and another thread reading it then finds half of its names
    (seen on a 4xH200 host: ``partially initialized module 'torch.distributed' has no
    attribute 'is_available'`` while the encoder's loading thread imported it, issue
    28). A module being imported cannot have been set up by the program yet (no process
    group, no client), so it is as good as absent. Thread-safe.
    """
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _torch_rank() -> tuple[int, int] | None:
    torch_dist = imported_module("torch.distributed")
    if torch_dist is None:
        return None
    try:
        if torch_dist.is_available() and torch_dist.is_initialized():
            return int(torch_dist.get_rank()), int(torch_dist.get_world_size())
    except Exception:  # a half-initialised or exotic build: fall through to the env
        return None
    return None


def _jax_rank() -> tuple[int, int] | None:
    if "jax" not in sys.modules:
        return None
    try:
        # jax.distributed.initialize() sets a coordination client; without it
        # process_count() is 1 and would also initialise a backend we were not asked for.
        from jax._src import distributed as jax_dist

        if getattr(jax_dist.global_state, "client", None) is None:
            return None
        jax = sys.modules["jax"]
        return int(jax.process_index()), int(jax.process_count())
    except Exception:
        return None


def _local_fields(
    readings: list[_Reading], rank: int, world_size: int
) -> tuple[int, int, int] | None:
    """Local rank/size/node from the first launcher that describes this same world."""
    for r in readings:
        if r.world_size == world_size and r.rank == rank:
            return _fill_local(r)
    return None


def _fill_local(r: _Reading) -> tuple[int, int, int]:
    if r.local_rank is None and r.local_world_size is None:
        # No local information: assume one node.
        return r.rank, r.world_size, r.node_rank or 0
    if r.local_rank is not None:
        local_rank = r.local_rank
    else:  # only a local size: assume ranks fill nodes in order
        local_rank = r.rank % r.local_world_size if r.local_world_size else 0
    local_size = r.local_world_size
    if local_size is None:
        # Unknown: the smallest size consistent with what we know (validation catches
        # a contradiction when the launcher did give a size).
        local_size = local_rank + 1
    node = r.node_rank
    if node is None:
        node = r.rank // local_size if local_size > 0 else 0  # homogeneous nodes
    return local_rank, local_size, node


def detect(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    node_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessInfo:
    """Find this process's rank and world size (see the module docstring for the order).

    Thread-safe; reads ``os.environ`` (or ``environ``) and ``sys.modules`` at call time.

    Args:
        rank, world_size, local_rank, local_world_size, node_rank: explicit values; each
            overrides the detected field of the same name.
        environ: variables to read instead of ``os.environ`` (tests).

    Returns:
        A validated :class:`ProcessInfo`.

    Raises:
        EnvironmentConflictError: launcher variables contradict each other or are not
            integers.
        ValueError: the resulting values are inconsistent (``rank >= world_size``...).
    """
    env = os.environ if environ is None else environ
    readings = _env_readings(env)
    base = _from_process_group(readings) or _from_launcher(readings) or ProcessInfo()
    overrides = {
        k: v
        for k, v in (
            ("rank", rank),
            ("world_size", world_size),
            ("local_rank", local_rank),
            ("local_world_size", local_world_size),
            ("node_rank", node_rank),
        )
        if v is not None
    }
    return _with_overrides(base, overrides) if overrides else base


def _from_process_group(readings: list[_Reading]) -> ProcessInfo | None:
    """An initialised torch.distributed or jax.distributed job, with local fields from
    the launcher variables that describe the same world."""
    source, found = "torch.distributed", _torch_rank()
    if found is None:
        source, found = "jax.distributed", _jax_rank()
    if found is None:
        return None
    r, w = found
    local = _local_fields(readings, r, w)
    if local is None:
        # JAX is one process per host; torch without launcher info: assume one node.
        local = (0, 1, r) if source == "jax.distributed" else (r, w, 0)
    return ProcessInfo(
        rank=r,
        world_size=w,
        local_rank=local[0],
        local_world_size=local[1],
        node_rank=local[2],
        source=source,
    )


def _from_launcher(readings: list[_Reading]) -> ProcessInfo | None:
    """The first launcher's variables (torchrun, SLURM, Open MPI, PMI), if any."""
    if not readings:
        return None
    first = readings[0]
    try:
        lr, lw, node = _fill_local(first)
        return ProcessInfo(
            rank=first.rank,
            world_size=first.world_size,
            local_rank=lr,
            local_world_size=lw,
            node_rank=node,
            source=first.source,
        )
    except ValueError as exc:  # e.g. RANK=3 with WORLD_SIZE=3: name what was read
        raise EnvironmentConflictError(
            f"{first.rank_var}={first.rank} and {first.size_var}={first.world_size} "
            f"({first.source}) do not make a process: {exc}",
            (first.rank_var, first.size_var),
        ) from None


def _with_overrides(base: ProcessInfo, overrides: dict[str, int]) -> ProcessInfo:
    """``base`` with the explicitly given fields (source ``"explicit"``)."""
    fields = dataclasses.asdict(base)
    fields.update(overrides)
    fields["source"] = "explicit"
    moved = "rank" in overrides or "world_size" in overrides
    if moved and not ({"local_rank", "local_world_size"} & overrides.keys()):
        # A new global position invalidates the detected local one unless it still fits.
        if (
            fields["local_world_size"] > fields["world_size"]
            or base.world_size != fields["world_size"]
        ):
            fields["local_rank"], fields["local_world_size"] = (
                fields["rank"],
                fields["world_size"],
            )
            if "node_rank" not in overrides:
                fields["node_rank"] = 0
    return ProcessInfo(**fields)


def jax_initialize_args(
    process: ProcessInfo, environ: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """How this process joins the job's ``jax.distributed``: the keyword arguments of
    ``jax.distributed.initialize``, ``{}`` to let JAX read SLURM's or Open MPI's own
    variables, or None for a single process.

    In order: ``JAX_COORDINATOR_ADDRESS`` (host:port); else ``MASTER_ADDR`` and
    ``MASTER_PORT`` (torchrun and most launchers set them; JAX's coordinator then
    listens on ``MASTER_PORT + 1`` of that host, since torchrun's own store holds
    ``MASTER_PORT``); else a SLURM or Open MPI job (JAX's cluster detection). The rank
    and world size are ``process``'s. Reads ``environ`` (default ``os.environ``) only.

    Raises:
        EnvironmentConflictError: several processes, but nothing says where the
            coordinator is (each would train a model of its own), or ``MASTER_PORT`` is
            not a port number.
    """
    if process.world_size <= 1:
        return None
    env = os.environ if environ is None else environ
    given = {"num_processes": process.world_size, "process_id": process.rank}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"], **given}
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if host and port:
        if not port.isdigit() or not 0 < int(port) < 65535:
            raise EnvironmentConflictError(
                f"MASTER_PORT must be a port number below 65535, got {port!r}", ("MASTER_PORT",)
            )
        return {"coordinator_address": f"{host}:{int(port) + 1}", **given}
    if process.source in ("slurm", "openmpi"):
        return {}
    raise EnvironmentConflictError(
        f"{process.world_size} processes ({process.source}) but no jax.distributed "
        "coordinator: set JAX_COORDINATOR_ADDRESS=host:port (the same on every rank), or "
        "MASTER_ADDR and MASTER_PORT, or launch with torchrun, srun or mpirun",
        ("JAX_COORDINATOR_ADDRESS", "MASTER_ADDR", "MASTER_PORT"),
    )


def check_coordinator_port(
    initialize_args: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> None:
    """On the process that hosts ``jax.distributed``'s coordinator (``process_id`` 0),
    refuse a coordinator port that something else on this host holds.

    JAX's gRPC server fails to bind such a port and the process dies of SIGSEGV
    ("Failed to add port to server"); a ``MASTER_PORT + 1`` that another program
    took is the usual case. The check binds the port (all interfaces, as JAX does) and
    lets it go: a program that takes the port between this check and JAX's bind still
    wins that race. Other ranks, SLURM/Open MPI (no address given) and an address that
    is not ``host:port`` are left to JAX.

    Args:
        initialize_args: :func:`jax_initialize_args`'s result.
        environ: the environment it was read from (default ``os.environ``).

    Raises:
        EnvironmentConflictError: the port is in use, or this user may not bind it.
    """
    address = initialize_args.get("coordinator_address")
    if not address or initialize_args.get("process_id") != 0:
        return
    port_text = str(address).rpartition(":")[2]
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return
    port = int(port_text)
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        origin, variable = f"from JAX_COORDINATOR_ADDRESS={address}", "JAX_COORDINATOR_ADDRESS"
    else:
        origin, variable = f"MASTER_PORT + 1, MASTER_PORT={port - 1}", "MASTER_PORT"
    problem = _bind_problem(port)
    if problem:
        raise EnvironmentConflictError(
            f"the jax.distributed coordinator's port {port} ({origin}) {problem} on this "
            "host, where rank 0 hosts the coordinator: set JAX_COORDINATOR_ADDRESS="
            "<this host>:<a free port>, the same on every rank",
            (variable,),
        )


def _bind_problem(port: int) -> str:
    """Why ``port`` cannot be bound on every interface here ("" when it can)."""
    families = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: the IPv4 check
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return "is in use"
                if e.errno == errno.EACCES:
                    return "may not be bound by this user"
                continue  # e.g. an IPv6 socket without a v6 address: the IPv4 check
            return ""
    return ""
