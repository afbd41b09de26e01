"""Shared command-line plumbing for ``scripts/``: common flags, config loading, exit codes.

Exit codes: 0 success; 1 a coordination or runtime failure (timeout waiting for the
cache, the builder failed, read-only cache without a build, disk full, a store that did not
answer after every retry); 2 bad usage, config or input (one line on stderr, no traceback);
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dist.env import EnvironmentConflictError
from dist.errors import (
    BuildFailedError,
    CacheWaitTimeout,
    ForeignCacheFolderError,
    ReadOnlyCacheError,
)
from dist.layout import cache_mark
from hf_pipeline.config import Config, cache_root_variable, load_config
from hf_pipeline.config_docs import env_help
from hf_pipeline.errors import ConfigError, StoreUnreachableError, UserError

__all__ = ["add_common_args", "check_cache_root", "config_from_args", "run"]

#: The scripts' ``--help`` epilog: ``hf_pipeline.config.ENV_VARS``, rendered.
ENV_HELP = env_help()


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--set``, ``--cache-dir``, ``--num-proc``, ``-q``/``-v``."""
    parser.add_argument(
        "--config",
        default=None,
        help="YAML config (default: configs/demo.yaml); a bare name like 'coyo11m' "
        "means configs/<name>.yaml",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field, e.g. --set loader.global_batch_size=128 (repeatable)",
    )
    parser.add_argument("--cache-dir", default=None, help="cache root (build.cache_dir)")
    parser.add_argument("--num-proc", type=int, default=None, help="build.num_proc")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars, fewer logs")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def config_from_args(args: argparse.Namespace, extra: Sequence[str] = ()) -> Config:
    """Load the config named by ``args`` and apply flag overrides (flags win)."""
    overrides = list(args.overrides)
    # A blank root ("--cache-dir $DIR" with DIR unset) would be the default root, in
    # silence: a build there fills the home folder. The default is the flag left out.
    blank = args.cache_dir is not None and not args.cache_dir.strip()
    set_root = _set_value(overrides, "build.cache_dir")
    if blank or (set_root is not None and not set_root.strip()):
        source = "--cache-dir" if blank else "--set"
        raise ConfigError(
            f"build.cache_dir (from {source}) is blank: give the cache root folder, or leave "
            f"{source} out for the default root",
            field="build.cache_dir",
        )
    if args.cache_dir:
        overrides.append(f"build.cache_dir={args.cache_dir}")
    if args.num_proc is not None:
        overrides.append(f"build.num_proc={args.num_proc}")
    overrides.extend(extra)
    return load_config(args.config, overrides)


def _set_value(overrides: Sequence[str], key: str) -> str | None:
    """The value the last ``--set key=VALUE`` gives ``key`` (None: no ``--set`` of it)."""
    pairs = (o.partition("=") for o in overrides if "=" in o)
    values = [v for k, _, v in pairs if k.strip() == key]
    return values[-1] if values else None


def check_cache_root(cfg: Config, args: argparse.Namespace, *, must_exist: bool) -> None:
    """Refuse a cache root (``cfg.cache_root``) that is no folder, or that is a cache
    folder (``<root>/<name>-<fingerprint>``, :func:`dist.layout.cache_mark`) instead of
    the root that holds it, in one line naming it.

    ``must_exist``: status, verify and clean only look at a root, so a missing one is a
    mistyped path (it printed "0 caches", exit 0); a build creates it, but not below a
    file (it printed the OS's "[Errno 20] Not a directory", exit 1).

    Raises:
        ConfigError: ``build.cache_dir`` and where it came from (``--cache-dir``,
            ``--set``, ``$HF_PIPELINE_CACHE``, the config file or the default).
    """
    root = cfg.cache_root
    if getattr(args, "cache_dir", None):
        given = "--cache-dir"
    elif _set_value(args.overrides, "build.cache_dir") is not None:
        given = "--set build.cache_dir"
    elif os.environ.get("HF_PIPELINE_CACHE", "").strip():
        given = "$HF_PIPELINE_CACHE"
    elif not cfg.build.cache_dir and (var := cache_root_variable()):
        given = f"${var}"
    else:
        given = ""
    source = f" (from {given.split()[0]})" if given else ""
    inside = _inside_a_root(root)
    if inside is not None:
        what, holder = inside
        raise ConfigError(
            f"build.cache_dir {root}{source} is {what}, not a cache root: "
            f"{given or 'build.cache_dir'} takes the folder that holds it: {holder}",
            field="build.cache_dir",
        )
    if root.is_dir():
        return
    # The nearest existing path at or above the root says what is wrong with it.
    there = next((p for p in (root, *root.parents) if os.path.lexists(p)), None)
    if there == root:
        why = "not a folder; the cache root must be a folder"
    elif there is not None and not there.is_dir():
        why = f"{there} is a file, not a folder; the cache root must be a folder"
    elif must_exist:
        why = "no such folder (a build creates it; status, verify and clean do not)"
    else:
        return
    raise ConfigError(f"build.cache_dir {root}{source}: {why}", field="build.cache_dir")


