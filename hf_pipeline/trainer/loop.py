"""The demo training loop: the cache's loader feeding the JAX denoiser.

JAX may be initialised before the cache is built (the build spawns its workers, see
:mod:`hf_pipeline.workers.pool`); :func:`jax_distributed` joins the job first and leaves it
cleanly at the end.

Checkpoints (``train.checkpoint``) go through Orbax's ``CheckpointManager``: one folder
per saved step holding the model and optimizer state (Orbax's PyTree format) and a JSON
item with the loader's exact position, written to a temporary folder and renamed when
complete, so a run killed at any moment leaves only whole checkpoints to resume from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dist.safepath import shown
from hf_pipeline.config import Config
from hf_pipeline.errors import ConfigError

__all__ = [
    "CHECKPOINT_VERSION",
    "TrainResult",
    "init_jax_distributed",
    "jax_distributed",
    "shutdown_jax_distributed",
    "train",
]

log = logging.getLogger(__name__)

#: Layout of a checkpoint's ``meta`` item (``{"version", "step", "loader"}``); a
#: checkpoint of another version is refused, never misread.
CHECKPOINT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a training run did.

    Attributes:
        steps: optimizer steps taken in this run.
        first_loss: loss of this run's first step (nan when it took none).
        last_loss: loss of this run's last step (nan when it took none).
        step: the step reached (``train.steps`` when the run is finished).
        samples_per_s: global samples per second over the run.
        data_wait_share: fraction of step time spent waiting for the next batch.
        history: one dict per log line.
        loader_state: the loader's state after the last step (for resume).
        params: the trained parameters with ``keep_params=True``, else None (the caller
            drops them before leaving ``jax.distributed``).
    """

    steps: int
    step: int
    first_loss: float
    last_loss: float
    samples_per_s: float
    data_wait_share: float
    history: list[dict[str, Any]]
    loader_state: dict[str, Any]
    params: Any = None


def init_jax_distributed(process, environ=None) -> bool:
    """Join the job's ``jax.distributed`` when there are several processes.

    The coordinator comes from ``JAX_COORDINATOR_ADDRESS``, else from the launcher's
    ``MASTER_ADDR``/``MASTER_PORT`` (torchrun), else from SLURM or Open MPI
    (:func:`dist.env.jax_initialize_args`); the rank and world size are those
    :mod:`dist.env` detected. Returns True when JAX now spans several processes.

    Raises:
        dist.env.EnvironmentConflictError: several processes but no coordinator to be
            found (each would train its own model), or (rank 0) the coordinator's port
            is in use on this host: names what to set.
        RuntimeError: called while a new worker process of a build imports the main
            script (no ``if __name__ == "__main__":`` guard): names the fix.
    """
    from dist.env import check_coordinator_port, jax_initialize_args
    from hf_pipeline.workers.pool import check_not_bootstrapping

    # A new worker of a build importing an unguarded main script must not join the job
    # as a second copy of its rank (JAX's coordinator aborts every rank for it).
    check_not_bootstrapping("hf_pipeline.jax_distributed")
    kwargs = jax_initialize_args(process, environ)
    if kwargs is None:
        return False
    check_coordinator_port(kwargs, environ)  # JAX dies of SIGSEGV on a port in use
    import jax

    jax.distributed.initialize(**kwargs)
    return True


def shutdown_jax_distributed(*, barrier_timeout: float = 300.0) -> None:
    """Leave ``jax.distributed`` so that a good run ends quietly; no-op when not joined.

    Call on every rank after its last use of a JAX array. In order:

    1. a barrier of the coordination service: no rank releases its backend (and the
       communicators of its collectives) while a peer may still be in a step;
    2. release JAX's compiled functions and backend clients (``jax.clear_caches``,
       ``jax.extend.backend.clear_backends``, a GC pass). A GPU client keeps a
       ``WatchTasks`` call open on the coordination service; one still alive when the
       service shuts down logs ``WatchTasksAsync failed ... CANCELLED`` on every rank.
       Seen on 2 H200s with a plain ``jax.distributed.shutdown()`` (and with none); gone
       once the clients are released first. Arrays still referenced keep their client;
    3. ``jax.distributed.shutdown()``, whose own barrier every rank then reaches.

    Args:
        barrier_timeout: most seconds to wait for the other ranks at step 1.

    Raises:
        jax.errors.JaxRuntimeError: a rank did not reach the barrier in time.
    """
    import jax

    if not jax.distributed.is_initialized():
        return
    # The job's coordination client (the same handle dist.env and the doorbell use).
    from jax._src import distributed as jax_dist
    from jax.extend.backend import clear_backends

    client = jax_dist.global_state.client
    assert client is not None  # jax.distributed is initialized (checked above)
    client.wait_at_barrier("hf_pipeline/shutdown", int(barrier_timeout * 1000))
    jax.clear_caches()
    clear_backends()
    gc.collect()
    jax.distributed.shutdown()


