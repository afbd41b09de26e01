"""dist.inventory through the real CLI (``prebuild_cache.py --status/--verify/--clean``).

The caches are made by real builds (tests/procs/dist_rank.py under ``ensure_built``:
completed, SIGKILLed, failed; the session's demo cache for ``datasets`` files) and sit in
a root that also holds user folders and symlinks, as a shared ``HF_PIPELINE_CACHE`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dist.markers import check_marker, read_json
from tests.conftest import PYTHON, REPO, script_env
from tests.helpers.dist_job import Job
from tests.helpers.victims import Victim

FAST = ["--poll", "0.05", "--lease-timeout", "1.0", "--heartbeat", "0.2"]
# The CLI watches leases for 2.5 heartbeat intervals (--clean: at least 1 s).
CLI_TIMING = ["--set", "coord.heartbeat_interval=0.2"]


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path / "job")
    yield j
    j.kill_all()


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, str(REPO / "scripts" / "prebuild_cache.py"), "--cache-dir", str(root),
         *CLI_TIMING, *args],
        env=script_env(), capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


def _complete(job: Job, folder: Path, fingerprint: str) -> dict:
    (r,) = job.wait([job.start(folder, 0, "--fingerprint", fingerprint, *FAST, "--size-mb", "0.1")])
    assert r["ok"], r
    return r["markers"]


def _failed(job: Job, folder: Path, fingerprint: str) -> None:
    (r,) = job.wait(
        [job.start(folder, 0, "--fingerprint", fingerprint, *FAST, "--fail-stage", "filtered")]
    )
    assert r["error_type"] == "RuntimeError", r


def _killed(job: Job, folder: Path, fingerprint: str) -> int:
    proc = job.start(folder, 0, "--fingerprint", fingerprint, *FAST, "--hold", "build-converted:60")
    job.wait_for_signal("build-converted")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    return proc.pid


def _tree(path: Path) -> dict[str, bytes | str | None]:
    """Every entry under ``path`` (not following symlinks): file bytes, link targets."""
    out: dict[str, bytes | str | None] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(path).as_posix()
            if p.is_symlink():
                out[rel] = f"-> {os.readlink(p)}"
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = None
    return out


def _trash(path: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(path)
        for n in dirs + files
        if ".trash-" in n
    ]


def test_clean_removes_only_caches_the_project_marked_and_follows_no_symlink(job, tmp_path):
    root, outside = tmp_path / "shared", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    # User data beside the caches (HF_PIPELINE_CACHE pointing at a shared parent).
    (root / "docs").mkdir()
    (root / "docs" / "lease-agreement.pdf").write_bytes(b"%PDF signed")
    (root / "proj" / "package").mkdir(parents=True)
    (root / "proj" / "package.json").write_text('{"name": "proj"}')
    (root / "proj" / "package" / "index.js").write_text("export {}")
    # Named like a cache, holding names like a cache's, but nothing the project wrote:
    # a marker-looking JSON of another schema, a stage-looking folder, a "lease".
    fake = root / "demo-00000000000000aa"
    (fake / "converted").mkdir(parents=True)
    (fake / "converted.json").write_text('{"schema_version": 7, "fingerprint": "00000000000000aa"}')
    (fake / "lease").write_text("lease of flat 3")
    (fake / "failed-attempts.json").write_text("[]")
    # Real caches: complete, killed in its build, failed in its build.
    complete = root / "demo-00000000000000c0"
    markers = _complete(job, complete, "00000000000000c0")
    killed = root / "demo-00000000000000d0"
    _killed(job, killed, "00000000000000d0")
    failed = root / "demo-00000000000000f0"
    _failed(job, failed, "00000000000000f0")
    # Outside the root: a complete cache with bookkeeping a --clean would drop, a failed
    # cache, and folders of precious files; the root links to each.
    far_complete = outside / "demo-00000000000000e0"
    _complete(job, far_complete, "00000000000000e0")
    (far_complete / "lease.takeover-0000000000000000-0").write_text("")
    (far_complete / "heartbeat-0000000000000000.json").write_text('{"counter": 1}')
    far_failed = outside / "demo-00000000000000e1"
    _failed(job, far_failed, "00000000000000e1")
    for name in ("precious", "precious2", "precious3", "precious4", "precious5"):
        (outside / name).mkdir()
        (outside / name / "keep.txt").write_text(name)
    # Links out of the caches --clean removes whole: it deletes the links, not their targets.
    (dead_stage,) = [p for p in killed.iterdir() if p.name.startswith("converted.")]
    os.symlink(outside / "precious4", dead_stage / "escape")
    os.symlink(outside / "precious5" / "keep.txt", failed / "notes.txt")
    os.symlink(far_complete, root / "demo-00000000000000e0")
    os.symlink(far_failed, root / "demo-00000000000000e1")
    # Inside a real cache: a link named like an unpublished stage folder, one in a
    # published stage folder, both pointing out; and a link left by an earlier --clean.
    os.symlink(outside / "precious", complete / "converted.0123456789abcdef")
    stage_dir = complete / markers["converted"]["directory"]
    os.symlink(outside / "precious2", stage_dir / "escape")
    os.symlink(outside / "precious3", root / ".demo-00000000000000e9.trash-0a1b2c3d")
    before_outside = _tree(outside)
    user = {n: _tree(root / n) for n in ("docs", "proj", fake.name)}

    p = _cli(root, "--clean", "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"would remove {killed}" in p.stdout and f"would remove {failed}/" in p.stdout
    assert f"would remove {failed}\n" not in p.stdout  # it holds a link of the user's
    for name in ("docs", "proj", fake.name, "demo-00000000000000e0", "demo-00000000000000e1"):
        assert f"would remove {root / name}\n" not in p.stdout, p.stdout
    assert killed.exists() and failed.exists()

    p = _cli(root, "--clean")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not killed.exists()  # a real dead cache: gone
    # A failed one, but for the link the user put in it: only what the project wrote.
    assert sorted(os.listdir(failed)) == [".hf_pipeline-cache.json", "notes.txt"]
    assert f"left {failed}: kept" in p.stdout and "notes.txt' (a symbolic link)" in p.stdout
    assert {n: _tree(root / n) for n in user} == user  # user data: untouched
    assert _tree(outside) == before_outside  # nothing behind a link touched
    assert (root / "demo-00000000000000e0").is_symlink()  # links left as they are...
    assert (root / "demo-00000000000000e1").is_symlink()
    assert (complete / "converted.0123456789abcdef").is_symlink()
    assert "symbolic link" in p.stdout  # ...and reported
    assert _trash(root) == []  # the earlier run's trash link too (only the link)
    for stage, m in markers.items():
        marker, why = check_marker(
            complete / f"{stage}.json", fingerprint="00000000000000c0", base_dir=complete,
            stage=stage, verify=True,
        )  # fmt: skip
        assert marker is not None and marker.to_dict() == m, why


def test_a_cache_of_an_earlier_release_is_known_by_its_marker_only(job, tmp_path):
    """Without the identity file (a cache written before it existed), a folder is a cache
    only if a marker of the project's schema and of the folder's fingerprint says so."""
    root = tmp_path / "root"
    old = root / "demo-00000000000000b0"
    _complete(job, old, "00000000000000b0")
    (old / ".hf_pipeline-cache.json").unlink(missing_ok=True)
    # The same marker in a folder whose name names another fingerprint: not a cache.
    shutil.copytree(old, root / "demo-00000000000000b1")
    (root / "demo-00000000000000b1" / "lease.takeover-x-0").write_text("")
    p = _cli(root, "--status")
    assert p.returncode == 0, p.stderr
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln.startswith("demo-")}
    assert "complete" in lines["demo-00000000000000b0"], p.stdout
    assert "demo-00000000000000b1" not in lines, p.stdout
    p = _cli(root, "--clean")
    assert p.returncode == 0, p.stderr
    assert (root / "demo-00000000000000b1" / "lease.takeover-x-0").exists()


def _copy_built(built_cache, root: Path) -> Path:
    """The session's demo cache, hard-linked into ``root`` (new names stay in the copy)."""
    root.mkdir()
    dest = root / built_cache.cache_dir.name
    subprocess.run(["cp", "-al", str(built_cache.cache_dir), str(dest)], check=True)
    return dest


