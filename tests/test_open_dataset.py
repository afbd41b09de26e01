"""Readers of a published cache read exactly the files its markers list, and a plain
``datasets`` user of ``open_dataset`` never writes into the cache and gets float latents
in every format (issue 24 items 3 and 4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest

from hf_pipeline.adapters.grain_source import GrainSource
from hf_pipeline.cache.layout import CacheLayout, open_dataset, open_sample_source
from tests.conftest import ANY_CACHE_SAMPLES_PER_SHARD, SMALL_DEMO


@pytest.fixture(autouse=True)
def _views_in_tmp(tmp_path, monkeypatch):
    # datasets' per-user cache (HF_DATASETS_CACHE), where open_dataset keeps its views.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture(scope="module")
def bf16_cache(session_cache_root, built_cache):
    """A demo with bfloat16 latents (any size will do), built through the real build.

    Into the session's root after ``built_cache``: under xdist a worker takes its copy of
    the run's shared ``built_cache`` only into an empty root (else it builds its own)."""
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    cfg = load_config(
        None,
        [
            *SMALL_DEMO,
            "data.demo.latent_dtype=bfloat16",
            f"data.demo.samples_per_shard={ANY_CACHE_SAMPLES_PER_SHARD}",
            f"build.cache_dir={session_cache_root}",
        ],
        environ={},
    )
    built = prepare_cache(cfg, progress=False)
    assert built.report["precision"]["storage_dtype"] == "bfloat16"
    return built


def _snapshot(folder: Path) -> list[tuple[str, int, int]]:
    """Every path under ``folder`` with its size and mtime (a write shows)."""
    return sorted(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in [folder, *folder.rglob("*")]
    )


def _reference(built) -> dict[str, np.ndarray]:
    """Keys and float32 latents (rows, crops, C, H, W) as the zero-copy reader gives them."""
    with open_sample_source(built.layout, built.fingerprint) as src:
        rows = np.arange(src.num_rows)
        crops = [src.gather(rows, c) for c in range(src.num_crops)]
    return {
        "keys": crops[0]["keys"],
        "latents": np.stack([c["latents"].astype(np.float32) for c in crops], axis=1),
    }


def test_readers_read_only_the_files_the_markers_list(built_cache, tmp_path):
    """A file that merely sits in a stage folder (what `open_dataset(...).filter` used to
    write beside the rows: a `cache-*.arrow` without latents) is never read."""
    copy, fp = tmp_path / "cache", built_cache.fingerprint
    shutil.copytree(built_cache.cache_dir, copy)
    layout = CacheLayout(copy)
    want = _reference(built_cache)
    stray = datasets.Dataset.from_dict({"indices": [0, 1], "x": [1, 2]})
    for folder in (layout.rows_files()[0].parent, layout.embedding_files()[0].parent):
        _write_arrow(stray, folder / "cache-0123456789abcdef.arrow")
    _write_arrow(stray, layout.filtered / "indices-stray.arrow")  # would keep rows 0, 1

    with open_sample_source(layout, fp) as src:
        np.testing.assert_array_equal(src.keys, want["keys"])
    ds = open_dataset(layout).with_format("numpy")
    np.testing.assert_array_equal(ds["key"], want["keys"])
    with GrainSource(copy) as grain:
        assert len(grain) == len(want["keys"])


def _write_arrow(ds: datasets.Dataset, path: Path) -> None:
    import pyarrow as pa

    table = ds.data.table
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)


@pytest.mark.parametrize("mode", [pytest.param("writable", marks=pytest.mark.slow), "read-only"])
def test_datasets_operations_write_nothing_into_the_cache(built_cache, tmp_path, mode, request):
    """`.filter/.map/.sort/.shuffle/.select/.train_test_split` with default arguments put
    their files in the per-user view folder, never in the cache (a read-only one too)."""
    copy = tmp_path / "cache"
    shutil.copytree(built_cache.cache_dir, copy)
    where = copy
    if mode == "read-only":
        mounts = request.getfixturevalue("mounts")
        where = tmp_path / "ro"
        where.mkdir()
        mounts("--bind", "-o", "ro", str(copy), str(where))
    before = _snapshot(copy)
    ds = open_dataset(CacheLayout(where))
    keys = list(ds["key"])
    even = ds.filter(lambda row: row["key"] % 2 == 0)
    assert list(even["key"]) == [k for k in keys if k % 2 == 0]
    mapped = ds.map(lambda row: {"n": len(row["caption"])})
    assert list(mapped["n"]) == [len(c) for c in ds["caption"]]
    assert list(ds.sort("key", reverse=True)["key"]) == sorted(keys, reverse=True)
    assert sorted(ds.shuffle(seed=1)["key"]) == sorted(keys)
    assert list(ds.select([2, 0])["key"]) == [keys[2], keys[0]]
    split = ds.train_test_split(test_size=0.25, seed=0)
    assert sorted([*split["train"]["key"], *split["test"]["key"]]) == sorted(keys)
    # Chained: the derived datasets' own files are in the view folder too.
    chained = even.map(lambda row: {"m": 1}).filter(lambda row: row["key"] % 4 == 0)
    assert list(chained["key"]) == [k for k in keys if k % 4 == 0]
    assert _snapshot(copy) == before
    views = Path(datasets.config.HF_DATASETS_CACHE) / "hf_pipeline-views"
    assert list(views.rglob("cache-*.arrow"))  # datasets did write: there


