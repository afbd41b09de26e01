"""A build's start-up and end in a fresh process (issue 28): what the join's first shard
waits on, read from the build's own timeline (hf_pipeline.build.startup), and how soon
the process is gone once its report is out; the kept tokenizer exports
(hf_pipeline.encoder.model.ExportedTokenizers) it starts from."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def _timed_run(args: list[str]) -> tuple[int, list[str], float]:
    """Run ``args`` with Python; its exit code, stdout lines, and the seconds between
    its last line of output and its exit."""
    p = subprocess.Popen(
        [PYTHON, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=script_env(), cwd=REPO,
    )  # fmt: skip
    lines, last = [], time.monotonic()
    assert p.stdout is not None
    for line in p.stdout:  # ends at EOF: the process closed stdout (exited)
        lines.append(line.rstrip("\n"))
        last = time.monotonic()
    gone = time.monotonic() - last
    err = p.stderr.read() if p.stderr else ""
    code = p.wait(timeout=60)
    assert code == 0, err
    return code, lines, gone


def _report(cache_root: Path, name: str) -> dict:
    (report,) = cache_root.glob(f"{name}-*/filtered.*/report.json")
    return json.loads(report.read_text())


def test_fresh_process_starts_workers_first_and_tokenizes_from_the_kept_export(tmp_path):
    """Two fresh-process builds of the same encoder (scripts/prebuild_cache.py): the
    first exports the workers' tokenizer from transformers' (its first shard waited for
    that), the second starts its workers from the kept export without waiting for
    transformers' tokenizer; in both, the workers' fork server starts before the
    inputs are listed and the main thread has imported what the loading thread imports
    before that thread starts. Then the process exits without the interpreter's
    shut-down: its exit after the report line takes a small share of what a fresh
    interpreter with the same libraries takes to shut down (measured in this test).

    On the code before issue 28 the report had no start-up timeline, the first shard
    waited for the tokenizer in every build, and the exit took seconds."""
    root = tmp_path / "cache"
    gaps = []
    for i in (1, 2):
        _, lines, gone = _timed_run([
            str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root), "-q",
            *_sets([*SMALL_DEMO, f"name=startup{i}", f"data.demo.seed={i}"]),
        ])  # fmt: skip
        assert any(line.startswith("rows ") for line in lines), lines
        gaps.append(gone)
    first, second = (_report(root, f"startup{i}")["startup"] for i in (1, 2))
    for s in (first, second):
        t = s["seconds"]
        assert t["workers_starting"] < t["identity"] < t["imports"] <= t["join_map"], t
        assert t["imports"] < t["tokenizer"] < t["encoder"], t  # the loading thread's
        assert t["join_map"] <= t["worker_tokenizer"] <= t["first_shard"], t
    assert first["notes"]["worker_tokenizer"] == "exported"
    assert first["seconds"]["worker_tokenizer"] >= first["seconds"]["tokenizer"]
    assert second["notes"]["worker_tokenizer"] == "kept"
    assert len(list((root / ".tokenizers").iterdir())) == 1  # one encoder, one export

    # The reference: a fresh interpreter with the build's heavy libraries, ending
    # through the interpreter's own shut-down.
    _, _, reference = _timed_run([
        "-c", "import datasets, torch, transformers.modeling_utils; print('ready', flush=True)",
    ])  # fmt: skip
    assert max(gaps) < reference / 4, (gaps, reference)


def test_kept_export_is_the_tokenizers_own_and_a_tampered_one_is_absent(tmp_path):
    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import (
        CaptionTokenizer,
        ExportedTokenizers,
        WorkerTokenizer,
        encoder_identity,
        exported_tokenizer_key,
    )

    cfg = EncoderConfig(max_length=16)
    tok = CaptionTokenizer(cfg)
    kept = ExportedTokenizers(tmp_path / "kept")
    key = exported_tokenizer_key(encoder_identity(cfg))
    assert kept.load(key, max_length=16) is None
    spec = tok.export(tmp_path / "own")
    assert spec is not None
    kept.save(key, spec)
    kept.save(key, spec)  # a second writer: the first entry stays
    loaded = kept.load(key, max_length=16)
    assert loaded is not None and ExportedTokenizers.matches(loaded, tok)
    texts = ["a cat on a mat", "x" * 500, ""]
    assert WorkerTokenizer(loaded)(texts) == tok(texts)
    assert kept.load(key, max_length=32) is None  # another max_length: not this one
    # Another encoder identity, another key (and another tokenizers version would too).
    assert exported_tokenizer_key({**encoder_identity(cfg), "revision": "x"}) != key

    path = Path(loaded.path)
    path.write_text(path.read_text().replace('"[CLS]"', '"[CLX]"', 1))
    assert kept.load(key, max_length=16) is None  # not its checksum: absent
    (path.parent / "spec.json").write_text("{not json")
    assert kept.load(key, max_length=16) is None


@pytest.mark.parametrize("bad", [{"max_length": 0}, {"direction": "up"}, {"version": 99}])
def test_a_kept_spec_out_of_range_is_absent(tmp_path, bad):
    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import CaptionTokenizer, ExportedTokenizers

    tok = CaptionTokenizer(EncoderConfig(max_length=16))
    kept = ExportedTokenizers(tmp_path)
    kept.save("k", tok.export(tmp_path / "own"))
    meta_path = tmp_path / "k" / "spec.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, **bad}))
    assert kept.load("k", max_length=bad.get("max_length", 16)) is None
