"""The ``hf-pipeline`` command: one subcommand per operation of the two scripts.

  hf-pipeline build [--json PATH]          scripts/prebuild_cache.py
  hf-pipeline status [URL] [--json PATH]   scripts/prebuild_cache.py --status [URL]
  hf-pipeline verify [--json PATH]         scripts/prebuild_cache.py --verify
  hf-pipeline clean [--dry-run]            scripts/prebuild_cache.py --clean [--dry-run]
  hf-pipeline publish URL                  scripts/prebuild_cache.py --publish URL
  hf-pipeline train [--steps N ...]        scripts/train.py

Installed by ``pip install`` (setup.py's console_scripts) and run by
``python -m hf_pipeline``. Each subcommand sets the same namespace the script's flags
set and calls the same ``main`` (``commands.prebuild``, ``commands.train``), so their
output and exit codes are the scripts' (``hf_pipeline.cli.run``: 0 ok, 1 a runtime
failure, 2 bad usage or input, 130 interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from hf_pipeline import cli
from hf_pipeline.commands import prebuild, train

__all__ = ["exit_now", "main", "parser"]

PROG = "hf-pipeline"

#: Every operation flag of prebuild_cache.py off: a subcommand then turns its own on.
_NO_OPERATION = {"status": None, "publish": None, "verify": False, "clean": False}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage error is one line (exit 2), like every bad input."""

    def error(self, message: str) -> NoReturn:
        # argparse's default prints the whole usage block first; the project's bad input
        # is one line on stderr, and --help is where the usage lives.
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # The top level takes no flag but --help: a flag before the command is a typo
        # (argparse itself would say the command is missing).
        argv = list(sys.argv[1:] if args is None else args)
        if (
            self.prog == PROG
            and argv
            and argv[0].startswith("-")
            and argv[0] not in ("-h", "--help")
        ):
            self.error(f"unrecognized arguments: {argv[0]} (flags go after COMMAND)")
        return super().parse_known_args(argv, namespace)


def _add(subs, name: str, summary: str, epilog: str = cli.ENV_HELP) -> argparse.ArgumentParser:
    p = subs.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_common_args(p)
    return p


def parser() -> argparse.ArgumentParser:
    """The ``hf-pipeline`` command line (subcommands build, status, verify, clean, publish,
    train)."""
    top = _Parser(
        prog=PROG,
        description="Build, inspect, publish and train from the shared hf_pipeline cache "
        "(the two scripts' operations, one subcommand each; COMMAND --help for its flags).",
        epilog=cli.ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subs = top.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    p = _add(subs, "build", "build (or find) the shared cache for a config")
    prebuild.add_json_arg(p, "write the build summary as JSON to PATH ('-' = stdout)")
    p.set_defaults(**_NO_OPERATION, dry_run=False, run=prebuild.main)

    p = _add(subs, "status", "list the caches under the cache root, or those published at URL")
    p.add_argument(
        "status",
        nargs="?",
        default=True,
        metavar="URL",
        help="a store to list instead (gs://... or hf://datasets/...)",
    )
    prebuild.add_json_arg(
        p, "write the report (with URL: the published caches) as JSON to PATH ('-' = stdout)"
    )
    p.set_defaults(publish=None, verify=False, clean=False, dry_run=False, run=prebuild.main)

    p = _add(
        subs,
        "verify",
        "re-read every cache's files whole and check them against their markers' checksums",
    )
    prebuild.add_json_arg(p, "write the report as JSON to PATH ('-' = stdout)")
    p.set_defaults(**{**_NO_OPERATION, "verify": True}, dry_run=False, run=prebuild.main)

    p = _add(subs, "clean", "remove stale, failed or corrupt caches (never a live one)")
    prebuild.add_json_arg(p, "write the report as JSON to PATH ('-' = stdout)")
    prebuild.add_dry_run_arg(p, "only say what would be removed; remove nothing")
    p.set_defaults(**{**_NO_OPERATION, "clean": True}, run=prebuild.main)

    p = _add(subs, "publish", "build the cache if needed, then upload it to URL (resumable)")
    p.add_argument(
        "publish",
        metavar="URL",
        help="gs://<bucket>[/<prefix>] or hf://datasets/<org>/<repo>[/<path>]; the cache "
        "goes to URL/<name>-<fingerprint>/",
    )
    prebuild.add_json_arg(p, "write the build and publish summary as JSON to PATH ('-' = stdout)")
    p.set_defaults(status=None, verify=False, clean=False, dry_run=False, run=prebuild.main)

    p = _add(
        subs,
        "train",
        "train the demo denoiser (JAX) from the shared cache",
        epilog=train.EPILOG,
    )
    train.add_train_args(p)
    p.set_defaults(run=train.main)
    return top


def _dispatch(args: argparse.Namespace) -> int:
    return int(args.run(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-pipeline`` with ``argv`` (default: ``sys.argv[1:]``); the exit code."""
    return cli.run(_dispatch, parser(), argv)


def exit_now(code: int) -> NoReturn:
    """End a command's process with ``code`` as soon as its output is out: the streams
    and log handlers are flushed, then the process exits without the interpreter's
    shut-down.

    That shut-down collected and tore down the ~3,500 modules a build imports (torch,
    transformers, datasets) and the CUDA state: 1.5-2.6 s after the last marker on a
    GPU host (issue 28; 4.8 s on a loaded 2-CPU VM, 70 ms of it the atexit handlers and
    thread joins), and on ranks given GPU 1-3 it released CUDA graphs from the main
    thread, whose current device was GPU 0. Everything a command leaves is on disk
    before this (markers are fsync'd; ``--json`` and the report are closed files), the
    fork server of the build's workers dies with the process (PR_SET_PDEATHSIG, see
    :mod:`hf_pipeline.workers.pool`). For the build scripts' entry points only: a
    program that calls the library keeps its own shut-down, and so does ``train.py``
    (``jax.distributed`` says goodbye to its peers at exit).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