@contextlib.contextmanager
def jax_distributed(
    process=None, environ=None, *, barrier_timeout: float = 300.0
) -> Iterator[bool]:
    """Join ``jax.distributed`` for the block (:func:`init_jax_distributed`), then leave it.

    Yields True when JAX spans several processes. When the block ends normally every
    rank calls :func:`shutdown_jax_distributed`; JAX arrays made inside the block must
    not be used after it. When it raises, nothing is waited for: a failed rank must not
    sit at a barrier that its peers, perhaps stuck waiting for it, never reach (JAX's
    own exit handler still shuts the client down).

    Args:
        process: this process's place in the job; None: detected from the launcher's
            environment (torchrun, SLURM, Open MPI), as ``prepare_cache`` does.
        environ: the environment to read (default ``os.environ``).
        barrier_timeout: most seconds to wait for the other ranks at the end.
    """
    if process is None:
        from dist.env import detect

        process = detect(environ=environ)
    joined = init_jax_distributed(process, environ)
    yield joined
    if joined:
        shutdown_jax_distributed(barrier_timeout=barrier_timeout)


class _Checkpoints:
    """The run's checkpoints in ``train.checkpoint``: Orbax's ``CheckpointManager``.

    A step's folder (``<dir>/<step>/``) holds two items: ``state`` (``{"params",
    "opt_state"}``, Orbax's standard PyTree format) and ``meta`` (JSON:
    :data:`CHECKPOINT_VERSION`, the step, ``train_steps`` (the schedule's length; absent
    in checkpoints saved before it was recorded) and the loader's ``state_dict``). Orbax writes a
    step under a temporary name and renames it when every file is written, so a step
    folder is always complete; ``keep`` newest steps are kept. Saves run in Orbax's
    background thread; :meth:`close` waits for the last one.

    With ``writer=False`` (the ranks of a job that is not one ``jax.distributed`` job,
    other than rank 0) it only restores, so that ranks never write the same folder.
    """

    def __init__(self, path: Path, keep: int, *, writer: bool):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.path = path
        if (path / "meta.json").is_file() or (path / "state.npz").is_file():
            raise ConfigError(
                f"train.checkpoint {path} holds a checkpoint of the old single-file format "
                "(state.npz, meta.json), which cannot be resumed: use another folder",
                field="train.checkpoint",
            )
        if not writer and not path.is_dir():
            self._mngr = None
            return
        self._mngr = ocp.CheckpointManager(
            path.absolute(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=writer, read_only=not writer
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return None if self._mngr is None else self._mngr.latest_step()

    def save(
        self, step: int, params, opt_state, loader_state: dict[str, Any], train_steps: int
    ) -> None:
        ocp = self._ocp
        if self._mngr is None or step in self._mngr.all_steps():
            return
        meta = {
            "version": CHECKPOINT_VERSION,
            "step": step,
            "train_steps": train_steps,
            "loader": loader_state,
        }
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,  # we decide when to save (train.checkpoint_every)
        )

    def restore(
        self, step: int, params, opt_state, train_steps: int
    ) -> tuple[Any, Any, dict[str, Any]]:
        """``(params, opt_state, loader_state)`` of ``step``, shaped and placed like the
        arguments.

        Raises:
            ConfigError: the checkpoint does not fit this model, is of another version,
                or was saved by a run of another ``train_steps`` (the learning-rate
                schedule spans them: continuing under another would be neither run).
        """
        import jax

        ocp = self._ocp
        where = f"train.checkpoint {self.path / str(step)}"
        # Restored onto the shardings of the fresh state it replaces, so a resumed run
        # places its state exactly as a fresh start does.
        target = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            {"params": params, "opt_state": opt_state},
        )
        try:
            assert self._mngr is not None  # restore() is given a step of latest_step()
            got = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except (ValueError, TypeError, KeyError) as exc:
            first = (
                str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            )
            raise ConfigError(
                f"{where} does not fit this model (another train.hidden or encoder?): {first}",
                field="train.checkpoint",
            ) from None
        meta = got["meta"]
        if not isinstance(meta, dict) or meta.get("version") != CHECKPOINT_VERSION:
            version = meta.get("version") if isinstance(meta, dict) else None
            raise ConfigError(
                f"{where} has checkpoint version {version!r:.40}, this trainer reads "
                f"{CHECKPOINT_VERSION}",
                field="train.checkpoint",
            )
        if meta.get("step") != step or not isinstance(meta.get("loader"), dict):
            raise ConfigError(f"{where}: malformed meta item", field="train.checkpoint")
        # Absent from checkpoints saved before it was recorded: nothing to compare.
        saved_steps = meta.get("train_steps", train_steps)
        if saved_steps != train_steps:
            raise ConfigError(
                f"train.steps is {train_steps}, but {where} was saved by a run of "
                f"train.steps {shown(saved_steps)} (the learning-rate schedule spans "
                "train.steps): resume with the same value, or start a new "
                "train.checkpoint folder",
                field="train.steps",
            )
        return got["state"]["params"], got["state"]["opt_state"], meta["loader"]

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.wait_until_finished()
            self._mngr.close()


