"""Row accounting helpers over whole columns (hf_pipeline.build.accounting)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_pipeline.build.accounting import later_duplicates, sorted_unique


@pytest.mark.parametrize(
    "values",
    [
        np.array([], dtype=np.int64),
        np.array([7], dtype=np.int64),
        np.array([3, -1, 3, 3, 0, -1, 2**62, -(2**62)], dtype=np.int64),
        np.random.default_rng(0).integers(-50, 50, size=10_000),
        np.random.default_rng(1).permutation(100_000),
    ],
    ids=["empty", "one", "extremes", "many-duplicates", "all-distinct"],
)
def test_sorted_unique_is_numpys_unique(values):
    got = sorted_unique(values)
    np.testing.assert_array_equal(got, np.unique(values))
    assert got.dtype == values.dtype


def test_later_duplicates_first_eligible_occurrence_wins():
    keys = np.array([5, 1, 5, 2, 1, 5, 9, 9])
    eligible = np.array([False, True, True, True, True, True, True, True])
    # Row 0 (key 5) cannot win: row 2 is the first copy that counts, row 5 a duplicate.
    assert later_duplicates(keys, eligible).tolist() == [
        False, False, False, False, True, True, False, True,
    ]  # fmt: skip
    assert later_duplicates(keys).tolist() == [
        False, False, True, False, True, True, False, True,
    ]  # fmt: skip


def _reasons_file(path, batches, *, embedding=False):
    """An Arrow stream of ``drop_reason`` batches: as ``reasons.arrow``, or (``embedding``)
    as a 0.1 cache's embedding files, the reasons beside the embeddings."""
    import pyarrow as pa

    fields = [("embedding", pa.list_(pa.float32(), 2))] if embedding else []
    schema = pa.schema([*fields, ("drop_reason", pa.string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for reasons in batches:
            emb = [pa.array([[0.5, 1.5]] * len(reasons), fields[0][1])] if embedding else []
            writer.write_batch(
                pa.record_batch([*emb, pa.array(reasons, pa.string())], schema=schema)
            )


def test_kept_indices_are_the_file_datasets_filter_writes(tmp_path):
    """The filter stage's indices: the rows with no drop reason across every file and
    record batch, in order, read by ``datasets`` as the file its own filter writes."""
    import datasets
    import pyarrow as pa

    from hf_pipeline.build.parts import write_kept_indices

    rng = np.random.default_rng(0)
    choices = np.array(["", "", "", "no_caption", "duplicate_key", "nonfinite_latents"])
    batches = [list(choices[rng.integers(0, len(choices), n)]) for n in (7, 0, 13, 5)]
    batches[2][0] = None  # a missing reason is no reason to keep
    files = [tmp_path / "a.arrow", tmp_path / "b.arrow"]
    _reasons_file(files[0], batches[:3])
    _reasons_file(files[1], batches[3:], embedding=True)
    out = tmp_path / "indices.arrow"

    kept = write_kept_indices(files, out, fingerprint="fp-filtered", batch_rows=4)

    flat = [r for b in batches for r in b]
    want = [i for i, r in enumerate(flat) if r == ""]
    assert kept == len(want) and 0 < kept < len(flat)
    ref = datasets.Dataset.from_dict({"drop_reason": flat}).filter(
        lambda rs: [r == "" for r in rs], input_columns=["drop_reason"], batched=True,
        cache_file_name=str(tmp_path / "ref.arrow"), keep_in_memory=False,
    )  # fmt: skip
    ref_table = pa.ipc.open_stream(pa.memory_map(str(tmp_path / "ref.arrow"))).read_all()
    ours = pa.ipc.open_stream(pa.memory_map(str(out))).read_all()
    assert ours.schema.equals(ref_table.schema)  # uint64 "indices"
    assert ours.column("indices").to_pylist() == ref_table.column("indices").to_pylist() == want
    assert max(len(b) for b in ours.to_batches()) <= 4
    assert datasets.Dataset.from_file(str(out))["indices"] == want
    assert len(ref) == kept


def test_kept_indices_of_no_rows(tmp_path):
    from hf_pipeline.build.parts import write_kept_indices

    _reasons_file(tmp_path / "r.arrow", [])
    out = tmp_path / "indices.arrow"
    assert write_kept_indices([tmp_path / "r.arrow"], out, fingerprint="f", batch_rows=10) == 0
    import datasets

    assert len(datasets.Dataset.from_file(str(out))) == 0
