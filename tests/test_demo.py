"""Tests for hf_pipeline.demo.generate: real format, determinism, planted defects, concurrency, signal."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from hf_pipeline.build.captions import REASONS, classify, read_captions
from hf_pipeline.build.shards import LATENT_SHAPE, load_shard
from hf_pipeline.config import DataConfig
from hf_pipeline.demo.generate import COLORS, METADATA_NAME, generate_demo
from hf_pipeline.errors import SourceError
from hf_pipeline.stores import open_source

_SMALL = {"num_shards": 3, "samples_per_shard": 200, "seed": 7}
_REPO = Path(__file__).resolve().parent.parent


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _latents(demo) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    per_shard = []
    lats = []
    for p in demo.shard_paths:
        k, lat = load_shard(p, dtype="float32")
        per_shard.append(k)
        lats.append(lat)
    return np.concatenate(per_shard), np.concatenate(lats), per_shard


def test_real_format_and_names(tmp_path):
    demo = generate_demo(tmp_path / "d", **_SMALL)
    assert [p.name for p in demo.shard_paths] == [
        "000000-000199.pt",
        "000200-000399.pt",
        "000400-000599.pt",
    ]
    listed = open_source(str(demo.out_dir), data_config=DataConfig()).list_shards()
    assert [f.name for f in listed] == [p.name for p in demo.shard_paths]
    raw = torch.load(demo.shard_paths[0], weights_only=True, map_location="cpu")
    assert set(raw) == {"keys", "latents"}
    assert raw["keys"].dtype == torch.int64 and raw["keys"].shape == (200,)
    assert raw["latents"].dtype == torch.float16 and raw["latents"].shape == (200, *LATENT_SHAPE)
    meta = pq.read_table(demo.metadata_path)
    assert meta.column_names == ["key", "caption_llava", "caption", "caption_llava_short", "url"]
    assert demo.metadata_path.name == METADATA_NAME
    keys, lat, _ = _latents(demo)
    # Non-contiguous ids, VAE-like scale, and crops that are related but not identical.
    assert np.unique(np.diff(np.sort(np.unique(keys)))).size > 10
    assert 0.7 < lat.std() < 1.4
    assert not np.array_equal(lat[:, 0], lat[:, 1])
    crop_corr = np.corrcoef(lat[:, 0].ravel(), lat[:, 1].ravel())[0, 1]
    assert crop_corr > 0.5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_other_latent_dtypes(tmp_path, dtype):
    demo = generate_demo(tmp_path / dtype, num_shards=1, samples_per_shard=20, latent_dtype=dtype)
    raw = torch.load(demo.shard_paths[0], weights_only=True)
    assert raw["latents"].dtype == getattr(torch, dtype)
    assert load_shard(demo.shard_paths[0])[1].dtype == np.float16


def test_deterministic_byte_identical(tmp_path):
    a = generate_demo(tmp_path / "a", **_SMALL)
    b = generate_demo(tmp_path / "b", **_SMALL)
    fa, fb = _files(a.out_dir), _files(b.out_dir)
    assert fa == fb
    c = generate_demo(tmp_path / "c", **{**_SMALL, "seed": 8})
    assert _files(c.out_dir)[a.shard_paths[0].name] != fa[a.shard_paths[0].name]


@pytest.mark.slow
def test_parallel_writers_same_bytes(tmp_path):
    """num_proc > 1 (a pool of spawned processes writes the shards) gives the very bytes
    of the in-process generation, and a folder made one way is reused the other way."""
    params = {"num_shards": 5, "samples_per_shard": 40, "seed": 11, "latent_dtype": "bfloat16"}
    one = generate_demo(tmp_path / "one", **params)
    pool = generate_demo(tmp_path / "pool", **params, num_proc=3)
    assert _files(pool.out_dir) == _files(one.out_dir)
    assert pool.duplicate_latent_keys == 1  # the shard copying shard 0's image is there
    again = generate_demo(tmp_path / "pool", **params)  # not "other parameters"
    assert again == pool
    with pytest.raises(ValueError, match="num_proc must be >= 1, got 0"):
        generate_demo(tmp_path / "zero", **params, num_proc=0)


def _content_digest(demo) -> str:
    """The shards' keys and latent bits and the metadata table's values (not the file
    bytes, which depend on the torch and pyarrow writers)."""
    h = hashlib.sha256()
    for p in demo.shard_paths:
        raw = torch.load(p, weights_only=True)
        h.update(p.name.encode())
        h.update(raw["keys"].numpy().tobytes())
        h.update(raw["latents"].view(torch.int16).numpy().tobytes())
    h.update(json.dumps(pq.read_table(demo.metadata_path).to_pydict(), sort_keys=True).encode())
    return h.hexdigest()


#: The content of generate_demo(num_shards=3, samples_per_shard=20, seed=5, bfloat16),
#: as generated before the shards could be written by a pool (the same since): caches
#: built from the demo keep their fingerprints only while this holds.
_GOLDEN_DEMO = "9ec8ddbdc0b389efbad38584b528638df79b0db925ca69a768413c1848295a23"


@pytest.mark.parametrize("num_proc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_golden_content(tmp_path, num_proc):
    demo = generate_demo(
        tmp_path / "g", num_shards=3, samples_per_shard=20, seed=5, latent_dtype="bfloat16",
        num_proc=num_proc,
    )  # fmt: skip
    assert _content_digest(demo) == _GOLDEN_DEMO


def test_planted_defects_match_files(tmp_path):
    demo = generate_demo(tmp_path / "d", **_SMALL)
    keys, _, per_shard = _latents(demo)
    meta = pd.read_parquet(demo.metadata_path)
    assert len(keys) == demo.num_latent_rows == 600
    assert len(meta) == demo.num_meta_rows

    # Duplicate latent key: present in two different shards.
    uniq, counts = np.unique(keys, return_counts=True)
    assert demo.duplicate_latent_keys == int((counts - 1).sum()) == 1
    dup_key = uniq[counts > 1][0]
    assert sum(dup_key in s for s in per_shard) == 2
    assert demo.num_unique_latent_keys == len(uniq)

    meta_keys = meta["key"].to_numpy()
    assert demo.duplicate_meta_rows == len(meta_keys) - len(np.unique(meta_keys)) == 1
    assert demo.latent_keys_without_meta == len(np.setdiff1d(uniq, meta_keys)) > 0
    assert demo.meta_rows_without_latents == len(np.setdiff1d(meta_keys, uniq)) > 0

    first = meta.drop_duplicates("key").set_index("key").loc[np.intersect1d(uniq, meta_keys)]
    for col in ("caption_llava", "caption", "caption_llava_short"):
        caps = first[col]
        assert int(caps.isna().sum()) == demo.null_captions > 0
        s = caps.dropna()
        assert int((s == "").sum()) == demo.empty_captions > 0
        assert int(((s != "") & (s.str.strip() == "")).sum()) == demo.whitespace_captions > 0

    # The pipeline's own classification agrees with the planted counts.
    table = read_captions(demo.metadata_path)
    codes = classify(*table.lookup(uniq))
    by = dict(zip(REASONS, np.bincount(codes, minlength=len(REASONS)).tolist(), strict=True))
    assert by[""] == demo.clean_samples
    assert by["no_caption"] == demo.latent_keys_without_meta + demo.null_captions
    assert by["empty_caption"] == demo.empty_captions + demo.whitespace_captions
    assert table.count_absent(keys) == demo.meta_rows_without_latents
    assert table.duplicate_meta_rows == demo.duplicate_meta_rows


def test_key_as_index_variant(tmp_path):
    plain = generate_demo(tmp_path / "plain", **_SMALL)
    indexed = generate_demo(tmp_path / "idx", **_SMALL, key_as_index=True)
    names = pq.read_schema(indexed.metadata_path).names
    assert "key" not in names and "__index_level_0__" in names
    a, b = read_captions(plain.metadata_path), read_captions(indexed.metadata_path)
    assert a.keys.tolist() == b.keys.tolist()
    assert a.captions.to_pylist() == b.captions.to_pylist()
    assert (
        _files(plain.out_dir)[plain.shard_paths[0].name]
        == _files(indexed.out_dir)[indexed.shard_paths[0].name]
    )


def test_reuse_and_refusals(tmp_path):
    demo = generate_demo(tmp_path / "d", **_SMALL)
    mtimes = {p: p.stat().st_mtime_ns for p in demo.out_dir.iterdir()}
    t0 = time.perf_counter()
    again = generate_demo(tmp_path / "d", **_SMALL)
    assert time.perf_counter() - t0 < 0.5
    assert again == demo
    assert {p: p.stat().st_mtime_ns for p in demo.out_dir.iterdir()} == mtimes
    with pytest.raises(SourceError, match="holds a demo generated with"):
        generate_demo(tmp_path / "d", **{**_SMALL, "seed": 1})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("hi")
    with pytest.raises(SourceError, match="not a demo folder"):
        generate_demo(foreign, **_SMALL)
    # An empty folder (made by a user or a launcher) is filled.
    (tmp_path / "empty").mkdir()
    assert generate_demo(tmp_path / "empty", **_SMALL).num_latent_rows == 600
    # A damaged demo is reported, not silently reused.
    demo.shard_paths[1].write_bytes(b"oops")
    with pytest.raises(SourceError, match="manifest says"):
        generate_demo(tmp_path / "d", **_SMALL)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text(json.dumps({"params": again.params}))
    with pytest.raises(SourceError, match="malformed demo manifest"):
        generate_demo(bad, **_SMALL)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        generate_demo(tmp_path / "z", seed=-1)
    with pytest.raises(ValueError, match="samples_per_shard must be >= 10, got 5"):
        generate_demo(tmp_path / "z", samples_per_shard=5)
    with pytest.raises(ValueError, match="latent_dtype must be"):
        generate_demo(tmp_path / "z", latent_dtype="int8")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_concurrent_generation_four_processes(tmp_path):
    target = tmp_path / "shared" / "demo"
    start_at = time.time() + 3.0  # all four start generating at the same instant
    code = textwrap.dedent(
        f"""
        import json, os, sys, time
        from hf_pipeline.demo.generate import generate_demo
        renames = []
        _rename = os.rename
        def rename(src, dst):  # record who published and who lost the race
            try:
                _rename(src, dst)
            except OSError:
                renames.append("lost")
                raise
            renames.append("won")
        os.rename = rename
        time.sleep(max(0.0, {start_at!r} - time.time()))
        d = generate_demo({str(target)!r}, num_shards=2, samples_per_shard=50, seed=7)
        print(json.dumps({{"clean": d.clean_samples, "shards": [str(p) for p in d.shard_paths],
                           "renames": renames}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(_REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(4)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
    results = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
    renames = [r.pop("renames") for r in results]
    assert all(r == results[0] for r in results)
    # Exactly one process published; every other one either lost the rename (and
    # discarded its copy) or found the finished folder and returned at once.
    assert sum(r.count("won") for r in renames) == 1, renames
    assert all(len(r) <= 1 for r in renames), renames
    # One complete dataset, identical to a fresh single-process one, and no temp leftovers.
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo"]
    reference = generate_demo(tmp_path / "ref", num_shards=2, samples_per_shard=50, seed=7)
    assert _files(target) == _files(reference.out_dir)


def test_captions_carry_signal(tmp_path):
    demo = generate_demo(tmp_path / "d", num_shards=2, samples_per_shard=800, seed=3)
    keys, lat, _ = _latents(demo)
    table = read_captions(demo.metadata_path, caption_column="caption_llava_short")
    caps, _ = table.lookup(keys)
    # "a {color} {shape} on a gray background, {style}": on the zero-mean gray background
    # the image mean of channel 0 is (shape area) x (colour's channel-0 mean) + noise.
    words = [
        c.split(" ")[1] if c and c.startswith("a ") and " on a gray background" in c else None
        for c in caps.to_pylist()
    ]
    ch0 = lat[:, :, 0].mean(axis=(1, 2, 3))  # per sample, over crops and pixels
    means, ses = {}, {}
    for color in COLORS:
        sel = np.array([w == color for w in words])
        assert sel.sum() >= 20
        means[color], ses[color] = ch0[sel].mean(), ch0[sel].std() / np.sqrt(sel.sum())
    # The colour word moves channel 0 the way the colour table says, far beyond noise.
    table_ch0 = {c: v[0] for c, v in COLORS.items()}
    obs = np.argsort(np.argsort([means[c] for c in COLORS]))
    tab = np.argsort(np.argsort([table_ch0[c] for c in COLORS]))
    rho = np.corrcoef(obs, tab)[0, 1]  # Spearman rank correlation
    assert rho > 0.9, (means, table_ch0)
    gap = means["red"] - means["black"]
    assert gap > 8 * np.hypot(ses["red"], ses["black"]), (gap, ses)


@pytest.mark.parametrize("how", ["stdin", "unguarded"])
def test_parallel_writers_explain_a_main_they_cannot_import(tmp_path, how):
    """num_proc > 1 from a program on standard input, or from a script without a main
    guard: one message that says so and a non-zero exit, no half-written folder."""
    repo = Path(__file__).resolve().parent.parent
    code = (
        "from hf_pipeline.demo.generate import generate_demo\n"
        f"generate_demo({str(tmp_path / 'demo')!r}, num_shards=3, samples_per_shard=10, "
        "num_proc=2)\n"
    )
    if how == "stdin":
        cmd, stdin = [sys.executable, "-"], code
    else:
        (tmp_path / "unguarded.py").write_text(code)
        cmd, stdin = [sys.executable, str(tmp_path / "unguarded.py")], None
    proc = subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert proc.returncode != 0
    # One message from the caller (a dead worker's own traceback may come after it).
    mine = [line for line in proc.stderr.splitlines() if "generate_demo(num_proc=2)" in line]
    assert len(mine) == 1
    if how == "stdin":
        assert mine[0].startswith("ValueError: ") and "'<stdin>' is not a file" in mine[0]
    else:
        assert (
            mine[0].startswith("RuntimeError: ") and "a process writing the shards died" in mine[0]
        )
        assert 'outside `if __name__ == "__main__":`' in mine[0] and "unguarded.py" in mine[0]
        assert "generate_demo was called while a new worker process was importing" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["unguarded.py"] if how != "stdin" else []
    )
