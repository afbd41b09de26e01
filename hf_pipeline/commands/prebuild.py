"""Build (or find) the shared cache for a config, before a training job starts.

The code behind ``hf-pipeline build | status | verify | clean | publish`` and
``scripts/prebuild_cache.py`` (one flag per operation there, one subcommand here): the
same ``main(args)`` serves both, so they cannot drift. ``parser()`` is the script's
command line; ``add_json_arg`` and ``add_dry_run_arg`` are the flags the subcommands share
with it. Exit codes (through ``hf_pipeline.cli.run``): 0 ok, 1 coordination failure /
store unreachable / problems found by --verify / something --clean could not remove,
2 bad input, 130 interrupted. docs/operations.md says what --status, --verify and
--clean show and touch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dist.safepath import shown
from hf_pipeline import cli

__all__ = ["add_dry_run_arg", "add_json_arg", "main", "parser"]

#: --json's help in the script, where one flag serves every operation.
JSON_HELP = (
    "write the build summary (with --status [URL] / --verify / --clean: their report) "
    "as JSON to PATH ('-' = stdout)"
)


def add_json_arg(p: argparse.ArgumentParser, help: str = JSON_HELP) -> None:
    """``--json PATH``: the summary or report as JSON (``-``: stdout)."""
    p.add_argument("--json", metavar="PATH", help=help)


def add_dry_run_arg(
    p: argparse.ArgumentParser, help: str = "with --clean: only say what would be removed"
) -> None:
    """``--dry-run`` of the clean operation (``help``: the script's; the subcommand
    ``clean`` passes its own, without the script's ``--clean``)."""
    p.add_argument("--dry-run", action="store_true", help=help)


def parser(prog: str = "prebuild_cache.py") -> argparse.ArgumentParser:
    """The command line of ``scripts/prebuild_cache.py`` (one flag per operation)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=cli.ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_common_args(p)
    add_json_arg(p)
    ops = p.add_mutually_exclusive_group()
    ops.add_argument(
        "--status",
        nargs="?",
        const=True,
        default=None,
        metavar="URL",
        help="list the caches under the cache root, or those published at URL "
        "(gs://... or hf://datasets/...)",
    )
    ops.add_argument(
        "--publish",
        metavar="URL",
        help="build the cache if needed, then upload it to URL/<name>-<fingerprint>/ "
        "(gs://<bucket>[/<prefix>] or hf://datasets/<org>/<repo>[/<path>]); resumable",
    )
    ops.add_argument(
        "--verify",
        action="store_true",
        help="re-read every cache's files, and every stored part's, whole and check them "
        "against their markers' checksums (docs/integrity.md); a corrupt cache is then "
        "reported by --status, and --clean removes it and a corrupt part",
    )
    ops.add_argument(
        "--clean",
        action="store_true",
        help="remove stale, failed or corrupt caches (never a live one, never a folder "
        "without the hf_pipeline mark, never through a symlink) and files no marker lists",
    )
    add_dry_run_arg(p)
    return p


#: Problems of one cache printed on its line by ``--verify`` (all of them in ``--json``):
#: a cache whose every file differs is one readable line, not thousands of names.
VERIFY_SHOWN = 10


#: Corrupt stored units named on ``--status``'s summary line (all of them in ``--json``).
SUMMARY_SHOWN = 3


def _some(problems: Sequence[str]) -> str:
    """The first :data:`VERIFY_SHOWN` problems joined, and how many more there are."""
    head = "; ".join(problems[:VERIFY_SHOWN])
    more = len(problems) - VERIFY_SHOWN
    return head + (f"; ... and {more} more (all of them: --json)" if more > 0 else "")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _print_kept(foreign, out) -> None:
    """The line under a work or job folder naming the entries the project did not
    write there (never removed); none when there are none."""
    if foreign:
        print(f"    not hf_pipeline's, kept: {_safe(', '.join(foreign))}", file=out)


def _safe(text: object) -> str:
    """``text`` for one terminal line: as it is when printable, else escaped and bounded
    (:func:`dist.safepath.shown`). Names, hosts and problems come from shared roots and
    stores: a newline or an ANSI escape in them must not forge a row."""
    s = str(text)
    return s if s.isprintable() else shown(s)


def _print_summary(result, out) -> None:
    s = result.summary()
    if result.built:
        how = f"built in {s['seconds']:.1f} s"
    elif result.pulled:
        how = f"pulled in {s['seconds']:.1f} s"
    else:
        how = f"found ({s['seconds']:.1f} s)"
    print(f"cache       {s['cache_dir']}  [{how}]", file=out)
    print(f"fingerprint {s['fingerprint']}", file=out)
    print(f"rows        {s['rows_in']} latent rows in -> {s['rows_out']} kept", file=out)
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "none"
    print(f"dropped     {dropped}", file=out)
    for reason, bad in sorted((result.report.get("bad_rows") or {}).items()):
        if bad.get("count"):
            keys = ", ".join(map(str, bad.get("first_keys", [])))
            print(f"bad rows    {reason} {bad['count']} (first keys: {keys})", file=out)
    if s.get("metadata"):  # the caption parquet: discovery may have chosen it
        print(f"meta file   {_safe(s['metadata'])}", file=out)
    dup, null = s["duplicate_meta_rows"], s["null_key_meta_rows"]
    print(
        f"metadata    {dup} rows repeating an earlier key ignored (first wins), "
        f"{null} with a null key dropped",
        file=out,
    )
    fetch = result.report.get("fetch") or {}
    if fetch.get("files"):
        print(
            f"fetched     {fetch.get('files')} files, {_human_bytes(fetch.get('bytes', 0))}, "
            f"{fetch.get('mean_mb_s', 0):.1f} MB/s, {fetch.get('retries', 0)} retries",
            file=out,
        )


def _describe(st) -> str:
    from dist.inventory import CacheState

    if st.state is CacheState.BUILDING:
        who = f"{_safe(st.builder_host)}/{st.builder_pid}" if st.builder_host else "?"
        return f"building by {who} ({_safe(st.heartbeat_stage or '-')})"
    if st.state is CacheState.PARTIAL:
        return f"partial ({', '.join(st.stages_done)} done)"
    return str(st.state)


def _unfinished(unit, store: str) -> str:
    """The status line of a stored unit whose marker was never published, or was
    retired as damaged."""
    st = unit.status
    who = f"{_safe(st.builder_host)}/{st.builder_pid}" if st.builder_host else None
    if unit.retired:
        # Not "abandoned": a build found its files damaged and moved its marker aside
        # (dist.coordinator.retire_damaged / retire_marker); it is made again, not lost.
        how = (
            f"being built again by {who or '?'} (its lease is live)"
            if unit.builder == "live"
            else "the next build that needs it makes it again (--clean removes what is "
            "left of it meanwhile)"
        )
        return f"retired unit {store}/{_safe(st.path.name)}: retired as damaged: {how}"
    if unit.builder == "live":
        how = f"being built by {who or '?'} (its lease is live)"
    elif who:
        how = f"abandoned: its builder {who} holds a stale lease (--clean removes it)"
    else:
        how = "abandoned: no builder holds its lease (--clean removes it)"
    return f"unfinished unit {store}/{_safe(st.path.name)}: {how}"


def _write_json(path: str, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


def _admin(args, cfg) -> int:
    from dist import inventory
    from dist.kvstore import JOBS_DIR
    from hf_pipeline.build.part_store import PARTS_DIR
    from hf_pipeline.cache.layout import ROOT_FOLDERS, STAGES, STAGING_DIR

    root = cfg.cache_root
    # Watch leases a little longer than two heartbeats to tell live builders from dead.
    observe = 2.5 * cfg.coord.heartbeat_interval
    # Human lines go to stderr when the JSON goes to stdout.
    out = sys.stderr if args.json == "-" else sys.stdout
    if args.status:
        rows = inventory.list_caches(root, stages=STAGES, observe_s=observe)
        units = inventory.list_store(root / PARTS_DIR, observe_s=observe)
        ignored = inventory.ignored_entries(root, own=ROOT_FOLDERS)
        work = inventory.list_work(root, STAGING_DIR, observe_s=observe)
        jobs = inventory.list_jobs(root, JOBS_DIR)
        if args.json:
            _write_json(args.json, {
                "root": str(root),
                "caches": [st.as_dict() for st in rows],
                "parts": [u.as_dict() for u in units],
                "ignored": [{"path": str(p), "why": why} for p, why in ignored],
                "staging": [w.as_dict() for w in work],
                "jobs": [j.as_dict() for j in jobs],
            })  # fmt: skip
        if not rows:
            print(f"no caches under {root}", file=out)
        else:
            print(f"{'cache':34} {'fingerprint':17} {'state':34} {'size':>10} {'age':>8}", file=out)
        for st in rows:
            print(
                f"{_safe(st.path.name):34} {_safe(st.fingerprint or '?'):17} {_describe(st):34} "
                f"{_human_bytes(st.size_bytes):>10} {st.age_s / 3600:7.1f}h",
                file=out,
            )
            if st.shared_files:
                print(
                    f"    shares {st.shared_parts} part(s), {st.shared_files} file(s), "
                    f"{_human_bytes(st.shared_bytes)} (stored once) with "
                    f"{_safe(', '.join(st.shared_with))}",
                    file=out,
                )
            for problem in st.problems:
                print(f"    {_safe(problem)}", file=out)
        if units:
            # Complete units no cache links: a later build of their inputs still reuses
            # them, and --clean still removes them (docs/cli.md): one clause says both.
            unused = [
                u for u in units if u.status.state is inventory.CacheState.COMPLETE and not u.in_use
            ]
            line = (
                f"stored parts ({PARTS_DIR}): {len(units)} unit(s), "
                f"{_human_bytes(sum(u.status.size_bytes for u in units))}"
            )
            if unused:
                # While a cache of the root is being built, --clean keeps them (the build
                # may link them): said here as clean says it (a tester saw them differ).
                building = [st for st in rows if st.state is inventory.CacheState.BUILDING]
                removal = (
                    f"--clean keeps them while {_safe(building[0].path.name)} is being built"
                    if building
                    else "--clean removes them"
                )
                line += (
                    f"; {len(unused)} stored unit(s) used by no cache "
                    f"({_human_bytes(sum(u.status.size_bytes for u in unused))}): "
                    f"reusable by a later build; {removal}"
                )
            corrupt = [u for u in units if u.status.state is inventory.CacheState.CORRUPT]
            if corrupt:  # named as --verify's part lines name them
                names = [f"{PARTS_DIR}/{_safe(u.status.path.name)}" for u in corrupt]
                more = (
                    f" (+{len(names) - SUMMARY_SHOWN} more)" if len(names) > SUMMARY_SHOWN else ""
                )
                line += (
                    f"; {len(corrupt)} corrupt: {', '.join(names[:SUMMARY_SHOWN])}{more} "
                    "(--verify names their problems; --clean removes them)"
                )
            print(line, file=out)
        for u in units:
            if u.unfinished or u.retired:
                print(f"    {_unfinished(u, PARTS_DIR)}", file=out)
        for w in work:
            rel = f"{STAGING_DIR}/{_safe(w.path.name)}"
            what = (
                "live (its cache's builder holds the lease)"
                if w.state == "live"
                else "abandoned (no live builder): --clean removes it"
            )
            print(
                f"pull staging {rel} for {_safe(w.cache)}: {what}, "
                f"{_human_bytes(w.size_bytes)}, {w.age_s / 3600:.1f}h old",
                file=out,
            )
            _print_kept(w.foreign, out)
        for j in jobs:
            what = {
                "finished": "finished (every rank done with it): --clean removes it",
                "abandoned": "abandoned (every rank that posted has exited): --clean removes it",
                "live": "live (a rank may still read it)",
            }[j.state]
            if j.state == "live" and not j.members:
                what = "unknown (its posts do not name their ranks: written by an earlier release)"
            print(
                f"job {JOBS_DIR}/{_safe(j.path.name)}: {what}, {j.rounds} round(s), "
                f"ranks {_safe(', '.join(j.members)) or '?'}",
                file=out,
            )
            _print_kept(j.foreign, out)
        for path, why in ignored:
            print(f"not a cache: {_safe(path.name)}: {_safe(why)}", file=out)
        return 0
    if args.verify:
        import time

        # A bar on stderr when someone watches it (a terminal) or asked for detail (-v).
        progress = not args.quiet and (sys.stderr.isatty() or args.verbose)
        bad = files = nbytes = 0
        report_json = []
        t0 = time.monotonic()
        caches = inventory.list_caches(root, stages=STAGES)
        memo: dict = {}  # a file the caches and the stored parts share is read once
        shared = 0
        for st in caches:
            found = inventory.verify_cache(
                st.path, STAGES, progress=progress, record=True, memo=memo
            )
            shared += found.shared
            bad += bool(found.problems)
            report_json.append(
                {
                    "path": str(st.path),
                    "ok": not found.problems,
                    "problems": list(found.problems),
                    "notes": list(found.notes),
                    "files": found.files,
                    "bytes": found.bytes,
                    "shared_files": found.shared,
                    "seconds": round(found.seconds, 3),
                }
            )
            files += found.files
            nbytes += found.bytes
            read = _verify_read(found)
            verdict = "ok" if not found.problems else _safe(_some(found.problems))
            print(f"{_safe(st.path.name)}: {verdict}{read}", file=out)
            for note in found.notes:
                print(f"    {_safe(note)}", file=out)
        # The stored parts too: a part damaged deep inside a file (past the first and
        # last MiB that a build's reuse check reads) is found here, and recorded, so
        # that `clean` removes it and the next build makes it again (docs/integrity.md).
        parts_json, damaged = [], 0
        for unit in inventory.list_store(root / PARTS_DIR):
            st = unit.status
            if st.state not in (inventory.CacheState.COMPLETE, inventory.CacheState.CORRUPT):
                continue  # being built, or nothing published to check
            kind = st.path.name.split("-", 1)[0]
            found = inventory.verify_cache(
                st.path, [kind], progress=progress, record=True, memo=memo
            )
            shared += found.shared
            users = [c.name for c in inventory.linked_by(st.path, [c.path for c in caches])]
            damaged += bool(found.problems)
            files += found.files
            nbytes += found.bytes
            parts_json.append({
                "path": str(st.path), "ok": not found.problems,
                "problems": list(found.problems), "linked_by": users,
                "files": found.files, "bytes": found.bytes, "shared_files": found.shared,
                "seconds": round(found.seconds, 3),
            })  # fmt: skip
            if found.problems:
                print(
                    f"{PARTS_DIR}/{_safe(st.path.name)}: {_safe(_some(found.problems))} "
                    f"(linked by {_safe(', '.join(users)) or 'no cache'})",
                    file=out,
                )
        seconds = time.monotonic() - t0
        print(
            f"verified {len(caches)} cache(s), {bad} with problems: {files} files, "
            f"{_human_bytes(nbytes)} in {seconds:.1f} s "
            f"({nbytes / 1e9 / seconds if seconds > 0 else 0.0:.2f} GB/s)"
            + (f"; {shared} hard-linked files checked by that read" if shared else ""),
            file=out,
        )
        if args.json:
            _write_json(args.json, {"root": str(root), "caches": report_json, "parts": parts_json})
        return 1 if bad or damaged else 0
    report = inventory.clean(
        root,
        dry_run=args.dry_run,
        stages=STAGES,
        observe_s=max(observe, 1.0),
        stores=(PARTS_DIR,),
        work=(STAGING_DIR,),
        jobs=(JOBS_DIR,),
        own=ROOT_FOLDERS,
    )
    verb = "would remove" if args.dry_run else "removed"
    for path in report.removed:
        print(f"{verb} {path}", file=out)
    for path, why in report.left:
        print(f"left {path}: {why}", file=out)
    print(f"{verb} {len(report.removed)} item(s) under {root}", file=out)
    if args.json:
        _write_json(args.json, {
            "root": str(root),
            "dry_run": bool(args.dry_run),
            "removed": [str(p) for p in report.removed],
            "left": [{"path": str(p), "why": why} for p, why in report.left],
        })  # fmt: skip
    return 1 if any(why.startswith("could not remove") for _, why in report.left) else 0


def _verify_read(found) -> str:
    """What ``verify`` read of one cache or stored part, for its line ("" if nothing)."""
    parts = []
    if found.files:
        parts.append(
            f"{found.files} files, {_human_bytes(found.bytes)} read whole in "
            f"{found.seconds:.1f} s, {found.gb_per_s:.2f} GB/s"
        )
    if found.shared:
        parts.append(f"{found.shared} hard-linked files already read")
    return f" ({'; '.join(parts)})" if parts else ""


def _published_status(url: str, cfg, json_path: str | None) -> int:
    """Print the caches published at ``url``; with ``json_path``, also write them as
    ``{"url": ..., "caches": [PublishedStatus fields]}`` (``-``: stdout, the table to
    stderr)."""
    import time

    from hf_pipeline.cache.layout import STAGES
    from hf_pipeline.publish.find import list_published
    from hf_pipeline.stores.factory import open_store

    rows = list_published(open_store(url, data_config=cfg.data), STAGES)
    out = sys.stderr if json_path == "-" else sys.stdout
    location = None
    if not rows:
        # The URL may be a published cache folder itself (what loader.stream_from takes):
        # it said "no published caches" of a cache that streams fine (outside tester).
        parent, _, name = url.rstrip("/").rpartition("/")
        if name and "://" in parent and not parent.endswith(":/"):
            rows = [
                r
                for r in list_published(open_store(parent, data_config=cfg.data), STAGES)
                if r.name == name
            ]
            location = parent if rows else None
    if json_path:
        doc: dict[str, Any] = {"url": url, "caches": [dataclasses.asdict(r) for r in rows]}
        if location is not None:
            doc["location"] = location
        _write_json(json_path, doc)
    if not rows:
        print(f"no published caches at {url}", file=out)
        return 0
    if location is not None:
        print(f"{url} is a published cache folder (its location: {location})", file=out)
    print(
        f"{'cache':34} {'fingerprint':17} {'state':10} {'rows':>9} {'size':>10}  published",
        file=out,
    )
    for st in rows:
        when = (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(st.published_at))
            if st.published_at
            else "-"
        )
        count = "-" if st.rows is None else str(st.rows)
        size = "-" if st.size_bytes is None else _human_bytes(st.size_bytes)
        by = f" by {_safe(st.host)}" if st.host else ""
        print(
            f"{_safe(st.name):34} {_safe(st.fingerprint):17} {st.state:10} {count:>9} "
            f"{size:>10}  {when}{by}",
            file=out,
        )
        if st.problem:
            print(f"    {_safe(st.problem)}", file=out)
    return 0


def _print_publish(report, out) -> None:
    verb = {
        "published": "published",
        "unchanged": "already there, unchanged",
        "already_published": "already published by another build; left as it is",
    }[report.state]
    print(f"published   {report.url}  [{verb}]", file=out)
    print(
        f"uploaded    {report.uploaded_files} of {report.files} files, "
        f"{_human_bytes(report.uploaded_bytes)} in {report.seconds:.1f} s "
        f"({report.skipped_files} already there, {report.copied_files} copied in the store)",
        file=out,
    )


def _check_json_path(path: Path) -> None:
    """Raise a ConfigError naming ``--json`` if ``path`` cannot be written; creates
    nothing (a build may take hours: found only after it, the report was lost).

    Root passes ``os.access`` everywhere, so a missing file is tried as an unnamed one
    (``O_TMPFILE``: never visible, gone at close); a filesystem without it (NFS, /proc)
    is judged by ``statvfs``: read-only, or no blocks and no inodes (/proc, /sys: the
    OS's "No such file or directory" only after the build).
    """
    from hf_pipeline.errors import ConfigError

    folder = path.parent
    # The nearest existing path at or above the folder: a file there is not a folder.
    there = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), None)
    if path.is_dir():
        why: str | None = "is a directory"
    elif there is not None and not there.is_dir():
        why = f"{there} is a file, not a folder"
    elif there != folder:
        why = f"its folder {folder} does not exist"
    elif path.exists():
        why = _unwritable(lambda: os.open(path, os.O_WRONLY | os.O_APPEND), "cannot be written")
    else:
        why = _folder_unwritable(folder)
    if why:
        raise ConfigError(f"--json {path}: {why}")


def _unwritable(opener, what: str) -> str | None:
    """None when ``opener()`` opens a descriptor (closed at once), else ``what`` and the
    OS's words."""
    try:
        os.close(opener())
    except OSError as exc:
        return f"{what} ({exc.strerror})"
    return None


def _folder_unwritable(folder: Path) -> str | None:
    """Why no new file can be written in ``folder`` (an existing folder), or None."""
    import errno

    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable"
    vfs = os.statvfs(folder)
    if vfs.f_flag & os.ST_RDONLY:
        return f"its folder {folder} is on a read-only filesystem"
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            os.close(os.open(folder, tmpfile | os.O_WRONLY, 0o600))
            return None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                return f"its folder {folder} is not writable ({exc.strerror})"
    if vfs.f_blocks == 0 and vfs.f_files == 0:
        return f"its folder {folder} cannot hold files (a kernel filesystem like /proc)"
    return None


def main(args: argparse.Namespace) -> int:
    """Run the operation ``args`` names (build, status, verify, clean, publish); the exit code."""
    from hf_pipeline.errors import ConfigError

    if args.dry_run and not args.clean:
        # Without this, a mistyped `--dry-run` alone would run a whole build.
        raise ConfigError("--dry-run works only with --clean (it would otherwise build)")
    if args.json and args.json != "-":
        _check_json_path(Path(args.json))  # before the work, not after it
    cfg = cli.config_from_args(args)
    if isinstance(args.status, str):
        return _published_status(args.status, cfg, args.json)
    admin = bool(args.status or args.verify or args.clean)
    cli.check_cache_root(cfg, args, must_exist=admin)
    # Absolute from here on: every JSON report (the build's cache_dir and hashing index,
    # status/verify/clean's paths) is read by tools run from other folders.
    cfg = dataclasses.replace(
        cfg, build=dataclasses.replace(cfg.build, cache_dir=str(cfg.cache_root.absolute()))
    )
    if admin:
        return _admin(args, cfg)
    # `--json -`: stdout carries the JSON document alone (`| jq` works); the human
    # summary goes to stderr then, as _admin's lines do.
    out = sys.stderr if args.json == "-" else sys.stdout
    from hf_pipeline.build.prepare import prepare_cache

    if args.publish:
        from hf_pipeline.stores.factory import open_store

        # A bad URL or a missing bucket fails before the build, not after it.
        open_store(args.publish, data_config=cfg.data).check_location()
    result = prepare_cache(cfg, progress=not args.quiet)
    _print_summary(result, out)
    summary = result.summary()
    if args.publish:
        from hf_pipeline.publish.upload import publish_cache

        report = publish_cache(
            result.cache_dir, result.fingerprint, args.publish, data_config=cfg.data
        )
        _print_publish(report, out)
        summary["publish"] = report.as_dict()
    if args.json:
        _write_json(args.json, summary)
    return 0
