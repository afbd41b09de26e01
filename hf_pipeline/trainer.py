"""The demo training loop: the cache's loader feeding the JAX denoiser.

JAX may be initialised before the cache is built (the build spawns its workers, see
:mod:`hf_pipeline.workers`); :func:`jax_distributed` joins the job first and leaves it
cleanly at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dist.atomic import atomic_write, write_json_atomic
from hf_pipeline.config import Config

__all__ = [
    "TrainResult",
    "init_jax_distributed",
    "jax_distributed",
    "shutdown_jax_distributed",
    "train",
]

log = logging.getLogger("hf_pipeline")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a training run did.

    Attributes:
        steps: optimizer steps taken in this run.
        first_loss: mean loss over the first logging window.
        last_loss: mean loss over the last logging window.
        samples_per_s: global samples per second over the run.
        data_wait_share: fraction of step time spent waiting for the next batch.
        history: one dict per log line.
        loader_state: the loader's state after the last step (for resume).
    """

    steps: int
    first_loss: float
    last_loss: float
    samples_per_s: float
    data_wait_share: float
    history: list[dict[str, Any]]
    loader_state: dict[str, Any]


def init_jax_distributed(process, environ=None) -> bool:
    """Join the job's ``jax.distributed`` when there are several processes.

    The coordinator comes from ``JAX_COORDINATOR_ADDRESS``, else from the launcher's
    ``MASTER_ADDR``/``MASTER_PORT`` (torchrun), else from SLURM or Open MPI
    (:func:`dist.env.jax_initialize_args`); the rank and world size are those
    :mod:`dist.env` detected. Returns True when JAX now spans several processes.

    Raises:
        dist.env.EnvironmentConflictError: several processes but no coordinator to be
            found (each would train its own model): names what to set.
    """
    from dist.env import jax_initialize_args

    kwargs = jax_initialize_args(process, environ)
    if kwargs is None:
        return False
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
    from jax._src import distributed as jax_dist  # type: ignore[import-not-found]
    from jax.extend.backend import clear_backends

    jax_dist.global_state.client.wait_at_barrier(
        "hf_pipeline/shutdown", int(barrier_timeout * 1000)
    )
    jax.clear_caches()
    clear_backends()
    gc.collect()
    jax.distributed.shutdown()


@contextlib.contextmanager
def jax_distributed(process, environ=None, *, barrier_timeout: float = 300.0) -> Iterator[bool]:
    """Join ``jax.distributed`` for the block (:func:`init_jax_distributed`), then leave it.

    Yields True when JAX spans several processes. When the block ends normally every
    rank calls :func:`shutdown_jax_distributed`; JAX arrays made inside the block must
    not be used after it. When it raises, nothing is waited for: a failed rank must not
    sit at a barrier that its peers, perhaps stuck waiting for it, never reach (JAX's
    own exit handler still shuts the client down).
    """
    joined = init_jax_distributed(process, environ)
    yield joined
    if joined:
        shutdown_jax_distributed(barrier_timeout=barrier_timeout)


def _save_checkpoint(path: Path, params, opt_state, loader_state: dict, step: int) -> None:
    import jax

    leaves = jax.tree_util.tree_leaves((params, opt_state))
    path.mkdir(parents=True, exist_ok=True)
    with atomic_write(path / "state.npz") as fh:
        np.savez(fh, *[np.asarray(jax.device_get(x)) for x in leaves])
    write_json_atomic(path / "meta.json", {"step": step, "loader": loader_state}, indent=1)


def _load_checkpoint(path: Path, params, opt_state):
    import jax

    meta = json.loads((path / "meta.json").read_text())
    with np.load(path / "state.npz", allow_pickle=False) as z:
        leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
    treedef = jax.tree_util.tree_structure((params, opt_state))
    if treedef.num_leaves != len(leaves):
        raise ValueError(
            f"checkpoint {path} has {len(leaves)} arrays, the model needs {treedef.num_leaves} "
            "(different train.hidden or encoder?)"
        )
    params, opt_state = jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(x) for x in leaves])
    return params, opt_state, int(meta["step"]), meta["loader"]


def train(
    cfg: Config,
    source,
    *,
    process_index: int = 0,
    process_count: int = 1,
    max_steps: int | None = None,
    on_log: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train the denoiser on ``source`` up to ``train.steps`` optimizer steps in total.

    With ``train.checkpoint`` set, resumes from it when present (model, optimizer and
    the loader's exact position) and saves to it at the end, so an interrupted run
    continues with exactly the batches, noise and learning rate it would have had.

    Args:
        cfg: configuration (``loader`` and ``train`` sections).
        source: the opened cache (:func:`hf_pipeline.cache.open_sample_source`).
        process_index, process_count: this process's share of each global batch when
            JAX is not multi-process itself.
        max_steps: stop after this many steps in this call (the schedule still spans
            ``train.steps``); None runs to the end.
        on_log: called with each log record (step, loss, samples_per_s, data_wait).

    Returns:
        :class:`TrainResult`.
    """
    import jax
    from jax.sharding import Mesh

    from hf_pipeline.denoiser import init_params, make_optimizer, make_train_step
    from hf_pipeline.loader import Loader

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
    start = 0
    ckpt = Path(t_cfg.checkpoint).expanduser() if t_cfg.checkpoint else None
    if ckpt is not None and (ckpt / "meta.json").is_file():
        params, opt_state, start, loader_state = _load_checkpoint(ckpt, params, opt_state)
        loader.load_state_dict(loader_state)
        log.info("resumed from %s at step %d (epoch %d)", ckpt, start, loader.epoch)
    step_fn = make_train_step(optimizer)
    # Noise depends on (seed, step) only, so a resumed run draws what the original would.
    base_key = jax.random.PRNGKey(t_cfg.seed + 1)
    end = total if max_steps is None else min(total, start + max_steps)
    global_batch = cfg.loader.global_batch_size
    history: list[dict[str, Any]] = []
    window_losses: list[jax.Array] = []
    window_wait = wait_total = 0.0
    t_window = t_run = time.perf_counter()
    step = start
    with loader:
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
        state = loader.state_dict()
    run_s = time.perf_counter() - t_run
    if ckpt is not None and jax.process_index() == 0:
        _save_checkpoint(ckpt, params, opt_state, state, step)
    return TrainResult(
        steps=step - start,
        first_loss=history[0]["loss"],
        last_loss=history[-1]["loss"],
        samples_per_s=(step - start) * global_batch / run_s if run_s > 0 else 0.0,
        data_wait_share=wait_total / run_s if run_s > 0 else 0.0,
        history=history,
        loader_state=state,
    )
