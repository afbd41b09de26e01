"""dist.markers' bounded reader of JSON that others wrote (markers, manifests, failure
records, heartbeats): size and depth caps, one line naming the file, lenient where a
malformed marker is "absent"."""

from __future__ import annotations

import json
import logging
import tracemalloc

import pytest

from dist.markers import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    ForeignJSONError,
    load_json,
    parse_json,
    read_json,
    read_marker,
)


def test_depth_is_counted_outside_strings_only(tmp_path):
    ok = {"a": "[[[[{{{{" * 100, "b": [[[1]]]}
    assert parse_json(json.dumps(ok).encode(), path="x") == ok
    assert parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, path="x")
    with pytest.raises(ForeignJSONError, match=f"^x: nested deeper than {MAX_JSON_DEPTH} levels"):
        parse_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), path="x")


def test_a_deeply_nested_marker_is_absent_not_a_traceback(tmp_path, caplog):
    """Was RecursionError out of read_marker (a malformed marker must read as absent)."""
    path = tmp_path / "converted.json"
    path.write_bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    with caplog.at_level(logging.WARNING, logger="dist"):
        assert read_marker(path, fingerprint="f", base_dir=tmp_path) is None
    assert read_json(path) is None
    [line] = [r.getMessage() for r in caplog.records]
    assert str(path) in line and "nested deeper than" in line, line
    with pytest.raises(ForeignJSONError, match="nested deeper"):
        load_json(path)


def test_an_oversized_file_is_read_only_up_to_the_cap(tmp_path, caplog):
    """Was read whole (a 500 MB manifest: 6.4 GB of memory). A sparse file of 8x the cap:
    at most cap + 1 bytes are read, and it is refused as too large."""
    path = tmp_path / "converted.json"
    with open(path, "wb") as f:
        f.truncate(8 * MAX_JSON_BYTES)
    tracemalloc.start()
    try:
        with pytest.raises(ForeignJSONError, match=f"larger than {MAX_JSON_BYTES} bytes"):
            load_json(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_JSON_BYTES, peak
    with caplog.at_level(logging.WARNING, logger="dist"):
        assert read_marker(path, fingerprint="f", base_dir=tmp_path) is None
    assert "larger than" in caplog.records[0].getMessage()
