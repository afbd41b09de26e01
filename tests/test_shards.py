"""Tests for hf_pipeline.build.shards: natural order, listing, safe loading and validation."""

from __future__ import annotations

import pickle
import zipfile

import numpy as np
import pytest
import torch

from hf_pipeline.build.shards import (
    LATENT_SHAPE,
    load_shard,
    nonfinite_rows,
    read_shard,
    shard_header,
    shard_latent_dtype,
)
from hf_pipeline.errors import CorruptShardError, SourceError
from tests.helpers.pickles import RunsCode


def _save(path, obj) -> str:
    torch.save(obj, path)
    return str(path)


def _good(n: int = 5, dtype=torch.float16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "keys": torch.arange(100, 100 + 7 * n, 7, dtype=torch.int64),
        "latents": torch.randn((n, *LATENT_SHAPE), generator=g).to(dtype),
    }


# ----------------------------------------------------------------------------- good shards


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dst", ["float16", "float32"])
def test_load_shard_good(tmp_path, src, dst):
    obj = _good(6, src)
    path = _save(tmp_path / "000000-000005.pt", obj)
    keys, lat = load_shard(path, dtype=dst)
    assert keys.dtype == np.int64 and keys.shape == (6,)
    np.testing.assert_array_equal(keys, obj["keys"].numpy())
    assert lat.dtype == np.dtype(dst) and lat.shape == (6, *LATENT_SHAPE)
    expected = obj["latents"].to(torch.float32).numpy().astype(dst)
    np.testing.assert_array_equal(lat, expected)


def test_load_shard_empty_and_other_int_keys(tmp_path):
    path = _save(
        tmp_path / "e.pt",
        {"keys": torch.zeros(0, dtype=torch.int64), "latents": torch.zeros((0, *LATENT_SHAPE))},
    )
    keys, lat = load_shard(path)
    assert keys.shape == (0,) and lat.shape == (0, *LATENT_SHAPE)
    path = _save(
        tmp_path / "i32.pt", {**_good(3), "keys": torch.tensor([1, 2, 3], dtype=torch.int32)}
    )
    keys, _ = load_shard(path)
    assert keys.dtype == np.int64 and keys.tolist() == [1, 2, 3]
    # An extra field is tolerated (forward compatible).
    path = _save(tmp_path / "extra.pt", {**_good(2), "sizes": torch.ones(2)})
    assert load_shard(path)[0].shape == (2,)


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zipped", [True, False])
def test_read_shard_source_keeps_the_bits_and_header_names_the_dtype(tmp_path, src, zipped):
    obj = _good(4, src)
    obj["latents"].view(4, -1)[:, :3] = torch.tensor([1e-9, -0.0, 1e-40]).to(src)
    path = str(tmp_path / "000000-000003.pt")
    torch.save(obj, path, _use_new_zipfile_serialization=zipped)
    name = str(src).removeprefix("torch.")
    assert shard_latent_dtype(path) == name
    shard = read_shard(path)  # dtype="source"
    assert shard.source_dtype == name and shard.latents.dtype.name == name
    assert shard.latents.flags.c_contiguous and shard.loss.changed == 0
    int_type = {2: torch.int16, 4: torch.int32}[obj["latents"].element_size()]
    want = obj["latents"].view(int_type).numpy()
    np.testing.assert_array_equal(shard.latents.view(want.dtype), want)