@pytest.mark.slow
def test_files_no_marker_lists_are_reported_and_cleaned(tmp_path, built_cache):
    """A plain ``datasets`` call on the cache writes cache-*.arrow beside its source."""
    import datasets

    cache = _copy_built(built_cache, tmp_path / "root")
    before = _tree(cache)
    source = sorted((cache / built_cache.stage_dirs["converted"]).glob("**/rows/*.arrow"))[0]
    rows_dir = source.parent
    ds = datasets.Dataset.from_file(str(source))
    ds.filter(lambda r: r["drop_reason"] == "", num_proc=1)
    rel = rows_dir.relative_to(cache).as_posix()
    strays = sorted(n for n in os.listdir(rows_dir) if f"{rel}/{n}" not in before)
    assert strays and all(n.startswith("cache-") for n in strays), strays

    p = _cli(cache.parent, "--verify")
    assert p.returncode == 1, p.stdout + p.stderr
    assert all(n in p.stdout for n in strays) and "not listed" in p.stdout, p.stdout
    p = _cli(cache.parent, "--status")
    assert all(n in p.stdout for n in strays) and "not listed" in p.stdout, p.stdout
    p = _cli(cache.parent, "--clean")
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(f"removed {rows_dir / n}" in p.stdout for n in strays), p.stdout
    assert _tree(cache) == before  # the strays gone, every listed file still there
    p = _cli(cache.parent, "--verify")
    assert p.returncode == 0 and f"{cache.name}: ok" in p.stdout, p.stdout + p.stderr


