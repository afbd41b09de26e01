"""What each integrity check catches, on a real demo-built cache through the real CLI.

``--verify`` hashes whole files (the marker's whole-file checksum), ``--status`` reports
what ``--verify`` found, and opening a cache for training checks every file's size and
first/last MiB (docs/integrity.md).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env


def _run(script, *args, timeout=600):
    return subprocess.run(
        [PYTHON, str(REPO / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=script_env(),
    )


def _sets():
    return [a for s in SMALL_DEMO for a in ("--set", s)]


def _refused_as_corrupt(argv: list[str], path: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``argv``: exit 2 with one error line, the verify record's refusal naming
    ``path`` and the record. Returns the run and that line."""
    b = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=script_env())
    assert b.returncode == 2, b.stdout + b.stderr
    errors = [ln for ln in b.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "this cache is corrupt" in errors[0], b.stderr
    assert path in errors[0] and "corrupt.json" in errors[0]
    # What to do, with the cache root the command needs (clean looks at the default
    # root without it).
    named = re.search(r"run hf-pipeline clean --cache-dir (\S+) or", errors[0])
    assert named and errors[0].split(":")[1].strip().startswith(named[1] + "/"), errors[0]
    return b, errors[0]


@pytest.fixture
def root(tmp_path, session_cache_root, built_cache):
    """A private copy of the session's demo cache (and its demo inputs): corrupted here."""
    copy = tmp_path / "root"
    copy.mkdir()
    shutil.copytree(session_cache_root / ".demo-data", copy / ".demo-data")
    shutil.copytree(built_cache.cache_dir, copy / built_cache.cache_dir.name)
    return copy


def _cache(root):
    (cache,) = [p for p in root.iterdir() if not p.name.startswith(".")]
    return cache


def _rows_file(cache):
    """The largest rows file the converted marker lists (path relative to the cache)."""
    marker = json.loads((cache / "converted.json").read_text())
    rows = [f for f in marker["files"] if "/rows/" in f["path"]]
    return max(rows, key=lambda f: f["size"])


def _flip(path, offset, n):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        data = fh.read(n)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.slow
def test_verify_finds_64_flipped_bytes_in_the_middle_of_a_rows_file(root):
    cache = _cache(root)
    rows = _rows_file(cache)
    assert rows["size"] > 3 << 20  # the middle lies outside the first and last MiB
    ok = _run("prebuild_cache.py", "--cache-dir", str(root), "--verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{cache.name}: ok" in ok.stdout
    assert "GB/s" in ok.stdout  # the summary line says how fast it read

    _flip(cache / rows["path"], rows["size"] // 2, 64)
    p = _run("prebuild_cache.py", "--cache-dir", str(root), "--verify")
    assert p.returncode == 1, p.stdout + p.stderr
    assert rows["path"] in p.stdout and "whole-file checksum mismatch" in p.stdout, p.stdout

    # --status (which reads no data) now says what --verify found; --clean would remove it.
    st = _run("prebuild_cache.py", "--cache-dir", str(root), "--status")
    assert st.returncode == 0, st.stdout + st.stderr
    line = next(ln for ln in st.stdout.splitlines() if ln.startswith(cache.name))
    assert " corrupt " in line, st.stdout
    assert rows["path"] in st.stdout
    dry = _run("prebuild_cache.py", "--cache-dir", str(root), "--clean", "--dry-run")
    assert f"would remove {cache}" in dry.stdout, dry.stdout

    # Building "ahead of the job" refuses it as every reader would (not "found", rc 0),
    # with the readers' one line and exit code, naming both ways to clean; removes nothing.
    for build in (
        [PYTHON, str(REPO / "scripts" / "prebuild_cache.py")],
        [PYTHON, "-m", "hf_pipeline", "build"],
    ):
        b, line = _refused_as_corrupt(
            [*build, "--cache-dir", str(root), *_sets(), "--json", str(root / "b.json")],
            rows["path"],
        )
        assert f"hf-pipeline clean --cache-dir {root} or" in line
        assert f"scripts/prebuild_cache.py --clean --cache-dir {root}, then build again" in line
        assert "found" not in b.stdout and not (root / "b.json").exists()
    assert (cache / rows["path"]).exists()

    # And no trainer opens it any more (the open reads --verify's record, not the data).
    from hf_pipeline.cache.layout import CacheLayout, open_sample_source
    from hf_pipeline.errors import CacheFormatError

    fingerprint = json.loads((cache / "converted.json").read_text())["fingerprint"]
    with pytest.raises(CacheFormatError, match="this cache is corrupt") as e:
        open_sample_source(CacheLayout(cache), fingerprint)
    assert rows["path"] in str(e.value)


def test_train_refuses_a_cache_with_a_flipped_byte_in_a_first_mib(root):
    cache = _cache(root)
    rows = _rows_file(cache)
    _flip(cache / rows["path"], 600_000, 1)  # inside the first MiB, in the latents
    p = _run("train.py", "--cache-dir", str(root), *_sets(), "--set", "train.steps=2", timeout=900)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and rows["path"] in errors[0], p.stderr
    assert "checksum mismatch" in errors[0]
    # What to do, on the root it was given (without --cache-dir they look at the default).
    assert (
        f"hf-pipeline verify --cache-dir {root}, then hf-pipeline clean --cache-dir {root}"
        in (errors[0])
    )
    assert "step" not in p.stdout  # not one step trained


def _as_schema_1(marker_path):
    """Rewrite a marker as hf_pipeline wrote it before whole-file checksums."""
    d = json.loads(marker_path.read_text())
    d["schema_version"] = 1
    for f in d["files"]:
        f.pop("whole_checksum", None)
    marker_path.write_text(json.dumps(d, sort_keys=True, indent=1))


def test_a_schema_1_cache_still_opens_and_verify_says_what_it_could_not_check(root):
    from hf_pipeline.cache.layout import CacheLayout, open_sample_source

    cache = _cache(root)
    for stage in ("converted", "filtered"):
        _as_schema_1(cache / f"{stage}.json")
    fingerprint = json.loads((cache / "converted.json").read_text())["fingerprint"]
    with open_sample_source(CacheLayout(cache), fingerprint) as source:
        assert source.num_rows > 0
    p = _run("prebuild_cache.py", "--cache-dir", str(root), "--verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no whole-file checksums (schema 1 markers: converted, filtered)" in p.stdout, p.stdout


def _small_cache(root):
    """A complete two-stage cache (schema-2 markers) of plain files, no build."""
    from dist.markers import Marker, describe_files, write_marker

    cache = root / "c-0123456789abcdef"
    done = {}
    for stage, files in (("converted", {"a.bin": 3 << 20, "b.bin": 10}), ("filtered", {"i": 5})):
        folder = cache / f"{stage}.0123456789abcdef"
        folder.mkdir(parents=True)
        for name, size in files.items():
            (folder / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        marker = Marker(
            fingerprint="0123456789abcdef",
            stage=stage,
            directory=folder.name,
            host="h",
            pid=1,
            lease_id="0123456789abcdef",
            started_at=1.0,
            finished_at=2.0,
            files=describe_files(folder, relative_to=cache),
            inputs={s: m.directory for s, m in done.items()},
        )
        write_marker(cache / f"{stage}.json", marker)
        done[stage] = marker
    return cache


def test_verify_cache_reads_whole_files_and_status_reports_what_it_found(tmp_path):
    from dist.inventory import VERIFY_RECORD, list_caches, verify_cache

    cache = _small_cache(tmp_path)
    ok = verify_cache(cache, workers=2, record=True)
    assert ok.problems == () and ok.files == 3 and ok.bytes == (3 << 20) + 15
    assert not (cache / VERIFY_RECORD).exists()
    a = cache / "converted.0123456789abcdef" / "a.bin"
    _flip(a, (3 << 20) // 2, 64)
    (status,) = list_caches(tmp_path)
    assert status.state == "complete"  # sizes and markers only: it reads no data
    bad = verify_cache(cache, workers=2, record=True)
    assert bad.problems == (
        "converted: listed file 'converted.0123456789abcdef/a.bin' whole-file checksum "
        "mismatch (xxh3_128)",
    )
    (status,) = list_caches(tmp_path)
    assert status.state == "corrupt" and any("a.bin" in p for p in status.problems)
    _flip(a, (3 << 20) // 2, 64)  # restored: the next verify withdraws the record
    assert verify_cache(cache, record=True).problems == ()
    (status,) = list_caches(tmp_path)
    assert status.state == "complete" and not (cache / VERIFY_RECORD).exists()

    _flip(a, 1000, 1)  # in the first MiB: the edge checksum finds it first
    (problem,) = verify_cache(cache, record=True).problems
    assert problem.startswith("converted: ") and "a.bin' checksum mismatch" in problem
    (status,) = list_caches(tmp_path)
    assert status.state == "corrupt" and f"--verify found: {problem}" in status.problems


def test_a_verify_record_about_folders_no_longer_published_is_ignored(tmp_path):
    from dist.inventory import VERIFY_RECORD, list_caches

    cache = _small_cache(tmp_path)
    (cache / VERIFY_RECORD).write_text(
        json.dumps({"directories": {"converted": "converted.fedcba9876543210"}, "problems": ["x"]})
    )
    (status,) = list_caches(tmp_path)
    assert status.state == "complete"


def test_verify_names_every_damaged_file_of_a_stage_and_counts_what_it_read(tmp_path):
    """Two files of one stage damaged, one in its first MiB (the edge checksum) and one
    in the middle (the whole-file checksum): verify names both, and still reads every
    listed file whole (it used to stop at the first: the stage's marker failed its edge
    check, and its files were then not hashed at all; outside tester)."""
    from dist.inventory import verify_cache

    cache = _small_cache(tmp_path)
    folder = "converted.0123456789abcdef"
    _flip(cache / folder / "b.bin", 3, 1)  # in the first MiB
    _flip(cache / folder / "a.bin", (3 << 20) // 2, 1)  # deep inside: only hashing sees it
    found = verify_cache(cache, workers=2, record=True)
    assert found.problems == (
        f"converted: listed file '{folder}/b.bin' checksum mismatch",
        f"converted: listed file '{folder}/a.bin' whole-file checksum mismatch (xxh3_128)",
    ), found.problems
    assert found.files == 3 and found.bytes == (3 << 20) + 15


def test_verify_shows_ten_damaged_files_on_a_caches_line_and_counts_the_rest(tmp_path):
    """A cache whose every file differs (a hostile or wrecked one: thousands of files)
    is one readable line naming the first ten and how many more; ``--json`` has all."""
    from dist.markers import Marker, describe_files, write_marker

    cache = tmp_path / "root" / "c-0123456789abcdef"
    folder = cache / "converted.0123456789abcdef"
    folder.mkdir(parents=True)
    for i in range(15):
        (folder / f"f{i:02d}.bin").write_bytes(bytes(range(256)) * 4)
    marker = Marker(
        fingerprint="0123456789abcdef", stage="converted", directory=folder.name, host="h",
        pid=1, lease_id="0123456789abcdef", started_at=1.0, finished_at=2.0,
        files=describe_files(folder, relative_to=cache), inputs={},
    )  # fmt: skip
    write_marker(cache / "converted.json", marker)
    for i in range(15):
        _flip(folder / f"f{i:02d}.bin", 3, 1)
    report = tmp_path / "verify.json"
    p = _run(
        "prebuild_cache.py", "--cache-dir", str(cache.parent), "--verify", "--json", str(report)
    )
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith(cache.name)]
    assert all(f"f{i:02d}.bin" in line for i in range(10)), line
    # 15 files and the missing filtered stage: 16 problems, 10 on the line.
    assert "f10.bin" not in line and "... and 6 more (all of them: --json)" in line, line
    (entry,) = json.loads(report.read_text())["caches"]
    assert len(entry["problems"]) == 16 and entry["problems"][-1] == "filtered: missing"


@pytest.mark.slow
def test_a_file_truncated_after_verify_is_refused_not_rebuilt(root):
    """T2: a listed file cut short after its publication failed the build's size check
    first: the stage was rebuilt (markers retired, corrupt.json left stale) instead of
    refused as --verify recorded it. Every opener refuses it now, removing nothing."""
    cache = _cache(root)
    marker = json.loads((cache / "converted.json").read_text())
    victim = max(
        (f for f in marker["files"] if "embed" in f["path"]), key=lambda f: f["size"],
        default=_rows_file(cache),
    )  # fmt: skip
    with open(cache / victim["path"], "r+b") as fh:
        fh.truncate(victim["size"] - 100)
    v = _run("prebuild_cache.py", "--cache-dir", str(root), "--verify")
    assert v.returncode == 1, v.stdout + v.stderr
    assert (cache / "corrupt.json").exists()
    before = sorted(p.name for p in cache.iterdir())
    for build in (
        [PYTHON, "-m", "hf_pipeline", "build"],
        [PYTHON, "-m", "hf_pipeline", "train", "--steps", "2"],
    ):
        _refused_as_corrupt([*build, "--cache-dir", str(root), *_sets()], victim["path"])
        assert sorted(p.name for p in cache.iterdir()) == before  # nothing renamed/removed
    from hf_pipeline import CacheLayout, open_dataset
    from hf_pipeline.errors import CacheFormatError

    with pytest.raises(CacheFormatError, match="this cache is corrupt") as e:
        open_dataset(CacheLayout(cache))  # not "has N bytes": the record, first
    assert victim["path"] in str(e.value)