def test_load_shard_rejects_bad_dtype_argument(tmp_path):
    path = _save(tmp_path / "a.pt", _good(2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_shard(path, dtype="int8")


# ----------------------------------------------------------------------------- bad shards


def _bad_cases():
    good = _good(4)
    lat = good["latents"]
    return {
        "non_dict": ([good["keys"], lat], r"expected a dict with 'keys' and 'latents', got list"),
        "missing_latents": (
            {"keys": good["keys"], "lat": lat},
            r"missing field 'latents' \(fields present: 'keys', 'lat'\)",
        ),
        "missing_both": ({}, r"missing field 'keys' and 'latents' \(fields present: none\)"),
        "keys_not_tensor": (
            {"keys": [1, 2, 3, 4], "latents": lat},
            r"'keys' must be a torch tensor, got list",
        ),
        "keys_float": (
            {"keys": good["keys"].float(), "latents": lat},
            r"keys must be an integer tensor, got torch.float32",
        ),
        "keys_bool": (
            {"keys": torch.ones(4, dtype=torch.bool), "latents": lat},
            r"keys must be an integer tensor, got torch.bool",
        ),
        "keys_2d": (
            {"keys": good["keys"].reshape(2, 2), "latents": lat},
            r"keys must be 1-D \(N,\), got shape \(2, 2\)",
        ),
        "latents_4d": (
            {"keys": good["keys"], "latents": torch.zeros(4, 4, 32, 32)},
            r"latents must have shape \(N, 3, 4, 32, 32\), got \(4, 4, 32, 32\)",
        ),
        "latents_wrong_res": (
            {"keys": good["keys"], "latents": torch.zeros(4, 3, 4, 64, 64)},
            r"latents must have shape \(N, 3, 4, 32, 32\), got \(4, 3, 4, 64, 64\)",
        ),
        "row_mismatch": (
            {"keys": good["keys"], "latents": torch.zeros(5, *LATENT_SHAPE)},
            r"latents has 5 rows but keys has 4 \(must match\)",
        ),
        "latents_int": (
            {"keys": good["keys"], "latents": torch.zeros((4, *LATENT_SHAPE), dtype=torch.uint8)},
            r"latents must be float16, bfloat16 or float32, got torch.uint8",
        ),
        "latents_f64": (
            {"keys": good["keys"], "latents": torch.zeros((4, *LATENT_SHAPE), dtype=torch.float64)},
            r"latents must be float16, bfloat16 or float32, got torch.float64",
        ),
        "overflow_f16": (
            {"keys": good["keys"], "latents": _with(lat.float(), 1, 1e6)},
            r"float32 latents overflow float16 storage \(\|x\| up to 1e\+06 > 65504\)",
        ),
        "overflow_f16_beside_a_nan_row": (
            {"keys": good["keys"], "latents": _with(_with(lat.float(), 0, float("nan")), 3, -1e6)},
            r"float32 latents overflow float16 storage",
        ),
    }


def _with(t: torch.Tensor, row: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[row, 1, 2, 3, 4] = value
    return t


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_load_shard_bad_structure(tmp_path, case):
    obj, pattern = _bad_cases()[case]
    path = _save(tmp_path / f"{case}.pt", obj)
    with pytest.raises(CorruptShardError, match=pattern) as info:
        load_shard(path)
    err = info.value
    assert err.path == path
    assert str(err).startswith(f"{path}: ")
    assert "\n" not in str(err)
    assert isinstance(err, ValueError)
    # Crosses datasets worker process boundaries intact.
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.path, str(again)) == (type(err), err.path, str(err))


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dst", ["float16", "float32"])
def test_nonfinite_rows_are_returned_for_the_build_to_drop(tmp_path, src, dst):
    # One bad row is a row-level defect (the build counts it), never a refused shard.
    obj = _good(5, src)
    lat = _with(_with(obj["latents"], 1, float("nan")), 3, float("-inf"))
    path = _save(tmp_path / "000000-000004.pt", {**obj, "latents": lat})
    keys, got = load_shard(path, dtype=dst)
    np.testing.assert_array_equal(keys, obj["keys"].numpy())
    assert nonfinite_rows(got).tolist() == [False, True, False, True, False]
    good = [0, 2, 4]
    want = obj["latents"].to(torch.float32).numpy().astype(dst)
    np.testing.assert_array_equal(got[good], want[good])
    assert nonfinite_rows(np.zeros((0, *LATENT_SHAPE), np.float16)).shape == (0,)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_load_shard_refuses_malicious_pickle(tmp_path):
    marker = tmp_path / "pwned"
    path = _save(tmp_path / "evil.pt", {"keys": RunsCode(str(marker)), "latents": torch.zeros(1)})
    with pytest.raises(
        CorruptShardError,
        match=r"not a plain tensor file \(refused by torch.load\(weights_only=True\)\)",
    ) as info:
        load_shard(path)
    assert not marker.exists()
    assert "weights_only=False" not in str(info.value)  # never advise the unsafe retry
    assert "\n" not in str(info.value)
    # Also a raw (non-zip) pickle.
    raw = tmp_path / "raw.pt"
    with open(raw, "wb") as fh:
        pickle.dump(RunsCode(str(marker)), fh)
    with pytest.raises(CorruptShardError, match="refused by torch.load"):
        load_shard(raw)
    assert not marker.exists()


@pytest.mark.parametrize("keep", [0, 10, 1000, -100])
def test_load_shard_truncated(tmp_path, keep):
    good = _save(tmp_path / "good.pt", _good(4))
    data = open(good, "rb").read()
    bad = tmp_path / "trunc.pt"
    bad.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(
        CorruptShardError, match=r"not a readable torch file \(\d+ bytes; truncated or corrupt\?\)"
    ) as info:
        load_shard(bad)
    assert "\n" not in str(info.value)
    # torch's reason, its first sentence: not its advice, not cut in the middle of a word
    assert "If you are seeing this error" not in str(info.value), info.value
    assert str(info.value).endswith((".", ")", "end of file")), info.value


def test_load_shard_garbage_and_missing(tmp_path):
    """Bytes that are no torch file at all are said to be that, not a pickle
    ``weights_only`` refused ("Unsupported operand 66": outside tester)."""
    bad = tmp_path / "garbage.pt"
    for junk in (b"this is not a torch file at all" * 10, b"\x01" + np.random.bytes(5000)):
        bad.write_bytes(junk)
        with pytest.raises(CorruptShardError) as info:
            load_shard(bad)
        assert str(info.value) == (
            f"{bad}: not a torch file ({len(junk)} bytes, neither torch.save's zip archive "
            "nor a pickle)"
        )
    with pytest.raises(SourceError, match="does not exist"):
        load_shard(tmp_path / "nope.pt")


# ----------------------------------------------------------------------------- fork safety


def _load_all(paths: list[str]) -> list[tuple[int, str, float]]:
    out = []
    for p in paths:
        keys, lat = load_shard(p)
        out.append((len(keys), str(lat.dtype), float(lat.astype(np.float32).sum())))
    return out


def test_load_shard_in_forked_worker_after_parent_used_torch_threads(tmp_path):
    """datasets map workers are forked; a torch kernel there can hang on libgomp."""
    import multiprocessing

    if torch.get_num_threads() < 2:
        pytest.skip("needs an intra-op thread pool (>= 2 torch threads) to reproduce")
    n = 48  # 48 x 12288 elements: far above torch's parallel grain size
    g = torch.Generator().manual_seed(1)
    wide = torch.randn((n, 3, 4, 32, 64), generator=g)
    paths = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # A saved view: strided (non-contiguous) after loading, the copy-kernel path.
        obj = {"keys": torch.arange(2 * n)[::2], "latents": wide.to(dtype)[..., ::2]}
        paths.append(_save(tmp_path / f"{str(dtype)[6:]}.pt", obj))
    expected = _load_all(paths)
    torch.isfinite(torch.randn(4_000_000, generator=g)).all()  # start the parent's pool
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:  # terminate() on exit, also after a timeout
        result = pool.apply_async(_load_all, (paths,))
        try:
            got = result.get(timeout=60)
        except multiprocessing.TimeoutError:
            pytest.fail("load_shard hung in a forked worker (torch op after fork)")
    assert got == expected


# ------------------------------------------------------------- memory bombs, empty shards


def _one_element_as(shape: tuple[int, ...], dtype=torch.float16) -> torch.Tensor:
    """``shape`` over a single stored element (every stride 0): 2 bytes on disk."""
    return torch.zeros(1, dtype=dtype).as_strided(shape, (0,) * len(shape))


def _bombs() -> dict:
    n = 100_000  # 2.5 GB of float16 latents declared
    keys = torch.arange(n)
    row = torch.randn((1, *LATENT_SHAPE)).half()
    return {
        # Zero strides everywhere: the 1.9 KB shard (keys too).
        "all_zero_strides": (
            {
                "keys": _one_element_as((n,), torch.int64),
                "latents": _one_element_as((n, *LATENT_SHAPE)),
            },
            r"keys: stride 0 in dim 0 of shape \(100000,\)",
        ),
        # One row repeated by expand (stride 0 in the row dim only).
        "expanded_row": (
            {"keys": keys, "latents": row.expand(n, *LATENT_SHAPE)},
            r"latents: stride 0 in dim 0 of shape \(100000, 3, 4, 32, 32\)",
        ),
        # Rows overlapping: each row starts one element after the previous one.
        "overlapping_rows": (
            {
                "keys": keys,
                "latents": torch.zeros(n + 12288, dtype=torch.float16).as_strided(
                    (n, *LATENT_SHAPE), (1, 4096, 1024, 32, 1)
                ),
            },
            r"latents: elements overlap in storage \(shape \(100000, 3, 4, 32, 32\), "
            r"strides \(1, 4096, 1024, 32, 1\)\)",
        ),
        # Keys alone over one element (the latents are honest).
        "zero_stride_keys": (
            {"keys": _one_element_as((4,), torch.int64), "latents": _good(4)["latents"]},
            r"keys: stride 0 in dim 0 of shape \(4,\)",
        ),
    }


@pytest.mark.parametrize("case", sorted(_bombs()))
def test_a_shard_declaring_more_elements_than_it_stores_is_refused_unread(tmp_path, case):
    """Issue 23 item 4: storage must cover the elements once, checked before any copy.

    Before: accepted, with memory growing with the declared shape (2.5 GB here)."""
    from tests.helpers.memory import peak_mib, reset_peak

    obj, pattern = _bombs()[case]
    path = _save(tmp_path / "000000-099999.pt", obj)
    reset_peak()  # this worker's own peak so far would hide the growth
    before = peak_mib()
    for read in (load_shard, shard_latent_dtype):
        with pytest.raises(CorruptShardError, match=pattern) as info:
            read(path)
        assert info.value.path == path and "\n" not in str(info.value)
    grown_mb = peak_mib() - before
    assert grown_mb < 200, f"peak memory grew {grown_mb:.0f} MB reading a refused shard"


def test_saved_views_are_still_accepted(tmp_path):
    """A slice of a bigger tensor (its storage larger, strides wider) is honest."""
    big = torch.randn((8, *LATENT_SHAPE)).half()
    obj = {"keys": torch.arange(16)[::2][1:], "latents": big[1:, :, :, :, :].transpose(3, 4)}
    path = _save(tmp_path / "v.pt", obj)
    keys, lat = load_shard(path, dtype="source")
    np.testing.assert_array_equal(keys, np.arange(2, 16, 2))
    np.testing.assert_array_equal(lat.view(np.uint16), obj["latents"].numpy().view(np.uint16))
    # Size-1 dims may carry any stride (torch gives them 0 after unsqueeze/expand(1)).
    one = {
        "keys": torch.tensor([5]),
        "latents": torch.randn((1, *LATENT_SHAPE)).expand(1, -1, -1, -1, -1),
    }
    assert load_shard(_save(tmp_path / "one.pt", one))[0].tolist() == [5]


@pytest.mark.parametrize(
    "keys, latents",
    [
        (torch.zeros(0), torch.zeros(0)),  # the shard: 1-D float32, keys float too
        (torch.zeros(0, dtype=torch.int64), torch.zeros(0)),
        (torch.zeros(0, dtype=torch.int64), torch.zeros((0, 4, 32, 32), dtype=torch.bfloat16)),
        (torch.zeros(0, dtype=torch.int32), torch.zeros((0, 7), dtype=torch.float64)),
    ],
)
def test_a_zero_row_shard_of_any_shape_is_empty(tmp_path, keys, latents):
    """Issue 24 item 8: README says empty shards are fine; 1-D zeros(0) was refused."""
    path = _save(tmp_path / "e.pt", {"keys": keys, "latents": latents})
    for dtype in ("source", "float16", "bfloat16", "float32"):
        shard = read_shard(path, dtype=dtype)
        assert shard.keys.shape == (0,) and shard.keys.dtype == np.int64
        assert shard.latents.shape == (0, *LATENT_SHAPE)
        assert shard.nonfinite.shape == (0,)
    assert read_shard(path, dtype="source").source_dtype == ""  # no rows: no dtype
    assert shard_latent_dtype(path) is None
    saved = str(latents.dtype).removeprefix("torch.")
    assert shard_header(path) == (0, saved if saved != "float64" else None)


def test_zero_rows_with_rows_elsewhere_still_must_match(tmp_path):
    path = _save(tmp_path / "m.pt", {"keys": torch.arange(3), "latents": torch.zeros(0)})
    with pytest.raises(CorruptShardError, match=r"latents must have shape \(N, 3, 4, 32, 32\)"):
        load_shard(path)
    path = _save(
        tmp_path / "k.pt", {"keys": torch.zeros(0), "latents": torch.zeros((2, *LATENT_SHAPE))}
    )
    with pytest.raises(CorruptShardError, match="keys must be an integer tensor"):
        load_shard(path)


def test_a_shard_of_huge_or_many_field_names_gets_a_bounded_message(tmp_path):
    """An adversarial tester: a shard whose dict key is a 50 MB string made a 52 MB
    error "line" (and failure record). The fields present are named within bounds."""
    path = _save(
        tmp_path / "000000-000000.pt", {"x" * 5_000_000: 1, **{f"k{i}": i for i in range(50)}}
    )
    with pytest.raises(CorruptShardError) as info:
        load_shard(path)
    text = str(info.value)
    assert len(text) < 500 and "missing field 'keys' and 'latents'" in text, text[:600]
    assert "'k0'" in text and text.endswith(", ...)"), text


@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_a_shard_pickle_nested_too_deep_is_refused_before_loading(tmp_path, form):
    """An adversarial tester: a dict keyed by a tuple nested 300,000 deep (547 KB) made
    ``torch.load(weights_only=True)`` (and a build) die of SIGSEGV. Its nesting is found
    from the pickle's opcodes, nothing built: one line naming the shard. A real shard
    (nested dicts and lists of a few levels, the legacy format too) still loads."""
    deep = b"\x80\x02}" + b"K\x00" + b"\x85" * 300_000 + b"K\x01s."  # {((..(0,)..),): 1}
    path = tmp_path / "000000-000002.pt"
    if form == "zip":
        good = _save(tmp_path / "good.pt", {**_good(3), "meta": {"a": [1, {"b": (2, 3)}]}})
        with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as dst:
            for item in src.infolist():
                dst.writestr(item, deep if item.filename.endswith("/data.pkl") else src.read(item))
        assert load_shard(good)[0].tolist() == [100, 107, 114]
    else:
        magic = 0x1950A86A20F9469CFC6C  # torch's legacy format: magic, protocol, sys info
        path.write_bytes(b"".join(pickle.dumps(v, protocol=2) for v in (magic, 1001, {})) + deep)
        good = tmp_path / "legacy.pt"
        torch.save(_good(3), good, _use_new_zipfile_serialization=False)
        assert load_shard(good)[0].tolist() == [100, 107, 114]
    with pytest.raises(CorruptShardError) as info:
        load_shard(path)
    assert str(info.value) == (
        f"{path}: its pickle nests deeper than 200 levels: refused before loading (a crafted "
        "shard: loading it would overflow the stack)"
    )
