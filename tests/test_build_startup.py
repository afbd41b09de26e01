"""A build's start-up and end in a fresh process (issue 28): what the join's first shard
waits on, read from the build's own timeline (hf_pipeline.build.startup), and how soon
the process is gone once its report is out."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env
from tests.helpers.fresh_builds import minilm_copy


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


# slow: two fresh-process builds and a reference interpreter (about 45 CPU-s).
@pytest.mark.slow
def test_fresh_process_starts_workers_and_encoder_first(tmp_path):
    """Two fresh-process builds (scripts/prebuild_cache.py): in both, the workers' fork
    server starts before the inputs are listed, the main thread has imported what the
    loading thread imports before that thread starts, and the join starts after. Then the process exits without the interpreter's
    shut-down: its exit after the report line takes a small share of what a fresh
    interpreter with the same libraries takes to shut down (measured in this test).

    The first build is MiniLM's on a cold root: its tokenizer is read from the model
    folder (hf_pipeline.encoder.bert_tokenizer) and its model loads natively: nothing
    imports transformers. The second is a copy of MiniLM whose tokenizer class the
    native path leaves to transformers: transformers is imported off the main thread.

    On the code before issue 28 the report had no start-up timeline and the exit took
    seconds; before the join's start gated the encoder's loading, its tokenizer and
    model loaded beside the caption table and the pool's start (no ``encoder_loading``,
    ``transformers`` imported on the main thread before the thread started)."""
    root = tmp_path / "cache"
    copy = minilm_copy(tmp_path / "model", tokenizer_class="DistilBertTokenizer")
    gaps = []
    for i, model in ((1, []), (2, [f"encoder.model={copy}"])):
        _, lines, gone = _timed_run([
            str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root), "-q",
            *_sets([*SMALL_DEMO, f"name=startup{i}", f"data.demo.seed={i}", *model]),
        ])  # fmt: skip
        assert any(line.startswith("rows ") for line in lines), lines
        gaps.append(gone)
    first, second = (_report(root, f"startup{i}")["startup"] for i in (1, 2))
    for s in (first, second):
        t = s["seconds"]
        assert t["workers_starting"] < t["identity"] < t["imports"] <= t["join_map"], t
        assert t["imports"] < t["tokenizer"] < t["encoder"], t
        assert t["join_map"] < t["first_shard"], t
        # The join does not wait for the model: its loading begins once the join started.
        assert t["join_map"] <= t["encoder_loading"], t
        assert s["notes"]["encoder_backend"] == "native", s["notes"]  # MiniLM: a plain BERT
    # The first: nothing imports transformers, nothing waits for it.
    assert "transformers" not in first["seconds"], first
    assert first["notes"]["tokenizer"] == "native", first["notes"]
    # The second loads the tokenizer with transformers: transformers itself is imported
    # off the main thread, and the join's first use of datasets waits for it
    # (race-free). Whether the first shard starts before the encoder is ready is a
    # matter of speed (on a loaded VM the native model was ready 35 ms before it): the
    # join not waiting for the model is `join_map <= encoder_loading`, above.
    t = second["seconds"]
    assert t["imports"] < t["transformers"] <= t["first_shard"], t
    assert t["encoder_loading"] < t["tokenizer"], t  # the loading thread's
    assert second["notes"]["tokenizer"] == "transformers", second["notes"]

    # The reference: a fresh interpreter with the build's heavy libraries, ending
    # through the interpreter's own shut-down.
    _, _, reference = _timed_run([
        "-c", "import datasets, torch, transformers.modeling_utils; print('ready', flush=True)",
    ])  # fmt: skip
    assert max(gaps) < reference / 4, (gaps, reference)


def test_timeline_runs_a_callback_once_at_the_first_mark():
    """StartupTimeline.when: a callback waits for its event's first mark (later marks
    of the name do not run it again), and runs at once for an event marked already."""
    from hf_pipeline.build.startup import StartupTimeline

    timeline, ran = StartupTimeline(), []
    timeline.when("join_map", lambda: ran.append(("join_map", timeline.at("join_map"))))
    assert ran == []
    timeline.mark("identity")
    assert ran == []
    timeline.mark("join_map", at=123.0)
    timeline.mark("join_map", at=456.0)
    assert ran == [("join_map", 123.0)]  # after the stamp, once
    timeline.when("identity", lambda: ran.append(("identity", None)))
    assert ran[-1] == ("identity", None)


def test_encoder_loading_left_before_the_join_loads_nothing(tmp_path):
    """A build that ends (or fails) before its join started does not wait for a model:
    leaving the loading block cancels the tokenizer and the model; transformers'
    import, already under way, ends (the fence after it does not hang). (A copy of
    MiniLM whose tokenizer the build loads through transformers: MiniLM's own imports
    none.)"""
    from concurrent.futures import CancelledError

    import pytest

    from hf_pipeline.build.prepare import _EncoderLoading
    from hf_pipeline.build.startup import StartupTimeline
    from hf_pipeline.config import load_config

    copy = minilm_copy(tmp_path / "model", tokenizer_class="DistilBertTokenizer")
    overrides = [f"build.cache_dir={tmp_path}", "encoder.device=cpu", f"encoder.model={copy}"]
    cfg = load_config(None, overrides, environ={})
    timeline = StartupTimeline()
    with _EncoderLoading(cfg, None, timeline=timeline, after="join_map") as loading:
        pass
    t = timeline.as_dict()["seconds"]
    assert "imports" in t and "transformers" in t, t
    assert "encoder_loading" not in t and "tokenizer" not in t, t
    with pytest.raises(CancelledError):
        loading.tokenizer.result(timeout=60)


_IMPORT_AUDIT = """
import json, sys, threading

first = {}  # module -> the thread that imported it first (find_spec: not yet imported)


class _FirstImports:
    def find_spec(self, name, path=None, target=None):
        first.setdefault(name, threading.current_thread().name)
        return None  # the usual finders import it


sys.meta_path.insert(0, _FirstImports())

if __name__ == "__main__":
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    prepare_cache(load_config(None, sys.argv[1:]), progress=False)
    print(json.dumps(first))
"""


# slow: one fresh-process build (about 20 CPU-s).
@pytest.mark.slow
def test_shared_libraries_are_first_imported_on_the_main_thread(tmp_path):
    """In a fresh process, torch, ``torch.distributed`` and ``datasets`` (what the main
    thread and the build's threads both use) are first imported by the main thread,
    never by the encoder's loading thread or another of the build's threads: a
    thread's import in progress leaves a partial module where another thread looks
    (issue 28: ``partially initialized module 'torch.distributed' has no attribute
    'is_available'`` on a 4xH200 host). A guard, not seen failing: with
    ``_import_before_threads``' imports left out it still passed, because the main
    thread imports ``datasets`` (its progress-bar switch) and torch (the encoder's
    identity) before any of the build's threads starts; it fails once one of the
    build's threads imports one of them first."""
    script = tmp_path / "audit.py"
    script.write_text(_IMPORT_AUDIT)
    r = subprocess.run(
        [PYTHON, str(script), *SMALL_DEMO, f"build.cache_dir={tmp_path / 'c'}"],
        capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout.strip().splitlines()[-1])
    # safetensors and the native BERT: the main thread decides whether the model loads
    # natively (hf_pipeline.encoder.model.native_model) before any thread starts.
    names = ("torch", "torch.distributed", "datasets", "safetensors", "hf_pipeline.encoder.bert")
    shared = {m: first.get(m) for m in names}
    assert shared == dict.fromkeys(shared, "MainThread"), shared
    assert "tokenizers" in first, "the build loaded no tokenizer: the audit saw nothing"
