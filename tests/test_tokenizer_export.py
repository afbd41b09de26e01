"""The join workers' tokenizer exported by a child interpreter (hf_pipeline.tokenizer_export):
the same spec as the builder's own export, a fallback when the child fails, the same cache
from a build that uses it, and no folder left behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig
from hf_pipeline.embed import CaptionTokenizer
from hf_pipeline.errors import ConfigError
from hf_pipeline.tokenizer_export import TokenizerExport


def test_the_child_exports_the_spec_the_builder_would(tmp_path):
    cfg = EncoderConfig(max_length=40)
    export = TokenizerExport(cfg, tmp_path / "child")
    got = export.result()
    want = CaptionTokenizer(cfg).export(tmp_path / "builder")
    assert export._proc.returncode == 0  # the child did it
    assert (got.max_length, got.direction, got.split_special_tokens) == (
        want.max_length, want.direction, want.split_special_tokens
    )  # fmt: skip
    assert got.path.startswith(str(tmp_path / "child"))
    assert open(got.path, "rb").read() == open(want.path, "rb").read()
    assert export.result() is got  # waited for once
    export.close()


def test_a_failing_child_falls_back_to_the_builders_tokenizer(tmp_path, caplog):
    """Whatever stops the child, the builder exports its own tokenizer: through the
    fallback it was given, or by loading one, which raises the load error as usual."""
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    caplog.set_level(logging.WARNING, logger="hf_pipeline")
    with pytest.raises(ConfigError, match="encoder.model"):
        TokenizerExport(EncoderConfig(model=str(broken)), tmp_path / "a").result()
    assert "tokenizer export child exited 1" in caplog.text

    calls = []

    def fallback():
        calls.append(1)
        return CaptionTokenizer(EncoderConfig())

    export = TokenizerExport(EncoderConfig(), tmp_path / "b", fallback=fallback)
    export._proc.kill()  # e.g. the OOM killer
    spec = export.result()
    assert calls == [1] and open(spec.path).read().startswith("{")


def test_stale_export_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    from hf_pipeline.build import _tokenizer_export_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"hf_pipeline-tokenizer-{dead.pid}-abc"
    live = tmp_path / f"hf_pipeline-tokenizer-{os.getppid()}-def"
    other = tmp_path / "hf_pipeline-tokenizer-x"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{}")
    fresh = _tokenizer_export_dir()
    assert not stale.exists() and live.exists() and other.exists()
    assert fresh.is_dir() and fresh.name.startswith(f"hf_pipeline-tokenizer-{os.getpid()}-")


def test_a_build_with_the_export_child_gives_the_same_cache(tmp_path, monkeypatch):
    """With CPUs to spare the build's workers tokenize with the child's spec: same cache as
    a build that exports in the builder (fingerprint, captions, embeddings), and the
    child's folder is gone afterwards."""
    import hf_pipeline.tokenizer_export as tokenizer_export
    from hf_pipeline.build import prepare_cache
    from hf_pipeline.cache import open_dataset
    from tests.test_build import _tiny_config, _write_clean_inputs

    data = tmp_path / "data"
    _write_clean_inputs(data, ["float32", "float32", "float32"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    waited = []
    result = TokenizerExport.result
    monkeypatch.setattr(TokenizerExport, "result", lambda self: waited.append(1) or result(self))

    monkeypatch.setattr(tokenizer_export, "MIN_CPUS", 1)
    child = prepare_cache(_tiny_config(data, tmp_path / "c1"), progress=False)
    assert waited  # the workers got the child's spec
    monkeypatch.setattr(tokenizer_export, "MIN_CPUS", 10**6)
    waited.clear()
    builder = prepare_cache(_tiny_config(data, tmp_path / "c2"), progress=False)
    assert not waited

    assert child.fingerprint == builder.fingerprint
    a, b = open_dataset(child.layout), open_dataset(builder.layout)
    assert len(a) == 18 and a["caption"] == b["caption"] and a["input_ids"] == b["input_ids"]
    np.testing.assert_array_equal(np.asarray(a["embedding"]), np.asarray(b["embedding"]))
    assert not list(tmp.glob("hf_pipeline-tokenizer-*"))
