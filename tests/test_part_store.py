"""Parts with their own identity (hf_pipeline.build.part_store): content-defined
boundaries, reuse across caches (appended shards, another encoder), and a SIGKILLed
incremental build. Every scenario is compared with a from-scratch build of the same
final input: same keys in the same order, same latent and caption bytes, same
fingerprint; what was *not* done is read from the build report."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.build.part_store import part_bounds, plan_content_parts
from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env

pytestmark = pytest.mark.slow

#: The demo shards of these tests: 8 shards of 40 rows (names 000000-000039.pt ...).
_SHARDS, _ROWS = 8, 40
#: The shard that holds duplicates of old keys; its name sorts between shards 1 and 2.
_DUP = "000045-000054.pt"


def _names(n: int) -> list[str]:
    return [f"{i * 100:06d}-{i * 100 + 99:06d}.pt" for i in range(n)]


# ------------------------------------------------------------------ boundaries


@pytest.mark.parametrize("average", [1, 2, 4, 16])
def test_parts_cover_every_shard_in_order_within_their_bounds(average):
    names = _names(500)
    plans = plan_content_parts(names, average)
    assert plans[0].start == 0 and plans[-1].stop == len(names)
    assert [p.index for p in plans] == list(range(len(plans)))
    low, high = part_bounds(average)
    for a, b in zip(plans, plans[1:], strict=False):
        assert a.stop == b.start
    assert all(p.stop - p.start <= high for p in plans)
    assert all(p.stop - p.start >= low for p in plans[:-1])  # the last ends with the list
    if average > 1:  # about len/average parts: content-defined, not one per shard
        assert len(names) / average / 3 < len(plans) < len(names) / average * 3


def test_an_inserted_shard_moves_no_boundary_but_its_own_parts():
    """Content-defined: a shard inserted in the middle changes the part it lands in (and
    at most the next, until the next natural cut), never the parts before or far after
    it; fixed-size parts would shift every later boundary."""
    names = _names(400)
    before = plan_content_parts(names, 8)
    grown = [*names[:200], "000150-new.pt", *names[200:]]
    after = plan_content_parts(grown, 8)

    def ranges(plans, seq):
        return {tuple(seq[p.start : p.stop]) for p in plans}

    old, new = ranges(before, names), ranges(after, grown)
    changed = old - new
    assert 1 <= len(changed) <= 2, changed
    assert len(old & new) >= len(old) - 2


def test_no_shards_is_one_empty_part_and_bounds_are_checked():
    (only,) = plan_content_parts([], 4)
    assert (only.start, only.stop) == (0, 0)
    with pytest.raises(ValueError, match="average must be >= 1, got 0"):
        part_bounds(0)


# ------------------------------------------------------------------ scenarios


def _config(root: Path, data: Path, meta: Path, *extra: str):
    # A part per shard (the boundaries are tested above): which parts an insertion
    # touches is then known, whatever the hashes of these few names.
    from hf_pipeline.config import load_config

    return load_config(
        None,
        [*SMALL_DEMO, f"data.shards={data}", f"data.metadata={meta}",
         f"build.cache_dir={root}", "build.part_shards=1", *extra],
        environ={},
    )  # fmt: skip


def _build(root, data, meta, *extra):
    from hf_pipeline.build.prepare import prepare_cache

    return prepare_cache(_config(root, data, meta, *extra), progress=False)


def _content(res):
    """Keys, latents (stored bits), captions, embeddings of a cache's kept rows."""
    from hf_pipeline.cache.layout import open_dataset

    ds = open_dataset(res.layout, latents="stored").with_format("numpy")[:]
    return ds


def _assert_same_cache(got, want):
    assert got.fingerprint == want.fingerprint
    a, b = _content(got), _content(want)
    assert a["key"].tolist() == b["key"].tolist()
    assert a["latents"].tobytes() == b["latents"].tobytes()
    assert a["caption"].tolist() == b["caption"].tolist()
    assert [list(x) for x in a["input_ids"]] == [list(x) for x in b["input_ids"]]
    np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
    for k in ("rows_in", "rows_out", "dropped"):
        assert got.report[k] == want.report[k], k