def _replicated(tree, mesh):
    """``tree``'s arrays as one copy on each device of ``mesh``.

    Every process passes the same values (the state is drawn from ``train.seed``), which
    is what makes each process's copy the job's one replicated array.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec())

    def place(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(place, tree)


def train(
    cfg: Config,
    source,
    *,
    process_index: int = 0,
    process_count: int = 1,
    max_steps: int | None = None,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    keep_params: bool = False,
) -> TrainResult:
    """Train the denoiser on ``source`` up to ``train.steps`` optimizer steps in total.

    With ``train.checkpoint`` set, resumes from its latest complete checkpoint (model,
    optimizer and the loader's exact position), saves one every
    ``train.checkpoint_every`` steps and at the end, and keeps the newest
    ``train.keep_checkpoints``: an interrupted run, even one killed while saving,
    continues with exactly the batches, noise and learning rate it would have had.

    Args:
        cfg: configuration (``loader`` and ``train`` sections).
        source: the opened cache (:func:`hf_pipeline.cache.layout.open_sample_source`).
        process_index, process_count: this process's share of each global batch when
            JAX is not multi-process itself.
        max_steps: stop after this many steps in this call (the schedule still spans
            ``train.steps``); None runs to the end.
        on_log: called with each log record (step, loss, samples_per_s, data_wait).
        keep_params: return the trained parameters in :attr:`TrainResult.params`.

    Returns:
        :class:`TrainResult`.

    Raises:
        ConfigError: the checkpoint folder holds a checkpoint of another model, cache,
            loader order or version.
    """
    import jax
    from jax.sharding import Mesh

    from hf_pipeline.read.loader import Loader
    from hf_pipeline.trainer.denoiser import init_params, make_optimizer, make_train_step

    t_cfg = cfg.train
    total = t_cfg.steps
    if jax.process_count() > 1:
        mesh = Mesh(np.array(jax.devices()), ("data",))
        loader = Loader.from_config(source, cfg.loader, mesh=mesh)
    else:
        loader = Loader.from_config(
            source, cfg.loader, process_index=process_index, process_count=process_count
        )
    optimizer = make_optimizer(t_cfg.learning_rate, total)
    params = init_params(jax.random.PRNGKey(t_cfg.seed), source.embed_dim, t_cfg.hidden)
    opt_state = optimizer.init(params)
    if jax.process_count() > 1:
        # Placed on the job's devices now rather than left to jit: a restore gives back
        # the target's shardings, and an unplaced state would come back on each rank's
        # own device, which jit refuses next to a batch spread over the job's devices.
        params, opt_state = _replicated((params, opt_state), mesh)
    start = 0
    ckpts = None
    if t_cfg.checkpoint:
        # One jax.distributed job saves together (Orbax coordinates its processes);
        # separate processes leave it to rank 0.
        writer = jax.process_count() > 1 or process_index == 0
        ckpts = _Checkpoints(
            Path(t_cfg.checkpoint).expanduser(), t_cfg.keep_checkpoints, writer=writer
        )
        latest = ckpts.latest_step()
        if latest is not None:
            params, opt_state, loader_state = ckpts.restore(latest, params, opt_state, total)
            saved_on = loader_state.get("fingerprint") if isinstance(loader_state, dict) else None
            this = loader.state_dict()["fingerprint"]
            if saved_on is not None and saved_on != this:
                # The sample order is a function of (seed, epoch, dataset): the checkpoint's
                # position means nothing in another dataset (shards appended, another
                # encoder or caption column), so it is not continued under a rule.
                raise ConfigError(
                    f"train.checkpoint {ckpts.path / str(latest)} was saved on the cache "
                    f"{str(saved_on)[:64]!r}, this run reads the cache {this!r}: the dataset "
                    "changed (shards appended, another encoder or caption column) and the "
                    "checkpoint's sample order belongs to the old one; resume on the old "
                    "cache, or start a new train.checkpoint folder",
                    field="train.checkpoint",
                )
            try:
                loader.load_state_dict(loader_state)
            except ValueError as exc:
                raise ConfigError(
                    f"train.checkpoint {ckpts.path / str(latest)}: {exc}",
                    field="train.checkpoint",
                ) from None
            start = latest
            log.info("resumed from %s at step %d (epoch %d)", ckpts.path, start, loader.epoch)
    step_fn = make_train_step(optimizer)
    # Noise depends on (seed, step) only, so a resumed run draws what the original would.
    base_key = jax.random.PRNGKey(t_cfg.seed + 1)
    end = total if max_steps is None else min(total, start + max_steps)
    global_batch = cfg.loader.global_batch_size
    history: list[dict[str, Any]] = []
    window_losses: list[jax.Array] = []
    # Step losses, not window means: a run shorter than log_every has one window.
    first_loss = last_loss = None
    window_wait = wait_total = 0.0
    t_window = t_run = time.perf_counter()
    step = start
    every = t_cfg.checkpoint_every
    with contextlib.ExitStack() as stack:
        if ckpts is not None:
            stack.callback(ckpts.close)  # waits for the save in flight, also on errors
        stack.enter_context(loader)
        batches = loader.epochs(None)
        while step < end:
            t0 = time.perf_counter()
            batch = next(batches)
            waited = time.perf_counter() - t0
            window_wait += waited
            wait_total += waited
            params, opt_state, loss = step_fn(
                params, opt_state, batch, jax.random.fold_in(base_key, step)
            )
            window_losses.append(loss)
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            step += 1
            if step % t_cfg.log_every == 0 or step == end:
                losses = np.asarray(jax.device_get(window_losses))
                now = time.perf_counter()
                elapsed = now - t_window
                rec = {
                    "step": step,
                    "epoch": loader.epoch,
                    "loss": float(losses.mean()),
                    "samples_per_s": len(losses) * global_batch / elapsed if elapsed > 0 else 0.0,
                    "data_wait": window_wait / elapsed if elapsed > 0 else 0.0,
                    "queue_depth": loader.stats().queue_depth,
                }
                history.append(rec)
                if on_log is not None:
                    on_log(rec)
                window_losses, window_wait, t_window = [], 0.0, now
            if ckpts is not None and (step == end or (every and step % every == 0)):
                ckpts.save(step, params, opt_state, loader.state_dict(), total)
        state = loader.state_dict()
    run_s = time.perf_counter() - t_run
    return TrainResult(
        steps=step - start,
        step=step,
        # No step left (a finished run resumed): no loss to report.
        first_loss=float("nan") if first_loss is None else float(first_loss),
        last_loss=float("nan") if last_loss is None else float(last_loss),
        samples_per_s=(step - start) * global_batch / run_s if run_s > 0 else 0.0,
        data_wait_share=wait_total / run_s if run_s > 0 else 0.0,
        history=history,
        loader_state=state,
        params=params if keep_params else None,
    )
