"""A stored part damaged deep inside a file (past the first and last MiB that the check
at reuse reads) never goes into a new cache under a checksum of the damaged bytes: the
build that finds it is refused and retires the part's marker, so the next build makes
that part again; ``verify`` checks the stored parts too (docs/integrity.md). Real builds
through the real CLI.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, SMALL_DEMO, script_env
from tests.helpers.damage import flip_middle_bit


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "hf_pipeline", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=script_env(),
    )


def _build(root: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = [a for s in [*SMALL_DEMO, *extra] for a in ("--set", s)]
    return _cli("build", "--cache-dir", str(root), "-q", *sets)


def _caches(root: Path) -> dict[str, Path]:
    return {p.name: p for p in root.iterdir() if not p.name.startswith(".")}


def _latents(cache: Path) -> bytes:
    """The stored latent bytes of a cache's kept rows, in order."""
    from hf_pipeline.cache.layout import CacheLayout, open_dataset

    ds = open_dataset(CacheLayout(cache), latents="stored").with_format("numpy")[:]
    return ds["key"].tobytes() + ds["latents"].tobytes()


def test_describe_files_takes_recorded_entries_as_they_are(tmp_path):
    """A file linked from a stored unit is listed with the unit's record, not a checksum
    of what the disk holds now (which would certify damage); a size that differs from
    the record is refused, naming the file."""
    from dist.markers import describe_files

    stage = tmp_path / "converted.x"
    stage.mkdir()
    (stage / "linked.arrow").write_bytes(b"damaged bytes")
    (stage / "own.arrow").write_bytes(b"written by the stage")
    fresh = describe_files(stage, relative_to=tmp_path)[0]
    record = dataclasses.replace(fresh, whole_checksum="0" * 32, checksum="0" * 16)
    files = describe_files(stage, relative_to=tmp_path, recorded={record.path: record})
    assert [f.path for f in files] == ["converted.x/linked.arrow", "converted.x/own.arrow"]
    assert files[0] == record
    assert files[1].whole_checksum not in ("", "0" * 32)
    short = dataclasses.replace(record, size=record.size + 1)
    with pytest.raises(ValueError, match="linked.arrow: has 13 bytes, but its unit lists 14"):
        describe_files(stage, relative_to=tmp_path, recorded={short.path: short})


@pytest.mark.slow
def test_a_part_damaged_in_the_middle_is_refused_retired_and_rebuilt(tmp_path):
    """The outside tester's scenario: one bit flipped in the middle of a stored join's
    latents file, then a build of a new cache over that part (another max_length). It
    used to record a fresh checksum of the damaged bytes (verify said ok while the cache
    served wrong latents), and clean kept the damaged part that the next build reused.
    Then the refusal's advice (verify, clean, build) removed every intact part of the
    caches that linked the damaged one (a later tester): now the refusal retires the
    part's marker and the next build makes that part alone again."""
    root = tmp_path / "root"
    first = _build(root)
    assert first.returncode == 0, first.stdout + first.stderr
    ((name, cache),) = _caches(root).items()
    scratch = _latents(cache)  # a from-scratch build's
    (join,) = sorted((root / ".parts").glob("join-*"))
    rows = max(join.glob("join.*/rows/*.arrow"), key=lambda p: p.stat().st_size)
    assert rows.stat().st_size > 3 << 20  # its middle lies outside the first and last MiB
    flip_middle_bit(rows)  # one bit of a latent value, in place (the shared inode)

    # A new cache over the damaged part: refused, one line naming the part and its file;
    # nothing published over the damaged bytes; the part's marker retired.
    second = _build(root, "encoder.max_length=32")
    assert second.returncode == 2, second.stdout + second.stderr
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, second.stderr
    assert join.name in errors[0] and rows.name in errors[0], errors[0]
    assert "hf-pipeline verify" in errors[0] and "build again" in errors[0], errors[0]
    others = [p for n, p in _caches(root).items() if n != name]
    assert not any((p / "converted.json").exists() for p in others), "published anyway"
    assert list(join.glob("join.json.retired-*")) and not (join / "join.json").exists()

    # Built again as the message says: that part anew (the old advice, verify then
    # clean, removed every intact part of the caches that linked it: outside tester).
    third = _build(root, "encoder.max_length=32")
    assert third.returncode == 0, third.stdout + third.stderr
    (new,) = [p for n, p in _caches(root).items() if n != name]
    assert (join / "join.json").exists() and _latents(new) == scratch

    # verify: the old cache still links the damaged bytes (its own checksum); the
    # stored parts are sound (the part's marker names its new folder).
    v = _cli("verify", "--cache-dir", str(root), "--json", str(tmp_path / "v.json"))
    assert v.returncode == 1, v.stdout + v.stderr
    assert f"{name}: converted: listed file" in v.stdout, v.stdout
    assert f"{new.name}: ok" in v.stdout, v.stdout
    report = json.loads((tmp_path / "v.json").read_text())
    assert all(p["ok"] for p in report["parts"]), report["parts"]

    # clean removes the damaged cache (the recorded corruption is the proof) and keeps
    # the part the new cache uses; a build of the first config makes its cache again
    # from the stored parts, with the from-scratch build's latents.
    c = _cli("clean", "--cache-dir", str(root))
    assert c.returncode == 0, c.stdout + c.stderr
    assert f"removed {cache}" in c.stdout and f"removed {join}\n" not in c.stdout, c.stdout
    again = _build(root)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _latents(cache) == scratch
    ok = _cli("verify", "--cache-dir", str(root))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{name}: ok" in ok.stdout, ok.stdout