def _folder(path: Path, files) -> Path:
    """A shard folder of hard links to ``files`` (same inodes: same size, mtime, bytes)."""
    path.mkdir(parents=True)
    for f in files:
        os.link(f, path / Path(f).name)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The demo shards, a shard of duplicates of shard 0's first keys (other latents)
    named to sort between shards 1 and 2, the metadata; the *initial* input folder
    lacks shards 2 and 7 and the duplicates, the *final* one has them all; and a
    from-scratch build of the final input."""
    import torch

    from hf_pipeline.demo.generate import generate_demo

    base = tmp_path_factory.mktemp("evolve")
    demo = generate_demo(base / "gen", num_shards=_SHARDS, samples_per_shard=_ROWS, seed=3)
    shards = sorted(Path(p) for p in demo.shard_paths)
    first = torch.load(shards[0], weights_only=True)
    dup = base / "gen-dup" / _DUP
    dup.parent.mkdir()
    torch.save({"keys": first["keys"][:10].clone(), "latents": first["latents"][:10] + 1}, dup)
    initial = _folder(base / "initial", [s for i, s in enumerate(shards) if i not in (2, 7)])
    final = _folder(base / "final", [*shards, dup])
    meta = Path(demo.metadata_path)
    clean = _build(base / "clean", final, meta)
    return {"base": base, "initial": initial, "final": final, "meta": meta, "clean": clean}


def test_appended_shards_build_only_the_new_parts_and_equal_a_clean_build(inputs):
    """Shards appended at the end and between old ones, one holding duplicates of old
    keys: the build reuses every stored part it can, reads only the shards of the
    parts it builds, and gives the cache a from-scratch build of the final input
    gives (the first finite occurrence of a key in shard order still wins)."""
    root = inputs["base"] / "grow"
    first = _build(root, inputs["initial"], inputs["meta"])
    assert first.report["reuse"]["joins_reused"] == 0
    res = _build(root, inputs["final"], inputs["meta"])
    _assert_same_cache(res, inputs["clean"])
    reuse, parts = res.report["reuse"], res.report["parts"]
    assert reuse["parts"] == len(parts) >= 3
    # The 6 initial shards' parts are reused; shard 2, shard 7 and the duplicates are built.
    assert reuse["joins_reused"] == 6 and reuse["joins_built"] == 3 == len(parts) - 6
    built = [p for p in parts if not p["reused"]["join"]]
    # Only the built parts' shards were opened, and only their latents written.
    assert reuse["shards_read"] == sum(p["shards"] for p in built) < _SHARDS + 1
    assert (
        0 < reuse["latent_bytes_written"] < inputs["clean"].report["reuse"]["latent_bytes_written"]
    )
    # A reused part is the very file the first cache holds (a hard link, not a copy).
    old_inodes = {f.stat().st_ino for f in first.layout.converted.glob("parts/*/rows/*.arrow")}
    new_inodes = {f.stat().st_ino for f in res.layout.converted.glob("parts/*/rows/*.arrow")}
    assert len(old_inodes & new_inodes) == reuse["joins_reused"]
    # The duplicates of shard 0's keys lost to the first occurrence.
    assert res.report["dropped"]["duplicate_key"] >= 10


def test_another_encoder_reuses_the_joins_and_writes_no_latent_bytes(inputs):
    """A changed encoder (another max_length) builds only embeddings: no shard read, 0
    latent bytes written; the two caches share the latents on disk (same inodes), and
    the new cache equals a from-scratch build with that encoder."""
    root = inputs["base"] / "enc"
    first = _build(root, inputs["final"], inputs["meta"])
    res = _build(root, inputs["final"], inputs["meta"], "encoder.max_length=16")
    assert res.fingerprint != first.fingerprint
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["joins_reused"] == reuse["parts"]
    assert reuse["shards_read"] == 0 and reuse["latent_bytes_written"] == 0
    assert reuse["embeddings_built"] == reuse["parts"] and reuse["embeddings_reused"] == 0
    rows = {
        f.relative_to(first.layout.converted): f
        for f in first.layout.converted.glob("parts/*/rows/*.arrow")
    }
    for rel, f in rows.items():
        g = res.layout.converted / rel
        assert g.stat().st_ino == f.stat().st_ino  # the latents once on disk
        assert g.stat().st_nlink >= 3  # the store's file and both caches' links
    clean = _build(
        inputs["base"] / "enc-clean", inputs["final"], inputs["meta"], "encoder.max_length=16"
    )
    _assert_same_cache(res, clean)
    # The token ids belong to the encoder: max_length 16 truncates them.
    assert max(len(x) for x in _content(res)["input_ids"]) <= 16


def test_sigkill_during_an_incremental_build_then_a_build_equals_a_clean_one(inputs):
    """The incremental build (the final input over the initial one's parts) is
    SIGKILLed while it joins a new part; the next build takes the dead lease over and
    gives the from-scratch cache, and the store holds each part once."""
    from dist.markers import read_json

    root = inputs["base"] / "kill"
    _build(root, inputs["initial"], inputs["meta"])
    before = {d.name for d in (root / ".parts").glob("join-*")}
    args = [
        REPO / "scripts/prebuild_cache.py", "-q", "--cache-dir", root,
        *[a for o in [*SMALL_DEMO, f"data.shards={inputs['final']}",
                      f"data.metadata={inputs['meta']}", "build.part_shards=1",
                      "coord.lease_timeout=4", "coord.heartbeat_interval=0.5"]
          for a in ("--set", o)],
    ]  # fmt: skip
    proc = subprocess.Popen(
        [PYTHON, *map(str, args)], env=script_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        victim = None
        while victim is None:  # the build holds a new part's lease and writes into it
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the build never started a new part"
            for lease in (root / ".parts").glob("join-*/lease"):
                info = read_json(lease)
                if isinstance(info, dict) and info.get("pid") == proc.pid:
                    if any(lease.parent.glob("join.*/rows")):
                        victim = lease.parent
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert victim.name not in before
    assert not (victim / "join.json").exists(), "killed before it published"
    res = _build(root, inputs["final"], inputs["meta"], "coord.lease_timeout=4")
    _assert_same_cache(res, inputs["clean"])
    assert res.report["reuse"]["joins_reused"] >= len(before) - 2
    assert len(list(victim.glob("join.*/"))) == 1, "one published copy of the part"
