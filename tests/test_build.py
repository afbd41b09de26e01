"""The build: join checked against a pandas reference, accounting, cache identity, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from hf_pipeline.build.prepare import REASONS, prepare_cache, resolve_inputs
from hf_pipeline.cache.layout import (
    CacheLayout,
    compute_fingerprint,
    open_dataset,
    open_sample_source,
)
from hf_pipeline.config import load_config
from hf_pipeline.errors import CorruptShardError, MetadataError, SourceError
from tests.conftest import SMALL_DEMO
from tests.servers import make_shards, shards_with_nonfinite_rows


def _reference(shard_paths, meta_path, caption_column="caption_llava"):
    """An independent pandas implementation of join + drop rules (first key wins)."""
    parts = []
    for p in shard_paths:
        d = torch.load(p, weights_only=True)
        parts.append(pd.DataFrame({"key": d["keys"].numpy()}))
    lat = pd.concat(parts, ignore_index=True)
    meta = pd.read_parquet(meta_path)
    if "key" not in meta.columns:
        meta = meta.reset_index().rename(columns={"index": "key", "__index_level_0__": "key"})
    meta = meta.drop_duplicates("key", keep="first")[["key", caption_column]]
    m = lat.merge(meta, on="key", how="left", indicator=True)
    cap = m[caption_column]
    reason = np.where(
        (m["_merge"] == "left_only") | cap.isna(),
        "no_caption",
        np.where(cap.fillna("").str.strip() == "", "empty_caption", ""),
    )
    dup = m["key"].duplicated(keep="first").to_numpy()
    reason = np.where((reason == "") & dup, "duplicate_key", reason)
    m["reason"] = reason
    no_latents = int((~meta["key"].isin(lat["key"])).sum())
    return m, no_latents


def test_join_matches_pandas_reference(built_cache, small_config):
    inputs = resolve_inputs(small_config)
    shard_paths = [f.url for f in inputs.shards]
    ref, no_latents = _reference(shard_paths, inputs.metadata.url)
    kept = ref[ref["reason"] == ""]

    ds = open_dataset(built_cache.layout)
    # README lists these columns.
    assert ds.column_names == ["key", "latents", "caption", "input_ids", "embedding"]
    assert ds["key"] == kept["key"].tolist()  # same rows, same (shard, row) order
    assert ds["caption"] == kept["caption_llava"].tolist()

    r = built_cache.report
    assert r["rows_in"] == len(ref)
    assert r["rows_out"] == len(kept)
    expected = {k: int(v) for k, v in ref["reason"].value_counts().items() if k}
    assert {k: v for k, v in r["dropped"].items() if k in REASONS and v} == expected
    assert r["dropped"]["no_latents"] == no_latents
    # Every latent row is accounted for.
    assert r["rows_out"] + sum(r["dropped"][k] for k in REASONS) == r["rows_in"]
    # The demo planted every kind of defect real data has.
    demo = inputs.demo
    assert r["dropped"]["duplicate_key"] == demo.duplicate_latent_keys >= 1
    assert r["dropped"]["empty_caption"] == demo.empty_captions + demo.whitespace_captions > 0
    assert r["dropped"]["no_latents"] == demo.meta_rows_without_latents > 0


def test_latents_and_embeddings_are_the_inputs(built_cache, small_config):
    from hf_pipeline.encoder.model import TextEncoder

    inputs = resolve_inputs(small_config)
    by_key = {}
    for f in inputs.shards:
        d = torch.load(f.url, weights_only=True)
        for k, lat in zip(d["keys"].tolist(), d["latents"].numpy(), strict=True):
            by_key.setdefault(k, lat)  # first occurrence wins, like the build
    ds = open_dataset(built_cache.layout).with_format("numpy")
    rows = ds[[0, 7, len(ds) - 1]]
    for k, lat in zip(rows["key"], rows["latents"], strict=True):
        np.testing.assert_array_equal(lat, by_key[int(k)])
    enc = TextEncoder(small_config.encoder)
    np.testing.assert_allclose(rows["embedding"], enc.encode(list(rows["caption"])), atol=1e-4)

    src = open_sample_source(built_cache.layout, built_cache.fingerprint)
    assert src.num_rows == len(ds) and src.embed_dim == 384 and src.num_crops == 3
    g = src.gather(np.array([0, 7]), np.array([2, 1]))
    np.testing.assert_array_equal(g["latents"][0], rows["latents"][0][2])
    np.testing.assert_array_equal(g["latents"][1], rows["latents"][1][1])
    np.testing.assert_allclose(g["embeddings"], rows["embedding"][:2])
    src.close()


def test_a_cache_opened_by_its_folder_is_checked_against_its_markers(built_cache, tmp_path):
    """``CacheLayout(cache_dir)`` reads its stage folders from the markers: opening it
    checks them first (a cache whose filtered stage was gone opened as 0 rows). A
    layout from the build (``BuildResult.layout``) is checked the same way: a stage
    folder without its files, or a truncated file, is one CacheFormatError naming it,
    not 0 rows or a raw pyarrow OSError."""
    from hf_pipeline.errors import CacheFormatError

    copy, fp = tmp_path / "cache", built_cache.fingerprint
    shutil.copytree(built_cache.cache_dir, copy)
    trusted = CacheLayout(copy, dict(built_cache.stage_dirs))
    with open_sample_source(CacheLayout(str(copy)), fp) as src:  # a str path too
        assert src.num_rows == built_cache.report["rows_out"] > 0
    with pytest.raises(CacheFormatError, match="fingerprint") as e:
        open_sample_source(CacheLayout(copy), "0" * 16)
    assert e.value.path.endswith("converted.json")

    rows = trusted.rows_files()[0]
    whole = rows.read_bytes()
    rows.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CacheFormatError, match="bytes, expected") as e:
        open_sample_source(CacheLayout(copy), fp)
    assert e.value.path.endswith("converted.json")
    with pytest.raises(CacheFormatError, match="bytes, expected") as e:
        open_sample_source(trusted, fp)  # the build's layout is checked too (integrity.md)
    assert e.value.path.endswith("converted.json")
    rows.write_bytes(whole)

    for indices in trusted.indices_files():
        indices.unlink()
    with pytest.raises(CacheFormatError, match="indices.arrow' missing") as e:
        open_sample_source(trusted, fp)
    assert e.value.path.endswith("filtered.json")
    (copy / "filtered.json").unlink()
    for opening in (lambda: open_sample_source(CacheLayout(copy), fp),
                    lambda: open_dataset(CacheLayout(copy))):  # fmt: skip
        with pytest.raises(CacheFormatError, match="not a trusted filtered marker: missing"):
            opening()


def test_unchanged_config_never_rebuilds(built_cache, small_config):
    layout = built_cache.layout
    marker = layout.root / "filtered.json"
    before = marker.stat().st_mtime_ns
    again = prepare_cache(small_config, progress=False)
    assert again.built is False
    assert again.fingerprint == built_cache.fingerprint and again.cache_dir == built_cache.cache_dir
    assert marker.stat().st_mtime_ns == before
    # Speed-only knobs keep the identity.
    faster = load_config(
        None,
        [
            *SMALL_DEMO,
            f"build.cache_dir={small_config.cache_root}",
            "build.num_proc=1",
            "build.batch_size=7",
            "build.writer_batch_size=3",
        ],
        environ={},
    )
    assert prepare_cache(faster, progress=False).fingerprint == built_cache.fingerprint


def test_a_copy_of_the_model_folder_finds_the_cache(built_cache, small_config, tmp_path):
    """Outside tester: the same model at another path (another host's copy, a rename,
    ``minilm`` and a copy of its folder) was another cache and a full re-embed; a local
    model is its bytes (its digests remembered in the root's content index)."""
    from hf_pipeline.encoder.model import resolve_encoder_path
    from hf_pipeline.stores.identity import INDEX_DIR, ContentIndex

    copy = tmp_path / "my-minilm"
    shutil.copytree(resolve_encoder_path("minilm"), copy)
    cfg = load_config(
        None,
        [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}", f"encoder.model={copy}"],
        environ={},
    )
    again = prepare_cache(cfg, progress=False)
    assert again.built is False and again.fingerprint == built_cache.fingerprint
    index = ContentIndex(small_config.cache_root / INDEX_DIR).path
    entries = json.loads(index.read_text())["entries"]
    assert str(copy / "model.safetensors") in entries  # remembered: read once


@pytest.mark.slow
def test_changed_config_never_reuses(built_cache, small_config):
    other = load_config(
        None,
        [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}", "data.caption_column=caption"],
        environ={},
    )
    res = prepare_cache(other, progress=False)
    assert res.built is True
    assert res.fingerprint != built_cache.fingerprint and res.cache_dir != built_cache.cache_dir
    ds = open_dataset(res.layout)
    inputs = resolve_inputs(other)
    ref, _ = _reference([f.url for f in inputs.shards], inputs.metadata.url, "caption")
    assert ds["caption"] == ref[ref["reason"] == ""]["caption"].tolist()
    # A different encoder setting is a different identity too.
    longer = load_config(None, [*SMALL_DEMO, "encoder.max_length=32"], environ={})
    from hf_pipeline.cache.layout import compute_fingerprint as fp
    from hf_pipeline.encoder.model import encoder_identity

    ids = ([f.identity() for f in inputs.shards], inputs.metadata.identity())
    assert fp(small_config, *ids, encoder_identity(small_config.encoder)) != fp(
        longer, *ids, encoder_identity(longer.encoder)
    )


def _copy_demo(small_config, tmp_path) -> tuple[Path, Path]:
    inputs = resolve_inputs(small_config)
    data = tmp_path / "data"
    data.mkdir()
    for f in inputs.shards:
        shutil.copy(f.url, data / f.name)
    meta = data / "coyo11m-meta.parquet"
    shutil.copy(inputs.metadata.url, meta)
    return data, meta


def _nothing_published(root: Path) -> None:
    for cache in root.glob("bad*-*"):
        assert not (cache / "converted.json").exists()
        assert not (cache / "filtered.json").exists()
        stage_dirs = [p for p in cache.glob("*.*") if p.is_dir()]  # <stage>.<lease>/
        assert stage_dirs == [], f"builder left {stage_dirs} behind"


@pytest.mark.slow
def test_corrupt_shard_fails_cleanly(small_config, tmp_path):
    data, _ = _copy_demo(small_config, tmp_path)
    victim = sorted(data.glob("*.pt"))[1]
    torch.save({"keys": torch.arange(5), "latents": torch.zeros(5, 4, 32, 32)}, victim)
    cfg = load_config(
        None,
        [*SMALL_DEMO, "name=bad", f"data.shards={data}", f"build.cache_dir={tmp_path / 'c'}"],
        environ={},
    )
    with pytest.raises(CorruptShardError) as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path.endswith(victim.name)
    assert "latents must have shape (N, 3, 4, 32, 32), got (5, 4, 32, 32)" in str(ei.value)
    _nothing_published(tmp_path / "c")


@pytest.mark.slow
def test_corrupt_shard_in_a_later_part_fails_cleanly_while_an_embedding_runs(
    small_config, tmp_path
):
    """One builder in parts: the join of part 3 fails while earlier parts embed on their
    thread: the build fails with the shard's error, the embedding thread ends, nothing is
    published."""
    import threading

    data, _ = _copy_demo(small_config, tmp_path)
    victim = sorted(data.glob("*.pt"))[3]
    torch.save({"keys": torch.arange(5), "latents": torch.zeros(5, 4, 32, 32)}, victim)
    cfg = load_config(
        None,
        [*SMALL_DEMO, "name=bad", f"data.shards={data}", f"build.cache_dir={tmp_path / 'c'}",
         "build.part_shards=1"],
        environ={},
    )  # fmt: skip
    with pytest.raises(CorruptShardError) as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path.endswith(victim.name)
    threads = ("hf_pipeline-embed", "hf_pipeline-tokens")  # both of _ensure_parts' threads
    assert not [t for t in threading.enumerate() if t.name.startswith(threads)]
    _nothing_published(tmp_path / "c")


def test_metadata_without_caption_column_fails_cleanly(small_config, tmp_path):
    data, meta = _copy_demo(small_config, tmp_path)
    t = pq.read_table(meta).drop(["caption_llava"])
    pq.write_table(t, meta)
    cfg = load_config(
        None,
        [*SMALL_DEMO, "name=bad", f"data.shards={data}", f"build.cache_dir={tmp_path / 'c'}"],
        environ={},
    )
    with pytest.raises(MetadataError, match="caption_llava") as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path.endswith("coyo11m-meta.parquet")
    _nothing_published(tmp_path / "c")


def test_report_is_json_and_complete(built_cache):
    r = json.loads(CacheLayout(built_cache.cache_dir).report_path.read_text())
    for field in ("fingerprint", "rows_in", "rows_out", "dropped", "embed_dim", "config"):
        assert field in r
    s = built_cache.summary()
    assert set(s) >= {"fingerprint", "cache_dir", "rows_in", "rows_out", "dropped", "seconds"}
    assert s["reuse"] == r["reuse"] and s["reuse"]["parts"] >= 1  # --json shows it too
    # Where each part's time went, the encoder's loading included (CPU: no warm-up).
    (part,) = r["parts"]
    load = part["encoder_load"]
    assert set(load) == {"tokenizer", "imports", "model", "to_device", "ready"}
    assert all(v >= 0 for v in load.values())
    steps = sum(v for k, v in load.items() if k != "ready")
    assert steps <= load["ready"] + 0.01 and load["model"] > 0
    join = part["join"]  # the workers' start includes any wait for the tokenizer
    assert 0 <= join["seconds_tokenizer_wait"] <= join["seconds_to_first_shard"]
    assert join["seconds_to_first_shard"] + join["seconds_converting"] <= join["seconds"]
    # Where the embedding went: the encoder thread's share and the map's wait for it.
    emb = part["embed"]
    assert emb["batches"] >= 1 and set(emb["encode"]) == {"prepare", "launch", "finish"}
    assert sum(emb["encode"].values()) <= emb["seconds_encode"] + 0.01
    thread = emb["seconds_gather"] + emb["seconds_encode"] + emb["seconds_blocked"]
    assert 0 < thread <= part["seconds_embed"] + 0.01
    assert 0 <= emb["seconds_waiting"] <= part["seconds_embed"]


def _nan_config(data: Path, cache: Path, *extra: str, name: str = "nan"):
    return load_config(
        None,
        [*SMALL_DEMO, f"name={name}", f"data.shards={data}", f"build.cache_dir={cache}", *extra],
        environ={},
    )


@pytest.mark.slow
def test_nonfinite_rows_are_dropped_counted_and_named(tmp_path):
    # Before: one NaN failed the whole build (CorruptShardError, exit 2).
    data, finite8 = shards_with_nonfinite_rows(tmp_path / "data")
    res = prepare_cache(_nan_config(data, tmp_path / "c"), progress=False)
    r = res.report
    assert r["rows_in"] == 26
    assert r["dropped"]["nonfinite_latents"] == 2 and r["dropped"]["duplicate_key"] == 1
    assert r["bad_rows"] == {"nonfinite_latents": {"count": 2, "first_keys": [8, 14]}}
    assert r["rows_out"] == 23 == r["rows_in"] - sum(r["dropped"][k] for k in REASONS)
    assert res.summary()["dropped"]["nonfinite_latents"] == 2

    ds = open_dataset(res.layout).with_format("numpy")
    cols = ds[:]
    # Key 14 is gone; key 8 comes from its first finite copy (the fifth shard), not
    # dropped as a "duplicate" of its NaN copy.
    expected = [k for k in range(24) if k not in (8, 14)] + [8]
    assert cols["key"].tolist() == expected
    np.testing.assert_array_equal(cols["latents"][-1], finite8)
    assert np.isfinite(cols["latents"]).all() and np.isfinite(cols["embedding"]).all()
    src = open_sample_source(res.layout, res.fingerprint)
    try:
        assert src.num_rows == 23
        g = src.gather(np.arange(23), np.zeros(23, dtype=np.int64))
        assert np.isfinite(g["latents"]).all() and np.isfinite(g["embeddings"]).all()
    finally:
        src.close()


@pytest.mark.slow
def test_nonfinite_row_under_on_bad_rows_fail_names_shard_and_key(tmp_path):
    data, _ = shards_with_nonfinite_rows(tmp_path / "data")
    cfg = _nan_config(data, tmp_path / "c", "data.on_bad_rows=fail", name="bad")
    with pytest.raises(CorruptShardError) as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path.endswith("000006-000011.pt")
    assert "NaN/inf in 1 of 6 rows (first keys: 8)" in ei.value.reason
    assert "data.on_bad_rows: drop" in ei.value.reason
    _nothing_published(tmp_path / "c")


def test_on_bad_rows_is_part_of_the_identity(small_config):
    from hf_pipeline.encoder.model import encoder_identity

    inputs = resolve_inputs(small_config)
    fail = load_config(None, [*SMALL_DEMO, "data.on_bad_rows=fail"], environ={})
    args = (
        [f.identity() for f in inputs.shards],
        inputs.metadata.identity(),
        encoder_identity(small_config.encoder),
    )
    assert small_config.data.on_bad_rows == "drop"
    assert compute_fingerprint(small_config, *args) != compute_fingerprint(fail, *args)


@pytest.mark.slow
def test_empty_shards_build_in_parts_of_their_own_and_null_keys_are_counted(tmp_path, caplog):
    """A part holding only empty shards (0 rows: on a GPU a builder makes 4 parts by
    default) crashed the embed stage (datasets' map of 0 rows writes no file and drops
    the columns), and a build of only empty shards the assembly. Metadata rows with a
    null key were dropped but counted nowhere (README: "dropped and counted")."""
    import pyarrow as pa

    data = make_shards(tmp_path / "data", n_shards=3, per_shard=6)
    empty = {
        "keys": torch.zeros(0, dtype=torch.int64),
        "latents": torch.zeros(0, 3, 4, 32, 32).half(),
    }
    torch.save(empty, data / "000000-000005.pt")
    meta = data / "coyo11m-meta.parquet"
    keys = [None if k % 5 == 0 else k for k in range(18)]
    pq.write_table(pa.table({"key": pa.array(keys, pa.int64()),
                             "caption_llava": [f"caption {k}" for k in range(18)]}), meta)  # fmt: skip
    res = prepare_cache(_nan_config(data, tmp_path / "c", "build.part_shards=1"), progress=False)
    r = res.report
    assert [p["rows_in"] for p in r["parts"]] == [0, 6, 6]
    # Keys 0-5 have no latents; 10 and 15 have a null-key caption row only.
    assert r["rows_in"] == 12 and r["dropped"]["no_caption"] == 2
    assert r["null_key_meta_rows"] == 4 == res.summary()["null_key_meta_rows"]
    with open_sample_source(res.layout, res.fingerprint) as src:
        assert sorted(src.keys.tolist()) == [6, 7, 8, 9, 11, 12, 13, 14, 16, 17]

    for i in (1, 2):  # every shard empty: a cache of no rows, said at build time
        torch.save(empty, data / f"{i * 6:06d}-{i * 6 + 5:06d}.pt")
    with caplog.at_level("WARNING", logger="hf_pipeline"):
        res = prepare_cache(_nan_config(data, tmp_path / "c", name="empty"), progress=False)
    assert (res.report["rows_in"], res.report["rows_out"]) == (0, 0)
    assert "the cache keeps no rows" in caplog.text
    from hf_pipeline.errors import CacheFormatError

    with pytest.raises(CacheFormatError, match="holds no rows"):
        open_sample_source(res.layout, res.fingerprint)


@pytest.mark.slow
def test_a_dangling_shard_symlink_is_a_missing_shard(tmp_path):
    # Before: left out silently (exit 0, nothing in the report) even under
    # on_missing: fail.
    data = make_shards(tmp_path / "data", n_shards=4, per_shard=6)
    (data / "000024-000029.pt").symlink_to(tmp_path / "unmounted" / "000024-000029.pt")
    with pytest.raises(SourceError, match="dangling symlink") as ei:
        prepare_cache(_nan_config(data, tmp_path / "c", name="bad"), progress=False)
    assert ei.value.path == str(data / "000024-000029.pt")
    _nothing_published(tmp_path / "c")

    res = prepare_cache(_nan_config(data, tmp_path / "c", "data.on_missing=skip"), progress=False)
    r = res.report
    assert [s["name"] for s in r["skipped_files"]] == ["000024-000029.pt"]
    assert "dangling symlink" in r["skipped_files"][0]["reason"]
    assert r["dropped"]["missing_shard_files"] == 1
    assert r["rows_in"] == 24 == r["rows_out"] + sum(r["dropped"][k] for k in REASONS)
    assert r["fetch"]["listing_retries"] == 0 and r["fetch"]["metadata_retries"] == 0


# ------------------------------------------------------------------ storage precision

# Values every source dtype must keep bit for bit by default. float16's smallest normal is
# 6.1e-5 and its smallest subnormal 6e-8: the small ones are what float16 storage lost.
_PLANTED = {
    "bfloat16": [1e-9, -3e-8, 5.9e-8, 1e-6, 9.2e-41, -0.0, 3e-5, 1.0009765625],
    "float16": [2.0**-24, -3 * 2.0**-24, 1e-6, -0.0, 65504.0, 6.1e-5],
    "float32": [1e-40, -1e-30, 1e-9, 3e38, -0.0, 1.0000001],
}
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _write_clean_inputs(folder: Path, dtypes, rows: int = 6) -> list[Path]:
    """Shards (one per entry of ``dtypes``) + a parquet captioning every key: no defects.

    Latents are random normals with the dtype's awkward values planted at the start
    of every row.
    """
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(len(dtypes))
    paths, keys = [], []
    for i, dtype in enumerate(dtypes):
        k = torch.arange(100 * i, 100 * i + rows, dtype=torch.int64) * 7 + 3
        lat = torch.randn((rows, 3, 4, 32, 32), generator=g).to(_TORCH[dtype])
        planted = torch.tensor(_PLANTED[dtype], dtype=torch.float32).to(_TORCH[dtype])
        lat.view(rows, -1)[:, : len(planted)] = planted
        path = folder / f"{i * rows:06d}-{i * rows + rows - 1:06d}.pt"
        torch.save({"keys": k, "latents": lat}, path)
        paths.append(path)
        keys += k.tolist()
    pd.DataFrame({"key": keys, "caption_llava": [f"a photo number {k}" for k in keys]}).to_parquet(
        folder / "coyo11m-meta.parquet"
    )
    return paths


def _tiny_config(data: Path, cache: Path, *overrides: str):
    return load_config(
        None,
        [
            *SMALL_DEMO,
            "name=tiny",
            f"data.shards={data}",
            f"build.cache_dir={cache}",
            "build.num_proc=1",
            *overrides,
        ],
        environ={},
    )


def _bits(a) -> np.ndarray:
    """The raw bits of a float array (NumPy, ml_dtypes or torch) as unsigned ints."""
    if isinstance(a, torch.Tensor):
        a = a.view({2: torch.int16, 4: torch.int32}[a.element_size()]).numpy()
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.fixture(scope="module")
def clean_builds(tmp_path_factory):
    """``{dtype: (BuildResult, shard paths)}`` for default-config builds of clean inputs."""
    root = tmp_path_factory.mktemp("clean")
    out = {}
    for dtype in _PLANTED:
        paths = _write_clean_inputs(root / dtype, [dtype, dtype])
        out[dtype] = (prepare_cache(_tiny_config(root / dtype, root / "c"), progress=False), paths)
    return out


@pytest.mark.parametrize("dtype", list(_PLANTED))
def test_default_storage_keeps_the_source_bits(clean_builds, dtype):
    from hf_pipeline.cache.precision import arrow_dtype, from_arrow
    from hf_pipeline.read.loader import Loader

    built, paths = clean_builds[dtype]
    assert load_config(None, environ={}).build.latent_dtype == "source"
    p = built.report["precision"]
    assert p == {
        "source_dtype": dtype,
        "source_dtypes": {dtype: 2},
        "storage_dtype": dtype,
        "lossy": False,
        "values": 12 * 3 * 4 * 32 * 32,
        "changed": 0,
        "flushed_to_zero": 0,
        "beyond_1ulp": 0,
    }
    src_bits = {}
    for path in paths:
        d = torch.load(path, weights_only=True)
        assert d["latents"].dtype == _TORCH[dtype]
        src_bits.update(zip(d["keys"].tolist(), _bits(d["latents"]), strict=True))
    assert built.report["rows_out"] == len(src_bits) == 12

    # Zero-copy reader: every crop of every row, byte for byte.
    with open_sample_source(built.layout, built.fingerprint) as source:
        assert source.latent_dtype.name == dtype
        for crop in range(3):
            got = source.gather(np.arange(12), crop)
            for k, lat in zip(got["keys"].tolist(), _bits(got["latents"]), strict=True):
                np.testing.assert_array_equal(lat, src_bits[k][crop])
        # The JAX loader, batches as jax.Arrays.
        with Loader(
            source,
            global_batch_size=6,
            crop="all",
            shuffle="sequential",
            process_index=0,
            process_count=1,
        ) as ld:
            seen = set()
            for step, b in enumerate(ld):
                assert b["latents"].dtype.name == dtype
                crops = ld.sampler.process_batch(0, step, 0, 1).crops.tolist()
                keys = np.asarray(b["keys"]).tolist()
                for k, c, lat in zip(keys, crops, _bits(b["latents"]), strict=True):
                    np.testing.assert_array_equal(lat, src_bits[k][c])
                    seen.add((k, c))
            assert len(seen) == 36
    # datasets view (nothing was dropped: one contiguous run of kept rows).
    ds = open_dataset(built.layout, latents="stored")  # the column as stored, no copy
    assert len(ds) == 12
    # datasets' numpy format widens by default (uint16 -> int64, float16 -> float32):
    # ask for the stored type, then view it in the storage dtype.
    stored = ds.with_format("numpy", columns=["latents"], dtype=arrow_dtype(dtype))
    lat = from_arrow(stored[:]["latents"], dtype)
    for k, bits in zip(ds["key"], _bits(lat), strict=True):
        np.testing.assert_array_equal(bits, src_bits[k])


def test_open_dataset_when_nothing_was_dropped(clean_builds):
    """Regression: uint64 indices of a contiguous kept run made Dataset.select raise."""
    built, paths = clean_builds["float16"]
    assert built.report["rows_out"] == built.report["rows_in"] == 12
    ds = open_dataset(built.layout)
    keys = [k for p in paths for k in torch.load(p, weights_only=True)["keys"].tolist()]
    assert ds["key"] == keys
    assert ds["caption"] == [f"a photo number {k}" for k in keys]
    assert len(ds[3:5]["embedding"]) == 2


@pytest.mark.slow
def test_float16_embeddings_are_the_float32_ones_rounded(clean_builds, tmp_path):
    """``encoder.output_dtype: float16`` stores each embedding as the float32 build's,
    rounded to float16, row for row."""
    built32, paths = clean_builds["float32"]
    built16 = prepare_cache(
        _tiny_config(paths[0].parent, tmp_path / "c", "encoder.output_dtype=float16"),
        progress=False,
    )
    ds16 = open_dataset(built16.layout)
    assert ds16.features["embedding"].feature.dtype == "float16"
    e16 = np.asarray(ds16.with_format("arrow")["embedding"].combine_chunks().flatten())
    e32 = open_dataset(built32.layout).with_format("numpy")[:]["embedding"]
    assert e16.dtype == np.float16 and e32.shape == (12, 384)
    np.testing.assert_array_equal(e16.reshape(e32.shape), e32.astype(np.float16))


def _expected_loss(src32: np.ndarray, stored32: np.ndarray, mantissa_bits: int) -> dict:
    """Flushes and moves beyond one ulp (at the source magnitude), computed directly."""
    x, y = src32.astype(np.float64).ravel(), stored32.astype(np.float64).ravel()
    nz = x != 0
    ulp = np.zeros_like(x)
    ulp[nz] = 2.0 ** (np.floor(np.log2(np.abs(x[nz]))) - mantissa_bits)
    return {
        "values": x.size,
        "changed": int((x != y).sum()),
        "flushed_to_zero": int((nz & (y == 0)).sum()),
        "beyond_1ulp": int((nz & (np.abs(y - x) > ulp)).sum()),
    }


@pytest.mark.parametrize(
    "source, storage, bits",
    [
        pytest.param("bfloat16", "float16", 10, marks=pytest.mark.slow),
        pytest.param("float32", "bfloat16", 7, marks=pytest.mark.slow),
        pytest.param("float32", "float16", 10, marks=pytest.mark.slow),
    ],
)
def test_explicit_lossy_storage_is_counted(tmp_path, caplog, source, storage, bits):
    paths = _write_clean_inputs(tmp_path / "d", [source, source])
    if storage == "float16":
        for p in paths:  # 3e38 overflows float16 (the build refuses that): plant 1.0 instead
            d = torch.load(p, weights_only=True)
            lat = d["latents"]
            d["latents"] = torch.where(lat.float().abs() > 65504, 1.0, lat.float()).to(lat.dtype)
            torch.save(d, p)
    cfg = _tiny_config(tmp_path / "d", tmp_path / "c", f"build.latent_dtype={storage}")
    with caplog.at_level("WARNING", logger="hf_pipeline"):
        built = prepare_cache(cfg, progress=False)
    src32 = np.concatenate(
        [torch.load(p, weights_only=True)["latents"].float().numpy() for p in paths]
    )
    # Independent reference cast: torch's (round to nearest even), not the build's NumPy.
    stored32 = torch.from_numpy(src32).to(_TORCH[storage]).float().numpy()
    expected = _expected_loss(src32, stored32, bits)
    # The planted values exercise both counters (bfloat16 keeps float32's exponent range,
    # so nothing planted flushes there; its subnormals still lose precision).
    assert expected["flushed_to_zero"] > 0 or storage == "bfloat16"
    assert expected["beyond_1ulp"] > expected["flushed_to_zero"]
    p = built.report["precision"]
    assert p["source_dtype"] == source and p["storage_dtype"] == storage and p["lossy"] is True
    assert {k: p[k] for k in expected} == expected
    warned = [r.getMessage() for r in caplog.records if "is lossy" in r.getMessage()]
    assert len(warned) == 1
    assert f"{expected['flushed_to_zero']} flushed to zero" in warned[0]
    assert f"{expected['beyond_1ulp']} beyond 1 ulp of {storage}" in warned[0]
    # What was stored is the rounded value, read back in the storage dtype.
    with open_sample_source(built.layout, built.fingerprint) as source_:
        assert source_.latent_dtype.name == storage
        got = source_.gather(np.arange(12), 1)["latents"]
        want = torch.from_numpy(stored32[:, 1]).to(_TORCH[storage])
        np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.slow
def test_source_storage_refuses_mixed_shard_dtypes(tmp_path):
    paths = _write_clean_inputs(tmp_path / "d", ["bfloat16", "bfloat16", "float32"])
    cfg = _tiny_config(tmp_path / "d", tmp_path / "c", "name=bad")
    with pytest.raises(CorruptShardError) as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path == str(paths[2])
    msg = str(ei.value)
    assert (
        f"latents are float32, but {paths[0].name} (the first shard with rows of its part) "
        "holds bfloat16" in msg
    )
    assert "set build.latent_dtype explicitly" in msg
    _nothing_published(tmp_path / "c")
    # An explicit float32 stores both exactly.
    built = prepare_cache(
        _tiny_config(tmp_path / "d", tmp_path / "c", "build.latent_dtype=float32"), progress=False
    )
    p = built.report["precision"]
    assert p["source_dtype"] == "mixed" and p["source_dtypes"] == {"bfloat16": 2, "float32": 1}
    assert p["lossy"] is False and p["changed"] == 0
    ref = np.concatenate(
        [torch.load(q, weights_only=True)["latents"].float().numpy() for q in paths]
    )
    with open_sample_source(built.layout, built.fingerprint) as src:
        np.testing.assert_array_equal(src.gather(np.arange(18), 0)["latents"], ref[:, 0])


@pytest.mark.slow
def test_source_storage_refuses_mixed_dtypes_across_parts_and_on_append(tmp_path):
    # Each part takes its dtype from its own first shard: a dtype change exactly at a
    # part boundary used to publish a cache `verify` passed and every reader refused.
    from hf_pipeline.build.part_store import plan_content_parts

    paths = _write_clean_inputs(tmp_path / "d", ["bfloat16"] * 6)
    cut = plan_content_parts([q.name for q in paths], 2)[0].stop
    assert 0 < cut < len(paths)
    for q in paths[cut:]:  # from the first part boundary on: float32
        d = torch.load(q, weights_only=True)
        torch.save({"keys": d["keys"], "latents": d["latents"].float()}, q)
    cfg = _tiny_config(tmp_path / "d", tmp_path / "c", "name=bad", "build.part_shards=2")
    with pytest.raises(CorruptShardError) as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path == str(paths[cut])
    msg = str(ei.value)
    assert (
        f"latents are float32, but {paths[0].name} (the first shard with rows of the "
        "input) holds bfloat16" in msg
    ), msg
    assert "\n" not in msg and "set build.latent_dtype explicitly" in msg
    _nothing_published(tmp_path / "c")
    # On append: the part stored by a build of the first shards is reused, the new
    # parts (float32) are checked against it.
    aside = tmp_path / "aside"
    aside.mkdir()
    for q in paths[cut:]:
        q.rename(aside / q.name)
    first = _tiny_config(tmp_path / "d", tmp_path / "c2", "name=ok", "build.part_shards=2")
    assert prepare_cache(first, progress=False).report["rows_out"] == 6 * cut
    for q in paths[cut:]:
        (aside / q.name).rename(q)
    cfg = _tiny_config(tmp_path / "d", tmp_path / "c2", "name=bad", "build.part_shards=2")
    with pytest.raises(CorruptShardError) as ei:
        prepare_cache(cfg, progress=False)
    assert ei.value.path == str(paths[cut]) and paths[0].name in str(ei.value)
    _nothing_published(tmp_path / "c2")


@pytest.mark.slow
def test_encoder_load_error_from_the_background_thread_fails_the_build(small_config, tmp_path):
    """The encoder loads on a thread while the workers join: its error must surface as
    the build's own (one ConfigError naming encoder.model), nothing published."""
    import shutil

    from hf_pipeline.encoder.model import resolve_encoder_path
    from hf_pipeline.errors import ConfigError

    # The tokenizer loads (the join workers tokenize), the model does not: no weights.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in Path(resolve_encoder_path("minilm")).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".onnx", ".h5")):
            shutil.copy2(f, broken / f.name)
    cfg = load_config(
        None,
        [*SMALL_DEMO, "name=badenc", f"build.cache_dir={tmp_path / 'c'}",
         f"encoder.model={broken}"],
        environ={},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="encoder.model") as ei:
        prepare_cache(cfg, progress=False)
    # Raised where the part waits for the encoder, after its join ran.
    assert any(entry.name == "embed_part" for entry in ei.traceback)
    _nothing_published(tmp_path / "c")


@pytest.mark.slow
def test_the_join_does_not_fsync_per_shard(tmp_path, monkeypatch):
    """Issue 10: the join's per-shard bookkeeping (fetch counters, precision records) is
    not fsynced: on ext4 an fsync waits for the dirty data of the Arrow files being
    written, GBs at scale (17 ms against 2 ms here while one writer streams). A build's
    fsyncs (markers, report) do not grow with its shard count."""
    import os

    real, calls = os.fsync, []

    def counting_fsync(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    counts = {}
    for n in (2, 6):
        cfg = load_config(
            None,
            [*SMALL_DEMO, f"data.demo.num_shards={n}", "build.num_proc=1",
             f"build.cache_dir={tmp_path / str(n)}"],
            environ={},
        )  # fmt: skip
        resolve_inputs(cfg)  # the demo's own files are written before the count starts
        calls.clear()
        assert prepare_cache(cfg, progress=False).built
        counts[n] = len(calls)
    assert counts[6] == counts[2], counts


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["one", "ranks"])
def test_the_caption_table_is_written_with_the_fork_server_up_and_quick_gil_handoff(
    parallel, tmp_path, monkeypatch
):
    """Issue 10: while the caption table is written, the join workers' fork server is
    already importing (with ``parallel: ranks`` too: a rank used to start it only with
    its part, 4-6 s before its first shard on a 4xH100 host), and the stage runs with a
    switch interval of at most 1 ms (the encoder loads on a thread beside it); the
    caller's own interval is restored after the build; the report says what the caption
    table took."""
    import sys

    import multiprocess.forkserver

    import hf_pipeline.build.prepare as build

    seen = []
    real_save = build._save_captions

    def save_captions(*args, **kwargs):
        server = multiprocess.forkserver._forkserver._forkserver_pid
        seen.append((sys.getswitchinterval(), server is not None))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(build, "_save_captions", save_captions)
    cfg = load_config(
        None,
        [*SMALL_DEMO, f"build.parallel={parallel}", f"build.cache_dir={tmp_path / 'c'}"],
        environ={},
    )  # fmt: skip
    resolve_inputs(cfg)
    before = sys.getswitchinterval()
    assert before > 0.001, "the test needs the default (5 ms) to see the change"
    res = prepare_cache(cfg, progress=False)
    assert res.built
    # Where the time went: the report says what the caption table took.
    assert 0 < res.report["seconds_captions"] < res.seconds
    assert 0 < res.report["seconds_assemble"] < res.seconds
    assert len(seen) == 1
    interval, server_up = seen[0]
    assert interval <= 0.001
    assert server_up, "the fork server imports while the caption table is written"
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("kept", [".demo-data", ".content-index", ".staging", ".parts"])
def test_a_build_refuses_a_symlink_where_it_keeps_a_folder_in_the_root(tmp_path, kept):
    """The cache root is shared: someone put a symlink where the build keeps a folder of
    its own, aimed at a folder of the user's. The build generated the demo there (and
    removed a losing copy), wrote the content index there, staged and released the
    shards there, or built every stored part there (and the coordinator removed
    stage-named folders in it). Now it refuses in one line naming the link, before it
    writes anything there; the root itself may be a link."""
    from dist.errors import ForeignCacheFolderError
    from tests.helpers.victims import Victim

    victim = Victim(tmp_path / "victim")
    real = tmp_path / "nfs"
    real.mkdir()
    root = tmp_path / "hf_home"
    root.symlink_to(real)  # HF_HOME -> /mnt/nfs/...: fine
    (real / kept).symlink_to(victim.path)
    cfg = load_config(None, [*SMALL_DEMO, f"build.cache_dir={root}"], environ={})
    with pytest.raises(ForeignCacheFolderError) as e:
        prepare_cache(cfg, progress=False)
    assert e.value.path == str(root / kept), e.value
    assert str(e.value).startswith(f"{root / kept}: a symlink where hf_pipeline keeps")
    victim.assert_untouched()
