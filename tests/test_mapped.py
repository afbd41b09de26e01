"""mapped: zero-copy gathers equal what ``datasets`` reads from the same files."""

from __future__ import annotations

import pickle
import sys

import datasets
import numpy as np
import pyarrow as pa
import pytest

from hf_pipeline.read.mapped import CacheFormatError, MappedColumn, SampleSource
from tests.helpers.caches import LATENT_SHAPE, build_cache


def _reference(rows_files, emb_files, indices_files):
    rows = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in rows_files])
    emb = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in emb_files])
    if indices_files:
        idx = np.concatenate(
            [np.asarray(datasets.Dataset.from_file(f)["indices"]) for f in indices_files]
        ).astype(np.int64)
    else:
        idx = np.arange(len(rows))
    return rows.with_format("numpy"), emb.with_format("numpy"), idx


@pytest.fixture(scope="module", params=["float16", "float32"])
def cache(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"cache_{request.param}")
    files = build_cache(root, 300, dtype=request.param)
    return files, request.param


def test_fixture_has_several_files_and_chunks(cache):
    (rows_files, emb_files, idx_files), _ = cache
    assert len(rows_files) == 2 and len(emb_files) == 2 and len(idx_files) == 2
    with pa.memory_map(rows_files[0]) as mm:
        assert sum(1 for _ in pa.ipc.open_stream(mm)) > 2


def test_gather_matches_datasets(cache):
    files, dtype = cache
    ref_rows, ref_emb, idx = _reference(*files)
    rng = np.random.default_rng(0)
    with SampleSource(*files, fingerprint="fp") as src:
        assert src.num_rows == len(idx) == 200
        assert src.num_physical_rows == 300
        assert (src.num_crops, src.latent_shape, src.embed_dim) == (3, (4, 32, 32), 8)
        assert src.latent_dtype == np.dtype(dtype)
        np.testing.assert_array_equal(src.keys, ref_rows[idx]["key"])
        for _ in range(5):
            b = int(rng.integers(1, 80))
            rows = rng.integers(0, src.num_rows, b)
            crops = rng.integers(0, 3, b)
            got = src.gather(rows, crops)
            phys = idx[rows]
            lat = ref_rows[phys]["latents"]
            assert got["latents"].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got["latents"], lat[np.arange(b), crops])
            np.testing.assert_array_equal(got["embeddings"], ref_emb[phys]["embedding"])
            np.testing.assert_array_equal(got["keys"], ref_rows[phys]["key"])
        got = src.gather(np.array([0, src.num_rows - 1, 0]), 2)
        lat = ref_rows[idx[[0, src.num_rows - 1, 0]]]["latents"]
        np.testing.assert_array_equal(got["latents"], lat[:, 2])


def test_mapped_column_whole_rows_and_out(cache):
    (rows_files, _, _), dtype = cache
    ref_rows = datasets.concatenate_datasets(
        [datasets.Dataset.from_file(f) for f in rows_files]
    ).with_format("numpy")
    with MappedColumn.open(rows_files, "latents") as col:
        assert col.num_rows == 300 and col.row_shape == LATENT_SHAPE
        rows = np.array([299, 0, 150, 151, 40, 39, 299])
        np.testing.assert_array_equal(col.gather(rows), ref_rows[rows]["latents"])
        out = np.empty((len(rows), 4, 32, 32), dtype=dtype)
        res = col.gather(rows, np.array([0, 1, 2, 0, 1, 2, 1]), out=out)
        assert res is out
        np.testing.assert_array_equal(out[6], ref_rows[299]["latents"][1])
        assert col.gather(np.zeros(0, dtype=np.int64)).shape == (0, *LATENT_SHAPE)
        with pytest.raises(IndexError):
            col.gather([300])
        with pytest.raises(IndexError):
            col.gather([0], 3)
        with pytest.raises(ValueError):
            col.gather([0], out=np.empty((2, *LATENT_SHAPE), dtype=dtype))
    with MappedColumn.open(rows_files, "key") as keys:
        np.testing.assert_array_equal(keys.read_all(), 1000 + 7 * np.arange(300))
    with pytest.raises(ValueError, match="closed"):
        keys.gather([0])


def test_without_indices_and_single_process(tmp_path):
    files = build_cache(tmp_path, 50, num_proc=1, drop_every=None, writer_batch_size=7, embed_dim=3)
    assert files[2] is None and len(files[0]) == 1
    with SampleSource(files[0], files[1]) as src:
        assert src.num_rows == 50
        np.testing.assert_array_equal(src.keys, 1000 + 7 * np.arange(50))
        got = src.gather(np.arange(50)[::-1], 1)
        np.testing.assert_array_equal(got["embeddings"][:, 0], (1000 + 7 * np.arange(50))[::-1])


def test_errors_name_the_path(cache, tmp_path):
    (rows_files, emb_files, idx_files), _ = cache
    missing = str(tmp_path / "nope.arrow")
    with pytest.raises(CacheFormatError) as ei:
        SampleSource([missing], emb_files)
    assert ei.value.path == missing and isinstance(ei.value, ValueError)
    with pytest.raises(CacheFormatError, match="no column 'latents'"):
        SampleSource(emb_files, emb_files)
    with pytest.raises(CacheFormatError, match="embedding files hold 1"):
        SampleSource(rows_files, emb_files[:1])
    garbage = tmp_path / "garbage.arrow"
    garbage.write_bytes(b"not arrow at all" * 10)
    with pytest.raises(CacheFormatError) as ei:
        MappedColumn.open([str(garbage)], "latents")
    assert ei.value.path == str(garbage)
    with pytest.raises(CacheFormatError, match="no fixed-shape"):
        MappedColumn.open(rows_files, "caption")
    err = pickle.loads(pickle.dumps(ei.value))
    assert err.path == str(garbage) and str(err) == str(ei.value)