#: How far up :func:`_inside_a_root` looks for a cache or a root's own folder.
_ROOT_DEPTH = 4
#: The end of a cache's or stored part's folder name (``demo-<16 hex>``, ``join-<32 hex>``).
_MARKED_NAME = re.compile(r"-[0-9a-f]{16,}$")


def _inside_a_root(root: Path) -> tuple[str, Path] | None:
    """What ``root`` is if it is a cache folder (``<root>/<name>-<fingerprint>``), one
    of hf_pipeline's own folders of a cache root (:data:`ROOT_FOLDERS`: ``.parts``, the
    content index, ...), a stored part in one, or a folder inside any of these (up to
    :data:`_ROOT_DEPTH` levels): ``(what it is, the cache root that holds it)``; None
    for a folder that may be a root.

    The build prints the cache folder and the guides name it (DEMO_CACHE): given as the
    root, status found "no caches" in it and a build made a whole cache inside it; a
    stored part's folder was said to be a cache whose root is ``.parts``, and
    ``.parts`` as a root listed every stored part as a stale cache (outside testers).
    Only folders the project marked as caches, or named as its own, count.
    """
    from hf_pipeline.cache.layout import ROOT_FOLDERS

    found: Path | None = None  # the outermost cache or own folder at or above root
    # "." inside .parts is inside it too, and so is a symlink to .parts or to a cache
    # (a tester's `ln -s <root>/.parts partslink` was taken as a root): the path as
    # given, then the one its links lead to.
    for absolute in dict.fromkeys([Path(os.path.abspath(root)), Path(os.path.realpath(root))]):
        for path in [absolute, *absolute.parents][:_ROOT_DEPTH]:
            named = _MARKED_NAME.search(path.name)  # lists only folders named as a cache
            if path.name in ROOT_FOLDERS or (named and cache_mark(path) is not None):
                found = path
        if found is not None:
            break
    if found is None:
        return None
    holder = found.parent
    if found.name in ROOT_FOLDERS:
        own = f"{found.name}, {ROOT_FOLDERS[found.name]} of the cache root {holder}"
        what = f"hf_pipeline's own folder ({own})" if found == absolute else f"inside {own}"
    elif found == absolute:
        what = f"a cache folder ({found.name})"
    else:
        what = f"inside the cache folder {found.name}"
    return what, holder


def _setup_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:
        # httpx2: huggingface_hub's HTTP client logs every request at INFO under it.
        for noisy in ("datasets", "transformers", "httpx", "httpx2", "jax._src", "absl"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.quiet:
        os.environ.setdefault("TQDM_DISABLE", "1")


def run(
    main: Callable[[argparse.Namespace], int | None],
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv``, run ``main(args)``, and turn known errors into exit codes.

    Returns:
        The process exit code (also see the module docstring).
    """
    args = parser.parse_args(argv)
    _setup_logging(args)
    stdout = sys.stdout
    sys.stdout = _ReaderMayLeave(stdout)
    try:
        return int(main(args) or 0)
    except StoreUnreachableError as exc:
        # Before UserError (its base): the store is down, the input may be fine.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (UserError, EnvironmentConflictError, ForeignCacheFolderError) as exc:
        # the input, config or launcher; or a cache folder that is another cache's
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BuildFailedError as exc:  # a waiting rank: the builder's code
        print(f"error: {exc}", file=sys.stderr)
        return 2 if exc.input_error else 1
    except (CacheWaitTimeout, ReadOnlyCacheError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # Disk full, read-only or unreachable storage: the OS's own words, one line.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


class _ReaderMayLeave:
    """Standard output whose reader may stop reading (``status | head -1``,
    ``clean | grep -q removed``): the first write or flush into the closed pipe points
    the descriptor at ``/dev/null`` and the command goes on to its end and its own exit
    code (it said ``error: [Errno 32] Broken pipe``, exit 1, after a clean that
    succeeded; and a verify cut short by its reader would not have checked the rest)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_left()

    def _reader_left(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