@pytest.mark.parametrize("fmt", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("cache", ["float16", "bfloat16"])
def test_latents_are_float_values_in_every_format(built_cache, bf16_cache, cache, fmt):
    """`with_format("torch"/"jax"/"numpy")` gives the latent values as floats: a float16
    cache as stored, a bfloat16 cache as float32 (exact), never integer bit patterns."""
    built = bf16_cache if cache == "bfloat16" else built_cache
    want = _reference(built)
    ds = open_dataset(built.layout).with_format(fmt)
    got = ds[:]["latents"]
    assert "float" in str(got.dtype), f"{fmt}: {got.dtype}"
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float32), want["latents"])
    if fmt != "jax":  # JAX keeps 32-bit integers unless x64 is on
        np.testing.assert_array_equal(np.asarray(ds[:]["key"]), want["keys"])


def test_latents_choices(built_cache, bf16_cache):
    """`latents="stored"` gives the Arrow column as stored (bfloat16 bits as uint16, no
    copy); `latents="float32"` float32 for any cache; anything else is one line."""
    from hf_pipeline.cache.precision import from_arrow

    want = _reference(bf16_cache)["latents"]
    bits = open_dataset(bf16_cache.layout, latents="stored").with_format("numpy", dtype="uint16")
    assert bits[:]["latents"].dtype == np.uint16
    np.testing.assert_array_equal(from_arrow(bits[:]["latents"], "bfloat16"), want)
    f32 = open_dataset(built_cache.layout, latents="float32").with_format("torch")
    assert (
        f32[:]["latents"].dtype.is_floating_point
        and str(f32[:]["latents"].dtype) == "torch.float32"
    )
    np.testing.assert_array_equal(f32[:]["latents"].numpy(), _reference(built_cache)["latents"])
    with pytest.raises(ValueError, match="latents must be None or one of"):
        open_dataset(built_cache.layout, latents="int8")
    with pytest.raises(ValueError, match="must lie outside the cache"):
        open_dataset(built_cache.layout, derived_dir=built_cache.cache_dir / "views")


def test_open_sample_source_takes_a_cache_folder_path(built_cache):
    """A str or PathLike cache folder, as GrainSource takes; another type is a TypeError
    naming what is expected (it was `'str' object has no attribute 'root'`)."""
    want = _reference(built_cache)
    for folder in (str(built_cache.cache_dir), Path(built_cache.cache_dir)):
        with open_sample_source(folder) as src:
            assert src.fingerprint == built_cache.fingerprint
            assert np.array_equal(src.gather(np.arange(src.num_rows), 0)["keys"], want["keys"])
    with pytest.raises(TypeError, match=r"CacheLayout, a str or an os\.PathLike, got int"):
        open_sample_source(3)


@pytest.mark.parametrize("level", ["hf_pipeline-views", "hf_pipeline-views/<view>", "<view>"])
def test_a_symlinked_view_folder_is_refused_and_nothing_is_written_there(
    built_cache, tmp_path, level
):
    """`HF_HOME` shared: someone linked `hf_pipeline-views` (or a cache's view in it, or
    the view in a `derived_dir`) to a folder of the user's. `open_dataset` put its links,
    the folders for them and `datasets`' derived files there. Now refused in one line
    naming the link. `derived_dir` and `HF_DATASETS_CACHE` are the user's: links there
    are fine."""
    from dist.errors import ForeignCacheFolderError
    from hf_pipeline.cache.layout import dataset_view_dir
    from tests.helpers.victims import Victim

    victim = Victim(tmp_path / "victim")
    layout = CacheLayout(Path(built_cache.cache_dir))
    derived = None
    if level == "<view>":
        derived = tmp_path / "derived-link"
        (tmp_path / "derived").mkdir()
        derived.symlink_to(tmp_path / "derived")  # the user's own folder: may be a link
    view = dataset_view_dir(layout, derived)
    place = view if "<view>" in level else view.parent
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(victim.path)
    with pytest.raises(ForeignCacheFolderError) as e:
        open_dataset(layout, derived_dir=derived)
    assert e.value.path == str(place), e.value
    victim.assert_untouched()
    place.unlink()
    assert len(open_dataset(layout, derived_dir=derived)) > 0
    assert view.is_dir() and not view.is_symlink()
