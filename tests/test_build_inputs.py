# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Inputs through the real build: resolved once per job (8 real ranks make the Hub
requests 1 rank makes), and hostile inputs through ``scripts/prebuild_cache.py`` (shards
declaring more than they store, undecodable captions, shard-named folders, hidden
shards, empty shards saved in any shape)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, SMALL_DEMO, run_ranks, script_env
from tests.helpers.ports import free_port
from tests.servers import make_shards, shard_dir  # noqa: F401
from tests.servers.hub import FakeHub

HUB_REPO = "org/coyo-like"


def _resolve(hub, world: int, tmp_path) -> list[dict]:
    overrides = [f"data.shards=hf://datasets/{HUB_REPO}/latents", "build.num_proc=1"]
    runs = run_ranks(
        [REPO / "tests/procs/resolve_rank.py", *overrides], world, timeout=300,
        HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / f"home{world}"),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
    )  # fmt: skip
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs]


@pytest.mark.slow
@pytest.mark.remote
def test_eight_ranks_make_the_api_requests_of_one(shard_dir, tmp_path):
    files = {f"latents/{p.name}": p.read_bytes() for p in shard_dir.glob("*.pt")}
    files["coyo11m-meta.parquet"] = (shard_dir / "coyo11m-meta.parquet").read_bytes()
    with FakeHub(page_size=2) as hub:
        hub.add_commit(HUB_REPO, files)
        one = _resolve(hub, 1, tmp_path)
        requests_one = len(hub.log)
        assert requests_one > 0
        eight = _resolve(hub, 8, tmp_path)
        requests_eight = len(hub.log) - requests_one
    assert requests_eight == requests_one, (requests_one, requests_eight)
    assert {r["fingerprint"] for r in eight} == {one[0]["fingerprint"]}
    assert all(r["shards"] == one[0]["shards"] == 4 for r in eight)


# ----------------------------------------------------------------------- hostile inputs


#: Runs the build under an address-space limit and reports its exit code and peak RSS.
#: A small interpreter of its own starts it: a child forked from the test's process (an
#: xdist worker that imported JAX and torch: 1.6 GB) counts that process's resident
#: pages in its ``ru_maxrss`` until it execs, which one suite run read as the build's peak.
_MEASURED = """
import json, os, resource, subprocess, sys
limit = int(sys.argv[1])
with open(sys.argv[2], "w") as out, open(sys.argv[3], "w") as err:
    proc = subprocess.Popen(
        sys.argv[4:], stdout=out, stderr=err,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_maxrss]))
"""


