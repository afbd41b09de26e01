"""Tests for hf_pipeline.build.captions: reading, validation, dedup, lookup, classify, IPC."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_pipeline.build.captions import (
    BAD_CAPTION_ENCODING,
    EMPTY_CAPTION,
    KEEP,
    NO_CAPTION,
    REASONS,
    CaptionTable,
    caption_texts,
    classify,
    read_captions,
    reason_names,
    write_sorted_captions,
)
from hf_pipeline.errors import MetadataError
from tests.conftest import run_mount
from tests.helpers.memory import SOURCE as MEMORY


def _write(path, df: pd.DataFrame, index: bool = False) -> str:
    df.to_parquet(path, index=index)
    return str(path)


def _df():
    return pd.DataFrame(
        {
            "key": np.array([50, 10, 30, 10, 20], dtype=np.int64),
            "caption_llava": ["fifty", "ten", None, "ten again", "  "],
            "caption": ["5", "1", "3", "1b", "2"],
            "url": ["u"] * 5,
        }
    )


# ----------------------------------------------------------------------------- reading


def test_duplicate_key_first_row_in_file_wins_even_without_caption(tmp_path):
    """README: the first row in file order wins, whatever its caption; later rows with
    the same key are only counted."""
    df = pd.DataFrame(
        {
            "key": np.array([7, 3, 7, 7, 3], dtype=np.int64),
            "caption_llava": [None, "three", "seven", "seven again", ""],
        }
    )
    t = read_captions(_write(tmp_path / "m.parquet", df))
    assert t.keys.tolist() == [3, 7]
    assert t.captions.to_pylist() == ["three", None]
    assert t.duplicate_meta_rows == 3


def test_read_captions_key_column_and_duplicates(tmp_path):
    path = _write(tmp_path / "m.parquet", _df())
    t = read_captions(path)
    assert t.keys.tolist() == [10, 20, 30, 50]
    assert t.captions.to_pylist() == ["ten", "  ", None, "fifty"]  # first 10 kept
    assert (t.num_rows, t.duplicate_meta_rows, t.null_captions, len(t)) == (5, 1, 1, 4)
    assert t.counts == {
        "meta_rows": 5,
        "meta_keys": 4,
        "duplicate_meta_rows": 1,
        "null_key_rows": 0,
        "null_captions": 1,
    }
    other = read_captions(path, caption_column="caption")
    assert other.captions.to_pylist() == ["1", "2", "3", "5"]


@pytest.mark.parametrize("named", [False, True])
def test_read_captions_key_as_pandas_index(tmp_path, named):
    df = _df().set_index("key")
    if not named:
        df.index.name = None  # stored as __index_level_0__
    path = _write(tmp_path / "m.parquet", df, index=True)
    names = pq.read_schema(path).names
    assert ("__index_level_0__" in names) is (not named)
    t = read_captions(path)
    assert t.keys.tolist() == [10, 20, 30, 50]
    assert t.captions.to_pylist() == ["ten", "  ", None, "fifty"]
    assert t.duplicate_meta_rows == 1


def test_read_captions_other_int_types_and_null_keys(tmp_path):
    table = pa.table(
        {
            "key": pa.array([3, None, 1, 2], type=pa.int32()),
            "caption_llava": pa.array(["c", "x", "a", "b"], type=pa.large_string()),
        }
    )
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    t = read_captions(path)
    assert t.keys.dtype == np.int64 and t.keys.tolist() == [1, 2, 3]
    assert t.captions.to_pylist() == ["a", "b", "c"]
    assert (t.num_rows, t.null_key_rows) == (4, 1)


def test_read_captions_categorical_and_all_null_captions(tmp_path):
    cat = pd.DataFrame({"key": [3, 1, 2], "caption_llava": pd.Categorical(["c", "a", None])})
    t = read_captions(_write(tmp_path / "cat.parquet", cat))
    assert t.captions.to_pylist() == ["a", None, "c"] and t.null_captions == 1
    pq.write_table(
        pa.table({"key": [5, 4], "caption_llava": pa.array([None, None])}), tmp_path / "n.parquet"
    )
    t = read_captions(tmp_path / "n.parquet")
    assert t.captions.to_pylist() == [None, None]
    assert reason_names(classify(*t.lookup([4, 5]))).tolist() == [NO_CAPTION, NO_CAPTION]


def test_read_captions_already_sorted_file(tmp_path):
    keys = np.arange(0, 3000, 3, dtype=np.int64)
    caps = [None if i % 7 == 0 else f"c{i}" for i in range(len(keys))]
    pq.write_table(
        pa.table({"key": keys, "caption_llava": caps}), tmp_path / "s.parquet", row_group_size=100
    )
    t = read_captions(tmp_path / "s.parquet")
    assert t.keys.tolist() == keys.tolist() and t.captions.to_pylist() == caps
    assert (t.duplicate_meta_rows, t.null_captions) == (0, caps.count(None))
    assert t.lookup([3, 4, 2997])[0].to_pylist() == ["c1", None, "c999"]


def test_read_captions_errors(tmp_path):
    path = _write(tmp_path / "m.parquet", _df())
    with pytest.raises(
        MetadataError,
        match=r"caption column 'nope' not found; columns: key, caption_llava, caption, url",
    ) as info:
        read_captions(path, caption_column="nope")
    assert info.value.path == path
    assert pickle.loads(pickle.dumps(info.value)).path == path
    with pytest.raises(
        MetadataError,
        match=r"key column 'id' not found as a column or pandas index.*columns: key, caption_llava, caption, url",
    ):
        read_captions(path, key_column="id")
    with pytest.raises(
        MetadataError, match=r"key column 'url' must be an integer type, got (large_)?string"
    ):
        read_captions(path, key_column="url")
    with pytest.raises(
        MetadataError, match=r"caption column 'key' must be string/large_string, got int64"
    ):
        read_captions(path, caption_column="key")
    with pytest.raises(MetadataError, match="does not exist"):
        read_captions(tmp_path / "missing.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet" * 100)
    with pytest.raises(MetadataError, match="not a readable parquet file"):
        read_captions(junk)
    # A RangeIndex frame has no stored key at all: say so.
    ranged = _write(tmp_path / "r.parquet", _df().drop(columns="key"), index=None)
    with pytest.raises(MetadataError, match="RangeIndex"):
        read_captions(ranged)


# ----------------------------------------------------------------------------- lookup/classify


def _reference(meta: pd.DataFrame, query: np.ndarray) -> pd.DataFrame:
    """Independent pandas answer: first row per key, left-merged onto the query."""
    first = meta.drop_duplicates("key", keep="first")
    q = pd.DataFrame({"key": query})
    m = q.merge(first.assign(hit=True), on="key", how="left", sort=False)
    m["hit"] = m["hit"].fillna(False).astype(bool)

    def reason(row):
        if not row.hit or row.caption_llava is None or (isinstance(row.caption_llava, float)):
            return NO_CAPTION
        return EMPTY_CAPTION if row.caption_llava.strip() == "" else KEEP

    m["reason"] = [reason(r) for r in m.itertuples()]
    return m


_caption = st.one_of(
    st.none(),
    st.sampled_from(["", " ", "\t\n", "\u3000", " x ", "a cat", "\u00e9t\u00e9"]),
    st.text(max_size=8),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.lists(st.integers(-(2**40), 2**40), min_size=0, max_size=40),
    caps=st.data(),
    extra=st.lists(st.integers(-(2**40), 2**40), max_size=20),
)
@pytest.mark.slow
def test_lookup_and_classify_match_pandas(tmp_path, keys, caps, extra):
    # Small key pool so duplicates and hits are common.
    pool = keys[:10] if keys else [0]
    keys = [pool[i % len(pool)] if i % 3 == 0 else k for i, k in enumerate(keys)]
    captions = [caps.draw(_caption) for _ in keys]
    meta = pd.DataFrame(
        {"key": np.array(keys, dtype=np.int64), "caption_llava": pd.Series(captions, dtype=object)}
    )
    path = tmp_path / "h.parquet"
    pq.write_table(
        pa.table(
            {
                "key": pa.array(keys, type=pa.int64()),
                "caption_llava": pa.array(captions, type=pa.string()),
            }
        ),
        path,
    )
    t = read_captions(path)
    query = np.array(keys + extra + keys[::-1], dtype=np.int64)
    got_caps, found = t.lookup(query)
    codes = classify(got_caps, found)
    ref = _reference(meta, query)

    assert got_caps.type == pa.large_string()  # a part may hold > 2 GiB of captions
    assert found.tolist() == ref["hit"].tolist()
    ref_caps = [
        c if h and isinstance(c, str) else None
        for c, h in zip(ref["caption_llava"], ref["hit"], strict=True)
    ]
    assert got_caps.to_pylist() == ref_caps
    # Arrow utf8_trim_whitespace and str.strip agree on every code point (str.isspace).
    assert reason_names(codes).tolist() == ref["reason"].tolist()
    assert t.duplicate_meta_rows == len(keys) - len(set(keys))
    assert t.count_absent(np.array(extra, dtype=np.int64)) == len(set(keys) - set(extra))


def test_classify_codes_and_names():
    caps = pa.array(["ok", "", "   ", None, "\t\n", "x", "fine"])
    found = np.array([True, True, True, True, True, True, False])
    codes = classify(caps, found)
    assert codes.dtype == np.uint8
    assert reason_names(codes).tolist() == [
        KEEP,
        EMPTY_CAPTION,
        EMPTY_CAPTION,
        NO_CAPTION,
        EMPTY_CAPTION,
        KEEP,
        NO_CAPTION,
    ]
    assert REASONS == ("", "no_caption", "empty_caption", "bad_caption_encoding")
    assert classify(pa.chunked_array([caps[:3], caps[3:]]), found).tolist() == codes.tolist()
    assert classify(pa.array([], type=pa.string()), np.zeros(0, bool)).shape == (0,)
    with pytest.raises(ValueError, match="captions has 7 rows but found has 2"):
        classify(caps, found[:2])


def test_lookup_edge_cases(tmp_path):
    empty = CaptionTable(np.zeros(0, np.int64), pa.array([], type=pa.string()))
    caps, found = empty.lookup(np.array([1, 2]))
    assert caps.to_pylist() == [None, None] and found.tolist() == [False, False]
    assert empty.count_absent([1, 2]) == 0
    t = read_captions(_write(tmp_path / "m.parquet", _df()))
    # Below the smallest and above the largest key; list input; int32 input.
    caps, found = t.lookup([-5, 10, 51, 50])
    assert caps.to_pylist() == [None, "ten", None, "fifty"]
    assert t.lookup(np.array([30], dtype=np.int32))[1].tolist() == [True]
    assert t.count_absent([]) == 4
    with pytest.raises(ValueError, match="sorted and unique"):
        CaptionTable(np.array([2, 1]), pa.array(["a", "b"]))


# ----------------------------------------------------------------------------- IPC file


def test_save_open_round_trip_and_pickle(tmp_path):
    t = read_captions(_write(tmp_path / "m.parquet", _df()))
    t.captions  # noqa: B018 - touch before save
    target = tmp_path / "sub" / "captions.arrow"
    assert t.save(target) == target
    assert not [p for p in target.parent.iterdir() if p.name != "captions.arrow"]  # no temp left
    o = CaptionTable.open(target)
    assert o.keys.tolist() == t.keys.tolist()
    assert o.captions.to_pylist() == t.captions.to_pylist()
    assert o.counts == t.counts and o.source == t.source
    assert not o.keys.flags.writeable  # a view of the memory map, not a copy
    # Pickles as its path: tiny, so datasets workers reopen the map instead of copying.
    blob = pickle.dumps(o)
    assert len(blob) < 1000
    back = pickle.loads(blob)
    assert back.lookup([20, 30])[0].to_pylist() == ["  ", None]
    # An unsaved table pickles by value.
    mem = CaptionTable(np.array([1, 2]), pa.array(["a", None]))
    assert pickle.loads(pickle.dumps(mem)).captions.to_pylist() == ["a", None]
    # Saving over an existing file replaces it.
    mem.save(target)
    assert CaptionTable.open(target).keys.tolist() == [1, 2]


def test_save_open_empty_and_bad_files(tmp_path):
    e = CaptionTable(np.zeros(0, np.int64), pa.array([], type=pa.string()))
    e.save(tmp_path / "e.arrow")
    assert len(CaptionTable.open(tmp_path / "e.arrow")) == 0
    with pytest.raises(MetadataError, match="does not exist"):
        CaptionTable.open(tmp_path / "missing.arrow")
    (tmp_path / "bad.arrow").write_bytes(b"garbage" * 50)
    with pytest.raises(MetadataError, match="not a readable Arrow IPC caption table"):
        CaptionTable.open(tmp_path / "bad.arrow")
    with pa.OSFile(str(tmp_path / "other.arrow"), "wb") as fh:
        tbl = pa.table({"a": [1]})
        with pa.ipc.new_file(fh, tbl.schema) as w:
            w.write_table(tbl)
    with pytest.raises(MetadataError, match=r"expected columns \['key', 'caption'\]"):
        CaptionTable.open(tmp_path / "other.arrow")


# ----------------------------------------------------------------------------- streaming writer


def _same_table(a: CaptionTable, b: CaptionTable) -> None:
    assert a.keys.tolist() == b.keys.tolist()
    assert a.captions.to_pylist() == b.captions.to_pylist()
    assert a.counts == b.counts and a.source == b.source


def _messy_table(n: int, seed: int) -> pa.Table:
    """Shuffled keys with many duplicates (across row groups), null keys, null, empty and
    non-ASCII captions."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-50, n // 2, size=n).astype(np.int64)  # ~half the rows duplicate
    key_null = rng.random(n) < 0.05
    pool = ["", "  ", "\u3000", "a cat", "\u00e9t\u00e9 \U0001f600", "x" * 300]
    caps = [None if u < 0.1 else f"{pool[i % len(pool)]}#{i}" for i, u in enumerate(rng.random(n))]
    return pa.table(
        {
            "key": pa.array(keys, mask=key_null),
            "caption_llava": pa.array(caps, type=pa.string()),
            "url": pa.array([f"u{i}" for i in range(n)]),
        }
    )


