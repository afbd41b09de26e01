"""README and docs are the contract: their Python examples run as written (on the small demo).

README's example and the guides' code blocks run in one namespace, in reading order (a
guide may use what an earlier one made: ``cfg``, ``built``, ``source``).
"""

from __future__ import annotations

import re

from tests.conftest import REPO, SMALL_DEMO

#: The pages whose ``python`` blocks run, in order.
PAGES = (
    "README.md",
    "docs/guides/jax.md",
    "docs/guides/torch.md",
    "docs/guides/lightning.md",
    "docs/guides/grain.md",
)


def _python_blocks(page: str) -> list[str]:
    text = (REPO / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_every_page_has_examples():
    for page in PAGES:
        assert _python_blocks(page), page


def test_readme_and_docs_python_examples_run(small_config, built_cache, monkeypatch, tmp_path):
    import tempfile

    import hf_pipeline

    # The examples' temporary folders (the Lightning run's checkpoints, ~38 MB) go to
    # this test's folder, never left behind in the system's /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    real = hf_pipeline.load_config
    # Same code, the small demo and the session's cache root instead of the full demo.
    monkeypatch.setattr(
        hf_pipeline,
        "load_config",
        lambda path=None, overrides=(), environ=None: real(
            path, [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}"], environ={}
        ),
    )
    namespace: dict = {}
    for page in PAGES:
        for block in _python_blocks(page):
            exec(compile(block, page, "exec"), namespace)  # noqa: S102
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