def _prebuild(
    data: Path, cache: Path, *sets: str, limit_gb: float = 6.0, command: Sequence[str] = ()
):
    """Run the real build CLI on ``data``; ``(returncode, stdout, stderr, peak RSS in MB)``.

    ``command``: the CLI's arguments before the options (default: the script
    ``scripts/prebuild_cache.py``; ``("-m", "hf_pipeline", "build")``: ``hf-pipeline
    build``). The peak is the build process's own ``ru_maxrss`` (``wait4`` of that one
    process, and the children it waited for), started by a small launcher
    (:data:`_MEASURED`); an address-space limit keeps a regression from taking the test
    machine's memory with it (it then fails with a MemoryError, not exit 2).
    """
    limit = int(limit_gb * (1 << 30))
    args = [*SMALL_DEMO, "build.num_proc=1", f"data.shards={data}", *sets]
    command = list(command) or [str(REPO / "scripts/prebuild_cache.py")]
    cache.parent.mkdir(parents=True, exist_ok=True)
    out, err = cache.parent / "out.txt", cache.parent / "err.txt"
    proc = subprocess.run(
        [PYTHON, "-c", _MEASURED, str(limit), str(out), str(err), PYTHON, *command, "-q",
         "--cache-dir", str(cache), "--json", str(cache.parent / "summary.json"),
         *(x for a in args for x in ("--set", a))],
        capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, peak_kb = json.loads(proc.stdout.strip().splitlines()[-1])
    return code, out.read_text(), err.read_text(), peak_kb / 1024


def _published(cache: Path) -> list[str]:
    """What a failed build left published under the cache root: the JSON files but
    failure records, the cache folder's mark, the content index (kept for the next
    build) and the caption table's stored unit (``.parts/captions-*``: it depends on the
    metadata alone)."""
    from dist.layout import IDENTITY_FILE  # the cache folder's mark, written when claimed

    return [
        p.name
        for p in cache.rglob("*.json")
        if not p.name.startswith("failed-")
        and p.name != IDENTITY_FILE
        and ".content-index" not in p.parts
        and not any(q.startswith("captions-") for q in p.parts)
    ]


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_shard_declaring_gigabytes_over_a_few_bytes_is_one_line_exit_2(tmp_path):
    """Issue 23 item 4. Before: a 1.9 KB shard (zero strides, 10^5 rows declared over one
    element) was built (exit 0, 8 GB peak); with a bounded address space, a MemoryError
    traceback. Now: refused before its data is touched, exit 2, one line naming it."""
    import torch

    data = make_shards(tmp_path / "data", n_shards=2, per_shard=6)
    n = 100_000
    bomb = data / f"000012-{11 + n:06d}.pt"
    torch.save(
        {
            "keys": torch.zeros(1, dtype=torch.int64).as_strided((n,), (0,)),
            "latents": torch.zeros(1, dtype=torch.float16).as_strided((n, 3, 4, 32, 32), (0,) * 5),
        },
        bomb,
    )
    assert bomb.stat().st_size < 4096
    code, _, err, peak_mb = _prebuild(data, tmp_path / "c", limit_gb=4.0)
    assert code == 2, err[-3000:]
    line = _one_error_line(err)
    assert line.startswith(f"error: {bomb}: keys: stride 0 in dim 0 of shape (100000,)"), line
    assert peak_mb < 2000, f"peak {peak_mb:.0f} MB"  # a build of these 12 rows: ~0.6 GB
    # The content index and the caption table's stored unit are kept for the next
    # build; no part, no stage.
    assert _published(tmp_path / "c") == [], "nothing may be published"


@pytest.mark.slow
def test_shard_named_folders_and_hidden_shards_are_never_left_out_silently(tmp_path):
    """Issue 24 item 7. Before: both skipped without a word (exit 0, skipped_files: [])."""
    data = make_shards(tmp_path / "data", n_shards=3, per_shard=6)
    folder = data / "000060-000079.pt"
    folder.mkdir()
    code, _, err, _ = _prebuild(data, tmp_path / "c")
    assert code == 2, err[-3000:]
    line = _one_error_line(err)
    assert line.startswith(f"error: {folder}: missing shard: a directory, not a shard file"), line
    folder.rmdir()

    hidden = data / ".000018-000023.pt"
    (data / "000012-000017.pt").rename(hidden)  # e.g. what a copy tool left half-written
    code, _, err, _ = _prebuild(data, tmp_path / "c")
    assert code == 2, err[-3000:]
    line = _one_error_line(err)
    assert "not named by a row range like 000000-000009.pt: .000018-000023.pt" in line, line


@pytest.mark.slow
def test_bad_captions_empty_shards_and_skipped_folders_in_one_build(tmp_path):
    """Issue 24 items 6, 7 and 8 through one real build.

    Before: invalid UTF-8 in a string caption column was a 71-line traceback, exit 1
    (``input_error: false``); a 0-row shard saved as ``torch.zeros(0)`` was refused; a
    shard-named folder vanished. Now: the undecodable captions cost their rows
    (``bad_caption_encoding``), the empty shard is empty (first, so ``latent_dtype:
    source`` takes the next shard's dtype), the folder is a counted skipped file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    data = make_shards(tmp_path / "data", n_shards=3, per_shard=6)
    torch.save({"keys": torch.zeros(0), "latents": torch.zeros(0)}, data / "000000-000005.pt")
    meta = data / "coyo11m-meta.parquet"
    table = pq.read_table(meta)
    caps = [c.encode() for c in table.column("caption_llava").to_pylist()]
    caps[7], caps[15] = b"bad \xff\xfe caption", b"cut \xc3"  # not UTF-8, typed string
    bad = pa.array(caps, pa.binary()).view(pa.string())  # relabelled without validation
    table = table.set_column(table.schema.get_field_index("caption_llava"), "caption_llava", bad)
    pq.write_table(table, meta)
    (data / "000060-000079.pt").mkdir()

    code, out, err, _ = _prebuild(data, tmp_path / "c", "data.on_missing=skip")
    assert code == 0, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    from hf_pipeline.cache.layout import CacheLayout

    report = json.loads(CacheLayout(summary["cache_dir"]).report_path.read_text())
    assert report["rows_in"] == 12 and report["rows_out"] == 10
    assert report["dropped"]["bad_caption_encoding"] == 2
    assert report["precision"]["storage_dtype"] == "float16"
    skipped = report["skipped_files"]
    assert [(s["name"], s["reason"]) for s in skipped] == [
        ("000060-000079.pt", "a directory, not a shard file")
    ]
    assert report["dropped"]["missing_shard_files"] == 1
    assert "bad_caption_encoding 2" in out


def _with_captions(data: Path, captions, **write) -> Path:
    """Replace the caption column of ``data``'s metadata (its 12 keys, 0-11, kept)."""
    import pyarrow.parquet as pq

    meta = data / "coyo11m-meta.parquet"
    table = pq.read_table(meta)
    table = table.set_column(
        table.schema.get_field_index("caption_llava"), "caption_llava", captions
    )
    pq.write_table(table, meta, **write)
    return meta


@pytest.mark.slow
def test_one_dictionary_caption_of_10_mb_in_a_3_kb_parquet_is_one_line_exit_2(tmp_path):
    """The adversarial tester's file: 400 rows sharing one dictionary-encoded 10 MB
    caption, zstd, 2.2 KB. Before: the caption stage grew to 2.5 GB and ended in a
    traceback (``ArrowInvalid: Take operation overflowed binary array capacity``,
    exit 1). Now: refused in one line naming the file, column, row, key, size, limit and
    setting, exit 2, before the 4 GB the rows stand for are decoded; nothing published."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = make_shards(tmp_path / "data", n_shards=2, per_shard=6)
    n = 400
    caps = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(n, np.int32)), pa.array(["x" * (10 << 20)])
    )
    meta = data / "coyo11m-meta.parquet"
    table = pa.table({"key": np.arange(n, dtype=np.int64), "caption_llava": caps})
    pq.write_table(table, meta, use_dictionary=True, compression="zstd")
    assert meta.stat().st_size < 4096
    code, _, err, peak_mb = _prebuild(
        data, tmp_path / "c", limit_gb=4.0, command=("-m", "hf_pipeline", "build")
    )
    assert code == 2, err[-3000:]
    assert _one_error_line(err) == (
        f"error: {meta}: caption column 'caption_llava', row 0 (key 0): a caption of "
        "10485760 bytes, over the limit of 1048576 bytes (data.max_caption_bytes)"
    )
    # The whole build, torch and the encoder included (~0.4 GB), against 4 GB of captions.
    assert peak_mb < 1000, f"peak {peak_mb:.0f} MB"
    assert _published(tmp_path / "c") == [], "nothing may be published"
    assert not list((tmp_path / "c").rglob("captions.arrow")), "no caption table"
    assert not list((tmp_path / "c").rglob("*.spill")), "no spill folder left"


@pytest.mark.slow
def test_a_caption_of_the_limit_builds_and_one_byte_more_is_one_line_exit_2(tmp_path):
    """A plain (not dictionary-encoded) string column: a caption of exactly
    ``data.max_caption_bytes`` (the default, 1 MiB) is built; one byte more is refused,
    naming its row and key."""
    import pyarrow as pa

    data = make_shards(tmp_path / "data", n_shards=2, per_shard=6)
    caps = [f"caption {k}" for k in range(12)]
    caps[7] = "a " * (1 << 19)
    _with_captions(data, pa.array(caps), use_dictionary=False)
    code, out, err, _ = _prebuild(
        data, tmp_path / "ok" / "c", command=("-m", "hf_pipeline", "build")
    )
    assert code == 0, err[-3000:]
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    from hf_pipeline.cache.layout import CacheLayout

    report = json.loads(CacheLayout(summary["cache_dir"]).report_path.read_text())
    assert report["rows_in"] == report["rows_out"] == 12

    caps[7] += "!"
    meta = _with_captions(data, pa.array(caps), use_dictionary=False)
    code, _, err, _ = _prebuild(data, tmp_path / "no" / "c", command=("-m", "hf_pipeline", "build"))
    assert code == 2, err[-3000:]
    assert _one_error_line(err) == (
        f"error: {meta}: caption column 'caption_llava', row 7 (key 7): a caption of "
        "1048577 bytes, over the limit of 1048576 bytes (data.max_caption_bytes)"
    )
    assert _published(tmp_path / "no" / "c") == [], "nothing may be published"