@pytest.mark.parametrize("num_proc", [1, 3])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 0])
def test_write_sorted_captions_equals_in_memory_table(tmp_path, num_proc, chunk_rows):
    path = tmp_path / "m.parquet"
    pq.write_table(_messy_table(600, seed=chunk_rows), path, row_group_size=97)
    assert pq.ParquetFile(path).metadata.num_row_groups == 7
    ref = read_captions(path)
    assert ref.duplicate_meta_rows > 100 and ref.null_key_rows > 10 and ref.null_captions > 10
    out = tmp_path / "out" / "captions.arrow"
    t = write_sorted_captions(path, out, num_proc=num_proc, chunk_rows=chunk_rows)
    _same_table(t, ref)
    assert t.path == str(out) and out.exists()
    if chunk_rows:
        # Chunk boundaries at every size; at most 256 chunks (spill files open at once).
        assert t.num_chunks == -(-len(ref) // max(chunk_rows, -(-len(ref) // 256)))
        assert t.num_chunks == (138 if chunk_rows == 1 else -(-len(ref) // chunk_rows))
    assert not [p.name for p in out.parent.iterdir() if p.name != "captions.arrow"]  # no spill
    # Lookups across chunk boundaries agree, in any order, with misses and repeats.
    rng = np.random.default_rng(0)
    query = np.concatenate([ref.keys, ref.keys[::-1], rng.integers(-100, 400, 300)])
    rng.shuffle(query)
    got, found = t.lookup(query)
    want, want_found = ref.lookup(query)
    assert got.to_pylist() == want.to_pylist() and found.tolist() == want_found.tolist()
    assert classify(got, found).tolist() == classify(want, want_found).tolist()
    latent = rng.integers(-100, 400, 250)
    assert t.count_absent(latent) == ref.count_absent(latent)
    assert t.count_absent([]) == len(ref)
    # Reopened by a worker: same table, from the map.
    _same_table(pickle.loads(pickle.dumps(t)), ref)


@pytest.mark.parametrize("num_proc", [1, 4])
def test_write_sorted_captions_one_row_group_placed_by_spare_threads(
    tmp_path, monkeypatch, num_proc
):
    """Issue 10: a file of one row group (pyarrow's default before 15.0 for up to 64Mi
    rows) is not one thread's work: the reader decodes, the spare threads place its
    batches (take, spill writes); same table as in memory."""
    import threading

    import hf_pipeline.build.caption_sort as cs

    path = tmp_path / "m.parquet"
    pq.write_table(_messy_table(600, seed=5), path, row_group_size=600)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    monkeypatch.setattr(cs, "_BATCH_ROWS", 41)  # 15 batches
    writers, real_write = set(), cs.Spill.write

    def write(self, *args):
        writers.add(threading.current_thread().name.split("_")[0])
        return real_write(self, *args)

    monkeypatch.setattr(cs.Spill, "write", write)
    t = write_sorted_captions(path, tmp_path / "o.arrow", num_proc=num_proc, chunk_rows=50)
    _same_table(t, read_captions(path))
    if num_proc == 1:
        assert writers == {"caption-scatter"}
    else:
        assert writers == {"caption-place"}


def test_write_sorted_captions_duplicate_rule_first_in_file_order(tmp_path):
    # The same key in three row groups: the first row in the file wins, whichever chunk
    # or thread sees it; a null key is never a duplicate of anything.
    table = pa.table(
        {
            "key": pa.array([7, 3, None, 7, 3, 9, None, 7, 1], type=pa.int64()),
            "caption_llava": ["7a", "3a", "n1", "7b", "3b", "9a", "n2", "7c", "1a"],
        }
    )
    path = tmp_path / "m.parquet"
    pq.write_table(table, path, row_group_size=3)
    for num_proc in (1, 3):
        t = write_sorted_captions(
            path, tmp_path / f"o{num_proc}.arrow", num_proc=num_proc, chunk_rows=1
        )
        assert t.keys.tolist() == [1, 3, 7, 9]
        assert t.captions.to_pylist() == ["1a", "3a", "7a", "9a"]
        assert (t.num_rows, t.duplicate_meta_rows, t.null_key_rows) == (9, 3, 2)


@pytest.mark.parametrize("named", [False, True])
def test_write_sorted_captions_key_as_pandas_index(tmp_path, named):
    df = _df().set_index("key")
    if not named:
        df.index.name = None
    path = _write(tmp_path / "m.parquet", df, index=True)
    t = write_sorted_captions(path, tmp_path / "c.arrow", chunk_rows=2)
    _same_table(t, read_captions(path))
    assert t.captions.to_pylist() == ["ten", "  ", None, "fifty"]


def test_write_sorted_captions_types_sorted_input_and_empty(tmp_path):
    # Categorical captions, int32 keys with nulls, an all-null caption column.
    cat = pd.DataFrame(
        {"key": [3, 1, 2, 1], "caption_llava": pd.Categorical(["c", "a", None, "z"])}
    )
    p = _write(tmp_path / "cat.parquet", cat)
    _same_table(write_sorted_captions(p, tmp_path / "cat.arrow", chunk_rows=1), read_captions(p))
    pq.write_table(
        pa.table({"key": pa.array([3, None, 1], pa.int32()), "caption_llava": ["c", "x", "a"]}),
        tmp_path / "i.parquet",
    )
    t = write_sorted_captions(tmp_path / "i.parquet", tmp_path / "i.arrow")
    assert t.keys.tolist() == [1, 3] and t.null_key_rows == 1
    pq.write_table(
        pa.table({"key": [5, 4], "caption_llava": pa.array([None, None])}), tmp_path / "n.parquet"
    )
    t = write_sorted_captions(tmp_path / "n.parquet", tmp_path / "n.arrow")
    assert t.captions.to_pylist() == [None, None] and t.null_captions == 2
    # A key-ordered export (no duplicates) takes the same path and gives the same table.
    keys = np.arange(0, 3000, 3, dtype=np.int64)
    caps = [None if i % 7 == 0 else f"c{i}" for i in range(len(keys))]
    pq.write_table(
        pa.table({"key": keys, "caption_llava": caps}), tmp_path / "s.parquet", row_group_size=100
    )
    t = write_sorted_captions(
        tmp_path / "s.parquet", tmp_path / "s.arrow", num_proc=2, chunk_rows=128
    )
    assert t.keys.tolist() == keys.tolist() and t.captions.to_pylist() == caps
    # No rows at all, and only null keys.
    for name, key in (("e", pa.array([], pa.int64())), ("z", pa.array([None, None], pa.int64()))):
        pq.write_table(
            pa.table({"key": key, "caption_llava": pa.array(["a", "b"][: len(key)], pa.string())}),
            tmp_path / f"{name}.parquet",
        )
        t = write_sorted_captions(tmp_path / f"{name}.parquet", tmp_path / f"{name}.arrow")
        _same_table(t, read_captions(tmp_path / f"{name}.parquet"))
        assert len(t) == 0 and t.lookup([1])[1].tolist() == [False] and t.count_absent([1]) == 0


def test_write_sorted_captions_errors_name_file_and_field(tmp_path):
    path = _write(tmp_path / "m.parquet", _df())
    out = tmp_path / "o" / "c.arrow"
    with pytest.raises(
        MetadataError, match=r"caption column 'nope' not found; columns: key"
    ) as info:
        write_sorted_captions(path, out, caption_column="nope")
    assert info.value.path == path
    with pytest.raises(
        MetadataError, match=r"key column 'id' not found as a column or pandas index"
    ):
        write_sorted_captions(path, out, key_column="id")
    with pytest.raises(MetadataError, match=r"key column 'url' must be an integer type"):
        write_sorted_captions(path, out, key_column="url")
    with pytest.raises(MetadataError, match="does not exist"):
        write_sorted_captions(tmp_path / "missing.parquet", out)
    big = tmp_path / "u.parquet"
    pq.write_table(
        pa.table({"key": pa.array([2**63 + 5], pa.uint64()), "caption_llava": ["a"]}), big
    )
    with pytest.raises(MetadataError, match=r"key column 'key' has values beyond int64"):
        write_sorted_captions(big, out)
    with pytest.raises(ValueError, match="num_proc must be >= 1, got 0"):
        write_sorted_captions(path, out, num_proc=0)
    with pytest.raises(ValueError, match="chunk_rows must be >= 0, got -1"):
        write_sorted_captions(path, out, chunk_rows=-1)
    assert not out.parent.exists() or not list(out.parent.iterdir())  # nothing half-written


def test_write_sorted_captions_corrupt_row_group_leaves_nothing(tmp_path):
    # A caption page damaged after the footer was written: the read fails mid-stream, in a
    # worker thread; the error names the file and column, and neither the output nor a
    # spill file is left.
    path = tmp_path / "m.parquet"
    n = 4000
    pq.write_table(
        pa.table(
            {
                "key": np.arange(n, dtype=np.int64)[::-1].copy(),
                "caption_llava": [f"caption {i} " * 8 for i in range(n)],
            }
        ),
        path,
        row_group_size=1000,
        compression="none",
    )
    md = pq.ParquetFile(path).metadata
    col = md.row_group(2).column(1)
    raw = bytearray(path.read_bytes())
    start = col.data_page_offset
    raw[start : start + 64] = b"\xff" * 64  # the page header: undecodable
    path.write_bytes(bytes(raw))
    out = tmp_path / "o" / "c.arrow"
    with pytest.raises(MetadataError, match=r"cannot read column 'caption_llava'") as info:
        write_sorted_captions(path, out, num_proc=2, chunk_rows=100)
    assert info.value.path == str(path)
    assert list(out.parent.iterdir()) == []


def test_chunked_table_api(tmp_path):
    # Several chunks in, several chunks out: open() never concatenates a column.
    keys = pa.chunked_array([pa.array([1, 5], pa.int64()), pa.array([9, 12, 20], pa.int64())])
    caps = pa.chunked_array([pa.array(["a", None]), pa.array(["c", "d", ""])])
    t = CaptionTable(keys, caps)
    assert t.num_chunks == 2 and len(t) == 5 and t.null_captions == 1
    assert t.lookup([20, 0, 5, 9, 21, 1, 12])[0].to_pylist() == [
        "",
        None,
        None,
        "c",
        None,
        "a",
        "d",
    ]
    t.save(tmp_path / "c.arrow")
    o = CaptionTable.open(tmp_path / "c.arrow")
    assert o.num_chunks == 2 and isinstance(o.captions, pa.ChunkedArray)
    assert o.keys.tolist() == [1, 5, 9, 12, 20] and o.count_absent([5, 12, 99]) == 3
    # A NumPy key array is split like the captions; order is checked across chunks too.
    assert CaptionTable(np.array([1, 5, 9, 12, 20]), caps).num_chunks == 2
    with pytest.raises(ValueError, match="sorted and unique"):
        CaptionTable(np.array([1, 5, 5, 12, 20]), caps)
    with pytest.raises(ValueError, match="captions has 5 rows but keys has 4"):
        CaptionTable(np.array([1, 5, 9, 12]), caps)
    with pytest.raises(ValueError, match="keys must be a 1-D int64 array, got int32"):
        CaptionTable(np.array([1, 5, 9, 12, 20], dtype=np.int32), caps)


def test_open_reads_the_ipc_file_format_of_earlier_saves(tmp_path):
    # save() and write_sorted_captions write an IPC stream (batches written in parallel);
    # a table saved as an IPC file (one record batch, as before) still opens, mapped.
    ref = read_captions(_write(tmp_path / "m.parquet", _df()))
    old = tmp_path / "old.arrow"
    schema = pa.schema(
        [("key", pa.int64()), ("caption", pa.large_string())],
        metadata={
            b"hf_pipeline.caption_counts": b'{"duplicate_meta_rows": 1, "null_key_rows": 0, '
            b'"num_rows": 5, "source": "' + ref.source.encode() + b'"}'
        },
    )
    table = pa.table({"key": pa.array(ref.keys), "caption": ref.captions}, schema=schema)
    with pa.OSFile(str(old), "wb") as fh, pa.ipc.new_file(fh, schema) as w:
        w.write_table(table)
    assert old.read_bytes()[:6] == b"ARROW1"
    o = CaptionTable.open(old)
    _same_table(o, ref)
    assert not o.keys.flags.writeable
    new = tmp_path / "new.arrow"
    ref.save(new)
    assert new.read_bytes()[:6] != b"ARROW1"
    _same_table(CaptionTable.open(new), ref)


@pytest.mark.parametrize("groups", [4, 1])
@pytest.mark.parametrize("phase", ["spill", "output"])
def test_write_sorted_captions_full_disk_leaves_nothing(tmp_path, mounts, phase, groups):
    # A real full disk (tmpfs). "spill": 4 MB of captions, 1 MB of disk: the spill fails.
    # "output": 100k 6-byte captions in one chunk; the spill (1.4 MB: data + 8 bytes a
    # row) fits in 1.8 MB, the sorted file (2.2 MB: data + 16 bytes a row) does not. Either way the OSError
    # says so (not blamed on the metadata file), no spill or temp file is left, and the
    # file published before stays as it was.
    n, size = (12_000, "1m") if phase == "spill" else (100_000, "1800k")
    rng = np.random.default_rng(3)
    words = "caption words " * 24 if phase == "spill" else ""
    path = tmp_path / "m.parquet"
    pq.write_table(
        pa.table(
            {
                "key": rng.permutation(n).astype(np.int64),
                "caption_llava": [f"{i:06d}{words}" for i in range(n)],
            }
        ),
        path,
        row_group_size=n // groups,  # one group: a spare thread's spill write fails
    )
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk))
    out = disk / "captions.arrow"
    out.write_bytes(b"published before")
    chunk_rows = 1500 if phase == "spill" else n
    with pytest.raises(OSError, match="No space left on device") as info:
        write_sorted_captions(path, out, num_proc=2, chunk_rows=chunk_rows)
    assert not isinstance(info.value, MetadataError)
    assert sorted(p.name for p in disk.iterdir()) == ["captions.arrow"]
    assert out.read_bytes() == b"published before"
    run_mount("-o", "remount,size=64m", str(disk))
    t = write_sorted_captions(path, out, num_proc=2, chunk_rows=chunk_rows)
    _same_table(t, read_captions(path))


def _unvalidated_strings(values: list) -> pa.Array:
    """A string array holding whatever bytes it is given: a binary array relabelled as
    string without validation, as a parquet writer that does not check UTF-8 makes it."""
    return pa.array(values, pa.binary()).view(pa.string())


def test_undecodable_captions_are_their_own_drop_reason(tmp_path):
    """Issue 24 item 6. Before: ``classify`` raised ArrowInvalid ("Invalid UTF8 sequence")
    and the join's ``to_pylist`` a UnicodeDecodeError: a traceback, exit 1."""
    caps = _unvalidated_strings(
        [b"ok", b"bad \xff\xfe", None, b"cut \xc3", b"  ", "\u00e9t\u00e9".encode()]
    )
    found = np.ones(6, dtype=bool)
    found[5] = False
    codes = classify(caps, found)
    assert reason_names(codes).tolist() == [
        KEEP, BAD_CAPTION_ENCODING, NO_CAPTION, BAD_CAPTION_ENCODING, EMPTY_CAPTION, NO_CAPTION,
    ]  # fmt: skip
    assert classify(pa.chunked_array([caps[:2], caps[2:]]), found).tolist() == codes.tolist()
    # The texts the join stores and tokenizes: "" for a null or undecodable caption.
    assert caption_texts(caps, codes) == ["ok", "", "", "", "  ", "\u00e9t\u00e9"]

    # Through the metadata file: the table keeps the bytes (the rows are counted at the
    # join, where one bad caption costs its row, not the build).
    path = tmp_path / "meta.parquet"
    pq.write_table(pa.table({"key": pa.array([3, 1, 2], pa.int64()),
                             "caption_llava": _unvalidated_strings([b"c", b"a\xff", b"b"])}), path)  # fmt: skip
    for table in (read_captions(path), write_sorted_captions(path, tmp_path / "t.arrow")):
        got, hit = table.lookup(np.array([1, 2, 3, 4]))
        codes = classify(got, hit)
        assert reason_names(codes).tolist() == [BAD_CAPTION_ENCODING, KEEP, KEEP, NO_CAPTION]
        assert caption_texts(got, codes) == ["", "b", "c", ""]


# ----------------------------------------------------------------------------- caption bounds


def _one_value_table(n: int, value: str, *, dictionary: bool) -> pa.Table:
    """``n`` rows (keys ``100 + row``) sharing one caption: an Arrow dictionary column, or
    a plain string one."""
    caps = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value]))
    return pa.table(
        {
            "key": np.arange(100, 100 + n, dtype=np.int64),
            "caption_llava": caps if dictionary else caps.cast(pa.string()),
        }
    )


