"""README is the contract: its Python examples run as written (on the small demo)."""

from __future__ import annotations

import re

from tests.conftest import REPO, SMALL_DEMO


def _python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_run(small_config, built_cache, monkeypatch, tmp_path):
    import tempfile

    blocks = _python_blocks()
    assert len(blocks) >= 2
    import hf_pipeline

    # The examples' temporary folders (the Lightning run's checkpoints, ~38 MB) go to
    # this test's folder, never left behind in the system's /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    real = hf_pipeline.load_config
    # Same code, the small demo and the session's cache root instead of the full demo.
    monkeypatch.setattr(
        hf_pipeline, "load_config",
        lambda path=None, overrides=(), environ=None: real(
            path, [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}"], environ={}
        ),
    )
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["built"].fingerprint == built_cache.fingerprint
    assert namespace["emb"].shape == (16, 384)
    assert tuple(namespace["latents"].shape) == (64, 4, 32, 32)  # the torch example's batch
    assert namespace["state"]["step"] == 10
    # Lightning: fit to step 10 with a checkpoint at 5, then resumed from it to 10.
    assert namespace["resumed"].global_step == 10
    assert namespace["run_dir"].startswith(str(tmp_path))
    # Grain: per-record and global-batch paths give Loader-shaped batches.
    assert namespace["first"]["latents"].shape == (16, 4, 32, 32)
    assert namespace["sixth"]["keys"].shape == (16,)
    assert namespace["step_batch"]["keys"].shape == (16,)