def test_status_of_a_live_builder_and_of_hard_links(job, tmp_path):
    root = tmp_path / "root"
    live = root / "demo-00000000000000a1"
    proc = job.start(
        live, 0, "--fingerprint", "00000000000000a1", *FAST, "--hold", "build-filtered:60"
    )
    job.wait_for_signal("build-filtered")
    complete = root / "demo-00000000000000a2"
    markers = _complete(job, complete, "00000000000000a2")
    # As the ranks' parts are assembled: the stage files are hard links of the parts'.
    parts = complete / "parts"
    parts.mkdir()
    listed = [f["path"] for m in markers.values() for f in m["files"]]
    for i, rel in enumerate(listed):
        os.link(complete / rel, parts / f"{i}.bin")
    unique = {}
    for d, _, files in os.walk(complete):
        for n in files:
            st = os.lstat(os.path.join(d, n))
            unique[(st.st_dev, st.st_ino)] = st.st_size
    p = _cli(root, "--status")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "building by" in p.stdout and "leftover" not in p.stdout, p.stdout
    from dist.inventory import list_caches

    (st,) = [s for s in list_caches(root) if s.path == complete]
    assert st.size_bytes == sum(unique.values())  # a hard-linked file counted once
    out = tmp_path / "status.json"
    p = _cli(root, "--status", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {Path(r["path"]).name: r for r in json.loads(out.read_text())["caches"]}
    assert rows[live.name]["state"] == "building" and rows[live.name]["live"] is True
    assert rows[live.name]["builder_pid"] == proc.pid
    assert not [x for x in rows[live.name]["problems"] if "leftover" in x], rows[live.name]
    assert rows[complete.name]["size_bytes"] == sum(unique.values())
    os.kill(proc.pid, signal.SIGKILL)


def test_dry_run_without_clean_is_one_line_exit_2_and_builds_nothing(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    p = _cli(root, "--dry-run", "--set", "data.demo.num_shards=2")
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "--dry-run" in line and "--clean" in line, line
    assert os.listdir(root) == []


def test_verify_json(job, tmp_path):
    root = tmp_path / "root"
    cache = root / "demo-00000000000000a3"
    markers = _complete(job, cache, "00000000000000a3")
    victim = cache / markers["filtered"]["files"][0]["path"]
    victim.write_bytes(b"x")
    out = tmp_path / "verify.json"
    p = _cli(root, "--verify", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    (row,) = read_json(out)["caches"]
    assert row["path"] == str(cache) and row["ok"] is False
    assert any(victim.name in x for x in row["problems"]), row


def test_the_builder_leaves_no_trash_link_for_a_link_named_like_a_stage_folder(tmp_path):
    """The coordinator collects unpublished stage folders by rename-then-delete; a
    symlink in such a place was renamed to ``*.trash-*`` and then left for good."""
    from dist import Stage, ensure_built

    def write(ctx):
        (ctx.tmp_dir / "part-0.bin").write_bytes(b"x" * 100)
        return {}

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    cache = tmp_path / "root" / "demo-00000000000000a4"
    cache.mkdir(parents=True)
    os.symlink(outside, cache / "converted.0123456789abcdef")
    os.symlink(outside, cache / "filtered.0123456789abcdef.trash-0a1b2c3d")
    stages = [Stage(name="converted", build=write), Stage(name="filtered", build=write)]
    ensure_built(cache, "00000000000000a4", stages, builder=True, poll_interval=0.05,
                 lease_timeout=1.0, heartbeat_interval=0.2, max_wait=30.0)  # fmt: skip
    assert _trash(cache) == [] and not os.path.lexists(cache / "converted.0123456789abcdef")
    assert (outside / "keep.txt").read_text() == "keep"


def test_status_does_not_call_a_users_files_in_a_cache_leftovers(tmp_path):
    """The user's own ``notes.trash-...``/``plan.tmp-1`` in a complete cache: ``clean``
    keeps them ("not hf_pipeline's") but ``status`` listed them as leftovers of the
    project, and the cache as not ok. Now status names only the project's leftovers."""
    from dist import Stage, ensure_built
    from dist.inventory import list_caches

    def write(ctx):
        (ctx.tmp_dir / "part-0.bin").write_bytes(b"x" * 100)
        return {}

    cache = tmp_path / "root" / "demo-00000000000000a5"
    stages = [Stage(name="converted", build=write), Stage(name="filtered", build=write)]
    ensure_built(cache, "00000000000000a5", stages, builder=True, poll_interval=0.05,
                 lease_timeout=1.0, heartbeat_interval=0.2, max_wait=30.0)  # fmt: skip
    (cache / "notes.trash-0a1b2c3d").write_text("mine")
    (cache / "plan.tmp-1").write_text("mine")
    (cache / "filtered.json.retired-0123456789abcdef").write_text("{}")  # the project's
    [st] = list_caches(tmp_path / "root")
    shown = [p for p in st.problems if p.startswith("leftover")]
    assert shown == ["leftover filtered.json.retired-0123456789abcdef"], st.problems


def test_status_escapes_a_forged_failure_record(tmp_path):
    """D3: a failure record's message and host reached the terminal raw: a newline and
    an ANSI escape forged a table row. Now every foreign string of a status problem is
    escaped (ascii) and bounded, in list_caches and in ``prebuild_cache.py --status``."""
    from dist.inventory import list_caches
    from dist.layout import IDENTITY_FILE, identity_bytes

    cache = tmp_path / "root" / "demo-0123456789abcdef"
    cache.mkdir(parents=True)
    (cache / IDENTITY_FILE).write_bytes(identity_bytes("0123456789abcdef", host="h", pid=1))
    (cache / "failed-00000000000000aa.json").write_text(json.dumps({
        "host": "h\x1b[2J", "pid": "1\nforged", "stage": "converted",
        "error_type": "E\r", "message": "boom\ndemo-ffffffffffffffff  ok  FORGED" + "x" * 500,
    }))  # fmt: skip
    [st] = list_caches(tmp_path / "root")
    text = "\n".join(st.problems)
    assert "\x1b" not in text and "\r" not in text and len(st.problems) == 1, st.problems
    assert "\\n" in text and len(text) < 700, text
    res = subprocess.run(
        [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "--status",
         "--set", f"build.cache_dir={tmp_path / 'root'}"],
        env=script_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "\x1b" not in res.stdout and "\r" not in res.stdout
    assert not any(x.startswith("demo-ffffffffffffffff") for x in res.stdout.splitlines())


def test_clean_removes_from_a_failed_cache_only_what_the_project_wrote(job, tmp_path):
    """T1: a failed cache holding the user's own file and a symlink was removed whole
    (the file lost). Now only the project's entries go; the folder stays, said why."""
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "target.txt").write_text("target")
    failed = root / "demo-00000000000000f3"
    _failed(job, failed, "00000000000000f3")
    ours = sorted(os.listdir(failed))
    assert any(n.startswith("failed-") for n in ours), ours
    (failed / "mine.txt").write_text("my notes")
    os.symlink(outside / "target.txt", failed / "link")

    p = _cli(root, "--clean", "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"would remove {failed}\n" not in p.stdout, p.stdout
    p = _cli(root, "--clean")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (failed / "mine.txt").read_text() == "my notes"
    assert os.readlink(failed / "link") == str(outside / "target.txt")
    assert (outside / "target.txt").read_text() == "target"
    assert f"removed {failed}\n" not in p.stdout, p.stdout
    left = [ln for ln in p.stdout.splitlines() if ln.startswith(f"left {failed}:")]
    assert len(left) == 1 and "mine.txt" in left[0] and "link" in left[0], p.stdout
    # Everything the failed build wrote is gone but its mark (still a cache of ours).
    remaining = sorted(os.listdir(failed))
    assert remaining == [".hf_pipeline-cache.json", "link", "mine.txt"], remaining
    assert _trash(root) == []


def test_clean_keeps_a_folder_whose_mark_names_another_fingerprint(job, tmp_path):
    """T1: a mark copied into a folder of another name (its fingerprint not the
    folder's) proves nothing; a failure record beside it did make the folder removable."""
    root = tmp_path / "root"
    folder = root / "small-aaaaaaaaaaaaaaaa"
    _failed(job, folder, "aaaaaaaaaaaaaaaa")
    mark = folder / ".hf_pipeline-cache.json"
    d = json.loads(mark.read_text())
    d["fingerprint"] = "16a1c317b11d8220"
    mark.write_text(json.dumps(d))
    before = _tree(folder)
    p = _cli(root, "--clean")
    assert p.returncode == 0, p.stdout + p.stderr
    assert _tree(folder) == before
    left = [ln for ln in p.stdout.splitlines() if ln.startswith(f"left {folder}:")]
    assert len(left) == 1 and "16a1c317b11d8220" in left[0], p.stdout
    p = _cli(root, "--status")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "16a1c317b11d8220" in p.stdout, p.stdout


def test_unmarked_folders_named_like_trash_are_not_called_trash(tmp_path):
    """T3: the user's folders named like trash were reported as "trash of an
    interrupted removal" (kept, rightly): the report claimed what it cannot prove."""
    root = tmp_path / "root"
    for name in (".y-0123456789abcdef.trash-abcdef12", ".z.trash-aaaaaaaa"):
        (root / name).mkdir(parents=True)
        (root / name / "mine.txt").write_text(name)
    before = _tree(root)
    for op in ("--status", "--clean"):
        p = _cli(root, op)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "trash of an interrupted removal" not in p.stdout, p.stdout
        assert p.stdout.count("carries no hf_pipeline mark") == 2, p.stdout
    assert _tree(root) == before


def _work_folder(root: Path, name: str, cache: str, fingerprint: str) -> Path:
    from dist.layout import WORK_MARK, work_mark_bytes

    folder = root / ".staging" / name
    (folder / "files" / "a").mkdir(parents=True)
    (folder / "files" / "a" / "x.bin").write_bytes(b"x" * 1000)
    (folder / WORK_MARK).write_bytes(
        work_mark_bytes(
            cache=cache, fingerprint=fingerprint, entries=["files", "meta"],
            lease_id="0123456789abcdef", host="elsewhere", pid=1,
        )
    )  # fmt: skip
    return folder


def test_work_folders_only_with_a_mark_of_their_own_name_and_never_through_a_link(tmp_path):
    """An abandoned work folder (its cache gone) is listed and removed; one whose mark
    names another fingerprint than its own name, a copy of a mark in a user's folder
    named otherwise, and a symlink to a marked folder are not the project's: left."""
    from dist.inventory import clean, list_work

    root = tmp_path / "root"
    fp, other = "1" * 16, "2" * 16
    ours = _work_folder(root, f"pull-{fp}", f"c-{fp}", fp)
    forged = _work_folder(root, f"pull-{other}", f"c-{fp}", fp)  # mark of another name
    target = _work_folder(tmp_path / "elsewhere", f"pull-{'3' * 16}", f"c-{'3' * 16}", "3" * 16)
    (root / ".staging" / f"pull-{'3' * 16}").symlink_to(target)
    rows = list_work(root, ".staging")
    assert [(w.path, w.state) for w in rows] == [(ours, "abandoned")]
    assert rows[0].size_bytes > 1000  # the staged file and the mark
    assert clean(root, dry_run=True, observe_s=0.1, work=(".staging",)).removed == (ours,)
    assert ours.exists()
    report = clean(root, dry_run=False, observe_s=0.1, work=(".staging",))
    assert report.removed == (ours,) and not ours.exists()
    assert (forged / "files" / "a" / "x.bin").exists()
    assert (target / "files" / "a" / "x.bin").exists()
    assert not [p for p in (root / ".staging").iterdir() if ".trash-" in p.name]


def _agree_rank(root: Path, rank: int, job_id: str) -> subprocess.Popen:
    """One rank (of 2) of a job named ``job_id`` running only the ranks' agreement
    (its FileJobStore under ``root/.jobs``)."""
    sets = [f"build.cache_dir={root}", "coord.poll_interval=0.05", "coord.max_wait=120"]
    env = script_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                     LOCAL_WORLD_SIZE="2", SLURM_JOB_ID=job_id)  # fmt: skip
    return subprocess.Popen(
        [PYTHON, str(REPO / "tests/procs/agree_rank.py"), *sets], env=env, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def _jobs(root: Path) -> dict[str, str]:
    res = _cli(root, "--status", "--json", "-")
    assert res.returncode == 0, res.stderr[-3000:]
    return {Path(j["path"]).name: j["state"] for j in json.loads(res.stdout)["jobs"]}


@pytest.mark.slow
def test_job_folders_finished_or_dead_are_cleaned_a_waiting_one_is_left(tmp_path):
    """``.jobs/<id>/`` (the ranks' agreement of one launch) piled up, one per launch:
    ``status`` did not show them, ``clean`` never removed them. Now a job whose every
    rank is done with it (finished), or whose every member provably exited, is removed;
    a job with a rank still waiting is left, and so is a file of a user's inside."""
    root = tmp_path / "root"
    root.mkdir()
    done = [_agree_rank(root, r, "300") for r in (0, 1)]
    for p in done:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err.decode()[-3000:]
    waiting = _agree_rank(root, 0, "301")  # its rank 1 never starts: it waits for it
    try:
        deadline = time.monotonic() + 120
        while not list((root / ".jobs" / "slurm-301-0-0").glob("*rank-0")):
            assert waiting.poll() is None, waiting.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "rank 0 of job 301 never posted"
            time.sleep(0.05)
        assert _jobs(root) == {"slurm-300-0-0": "finished", "slurm-301-0-0": "live"}
        res = _cli(root, "--clean")
        assert res.returncode == 0, res.stderr[-3000:]
        assert not (root / ".jobs" / "slurm-300-0-0").exists()
        assert list((root / ".jobs" / "slurm-301-0-0").glob("*rank-0"))
        assert waiting.poll() is None
    finally:
        os.killpg(waiting.pid, signal.SIGKILL)
        waiting.communicate(timeout=30)
    assert _jobs(root) == {"slurm-301-0-0": "abandoned"}
    (root / ".jobs" / "slurm-301-0-0" / "notes.txt").write_text("mine")
    res = _cli(root, "--clean")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kept" in res.stdout and "notes.txt" in res.stdout, res.stdout
    assert "notes.txt" in os.listdir(root / ".jobs" / "slurm-301-0-0")
    assert list((root / ".jobs" / "slurm-301-0-0").glob("*rank-0"))  # the job's proof stays
    (root / ".jobs" / "slurm-301-0-0" / "notes.txt").unlink()
    assert _cli(root, "--clean").returncode == 0
    assert not (root / ".jobs" / "slurm-301-0-0").exists()


#: A builder's first steps (dist.coordinator: claim the lease, beat, write the identity
#: file through dist.atomic.create_new's temp file), run in a real process that then
#: waits to be SIGKILLed before the temp file is linked into place.
_CLAIM_THEN_WAIT = """
import os, secrets, socket, sys, time
from pathlib import Path
from dist.layout import IDENTITY_FILE, identity_bytes
from dist.lease import Lease, try_claim
unit, fingerprint = Path(sys.argv[1]), sys.argv[2]
unit.mkdir(parents=True)
lease_id, host = secrets.token_hex(8), socket.gethostname()
assert try_claim(unit, lease_id, host, os.getpid())
Lease(unit, lease_id, host, 0.05).start()
tmp = unit / f".{IDENTITY_FILE}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
tmp.write_bytes(identity_bytes(fingerprint, host=host, pid=os.getpid()))
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_unit_killed_before_its_identity_file_is_unfinished_and_cleaned(tmp_path):
    """SIGKILLed between its lease and its identity file, a unit held only ``lease``,
    ``heartbeat-*`` and the identity's temp file (outside tester): --status did not say
    it was unfinished, --clean left it. The temp file's content is the project's mark
    (it names the folder's fingerprint): --status says unfinished and abandoned while
    the builder is dead, live while it beats; --clean removes it only once dead."""
    root = tmp_path / "root"
    unit = root / ".parts" / "join-00000000000000c1"
    proc = subprocess.Popen(
        [PYTHON, "-c", _CLAIM_THEN_WAIT, str(unit), "00000000000000c1"],
        env=script_env(), stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        out = tmp_path / "status.json"
        p = _cli(root, "--status", "--json", str(out))
        assert p.returncode == 0, p.stdout + p.stderr
        (row,) = read_json(out)["parts"]
        assert row["unfinished"] is True and row["builder"] == "live", row
        p = _cli(root, "--clean")
        assert p.returncode == 0 and sorted(os.listdir(unit))[-1] == "lease", p.stdout
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    names = sorted(os.listdir(unit))
    assert names[0].startswith(".") and names[1].startswith("heartbeat-"), names
    p = _cli(root, "--status", "--json", str(out))
    (row,) = read_json(out)["parts"]
    assert row["unfinished"] is True and row["builder"] == "abandoned", row
    p = _cli(root, "--status")
    assert f"unfinished unit .parts/{unit.name}: abandoned" in p.stdout, p.stdout
    p = _cli(root, "--clean")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not unit.exists(), sorted(os.listdir(unit))


@pytest.mark.slow
def test_verify_of_a_failed_cache_says_the_build_failed_and_its_json_paths_are_absolute(
    job, tmp_path
):
    """verify on a failed cache printed ``converted: missing; filtered: missing`` and
    exited 1 without saying the build failed; and its JSON paths were relative when
    ``--cache-dir`` was (outside tester). Now the line says ``build failed:`` with the
    failure record's message, and every JSON path (status, verify, clean) is absolute."""
    root = tmp_path / "root"
    cache = root / "demo-00000000000000a7"
    _failed(job, cache, "00000000000000a7")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PYTHON, str(REPO / "scripts" / "prebuild_cache.py"), "--cache-dir", "root",
             *CLI_TIMING, *args],
            env=script_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip

    out = tmp_path / "out.json"
    p = run("--verify", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith(cache.name)]
    # The failure record as --status shows it (escaped and quoted: another host wrote it).
    assert "build failed: 'RuntimeError': 'injected failure in filtered'" in line, line
    doc = read_json(out)
    (row,) = doc["caches"]
    assert "build failed" in row["problems"][0], row
    for path in (doc["root"], row["path"]):
        assert Path(path).is_absolute(), doc
    assert Path(row["path"]).resolve() == cache.resolve()
    for op in ("--status", "--clean"):
        p = run(op, "--json", str(out))
        assert p.returncode == 0, p.stdout + p.stderr
        doc = read_json(out)
        paths = [doc["root"]] + [c["path"] for c in doc.get("caches", [])] + doc.get("removed", [])
        assert len(paths) == 2 and all(Path(x).is_absolute() for x in paths), (op, doc)


def test_what_the_units_of_removed_caches_name_is_bounded_and_ends_at_a_cycle():
    """The units kept for a rebuild follow the markers' ``uses`` (read from files on
    disk): a cycle ends where it comes back, and a chain stops after _USES_DEPTH steps."""
    from dist.inventory import _USES_DEPTH, CacheState, CacheStatus, StoredUnit, _named_by

    def unit(name: str, *uses: str) -> StoredUnit:
        st = CacheStatus(path=Path("/store") / name, fingerprint="0", state=CacheState.COMPLETE)
        return StoredUnit(status=st, in_use=False, links=0, uses=uses)

    cycle = [unit("embed-a", "tokens-a", "text-a"), unit("tokens-a", "text-a", "embed-a"),
             unit("text-a", "join-a", "embed-a"), unit("join-a")]  # fmt: skip
    assert _named_by(cycle, ["embed-a"]) == {
        "tokens-a": "embed-a", "text-a": "embed-a", "join-a": "embed-a",
    }  # fmt: skip
    assert _named_by(cycle, ["tokens-a", "embed-a"]) == {"text-a": "tokens-a", "join-a": "tokens-a"}
    chain = [unit(f"u-{i}", f"u-{i + 1}") for i in range(3 * _USES_DEPTH)]
    assert set(_named_by(chain, ["u-0"])) == {f"u-{i}" for i in range(1, _USES_DEPTH + 1)}


def test_clean_never_removes_through_a_folder_swapped_for_a_link_while_it_runs(
    job, tmp_path, monkeypatch
):
    """`clean` renames a cache folder to a trash name, then deletes the trash. Someone
    who can write in a shared root renamed the trash away and put a symlink in its
    place, aimed at a private cache of the user's elsewhere: the deletion listed and
    removed that cache's whole content through the link. Now every step after the
    rename is relative to the folder it renamed (checked to be the one it judged): the
    link is left, reported, and the private cache is as it was."""
    from dist.inventory import clean

    root = tmp_path / "shared"
    root.mkdir()
    failed = root / "demo-00000000000000f0"
    _failed(job, failed, "00000000000000f0")
    private = tmp_path / "home" / "demo-00000000000000e0"
    _complete(job, private, "00000000000000e0")
    victim = Victim(private)
    real_rename = os.rename

    def rename_then_swap(src, dst, **kw):
        real_rename(src, dst, **kw)
        name = os.path.basename(dst)
        if ".trash-" in name and not (root / name).is_symlink():
            real_rename(root / name, tmp_path / "moved-away")
            os.symlink(private, root / name)

    monkeypatch.setattr(os, "rename", rename_then_swap)
    report = clean(root, dry_run=False, observe_s=0.3)
    monkeypatch.undo()
    victim.assert_untouched()
    [(where, why)] = report.left
    assert where == failed and not failed.exists(), report
    assert why.startswith("could not remove all of it: ") and why.endswith(
        "no longer the folder renamed there (swapped meanwhile), left as it is"
    ), why
    # The trash-named link itself is removed as such (unlinked, never followed).
    assert not [n for n in os.listdir(root) if ".trash-" in n]
