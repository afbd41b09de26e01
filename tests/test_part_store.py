"""Parts with their own identity (hf_pipeline.build.part_store): content-defined
boundaries, reuse across caches (appended shards, another encoder), and a SIGKILLed
incremental build. Every scenario is compared with a from-scratch build of the same
final input: same keys in the same order, same latent and caption bytes, same
fingerprint; what was *not* done is read from the build report."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from hf_pipeline.build.part_store import part_bounds, plan_content_parts
from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env
from tests.helpers.publishing import gcs_store  # noqa: F401 - a fixture
from tests.helpers.releases import build_with_release

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


@pytest.fixture(scope="module")
def grown(inputs):
    """The initial input built, then the final one in the same cache root."""
    root = inputs["base"] / "grow"
    first = _build(root, inputs["initial"], inputs["meta"])
    return first, _build(root, inputs["final"], inputs["meta"])


def test_appended_shards_build_only_the_new_parts_and_equal_a_clean_build(inputs, grown):
    """Shards appended at the end and between old ones, one holding duplicates of old
    keys: the build reuses every stored part it can, reads only the shards of the
    parts it builds, and gives the cache a from-scratch build of the final input
    gives (the first finite occurrence of a key in shard order still wins)."""
    first, res = grown
    assert first.report["reuse"]["joins_reused"] == 0
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


def test_an_append_starts_the_join_workers_before_its_imports(grown):
    """The fork server of the join's workers is not started at entry when a cache of
    the config's name is published (most likely the one wanted: an index hit needs
    no server). An append has such a cache and still joins: the server starts as soon
    as the identity says a join is missing, before the main thread's imports, as in a
    first build. It used to start at the first join (on the 2-CPU VM the first shard of
    bench_evolve.py's append then waited 3.5 s for the server's imports)."""
    first, res = grown
    t = res.report["startup"]["seconds"]
    # (milliseconds: in a process that imported torch and datasets already, the
    # imports end in the millisecond the server starts)
    assert t["identity"] <= t["workers_starting"] <= t["imports"] <= t["join_map"], t
    assert t["join_map"] < t["first_shard"], t
    assert "workers_starting" in first.report["startup"]["seconds"]


def test_metadata_rows_appended_with_the_shards_reuse_the_old_parts(inputs):
    """New shards come with new metadata rows (a new metadata file): the old parts'
    keys match the very same captions, so their joins and captions are reused (checked
    against what each stored part matched); the result is the from-scratch cache of the
    final input. A caption changed for one old key re-joins exactly the captions of the
    part holding that key (not its latents)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch

    full = pq.read_table(inputs["meta"])
    old_keys = np.concatenate(
        [
            torch.load(f, weights_only=True)["keys"].numpy()
            for f in sorted(inputs["initial"].iterdir())
        ]
    )
    (inputs["base"] / "meta-old").mkdir()
    old_meta = inputs["base"] / "meta-old" / inputs["meta"].name
    pq.write_table(full.filter(pc.is_in(full["key"], pa_array(old_keys))), old_meta)
    root = inputs["base"] / "meta"
    first = _build(root, inputs["initial"], old_meta)
    res = _build(root, inputs["final"], inputs["meta"])
    _assert_same_cache(res, inputs["clean"])
    reuse = res.report["reuse"]
    assert reuse["joins_reused"] == 6 and reuse["joins_built"] == 3, reuse
    assert first.report["rows_out"] < res.report["rows_out"]

    # One old key (of shard 3, which no other shard repeats) gets another caption.
    every = np.concatenate(
        [torch.load(f, weights_only=True)["keys"].numpy() for f in inputs["final"].iterdir()]
    )
    shard3 = torch.load(sorted(inputs["initial"].iterdir())[2], weights_only=True)["keys"]
    key = next(
        int(k) for k in shard3 if (every == int(k)).sum() == 1 and int(k) in full["key"].to_pylist()
    )
    caps = [("a new caption" if k == key else c) for k, c in
            zip(full["key"].to_pylist(), full["caption_llava"].to_pylist(), strict=True)]  # fmt: skip
    (inputs["base"] / "meta-edit").mkdir()
    edited = inputs["base"] / "meta-edit" / inputs["meta"].name
    pq.write_table(full.set_column(1, "caption_llava", pa_array(caps)), edited)
    again = _build(root, inputs["final"], edited)
    reuse = again.report["reuse"]
    # Only that part's captions are re-joined (and re-embedded): no latent byte written.
    assert reuse["joins_built"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert reuse["texts_built"] == 1 == reuse["embeddings_built"], reuse
    (changed,) = [p for p in again.report["parts"] if not p["reused"]["text"]]
    assert changed["shards"] == 1
    got = _content(again)
    assert got["caption"][got["key"].tolist().index(key)] == "a new caption"


def pa_array(values):
    import pyarrow as pa

    return pa.array(values)


def test_a_run_resumed_across_an_append_is_refused_naming_both_fingerprints(
    small_config, grown, tmp_path
):
    """A checkpoint saved on the cache before the append: its sample order belongs to
    that dataset, so resuming on the grown cache is refused, in one line naming both
    fingerprints (and nothing is trained)."""
    import dataclasses

    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.errors import ConfigError
    from hf_pipeline.trainer.loop import train

    first, res = grown
    cfg = dataclasses.replace(
        small_config,
        train=dataclasses.replace(small_config.train, steps=10, checkpoint=str(tmp_path / "ck")),
    )
    with open_sample_source(first.layout, first.fingerprint) as src:
        train(cfg, src, max_steps=3)
    with open_sample_source(res.layout, res.fingerprint) as src:
        with pytest.raises(ConfigError, match="dataset changed") as ei:
            train(cfg, src)
    msg = str(ei.value)
    assert first.fingerprint in msg and res.fingerprint in msg and "\n" not in msg
    assert ei.value.field == "train.checkpoint"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == ["3"]


@pytest.fixture(scope="module")
def two_encoders(inputs):
    """The final input built with the default encoder, then with max_length 16, in one
    cache root."""
    root = inputs["base"] / "enc"
    first = _build(root, inputs["final"], inputs["meta"])
    return first, _build(root, inputs["final"], inputs["meta"], "encoder.max_length=16")


@pytest.fixture(scope="module")
def clean16(inputs):
    """A from-scratch build of the final input with encoder.max_length=16."""
    return _build(
        inputs["base"] / "enc-clean", inputs["final"], inputs["meta"], "encoder.max_length=16"
    )


def test_another_encoder_reuses_the_joins_and_writes_no_latent_bytes(inputs, two_encoders, clean16):
    """A changed encoder (another max_length) builds only embeddings: no shard read, 0
    latent bytes written; the two caches share the latents on disk (same inodes), and
    the new cache equals a from-scratch build with that encoder."""
    first, res = two_encoders
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
    _assert_same_cache(res, clean16)
    # The token ids belong to the encoder: max_length 16 truncates them.
    assert max(len(x) for x in _content(res)["input_ids"]) <= 16
    # Another max_length: the token ids again, nothing of the captions or the latents.
    assert reuse["texts_built"] == 0 and reuse["texts_reused"] == reuse["parts"], reuse
    assert reuse["tokens_built"] == reuse["parts"] and reuse["tokens_reused"] == 0, reuse
    # ... derived from the stored ids at 64 (cut to 16), not tokenized: no worker ran, no
    # row tokenized but the sample each part checked (hf_pipeline.build.tokens).
    for part in res.report["parts"]:
        tokens = part["tokens"]
        assert tokens["derived_from"].startswith("tokens-"), tokens
        assert tokens["tokenized_rows"] == 0 and tokens["worker_pids"] == [], tokens
        assert tokens["derived_rows"] > 0 and tokens["checked_rows"] > 0, tokens
        assert tokens["max_length"] == 16, tokens
    _assert_same_bytes(res, clean16)


def test_a_longer_max_length_derives_the_rows_the_shorter_one_did_not_cut(inputs):
    """Stored ids at max_length 34, then the default 64: a row shorter than 34 ids is the
    same at 64 (derived), a row of 34 may have been cut (tokenized again, those rows
    only: about a tenth of the demo's captions, 26-35 ids); the cache equals a
    from-scratch build at 64 byte for byte."""
    root = inputs["base"] / "longer"
    first = _build(root, inputs["final"], inputs["meta"], "encoder.max_length=34")
    res = _build(root, inputs["final"], inputs["meta"])
    reuse = res.report["reuse"]
    assert reuse["texts_built"] == 0 and reuse["tokens_built"] == reuse["parts"], reuse
    tokens = [p["tokens"] for p in res.report["parts"]]
    assert all(t["derived_from"].startswith("tokens-") for t in tokens), tokens
    from hf_pipeline.build.parts import read_column

    stored = [read_column(sorted((root / ".parts" / t["derived_from"]).glob("tokens.*/tokens/*.arrow")),
                          "input_ids") for t in tokens]  # fmt: skip
    for t, ids in zip(tokens, stored, strict=True):  # exactly the rows 34 may have cut
        assert t["tokenized_rows"] == pc.sum(pc.equal(pc.list_value_length(ids), 34)).as_py()
    assert sum(t["tokenized_rows"] for t in tokens) > 0, tokens
    assert max(len(x) for x in _content(first)["input_ids"]) == 34
    assert sum(t["derived_rows"] for t in tokens) > 0, tokens
    _assert_same_bytes(res, inputs["clean"])


def test_a_re_embedding_tokenizes_later_parts_while_earlier_ones_embed(two_encoders):
    """A re-embedding reads no shard: tokenizing part k+1 waits for no join, so it runs
    while part k embeds (the wall is about the larger of the two sums, not their sum),
    at most TOKENS_LOOKAHEAD parts ahead of the embedding; each part's embedding still
    starts after its own token ids are published. Read from the report's timeline."""
    from hf_pipeline.build.prepare import TOKENS_LOOKAHEAD

    _, res = two_encoders
    walls = [p["wall"] for p in res.report["parts"]]
    assert all(w["tokens"] and w["embed"] for w in walls), walls
    for w in walls:  # the embedding reads the published token ids
        assert w["tokens"][1] <= w["embed"][0], w
    overlaps = [
        (k, j)
        for k, a in enumerate(walls)
        for j, b in enumerate(walls)
        if j > k and b["tokens"][0] < a["embed"][1] and b["tokens"][1] > a["embed"][0]
    ]
    assert overlaps, f"no part tokenized while an earlier one embedded: {walls}"
    # Bounded: part j's tokens wait for part j-LOOKAHEAD's embedding to start, so they
    # begin after the one before that ended.
    for j in range(TOKENS_LOOKAHEAD + 1, len(walls)):
        assert walls[j]["tokens"][0] >= walls[j - TOKENS_LOOKAHEAD - 1]["embed"][1], (j, walls)


def test_a_damaged_stored_part_is_built_again_not_linked_into_a_new_cache(inputs, clean16, caplog):
    """A stored join whose latents file was changed on disk (a flipped byte) is not
    linked into a later build (a reused part used to be linked as it was, and the new
    cache's marker then certified the damaged bytes: `verify` said ok; outside tester).
    Nor does it fail that build: the part's marker is retired and that part alone is
    built again (the refusal's advice, verify then clean, removed every intact part of
    the caches that linked it: outside tester). The new cache equals a scratch build;
    the other parts are reused; the first cache still links the damaged bytes and
    `verify` finds them."""
    import logging

    root = inputs["base"] / "damaged"
    first = _build(root, inputs["final"], inputs["meta"])
    join = sorted(_store_units(root, "join").values())[0]
    (rows,) = sorted(join.glob("join.*/rows/data*.arrow"))[:1]
    data = bytearray(rows.read_bytes())
    # Within the first MiB: what the check at reuse reads (the first and last MiB of each
    # file, its size); a flip deep inside a larger file is left to `hf-pipeline verify`.
    data[min(len(data) // 2, 300_000)] ^= 0xFF
    # In place, as a disk fault leaves it: the first cache's hard link sees it too.
    rows.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        res = _build(root, inputs["final"], inputs["meta"], "encoder.max_length=16")
    assert f"the stored part {join.name} is damaged" in caplog.text, caplog.text
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 1 and reuse["joins_reused"] == reuse["parts"] - 1, reuse
    assert list(join.glob("join.json.retired-*")), "the damaged marker moved aside"
    _assert_same_cache(res, clean16)
    _assert_same_bytes(res, clean16)
    code = subprocess.run(
        [sys.executable, "-m", "hf_pipeline", "verify", "--cache-dir", str(root)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert code.returncode == 1 and first.cache_dir.name in code.stdout, code.stdout[-3000:]


def test_a_damaged_stored_embedding_is_built_again_by_an_append(inputs, caplog):
    """An append reuses the old parts' embeddings; one of them changed on disk (a
    flipped byte) is retired and that part's token ids and embedding made again (the
    encoder loads for it), not linked and not a failed build; the result equals a
    scratch build of the final input."""
    import logging

    root = inputs["base"] / "damaged-embed"
    _build(root, inputs["initial"], inputs["meta"])
    embed = sorted(_store_units(root, "embed").values())[0]
    (emb,) = sorted(embed.glob("embed.*/embeddings/*.arrow"))[:1]
    data = bytearray(emb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    emb.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        res = _build(root, inputs["final"], inputs["meta"])
    assert f"the stored part {embed.name} is damaged" in caplog.text, caplog.text
    assert list(embed.glob("embed.json.retired-*")), "the damaged marker moved aside"
    assert (embed / "embed.json").exists(), "built again"
    _assert_same_cache(res, inputs["clean"])


def test_a_build_reads_no_reused_part_whole_whose_stat_is_unchanged(inputs):
    """The stored parts a build reuses are checked against their records before they
    are linked; each build used to read all of them whole (an append read the whole
    cache). Now a file whose exact stat the cache root's content index remembers with
    its unit's digest is not read: three caches over one input, each with another
    max_length (every join and text reused, the embeddings built), the third reads
    nothing whole. The report says what was checked and read (``reuse``)."""
    from hf_pipeline.stores.identity import RACY_NS

    root = inputs["base"] / "vouched"
    first = _build(root, inputs["initial"], inputs["meta"])
    assert first.report["reuse"]["reused_files_checked"] == 0
    # The first build's files leave the index's racy window (a file hashed within 2 s
    # of its mtime is read again: a coarse-mtime filesystem could hide a later write).
    time.sleep(RACY_NS / 1e9)
    second = _build(root, inputs["initial"], inputs["meta"], "encoder.max_length=32")
    checked = second.report["reuse"]
    assert checked["joins_reused"] == 6 == checked["texts_reused"], checked
    assert checked["reused_files_checked"] >= 12, checked  # every join's and text's files
    third = _build(root, inputs["initial"], inputs["meta"], "encoder.max_length=16")
    reuse = third.report["reuse"]
    assert reuse["reused_files_checked"] == checked["reused_files_checked"], reuse
    assert (reuse["reused_files_read"], reuse["reused_bytes_read"]) == (0, 0), reuse
    first_rows = first.layout.converted.glob("parts/*/rows/*.arrow")
    third_rows = third.layout.converted.glob("parts/*/rows/*.arrow")
    assert {f.stat().st_ino for f in first_rows} == {f.stat().st_ino for f in third_rows}


def test_damaged_stored_token_ids_are_made_again_for_their_part(inputs, clean_f16, caplog):
    """Another encoder of the same tokenizer reuses the stored token ids; those of a later
    part were changed on disk: that unit is retired and its part's ids made again, the
    other parts' reused (it stopped the build with its error, leaving every later
    build to fail the same way: the damage now costs its own part), and the cache equals
    a scratch build; neither of the build's threads is left running."""
    import logging
    import threading

    root = inputs["base"] / "damaged-tokens"
    _build(root, inputs["final"], inputs["meta"])
    unit = sorted(_store_units(root, "tokens").values())[4]
    (ids,) = unit.glob("tokens.*/tokens/data.arrow")
    data = bytearray(ids.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ids.unlink()  # a new inode with the damage, as a disk fault would leave it
    ids.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        res = _build(root, inputs["final"], inputs["meta"], _F16)
    assert f"the stored part {unit.name} is damaged" in caplog.text, caplog.text
    assert list(unit.glob("tokens.json.retired-*")) and (unit / "tokens.json").exists()
    reuse = res.report["reuse"]
    assert reuse["tokens_built"] == 1 and reuse["tokens_reused"] == reuse["parts"] - 1, reuse
    threads = ("hf_pipeline-embed", "hf_pipeline-tokens")
    assert not [t.name for t in threading.enumerate() if t.name.startswith(threads)]
    _assert_same_cache(res, clean_f16)


def _store_units(root: Path, kind: str) -> dict[str, Path]:
    """The published units of ``kind`` (``tokens``, ``embed`` ...) in ``root``'s store."""
    return {d.name: d for d in (root / ".parts").glob(f"{kind}-*") if (d / f"{kind}.json").exists()}


def _assert_same_bytes(got, want, metadata_of: tuple[str, ...] = ()):
    """Both caches' ``converted`` stages hold the same files, byte for byte (latents,
    captions, token ids, embeddings, reasons); the files of the ``metadata_of`` columns
    hold the same table (schema metadata aside)."""
    import pyarrow as pa

    a, b = got.layout.converted, want.layout.converted
    files = sorted(f.relative_to(a) for f in a.rglob("*.arrow"))
    assert files == sorted(f.relative_to(b) for f in b.rglob("*.arrow"))
    assert any(f.parts[-2] == "embeddings" for f in files), files
    for rel in files:
        if rel.parent.name in metadata_of:
            ta, tb = (pa.ipc.open_stream(p.read_bytes()).read_all() for p in (a / rel, b / rel))
            assert ta.replace_schema_metadata().equals(tb.replace_schema_metadata()), rel
            continue
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_token_ids_are_a_unit_of_their_own_built_by_the_workers(inputs):
    """Each part's token ids are a store unit ``tokens-<part>-<captions>-<tokenizer>``
    (its text unit's id and the tokenizer's key), built by the ``num_proc`` worker
    processes (not the builder) before the embedding, which tokenizes nothing; each
    embedding's marker names the tokens it read."""
    from dist.markers import read_json
    from hf_pipeline.build.part_store import tokenizer_key
    from hf_pipeline.encoder.model import CaptionTokenizer

    res = inputs["clean"]
    root = res.cache_dir.parent
    cfg = _config(root, inputs["final"], inputs["meta"])
    key = tokenizer_key(CaptionTokenizer(cfg.encoder))
    embeds = _store_units(root, "embed")
    texts = {n.removeprefix("embed-").rsplit("-", 1)[0] for n in embeds}
    tokens = _store_units(root, "tokens")
    assert set(tokens) == {f"tokens-{t}-{key}" for t in texts}, (tokens, texts)
    for name, folder in embeds.items():
        uses = read_json(folder / "embed.json")["info"]["uses"]
        text = name.removeprefix("embed-").rsplit("-", 1)[0]
        assert f"tokens-{text}-{key}" in uses, uses
    reuse = res.report["reuse"]
    assert reuse["tokens_built"] == reuse["parts"] and reuse["tokens_reused"] == 0, reuse
    # One pool for the build: the same workers tokenized every part (their tokenizer
    # loaded once each), and none outlived the build.
    pids = {pid for part in res.report["parts"] for pid in part["tokens"]["worker_pids"]}
    assert 1 <= len(pids) <= 2, [p["tokens"]["worker_pids"] for p in res.report["parts"]]
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], pids
    for part in res.report["parts"]:
        assert "seconds_tokenize" not in part["embed"], part["embed"]
        made = part["tokens"]
        assert made["num_proc"] == cfg.build.effective_num_proc == 2, made
        # Worker processes, not the builder (how many of the 2 took a batch is up to the
        # pool: one may take both halves of a small part before the other starts).
        assert made["worker_pids"] and os.getpid() not in made["worker_pids"], made
        assert made["rows"] == part["rows_in"] and made["seconds_tokenize"] >= 0, made


@pytest.fixture(scope="module")
def clean_f16(inputs):
    """A from-scratch build of the final input whose embeddings are stored as float16
    (another encoder identity, the same tokenizer and max_length)."""
    return _build(inputs["base"] / "f16-clean", inputs["final"], inputs["meta"], _F16)


#: Another encoder with the same tokenizer and max_length.
_F16 = "encoder.output_dtype=float16"


def test_another_encoder_of_the_same_tokenizer_reuses_the_token_ids(inputs, clean_f16):
    """An encoder of another identity with the same tokenizer and max_length builds
    only embeddings: the joins, the captions and the token ids are reused (no
    tokenization), no latent byte written; the cache is byte for byte the scratch one."""
    root = inputs["base"] / "tok"
    first = _build(root, inputs["final"], inputs["meta"])
    before = set(_store_units(root, "tokens"))
    res = _build(root, inputs["final"], inputs["meta"], _F16)
    assert res.fingerprint != first.fingerprint and res.fingerprint == clean_f16.fingerprint
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert reuse["texts_built"] == 0 and reuse["tokens_built"] == 0, reuse
    assert reuse["tokens_reused"] == reuse["parts"] == reuse["embeddings_built"], reuse
    assert set(_store_units(root, "tokens")) == before
    assert all(p["reused"]["tokens"] for p in res.report["parts"])
    _assert_same_cache(res, clean_f16)
    _assert_same_bytes(res, clean_f16)


def _start_and_kill(root: Path, inputs, unit: str, *extra: str) -> Path:
    """``prebuild_cache.py`` of the final input into ``root`` (a real process), SIGKILLed
    once it holds the lease of a stored ``unit`` (``join`` or ``embed``) and writes in
    it; the unit's folder."""
    from dist.markers import read_json

    args = [
        REPO / "scripts/prebuild_cache.py", "-q", "--cache-dir", root,
        *[a for o in [*SMALL_DEMO, f"data.shards={inputs['final']}",
                      f"data.metadata={inputs['meta']}", "build.part_shards=1",
                      "coord.lease_timeout=4", "coord.heartbeat_interval=0.5", *extra]
          for a in ("--set", o)],
    ]  # fmt: skip
    proc = subprocess.Popen(
        [PYTHON, *map(str, args)], env=script_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        victim = None
        while victim is None:  # the build holds a new unit's lease and writes into it
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, f"the build never started a {unit}"
            for lease in (root / ".parts").glob(f"{unit}-*/lease"):
                info = read_json(lease)
                if isinstance(info, dict) and info.get("pid") == proc.pid:
                    # Its folder is made as it starts (an embedding then waits for
                    # the model to load: seconds to catch it in).
                    if any(d.is_dir() for d in lease.parent.glob(f"{unit}.*")):
                        victim = lease.parent
                        os.kill(proc.pid, signal.SIGKILL)  # at once: a unit takes ms
                        break
            time.sleep(0.005)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return victim


def test_sigkill_during_an_incremental_build_then_a_build_equals_a_clean_one(inputs):
    """The incremental build (the final input over the initial one's parts) is
    SIGKILLed while it joins a new part; the next build takes the dead lease over and
    gives the from-scratch cache, and the store holds each part once."""
    root = inputs["base"] / "kill"
    _build(root, inputs["initial"], inputs["meta"])
    before = {d.name for d in (root / ".parts").glob("join-*")}
    victim = _start_and_kill(root, inputs, "join")
    assert victim.name not in before
    assert not (victim / "join.json").exists(), "killed before it published"
    res = _build(root, inputs["final"], inputs["meta"], "coord.lease_timeout=4")
    _assert_same_cache(res, inputs["clean"])
    assert res.report["reuse"]["joins_reused"] == len(before)
    assert len(list(victim.glob("join.*/"))) == 1, "one published copy of the part"


def _admin(root: Path, *ops: str) -> dict:
    """``prebuild_cache.py --cache-dir root <ops> --json -`` (a real process): its JSON."""
    import json

    out = subprocess.run(
        [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root), *ops,
         "--json", "-", "--set", "coord.heartbeat_interval=0.2"],
        env=script_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _admin_human(root: Path, *ops: str) -> str:
    """``prebuild_cache.py --cache-dir root <ops>`` (a real process): its human lines."""
    out = subprocess.run(
        [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root), *ops,
         "--set", "coord.heartbeat_interval=0.2"],
        env=script_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@contextlib.contextmanager
def _live_builder(folder: Path, stage: str):
    """A builder of ``folder`` (fingerprint: its name's tail) holding its lease in this
    process, through the real coordinator, inside the block: its stage waits until the
    block ends, then publishes."""
    import threading

    from dist import Stage, ensure_built

    go, building = threading.Event(), threading.Event()

    def write(ctx):
        building.set()
        assert go.wait(120), "the test never let the live builder finish"
        (ctx.tmp_dir / "data.arrow").write_bytes(b"x" * 100)
        return {}

    builder = threading.Thread(
        target=ensure_built, name="live-builder",
        args=(folder, folder.name.rsplit("-", 1)[1], [Stage(name=stage, build=write)]),
        kwargs=dict(builder=True, poll_interval=0.05, lease_timeout=4.0,
                    heartbeat_interval=0.05, max_wait=120.0), daemon=True,
    )  # fmt: skip
    builder.start()
    try:
        assert building.wait(60), "the live builder never started"
        yield
    finally:
        go.set()
        builder.join(60)


def test_status_says_which_units_are_unfinished_and_clean_removes_only_abandoned_ones(inputs):
    """A build SIGKILLed mid-join left its unit unpublished; another unit is being built
    by a live builder (this process, through the real coordinator). --status said
    neither (outside tester): now both are "unfinished", the first with an abandoned
    builder (--clean removes it), the second with a live one (--clean keeps it)."""

    root = inputs["base"] / "kill-status"
    _build(root, inputs["initial"], inputs["meta"])
    victim = _start_and_kill(root, inputs, "join")
    live = root / ".parts" / "join-00000000000000b1"
    with _live_builder(live, "join"):
        units = {Path(u["path"]).name: u for u in _admin(root, "--status")["parts"]}
        assert units[victim.name]["unfinished"] is True, units[victim.name]
        assert units[victim.name]["builder"] == "abandoned", units[victim.name]
        assert units[live.name]["unfinished"] is True and units[live.name]["builder"] == "live"
        done = {n: u for n, u in units.items() if n not in (victim.name, live.name)}
        assert done and all(not u["unfinished"] and u["builder"] is None for u in done.values())
        lines = _admin_human(root, "--status").splitlines()
        (killed,) = [x for x in lines if victim.name in x]
        assert "unfinished" in killed and "abandoned" in killed and "--clean" in killed, lines
        (running,) = [x for x in lines if live.name in x]
        assert "unfinished" in running and "live" in running, lines
        removed = {Path(p).name for p in _admin(root, "--clean")["removed"]}
        assert victim.name in removed and live.name not in removed, removed
        assert not victim.exists(), sorted(os.listdir(victim))
        assert (live / "lease").exists()
        assert not removed & set(done), "a finished unit in use was removed"
    assert (live / "join.json").exists(), "the live builder published after the clean"


def test_status_says_units_no_cache_uses_are_reusable_and_what_clean_does(inputs):
    """Units no cache uses any more (their cache removed, as after a killed re-embedding
    whose finished units no cache links yet): --status counted them "reusable by later
    builds" and also "used by no cache (--clean removes them)" in two clauses that read
    as opposites (outside tester). Now one clause says both: reusable, and cleaned."""
    import shutil

    root = inputs["base"] / "unused"
    res = _build(root, inputs["initial"], inputs["meta"])
    units = len(_admin(root, "--status")["parts"])
    shutil.rmtree(res.cache_dir)
    (line,) = [x for x in _admin_human(root, "--status").splitlines() if "stored parts" in x]
    assert f"; {units} stored unit(s) used by no cache (" in line, line
    assert line.endswith("): reusable by a later build; --clean removes them"), line
    assert "reusable by later builds" not in line, line


def test_clean_keeps_unused_units_while_a_build_is_live_on_the_root(inputs):
    """Outside tester: ``--clean`` during a re-embed removed the units the live build had
    made and not linked yet (used by no cache, for the moment): the build then failed
    with a traceback. While a cache of the root is being built (its lease live), the
    units no cache uses are kept, each with one line saying why; once it is done, the
    same clean removes them."""
    import shutil

    root = inputs["base"] / "clean-live"
    res = _build(root, inputs["initial"], inputs["meta"])
    units = {Path(u["path"]).name for u in _admin(root, "--status")["parts"]}
    shutil.rmtree(res.cache_dir)  # no cache links them: what a live build's new units are
    live = root / "demo-00000000000c1ea2"
    with _live_builder(live, "converted"):
        # --status says what --clean does now (a tester: it said "--clean removes them")
        (line,) = [x for x in _admin_human(root, "--status").splitlines() if "stored parts" in x]
        assert line.endswith(f"--clean keeps them while {live.name} is being built"), line
        report = _admin(root, "--clean")
        removed = {Path(p).name for p in report["removed"]}
        assert not removed & units, removed
        kept = {Path(e["path"]).name: e["why"] for e in report["left"]}
        assert set(kept) >= units, kept
        assert all(live.name in kept[u] and "being built" in kept[u] for u in units), kept
        assert all((root / ".parts" / u).exists() for u in units)
    removed = {Path(p).name for p in _admin(root, "--clean")["removed"]}
    assert units <= removed, removed


def test_status_summary_names_corrupt_units_as_verify_does(inputs):
    """A damaged stored unit was ``corrupt`` in --status --json only; the human summary
    line did not count it (outside tester). Now it counts and names them, as
    ``.parts/NAME`` like --verify's part lines."""
    root = inputs["base"] / "corrupt-unit"
    _build(root, inputs["initial"], inputs["meta"])
    joins = sorted((root / ".parts").glob("join-*"))
    for unit in joins[:2]:
        victim = next(unit.glob("join.*/rows/*.arrow"), None)
        assert victim is not None, sorted(unit.rglob("*"))
        victim.write_bytes(victim.read_bytes()[:-10])  # truncated: its marker's size differs
    units = {Path(u["path"]).name: u for u in _admin(root, "--status")["parts"]}
    assert [n for n, u in units.items() if u["state"] == "corrupt"] == [j.name for j in joins[:2]]
    (line,) = [x for x in _admin_human(root, "--status").splitlines() if "stored parts" in x]
    assert f"; 2 corrupt: .parts/{joins[0].name}, .parts/{joins[1].name}" in line, line


def test_status_shows_sharing_and_clean_keeps_every_file_a_complete_cache_uses(
    inputs, two_encoders
):
    """Two caches over the same parts (two encoders): --status says what each shares
    with the other. One of them turns corrupt: --clean removes it, and with it the
    stored embeddings only it used, but not one file the other (complete) cache uses:
    that cache still verifies whole and reads the same rows. Once no cache is left, the
    stored parts go too; a folder in the store without the project's mark stays."""
    from dist.inventory import verify
    from hf_pipeline.cache.layout import STAGES

    first, second = two_encoders
    root = first.cache_dir.parent
    parts = first.report["reuse"]["parts"]
    status = _admin(root, "--status")
    caches = {c["path"]: c for c in status["caches"]}
    for mine, other in ((first, second), (second, first)):
        c = caches[str(mine.cache_dir)]
        assert c["state"] == "complete" and c["shared_with"] == [other.cache_dir.name]
        assert c["shared_parts"] == parts and c["shared_files"] >= parts
    units = {Path(u["path"]).name: u for u in status["parts"]}
    assert len([n for n in units if n.startswith("join-")]) == parts
    assert len([n for n in units if n.startswith("embed-")]) == 2 * parts
    assert all(u["in_use"] for u in units.values())

    want = _content(second)
    foreign = root / ".parts" / "join-notours"
    foreign.mkdir()
    (foreign / "data.arrow").write_bytes(b"someone else's")
    marker = first.cache_dir / "converted.json"
    marker.write_text("{ not a marker")  # the first cache is corrupt now
    dry = _admin(root, "--clean", "--dry-run")
    report = _admin(root, "--clean")
    removed = {Path(p).name for p in report["removed"]}
    # The dry run lists what the run then removes: the stored units too (outside tester).
    assert {Path(p).name for p in dry["removed"]} == removed
    assert first.cache_dir.name in removed and second.cache_dir.name not in removed
    # The first cache's embeddings (no other cache used them) went; the joins stay.
    gone = {n for n in units if n.startswith("embed-") and n.endswith(first_encoder_key(first))}
    assert len(gone) == parts and gone <= removed
    assert not any(n.startswith(("join-", "captions-")) for n in removed)
    assert verify(second.cache_dir, STAGES) == []  # every file whole, checksums included
    got = _content(second)
    assert got["key"].tolist() == want["key"].tolist()
    assert got["latents"].tobytes() == want["latents"].tobytes()

    (second.cache_dir / "converted.json").write_text("{ not a marker")
    report = _admin(root, "--clean")
    left = [p.name for p in (root / ".parts").iterdir()]
    assert left == ["join-notours"], left  # every stored unit went; not what is not ours
    assert (foreign / "data.arrow").read_bytes() == b"someone else's"


def first_encoder_key(res) -> str:
    """The encoder key of a cache built with the default encoder."""
    from hf_pipeline.build.part_store import encoder_key
    from hf_pipeline.config import load_config
    from hf_pipeline.encoder.model import encoder_identity

    assert res.report["config"]["encoder"]["max_length"] == load_config(None, []).encoder.max_length
    return encoder_key(encoder_identity(load_config(None, [], environ={}).encoder))


def test_parts_of_many_shards_joined_by_several_workers_give_the_same_cache(inputs):
    """Bigger parts (several shards, joined by the ``num_proc`` workers, whose files
    ``datasets`` names with a suffix) give the cache a part per shard gives: the cut is
    a speed knob, not part of the result (the fingerprint included)."""
    res = _build(
        inputs["base"] / "big-parts", inputs["final"], inputs["meta"], "build.part_shards=8"
    )
    assert any(p["shards"] > 1 for p in res.report["parts"])
    assert max(p["join"]["workers"] for p in res.report["parts"]) == 2
    _assert_same_cache(res, inputs["clean"])


def test_ranks_build_only_the_missing_parts_together(inputs, tmp_path):
    """build.parallel=ranks, 2 real rank processes, first over the initial input, then
    over the final one in the same cache root: the second run reuses the 6 stored
    parts and the ranks share the 3 missing ones (part ``i`` to rank ``i % 2``), rank 0
    starting 6 s late changes no count; the cache equals the from-scratch build."""
    import json

    from hf_pipeline.build.prepare import prepare_cache
    from tests.conftest import run_ranks

    root = inputs["base"] / "ranks"

    def ranks(data: Path, late: float = 0) -> list[dict]:
        over = [*SMALL_DEMO, f"data.shards={data}", f"data.metadata={inputs['meta']}",
                f"build.cache_dir={root}", "build.part_shards=1", "build.parallel=ranks",
                "coord.poll_interval=0.1"]  # fmt: skip
        # A launch id, as torchrun's run id gives one: the ranks agree before building,
        # so a part rank 1 finishes before rank 0 reaches the store counts as built by
        # the job (the CI saw 7 reused of 6 without it, rank 0 started late).
        runs = run_ranks(
            [REPO / "tests/procs/rank_loader.py", tmp_path / "r{rank}.json", *over], 2,
            timeout=600, HF_PIPELINE_JOB_ID=f"{data.name}-{time.time_ns()}",
            rank_env=lambda r: {"RANK_LOADER_START_DELAY": str(late if r == 0 else 0)},
        )  # fmt: skip
        for code, out, err in runs:
            assert code == 0, (out + err)[-3000:]
        return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]

    ranks(inputs["initial"])
    results = ranks(inputs["final"], late=6)  # rank 0 starts late: still counted right
    assert all(r["built"] for r in results), "each rank built a missing part"
    cfg = _config(root, inputs["final"], inputs["meta"], "build.parallel=ranks")
    res = prepare_cache(cfg, progress=False)
    assert not res.built
    reuse, parts = res.report["reuse"], res.report["parts"]
    assert reuse["joins_reused"] == 6 and reuse["joins_built"] == 3
    built = [(i, p["builder"]["pid"]) for i, p in enumerate(parts) if not p["reused"]["join"]]
    assert len({pid for _, pid in built}) == 2, built  # both ranks built
    for i, pid in built:  # part i by rank i % 2: the same process for the same parity
        assert pid == next(q for j, q in built if j % 2 == i % 2)
    _assert_same_cache(res, inputs["clean"])


def test_sigkill_during_a_re_embedding_then_a_build_equals_a_clean_one(inputs, clean16):
    """Another encoder over stored joins, SIGKILLed while it embeds a part: the next
    build takes over, writes no latent bytes, and gives the from-scratch cache."""
    root = inputs["base"] / "kill-embed"
    _build(root, inputs["final"], inputs["meta"])
    victim = _start_and_kill(root, inputs, "embed", "encoder.max_length=16")
    assert not (victim / "embed.json").exists(), "killed before it published"
    res = _build(root, inputs["final"], inputs["meta"], "encoder.max_length=16",
                 "coord.lease_timeout=4")  # fmt: skip
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["latent_bytes_written"] == 0
    assert reuse["embeddings_built"] == reuse["parts"]
    assert len(list(victim.glob("embed.*/"))) == 1, "one published copy of the embeddings"
    _assert_same_cache(res, clean16)


def test_sigkill_during_a_tokenization_then_a_build_equals_a_clean_one(inputs, clean16):
    """Another max_length over stored joins and captions, SIGKILLed while its workers
    tokenize a part: the next build takes the dead lease over, recomputes only token ids
    and embeddings (no latent byte, no caption) and gives the from-scratch cache, byte
    for byte; the store holds that part's token ids once."""
    root = inputs["base"] / "kill-tokens"
    _build(root, inputs["final"], inputs["meta"])
    victim = _start_and_kill(root, inputs, "tokens", "encoder.max_length=16")
    assert not (victim / "tokens.json").exists(), "killed before it published"
    res = _build(root, inputs["final"], inputs["meta"], "encoder.max_length=16",
                 "coord.lease_timeout=4")  # fmt: skip
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert reuse["texts_built"] == 0 and reuse["tokens_built"] == reuse["parts"], reuse
    assert len(list(victim.glob("tokens.*/"))) == 1, "one published copy of the token ids"
    _assert_same_cache(res, clean16)
    _assert_same_bytes(res, clean16)


#: The last commit whose part store has no ``tokens`` units (the embedding tokenized:
#: part schema 2): what "a store of the previous release" is built with.
TEXT_UNITS_RELEASE = "9010ed968c2212b1042f7980cb0ef2b46dd8a9b8"


def test_a_store_of_the_release_before_tokens_units_is_found_and_reused(inputs, clean16, tmp_path):
    """A cache built by the release whose embedding tokenized (no ``tokens`` units; its
    own code in a subprocess) is found as it is (not rebuilt, no unit built); another
    max_length then reuses its joins and captions, builds the token ids and the
    embeddings only, and equals a scratch build byte for byte."""
    root = tmp_path / "cache"
    args = [*SMALL_DEMO, f"data.shards={inputs['final']}", f"data.metadata={inputs['meta']}",
            f"build.cache_dir={root}", "build.part_shards=1"]  # fmt: skip
    old_fp, old_dir = build_with_release(TEXT_UNITS_RELEASE, args, tmp_path)
    assert not list((root / ".parts").glob("tokens-*")), "the release before tokens units"

    res = _build(root, inputs["final"], inputs["meta"])
    assert not res.built and res.fingerprint == old_fp and str(res.cache_dir) == old_dir
    # Its embeddings files name the encoder's identity of that release (a local model
    # folder by its path, since 541a53a by its bytes) in their schema metadata: the same
    # rows, not the same bytes there.
    _assert_same_bytes(res, inputs["clean"], metadata_of=("embeddings",))

    res16 = _build(root, inputs["final"], inputs["meta"], "encoder.max_length=16")
    reuse = res16.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert reuse["texts_built"] == 0 and reuse["tokens_built"] == reuse["parts"], reuse
    _assert_same_bytes(res16, clean16)


# ------------------------------------------------------------------ another caption column

#: The caption column of the re-join scenarios (the demo metadata has it beside the
#: default ``caption_llava``).
_SHORT = "data.caption_column=caption_llava_short"


@pytest.fixture(scope="module")
def clean_short(inputs):
    """A from-scratch build of the final input with the short caption column."""
    return _build(inputs["base"] / "short-clean", inputs["final"], inputs["meta"], _SHORT)


def _latent_inodes(res) -> dict[str, int]:
    """The inode of each of a cache's latents files (``parts/*/rows/*.arrow``)."""
    conv = res.layout.converted
    return {
        f.relative_to(conv).as_posix(): f.stat().st_ino for f in conv.glob("parts/*/rows/*.arrow")
    }


def _assert_same_samples(got, want):
    """The memory-mapped loader reads the same kept rows from both caches."""
    from hf_pipeline.cache.layout import open_sample_source

    with open_sample_source(got.layout, got.fingerprint) as a:
        with open_sample_source(want.layout, want.fingerprint) as b:
            assert a.num_rows == b.num_rows > 0
            rows = np.arange(a.num_rows)
            x, y = a.gather(rows, 0), b.gather(rows, 0)
    assert x["keys"].tolist() == y["keys"].tolist()
    assert x["latents"].tobytes() == y["latents"].tobytes()
    np.testing.assert_allclose(x["embeddings"], y["embeddings"], atol=1e-5)


def test_another_caption_column_rejoins_only_captions_and_writes_no_latent_bytes(
    inputs, clean_short
):
    """A new caption column over the same shards: no shard read, 0 latent bytes written,
    only the parts' captions re-joined (from the stored keys) and re-embedded; both
    caches link the very same latents files (same inodes, once on disk), and the new
    cache equals a from-scratch build with that column, fingerprint included, through
    ``open_dataset`` and through the memory-mapped loader."""
    root = inputs["base"] / "captions"
    first = _build(root, inputs["final"], inputs["meta"])
    res = _build(root, inputs["final"], inputs["meta"], _SHORT)
    assert res.fingerprint != first.fingerprint
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["joins_reused"] == reuse["parts"], reuse
    assert reuse["shards_read"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert reuse["texts_built"] == reuse["parts"] == reuse["embeddings_built"], reuse
    assert reuse["tokens_built"] == reuse["parts"], reuse  # new captions: new token ids
    old, new = _latent_inodes(first), _latent_inodes(res)
    assert old and old == new, "the latents once on disk"
    _assert_same_cache(res, clean_short)
    _assert_same_samples(res, clean_short)
    assert _content(res)["caption"].tolist() != _content(first)["caption"].tolist()
    # Back to the first column: every stored unit is found, nothing is built.
    again = _build(root, inputs["final"], inputs["meta"])
    assert again.fingerprint == first.fingerprint and not again.built


def test_sigkill_during_a_caption_rejoin_leaves_the_first_cache_intact(inputs, clean_short):
    """The build with a new caption column is SIGKILLed while it re-joins a part's
    captions: the first cache still verifies whole and reads the same rows, and the next
    build takes the dead lease over, writes no latent bytes and gives the from-scratch
    cache of that column."""
    from dist.inventory import verify
    from hf_pipeline.cache.layout import STAGES

    root = inputs["base"] / "kill-text"
    first = _build(root, inputs["final"], inputs["meta"])
    want = _content(first)
    victim = _start_and_kill(root, inputs, "text", _SHORT)
    texts = [d for d in (root / ".parts").glob("text-*") if (d / "text.json").exists()]
    parts = first.report["reuse"]["parts"]
    assert len(texts) < 2 * parts, "killed before the re-join was done"
    assert verify(first.cache_dir, STAGES) == []
    got = _content(first)
    assert got["key"].tolist() == want["key"].tolist()
    assert got["caption"].tolist() == want["caption"].tolist()
    assert got["latents"].tobytes() == want["latents"].tobytes()
    res = _build(root, inputs["final"], inputs["meta"], _SHORT, "coord.lease_timeout=4")
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert len(list(victim.glob("text.*/"))) == 1, "one published copy of the captions"
    _assert_same_cache(res, clean_short)
    assert _latent_inodes(res) == _latent_inodes(first)


#: The last commit whose caches keep the caption in ``rows/`` (schema 1): what "a cache
#: built by the previous layout" is built with.
ROWS_CAPTION_RELEASE = "b1abb405b9aec62e881cf39c4c45be4a2b749fa1"


def test_a_cache_of_the_previous_layout_is_found_and_read(inputs, tmp_path):
    """A cache built by the release whose rows hold the captions (schema 1, built by
    that release's own code in a subprocess) is found by this one (not rebuilt) and
    read by the loader and by ``open_dataset`` as it was; another caption column then
    builds a cache of the current layout beside it, equal to a scratch build."""

    from hf_pipeline.cache.layout import open_dataset, open_sample_source

    root = tmp_path / "cache"
    args = [*SMALL_DEMO, f"data.shards={inputs['final']}", f"data.metadata={inputs['meta']}",
            f"build.cache_dir={root}", "build.part_shards=1"]  # fmt: skip
    old_fp, old_dir = build_with_release(ROWS_CAPTION_RELEASE, args, tmp_path)
    assert not list(Path(old_dir).glob("converted.*/parts/*/captions")), "the old layout"

    res = _build(root, inputs["final"], inputs["meta"])
    assert not res.built and res.fingerprint == old_fp and str(res.cache_dir) == old_dir
    clean = inputs["clean"]
    # The same rows as this release's scratch build, through both readers.
    a, b = _content(res), _content(clean)
    assert a["key"].tolist() == b["key"].tolist()
    assert a["caption"].tolist() == b["caption"].tolist()
    assert a["latents"].tobytes() == b["latents"].tobytes()
    _assert_same_samples(res, clean)
    with open_sample_source(res.layout) as src:
        assert src.fingerprint == old_fp
    assert len(open_dataset(res.layout)) == res.report["rows_out"]

    short = _build(root, inputs["final"], inputs["meta"], _SHORT)
    assert short.built and short.fingerprint not in (old_fp, clean.fingerprint)
    assert list(short.layout.converted.glob("parts/*/captions/*.arrow"))


def test_pulling_a_cache_of_another_caption_column_fetches_no_latents(
    inputs,
    gcs_store,  # noqa: F811 - the fixture
    tmp_path,
):
    """Content-addressed: the cache of another caption column, published, then pulled
    into a root that holds a copy of the first column's cache (same parts): every
    latents file is hard-linked from that copy, not one fetched; the captions files
    are fetched; the pulled cache reads as the published one."""
    import shutil

    from dist.layout import marker_name
    from dist.markers import read_json
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.publish.pull import PULLED_FROM
    from hf_pipeline.publish.upload import publish_cache

    _, url = gcs_store
    src = tmp_path / "src"
    first = _build(src, inputs["final"], inputs["meta"])
    short = _build(src, inputs["final"], inputs["meta"], _SHORT)
    publish_cache(
        short.cache_dir, short.fingerprint, url,
        data_config=_config(src, inputs["final"], inputs["meta"], _SHORT).data,
    )  # fmt: skip
    dest = tmp_path / "dest"
    dest.mkdir()
    mine = dest / first.cache_dir.name  # another complete cache: a copy, its own inodes
    shutil.copytree(first.cache_dir, mine)
    cfg = _config(dest, inputs["final"], inputs["meta"], _SHORT, f"build.pull_from={url}")
    res = prepare_cache(cfg, progress=False)
    assert res.pulled and not res.built and res.fingerprint == short.fingerprint
    conv = res.layout.converted
    have = {
        f.stat().st_ino: f for f in (mine / first.layout.converted.name).rglob("*.arrow")
    }  # fmt: skip
    rows = list(conv.glob("parts/*/rows/*.arrow"))
    captions = list(conv.glob("parts/*/captions/*.arrow"))
    assert rows and captions
    assert all(f.stat().st_ino in have for f in rows), "every latents file linked"
    assert not any(f.stat().st_ino in have for f in captions), "the captions fetched"
    info = read_json(res.cache_dir / marker_name("converted"))["info"][PULLED_FROM]
    assert info["linked_bytes"] >= sum(f.stat().st_size for f in rows)
    assert info["fetched_bytes"] < sum(f.stat().st_size for f in rows)
    _assert_same_cache(res, short)


def test_reuse_counts_what_this_run_did_after_its_cache_was_removed(inputs):
    """A cache removed (``hf-pipeline clean``) and built again from the parts its first
    build stored: those parts were built for this very fingerprint, but by the earlier
    run, so this run reused them all and read no shard. A cache only found reports a
    ``reuse`` of zeros in its summary (nothing was read or written by that run); the
    cache's own report keeps what its build did."""
    import shutil

    root = inputs["base"] / "rebuilt"
    first = _build(root, inputs["initial"], inputs["meta"])
    assert first.report["reuse"]["joins_built"] == first.report["reuse"]["parts"] > 0
    shutil.rmtree(first.cache_dir)
    res = _build(root, inputs["initial"], inputs["meta"])
    assert res.built and res.fingerprint == first.fingerprint
    reuse = res.report["reuse"]
    assert reuse["joins_built"] == 0 and reuse["joins_reused"] == reuse["parts"], reuse
    assert reuse["shards_read"] == 0 and reuse["latent_bytes_written"] == 0, reuse
    assert reuse["embeddings_built"] == 0 == reuse["texts_built"] == reuse["tokens_built"], reuse
    assert all(p["reused"]["join"] and p["reused"]["embed"] for p in res.report["parts"])
    assert res.summary()["reuse"] == reuse
    found = _build(root, inputs["initial"], inputs["meta"])
    assert not found.built
    assert set(found.summary()["reuse"].values()) == {0}, found.summary()["reuse"]
    assert found.report["reuse"] == reuse  # the cache's report: what its build did