def _caption_stage(path, out, *, num_proc: int = 1) -> dict:
    """:func:`write_sorted_captions` in a fresh process: its error message or its table's
    rows, caption bytes and first and last keys, and how much its peak RSS grew (MB)."""
    import json
    import subprocess

    from tests.conftest import PYTHON, script_env

    code = (
        MEMORY
        + f"""
import json
import pyarrow.compute as pc
from hf_pipeline.build.captions import write_sorted_captions
from hf_pipeline.errors import MetadataError
before = peak_mib()
try:
    t = write_sorted_captions({str(path)!r}, {str(out)!r}, num_proc={num_proc})
    got = dict(rows=len(t), keys=[int(t.keys[0]), int(t.keys[-1])],
               bytes=sum(pc.sum(pc.binary_length(c)).as_py() for c in t.captions.chunks))
except MetadataError as e:
    got = dict(error=str(e))
got["grown_mb"] = peak_mib() - before
print(json.dumps(got))
"""
    )
    proc = subprocess.run(
        [PYTHON, "-c", code], env=script_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_dictionary_caption_over_the_limit_is_refused_before_it_is_decoded(tmp_path):
    """The adversarial tester's file: 400 rows of one dictionary-encoded 10 MB caption in
    a 2 KB zstd parquet. Before: the caption stage grew by 2.1 GB, then ``ArrowInvalid:
    Take operation overflowed binary array capacity`` (default_chunk_rows' sample)."""
    path = tmp_path / "m.parquet"
    table = _one_value_table(400, "x" * (10 << 20), dictionary=True)
    pq.write_table(table, path, use_dictionary=True, compression="zstd")
    assert path.stat().st_size < 4096
    out = tmp_path / "o" / "c.arrow"
    want = (
        f"{path}: caption column 'caption_llava', row 0 (key 100): a caption of 10485760 "
        "bytes, over the limit of 1048576 bytes (data.max_caption_bytes)"
    )
    for num_proc in (1, 3):
        with pytest.raises(MetadataError) as info:
            write_sorted_captions(path, out, num_proc=num_proc)
        assert str(info.value) == want and info.value.path == str(path)
    assert list(out.parent.iterdir()) == []  # no spill, no output
    with pytest.raises(MetadataError) as info:
        read_captions(path)
    assert str(info.value) == want
    # In a fresh process: the dictionary is decoded once (10 MB), the 4 GB the rows stand
    # for never (~95 MB of growth, imports and the reader's buffers included).
    got = _caption_stage(path, out)
    assert got["error"] == want
    assert got["grown_mb"] < 300, got


@pytest.mark.parametrize("use_dictionary", [False, True])
def test_a_string_caption_over_the_limit_is_refused_naming_its_row(tmp_path, use_dictionary):
    """A plain string column, its pages plain or dictionary encoded: refused at its first
    caption over the limit, kept or not (row 5 repeats key 100, a dropped duplicate);
    a caption of exactly the limit is accepted."""
    limit = 1000
    caps = [f"c{i}" for i in range(12)]
    caps[3] = "y" * limit  # at the limit: accepted
    caps[5] = "z" * (limit + 1)
    keys = np.arange(100, 112, dtype=np.int64)
    keys[5] = 100
    path = tmp_path / "m.parquet"
    pq.write_table(
        pa.table({"key": keys, "caption_llava": caps}),
        path,
        use_dictionary=use_dictionary,
        row_group_size=4,
    )
    want = (
        f"{path}: caption column 'caption_llava', row 5 (key 100): a caption of 1001 bytes, "
        "over the limit of 1000 bytes (data.max_caption_bytes)"
    )
    for num_proc in (1, 2):
        with pytest.raises(MetadataError) as info:
            write_sorted_captions(
                path, tmp_path / "o.arrow", num_proc=num_proc, max_caption_bytes=limit
            )
        assert str(info.value) == want
    with pytest.raises(MetadataError) as info:
        read_captions(path, max_caption_bytes=limit)
    assert str(info.value) == want
    t = write_sorted_captions(path, tmp_path / "o.arrow", max_caption_bytes=limit + 1)
    _same_table(t, read_captions(path, max_caption_bytes=limit + 1))
    assert t.lookup([103])[0].to_pylist() == ["y" * limit]
    with pytest.raises(ValueError, match="max_caption_bytes must be >= 0, got -1"):
        write_sorted_captions(path, tmp_path / "o.arrow", max_caption_bytes=-1)


def test_the_default_limit_is_the_configs():
    import inspect

    from hf_pipeline.build.captions import MAX_CAPTION_BYTES
    from hf_pipeline.config import DataConfig

    assert DataConfig().max_caption_bytes == MAX_CAPTION_BYTES == 1 << 20
    for fn in (read_captions, write_sorted_captions):
        assert inspect.signature(fn).parameters["max_caption_bytes"].default == MAX_CAPTION_BYTES


def test_caption_lengths_decode_nothing():
    from hf_pipeline.build.caption_bounds import caption_lengths

    values = pa.array(["ab", "cdef", ""])
    d = pa.DictionaryArray.from_arrays(pa.array([1, None, 0, 2, 1], pa.int8()), values)
    assert caption_lengths(d).tolist() == [4, 0, 2, 0, 4]
    assert caption_lengths(d.slice(2)).tolist() == [2, 0, 4]
    big = pa.DictionaryArray.from_arrays(
        pa.array([0, 1], pa.int32()), pa.array(["a", "bcd"], pa.large_string())
    )
    assert caption_lengths(big).tolist() == [1, 3]
    plain = pa.array(["x", None, "yz"])
    assert caption_lengths(plain).tolist() == [1, 0, 2]
    assert caption_lengths(plain.cast(pa.string_view())).tolist() == [1, 0, 2]
    assert caption_lengths(pa.array([None, None])).tolist() == [0, 0]
    bad = pa.DictionaryArray.from_arrays(pa.array([0, 5], pa.int32()), values, safe=False)
    with pytest.raises(ValueError, match="dictionary index outside its 3 values"):
        caption_lengths(bad)


def test_a_dictionary_page_bounds_the_read_batches(tmp_path, monkeypatch):
    """One row of a dictionary-encoded page may stand for the page's longest value: a
    string column's batches are sized by it (measured on a one-row dictionary read), not
    only by the column's uncompressed size per row, which counts that value once."""
    import hf_pipeline.build.caption_sort as cs

    path = tmp_path / "m.parquet"
    pq.write_table(_one_value_table(3000, "v" * 5000, dictionary=False), path)
    meta = pq.ParquetFile(path).metadata
    assert meta.row_group(0).column(1).has_dictionary_page
    assert meta.row_group(0).column(1).total_uncompressed_size < 3000 * 100
    monkeypatch.setattr(cs, "_SLICE_BYTES", 50_000)
    reader, rows = cs.caption_reader(str(path), meta, "caption_llava", 0)
    reader.close()
    assert rows == 10  # 50_000 // 5000
    # Plain pages: by the uncompressed size per row.
    pq.write_table(_one_value_table(3000, "v" * 5000, dictionary=False), path, use_dictionary=False)
    meta = pq.ParquetFile(path).metadata
    reader, rows = cs.caption_reader(str(path), meta, "caption_llava", 0)
    reader.close()
    assert 9 <= rows <= 10


def test_captions_in_slices_and_pieces_make_the_same_table(tmp_path, monkeypatch):
    """More caption bytes than a slice (scatter) or a piece (gather) holds: taken and
    gathered in parts, the same table; a chunk that holds more than its estimate is
    several record batches."""
    import hf_pipeline.build.caption_sort as cs

    path = tmp_path / "m.parquet"
    pq.write_table(_messy_table(600, seed=3), path, row_group_size=250)
    dict_path = tmp_path / "d.parquet"
    table = _messy_table(600, seed=4)
    col = table.column("caption_llava").dictionary_encode()
    pq.write_table(table.set_column(1, "caption_llava", col), dict_path, row_group_size=250)
    monkeypatch.setattr(cs, "_SLICE_BYTES", 700)
    monkeypatch.setattr(cs, "_PIECE_BYTES", 1500)
    for p in (path, dict_path):
        ref = read_captions(p)
        for num_proc in (1, 3):
            t = write_sorted_captions(p, tmp_path / "o.arrow", num_proc=num_proc, chunk_rows=100)
            _same_table(t, ref)
            assert t.num_chunks > -(-len(ref) // 100)  # pieces


@pytest.mark.slow
def test_more_than_2_gib_of_captions_under_the_limit_in_bounded_memory(tmp_path):
    """2100 rows sharing one dictionary value of 1 MiB - 1 bytes (8 KB of parquet): 2.05 GiB
    of captions, each under the default limit. Before: ``ArrowInvalid: Take operation
    overflowed binary array capacity`` at 2.1 GB of growth. Now the table is written,
    growing a fresh process's memory by ~1.1 GB (num_proc 2: 3 pieces of ~128 MiB in
    flight, each held ~3 times)."""
    n, size = 2100, (1 << 20) - 1
    path = tmp_path / "m.parquet"
    table = _one_value_table(n, "w" * size, dictionary=True)
    keys = table.column("key").to_numpy()[::-1].copy()  # reversed: every row moves
    pq.write_table(table.set_column(0, "key", pa.array(keys)), path, compression="zstd")
    assert path.stat().st_size < 64 * 1024 and n * size > 2**31
    got = _caption_stage(path, tmp_path / "c.arrow", num_proc=2)
    assert (got["rows"], got["bytes"], got["keys"]) == (n, n * size, [100, 100 + n - 1]), got
    assert got["grown_mb"] < 1600, got


def test_a_part_s_captions_are_written_in_batches_a_string_array_holds(tmp_path, monkeypatch):
    """A ``text`` unit's record batches are cut by bytes too (``datasets``' string column
    has 32-bit offsets): the same captions, in more batches."""
    from datasets import Dataset

    import hf_pipeline.build.parts as parts

    keys = np.arange(30, dtype=np.int64)
    rows = tmp_path / "rows.arrow"
    schema = pa.schema([("key", pa.int64()), ("drop_reason", pa.string())])
    with pa.OSFile(str(rows), "wb") as fh, pa.ipc.new_stream(fh, schema) as writer:
        writer.write_table(pa.table({"key": keys, "drop_reason": [""] * 30}, schema=schema))
    caps = [None if i % 7 == 0 else f"caption {i} " * (i % 5) for i in range(30)]
    table = CaptionTable(keys, pa.array(caps, pa.large_string()))

    class Probe:
        def check(self):
            pass

    monkeypatch.setattr(parts, "_WRITE_BYTES", 40)
    parts.text_part([rows], table=table, probe=Probe(), out_dir=tmp_path / "u", batch_rows=8)
    out = tmp_path / "u" / "captions" / "data.arrow"
    with pa.memory_map(str(out)) as src:
        batches = list(pa.ipc.open_stream(src))
    assert len(batches) > 4  # more than the 4 of 8 rows
    assert all(b.num_rows <= 8 for b in batches)
    assert all(
        sum(len(c) for c in b.column(0).to_pylist()) <= 40 or b.num_rows == 1 for b in batches
    )
    got = Dataset.from_file(str(out))["caption"]
    assert got == [c or "" for c in caps]