def test_ragged_and_null_columns_are_refused(tmp_path):
    path = str(tmp_path / "ragged.arrow")
    table = pa.table({"x": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32()))})
    with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(CacheFormatError, match="different lengths"):
        MappedColumn.open([path], "x")
    path2 = str(tmp_path / "null.arrow")
    table = pa.table({"x": pa.array([1.0, None], pa.float32())})
    with pa.OSFile(path2, "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(CacheFormatError, match="nulls"):
        MappedColumn.open([path2], "x")


def test_sliced_batches_and_ipc_file_format(tmp_path):
    """Offsets that do not start at 0 (sliced writes) and the IPC file format work."""
    vals = np.arange(10 * 6, dtype=np.float32).reshape(10, 2, 3)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), 3)
    outer = pa.ListArray.from_arrays(pa.array(np.arange(0, 21, 2, dtype=np.int32)), inner)
    table = pa.table({"x": outer})
    path = str(tmp_path / "file.arrow")
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table.slice(3, 4))
        w.write_table(table.slice(0, 3))
    with MappedColumn.open([path], "x") as col:
        assert col.row_shape == (2, 3) and col.num_rows == 7
        np.testing.assert_array_equal(col.read_all(), np.concatenate([vals[3:7], vals[0:3]]))
        np.testing.assert_array_equal(col.gather([6, 0], [1, 0]), [vals[2, 1], vals[3, 0]])


def test_gather_is_thread_safe(cache):
    from concurrent.futures import ThreadPoolExecutor

    files, _ = cache
    with SampleSource(*files) as src:
        rows = np.arange(src.num_rows)
        expect = src.gather(rows, 1)["latents"]

        def work(seed):
            r = np.random.default_rng(seed).permutation(src.num_rows)
            got = src.gather(r, 1)["latents"]
            return np.array_equal(got, expect[r])

        with ThreadPoolExecutor(4) as ex:
            assert all(ex.map(work, range(16)))


def test_advise(cache):
    files, _ = cache
    with SampleSource(*files) as src:
        before = src.gather(np.arange(10), 1)["latents"]
        for pattern in ("random", "sequential", "willneed", "normal"):
            applied = src.advise(pattern)
            assert applied or not sys.platform.startswith("linux")
        np.testing.assert_array_equal(src.gather(np.arange(10), 1)["latents"], before)
        with pytest.raises(ValueError, match="pattern must be one of"):
            src.advise("fast")


def test_bfloat16_bits_are_read_as_bfloat16(tmp_path):
    """Arrow has no bfloat16: the uint16 bits come back as ml_dtypes.bfloat16, unchanged."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    files = build_cache(tmp_path, 60, dtype="bfloat16", num_proc=1, writer_batch_size=7)
    ref_rows, _, idx = _reference(*files)
    assert ref_rows.features["latents"].dtype == "uint16"
    bits = ref_rows[:]["latents"]  # the bits, widened to int64 by datasets' numpy format
    assert bits.min() >= 0 and bits.max() < 2**16
    bits = bits.astype(np.uint16)
    assert (bits[:, :, 0, 0, 0] == 3).all()  # the planted subnormal survived the write
    with SampleSource(*files, fingerprint="fp", latent_dtype="bfloat16") as src:
        assert src.latent_dtype == bf16
        rows = np.array([0, src.num_rows - 1, 5, 5, 17])
        crops = np.array([2, 0, 1, 1, 0])
        got = src.gather(rows, crops)["latents"]
        assert got.dtype == bf16 and got.shape == (5, 4, 32, 32)
        np.testing.assert_array_equal(got.view(np.uint16), bits[idx[rows], crops])
        assert float(got[0, 0, 0, 1]) == np.float32(-3e-8).astype(bf16).astype(np.float32)
        assert np.signbit(got[0, 0, 0, 2]) and float(got[0, 0, 0, 2]) == 0.0
        out = {"latents": np.empty((5, 4, 32, 32), bf16)}
        src.gather(rows, crops, out=out)
        np.testing.assert_array_equal(out["latents"].view(np.uint16), got.view(np.uint16))
        clone = pickle.loads(pickle.dumps(src))  # spawned workers reopen it as bfloat16
        with clone:
            assert clone.latent_dtype == bf16
            np.testing.assert_array_equal(
                clone.gather(rows, crops)["latents"].view(np.uint16), got.view(np.uint16)
            )
    # uint16 is never guessed to be bfloat16, and a wrong declaration is refused.
    with pytest.raises(CacheFormatError, match="stored as uint16; pass the cache's storage"):
        SampleSource(*files)
    with pytest.raises(CacheFormatError, match="the cache says float16"):
        SampleSource(*files, latent_dtype="float16")
    with pytest.raises(CacheFormatError, match="cannot be read as float32"):
        SampleSource(*files, latent_dtype="float32")