@pytest.mark.slow
def test_a_part_damaged_with_its_mtime_put_back_after_it_was_remembered_is_refused(tmp_path):
    """A build reads a reused part whole only when the content index does not vouch for
    its files' stat (what an earlier build checked them under). A flip in the middle of
    a stored latents file with its mtime put back (`touch -r`: same size, mtime and
    inode) still moves its ctime: the next build reads the file and refuses the part."""
    import time

    from hf_pipeline.stores.identity import RACY_NS

    root = tmp_path / "root"
    assert _build(root).returncode == 0
    time.sleep(RACY_NS / 1e9)  # the first build's files leave the index's racy window
    second = _build(root, "encoder.max_length=32")  # reads them whole, remembers them
    assert second.returncode == 0, second.stdout + second.stderr
    (join,) = sorted((root / ".parts").glob("join-*"))
    rows = max(join.glob("join.*/rows/*.arrow"), key=lambda p: p.stat().st_size)
    assert rows.stat().st_size > 3 << 20  # its middle lies outside the first and last MiB
    st = flip_middle_bit(rows, keep_mtime=True)
    assert rows.stat().st_mtime_ns == st.st_mtime_ns

    third = _build(root, "encoder.max_length=16")
    assert third.returncode == 2, third.stdout + third.stderr
    errors = [ln for ln in third.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, third.stderr
    assert join.name in errors[0] and rows.name in errors[0], errors[0]


@pytest.mark.slow  # three builds (~30 s on a quiet VM); test_dist_inventory covers clean's rules
def test_clean_after_verify_keeps_the_sound_parts_of_a_corrupt_cache(tmp_path):
    """A cache one of whose stored parts is damaged: `verify` marks the cache and the
    part corrupt, `clean` removes both and keeps the cache's sound parts (it removed
    them too, being used by no cache any more: the rebuild then read every input
    again for one damaged part; outside tester), saying why; the rebuild makes the
    damaged part alone and equals the first build."""
    root = tmp_path / "root"
    assert _build(root, "build.part_shards=1").returncode == 0
    ((name, cache),) = _caches(root).items()
    scratch = _latents(cache)
    joins = sorted((root / ".parts").glob("join-*"))
    assert len(joins) >= 2, joins
    bad, sound = joins[0], joins[1:]
    flip_middle_bit(max(bad.glob("join.*/rows/*.arrow"), key=lambda p: p.stat().st_size))

    v = _cli("verify", "--cache-dir", str(root))
    assert v.returncode == 1 and f".parts/{bad.name}" in v.stdout, v.stdout
    c = _cli("clean", "--cache-dir", str(root))
    assert c.returncode == 0, c.stdout + c.stderr
    assert f"removed {cache}" in c.stdout and f"removed {bad}" in c.stdout, c.stdout
    for unit in sound:
        assert unit.is_dir() and f"left {unit}: kept: sound" in c.stdout, c.stdout
    markers = {unit: (unit / "join.json").stat().st_ino for unit in sound}

    again = _build(root, "build.part_shards=1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert _latents(cache) == scratch
    assert all((u / "join.json").stat().st_ino == ino for u, ino in markers.items()), "rebuilt"
    assert (bad / "join.json").exists(), "the damaged part made again"
    ok = _cli("verify", "--cache-dir", str(root))
    assert ok.returncode == 0 and f"{name}: ok" in ok.stdout, ok.stdout


@pytest.mark.slow  # two caches over shared parts, verified (~40 s on a quiet VM)
def test_verify_reads_a_file_that_caches_and_parts_share_once(tmp_path):
    """Two caches over the same stored parts (two max_lengths) hold the latents as hard
    links of the parts' files: `verify` read each such file once per cache and once for
    its part. Now once per run (the later ones checked against that read's digest), and
    a damaged shared file is still named in every cache and part that lists it."""
    root = tmp_path / "root"
    assert _build(root).returncode == 0
    assert _build(root, "encoder.max_length=32").returncode == 0
    v = _cli("verify", "--cache-dir", str(root), "--json", str(tmp_path / "v.json"))
    assert v.returncode == 0, v.stdout + v.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    items = report["caches"] + report["parts"]
    shared = sum(i["shared_files"] for i in items)
    assert shared > 0 and report["caches"][1]["shared_files"] > 0, items
    assert "hard-linked files checked by that read" in v.stdout, v.stdout
    # Every byte read once: the bytes read are the distinct inodes' sizes.
    inodes = {}
    for folder in [Path(c["path"]) for c in items]:
        for f in folder.rglob("*"):
            st = f.lstat()
            if f.is_file() and not f.is_symlink():
                inodes[(st.st_dev, st.st_ino)] = st.st_size
    assert sum(i["bytes"] for i in items) <= sum(inodes.values()), (items, inodes)

    (join,) = sorted((root / ".parts").glob("join-*"))
    flip_middle_bit(max(join.glob("join.*/rows/*.arrow"), key=lambda p: p.stat().st_size))
    bad = _cli("verify", "--cache-dir", str(root), "--json", str(tmp_path / "bad.json"))
    assert bad.returncode == 1, bad.stdout
    found = json.loads((tmp_path / "bad.json").read_text())
    assert not any(i["ok"] for i in found["caches"]), found["caches"]
    assert not [p for p in found["parts"] if p["path"] == str(join)][0]["ok"]


def _uses(unit: Path) -> list[str]:
    """What a stored unit's marker names in ``uses`` ([] without a marker)."""
    marker = unit / f"{unit.name.split('-', 1)[0]}.json"
    return json.loads(marker.read_text())["info"].get("uses", []) if marker.exists() else []


def _closure(root: Path, names: set[str]) -> set[str]:
    """``names`` and every stored unit their markers' ``uses`` name, transitively."""
    todo, seen = list(names), set(names)
    while todo:
        for n in _uses(root / ".parts" / todo.pop()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


@pytest.mark.slow  # four builds (~50 s): the loop keeps the faster tests of this file
def test_clean_after_verify_keeps_the_token_ids_the_kept_parts_name(tmp_path):
    """The stored token ids (``tokens-*``) are named only by the embedding units'
    ``uses``, never linked by a cache: ``clean`` after ``verify`` kept the sound
    embeddings of the corrupt cache it removed but removed their token ids (outside
    tester), so a re-embedding at another ``max_length`` tokenized every caption again.
    Now a sound unit that a kept unit (or the damaged one, which the rebuild makes
    again) names is kept too: the re-embedding derives every part's ids from them, the
    rebuild reuses them, and nothing a complete cache uses is removed."""
    root = tmp_path / "root"
    assert _build(root, "build.part_shards=1").returncode == 0
    ((name64, cache64),) = _caches(root).items()
    embeds = sorted((root / ".parts").glob("embed-*"))
    tokens64 = {u.name for u in (root / ".parts").glob("tokens-*")}
    assert len(embeds) >= 2 and len(tokens64) == len(embeds), (embeds, tokens64)
    # A complete cache over the same parts, its ids at 32 (derived from those at 64).
    assert _build(root, "build.part_shards=1", "encoder.max_length=32").returncode == 0
    (name32,) = set(_caches(root)) - {name64}
    bad = embeds[0]
    (bad_tokens,) = set(_uses(bad)) & tokens64
    flip_middle_bit(max(bad.glob("embed.*/embeddings/*.arrow"), key=lambda p: p.stat().st_size))

    v = _cli("verify", "--cache-dir", str(root))
    assert v.returncode == 1 and f".parts/{bad.name}" in v.stdout, v.stdout
    assert f"{name32}: ok" in v.stdout, v.stdout
    before = {p.name for p in (root / ".parts").iterdir()}
    c = _cli("clean", "--cache-dir", str(root))
    assert c.returncode == 0, c.stdout + c.stderr
    assert f"removed {cache64}" in c.stdout and f"removed {bad}" in c.stdout, c.stdout
    left = {p.name for p in (root / ".parts").iterdir()}
    assert before - left == {bad.name}, before - left
    for unit in tokens64:
        assert f"left {root / '.parts' / unit}: kept: sound" in c.stdout, c.stdout
    # Nothing the complete cache uses went: its units, what they name, and its files.
    in32 = {n for n in before if n.startswith("embed-")} - {e.name for e in embeds}
    assert _closure(root, in32) <= left
    ok = _cli("verify", "--cache-dir", str(root))
    assert ok.returncode == 0 and f"{name32}: ok" in ok.stdout, ok.stdout

    # Another max_length: every part's ids derived from those kept at 64, none tokenized.
    again = _build(root, "build.part_shards=1", "encoder.max_length=48")
    assert again.returncode == 0, again.stdout + again.stderr
    (name48,) = set(_caches(root)) - {name32}
    from hf_pipeline.cache.layout import CacheLayout

    report = CacheLayout(root / name48).read_report()
    assert report["reuse"]["tokens_built"] == len(embeds), report["reuse"]
    for part in report["parts"]:
        t = part["tokens"]
        assert t["derived_from"] in tokens64 and t["tokenized_rows"] == 0, t
    # The rebuild of the removed cache reuses its sound embeddings and every token id.
    rebuilt = _build(root, "build.part_shards=1")
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    report = CacheLayout(cache64).read_report()
    assert report["reuse"]["embeddings_built"] == 1, report["reuse"]
    assert report["reuse"]["tokens_built"] == 0, report["reuse"]
    assert report["reuse"]["tokens_reused"] == 1, report["reuse"]
    assert (root / ".parts" / bad_tokens).is_dir()


@pytest.mark.slow  # two builds (~18 s)
def test_status_says_a_part_retired_as_damaged_is_made_again_not_abandoned(tmp_path):
    """A stored part whose marker a build retired as damaged (dist.coordinator
    .retire_damaged, what a build calls on a reused part) was listed as `unfinished
    ...: abandoned: no builder holds its lease` (outside tester). `status` says it was
    retired as damaged and that the next build that needs it makes it again, in the
    text and in --json (`retired`); that build does, and the line goes."""
    from dist.coordinator import retire_damaged

    root = tmp_path / "root"
    assert _build(root, "data.demo.samples_per_shard=25").returncode == 0
    ((_, cache),) = _caches(root).items()
    join = sorted((root / ".parts").glob("join-*"))[0]
    flip_middle_bit(max(join.glob("join.*/rows/*.arrow"), key=lambda p: p.stat().st_size))
    assert retire_damaged(join, join.name.split("-", 1)[1], "join") is not None

    out = tmp_path / "status.json"
    st = _cli("status", "--cache-dir", str(root), "--json", str(out))
    assert st.returncode == 0, st.stdout + st.stderr
    (line,) = [ln for ln in st.stdout.splitlines() if join.name in ln]
    assert line.strip() == (
        f"retired unit .parts/{join.name}: retired as damaged: the next build that needs "
        "it makes it again (--clean removes what is left of it meanwhile)"
    ), line
    assert "abandoned" not in st.stdout and "unfinished" not in st.stdout, st.stdout
    (row,) = [r for r in json.loads(out.read_text())["parts"] if r["path"] == str(join)]
    assert (row["retired"], row["unfinished"], row["builder"]) == (True, False, None), row

    again = _build(root, "data.demo.samples_per_shard=25", "encoder.max_length=32")
    assert again.returncode == 0, again.stdout + again.stderr
    assert (join / "join.json").exists()
    st = _cli("status", "--cache-dir", str(root), "--json", str(out))
    assert "retired" not in st.stdout, st.stdout
    assert not any(r["retired"] for r in json.loads(out.read_text())["parts"])
