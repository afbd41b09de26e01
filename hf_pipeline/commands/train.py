"""Train a small caption-conditioned latent denoiser (JAX) from the shared cache.

The code behind ``hf-pipeline train`` and ``scripts/train.py``: the same ``main(args)``
serves both. Every rank calls the same build: one builds (rank 0), the others wait for
the 'converted' and 'filtered' markers, then all memory-map the cache. Logs loss,
samples/s and the share of step time spent waiting for data. Exit codes through
``hf_pipeline.cli.run`` (0 ok, 1 a runtime failure, 2 bad input, 130 interrupted).
"""

from __future__ import annotations

import argparse
import math

from hf_pipeline import cli

__all__ = ["EPILOG", "add_train_args", "loss_change", "main", "parser"]

#: The environment table of ``--help`` (``JAX_COORDINATOR_ADDRESS`` is one of its rows).
EPILOG = cli.ENV_HELP


def parser(prog: str = "train.py") -> argparse.ArgumentParser:
    """The command line of ``scripts/train.py``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_common_args(p)
    add_train_args(p)
    return p


def add_train_args(p: argparse.ArgumentParser) -> None:
    """``--steps``, ``--batch-size``, ``--checkpoint``, ``--checkpoint-every``."""
    p.add_argument("--steps", type=int, default=None, help="training steps (train.steps)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="global batch size (loader.global_batch_size)"
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="folder of the run's checkpoints (Orbax): resume from the latest, save to it "
        "(train.checkpoint)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="save every N steps and at the end; 0: only at the end "
        "(train.checkpoint_every, default 100, in [0, 10**9])",
    )


def main(args: argparse.Namespace) -> int:
    """Build or find the cache (every rank), or stream a published one
    (``loader.stream_from``), then train on it; 0 when done."""
    extra = []
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.batch_size is not None:
        extra.append(f"loader.global_batch_size={args.batch_size}")
    if args.checkpoint:
        extra.append(f"train.checkpoint={args.checkpoint}")
    if args.checkpoint_every is not None:
        extra.append(f"train.checkpoint_every={args.checkpoint_every}")
    cfg = cli.config_from_args(args, extra)
    if not cfg.loader.stream_from:  # streaming reads no local cache
        cli.check_cache_root(cfg, args, must_exist=False)

    from dist.env import detect
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.trainer.loop import jax_distributed, train

    process = detect()
    lead = process.rank == 0

    def log(rec):
        if lead:
            print(
                f"step {rec['step']:6d}  epoch {rec['epoch']:3d}  loss {rec['loss']:.4f}  "
                f"{rec['samples_per_s']:8.0f} samples/s  data wait {100 * rec['data_wait']:5.1f}%",
                flush=True,
            )

    # JAX first, as in most training scripts: the build spawns (never forks) its
    # workers, and waiting ranks are woken through JAX's key-value store. Every rank
    # leaves jax.distributed in order at the end, so a good run ends quietly.
    with jax_distributed(process):
        if cfg.loader.stream_from:
            # A published cache read in place (loader.stream_from): no build, no local
            # copy; each rank fetches only its share of each batch.
            from hf_pipeline.read.stream import open_stream

            opened = open_stream(cfg.loader, cfg.data)
            if lead:
                print(
                    f"[rank {process.rank}/{process.world_size}] streaming "
                    f"{cfg.loader.stream_from} ({opened.num_rows} rows, cache limit "
                    f"{cfg.loader.stream_cache_bytes} bytes)",
                    flush=True,
                )
        else:
            result = prepare_cache(cfg, process=process, progress=lead and not args.quiet)
            if lead:
                how = "built" if result.built else "found"
                print(
                    f"[rank {process.rank}/{process.world_size}] cache {how}: "
                    f"{result.cache_dir} ({result.report['rows_out']} rows, "
                    f"{result.seconds:.1f} s)",
                    flush=True,
                )
            opened = open_sample_source(result.layout, result.fingerprint)
        with opened as source:
            out = train(
                cfg,
                source,
                process_index=process.rank,
                process_count=process.world_size,
                on_log=log,
            )
    if lead and out.steps == 0:  # a finished checkpointed run, run again
        print(f"already at step {out.step} of {cfg.train.steps}: nothing to train", flush=True)
    elif lead:
        print(
            f"done: {out.steps} steps, loss {out.first_loss:.4f} -> {out.last_loss:.4f} "
            f"({loss_change(out.first_loss, out.last_loss)}), "
            f"{out.samples_per_s:.0f} samples/s, "
            f"data wait {100 * out.data_wait_share:.1f}% of step time",
            flush=True,
        )
    return 0


def loss_change(first: float, last: float) -> str:
    """The summary line's words for the loss going from ``first`` to ``last``:
    ``"20% lower"``, ``"2% higher"`` (a resumed run's loss can rise), ``"unchanged"``
    (under half a percent either way), ``"from 0"`` (no relative change of a zero loss),
    ``"not a number"`` (a NaN loss)."""
    if math.isnan(first) or math.isnan(last):
        return "not a number"
    if first == 0:
        return "unchanged" if last == 0 else "from 0"
    pct = round(100 * (last - first) / abs(first))
    if pct == 0:
        return "unchanged"
    return f"{abs(pct)}% {'higher' if pct > 0 else 'lower'}"
