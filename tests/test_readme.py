"""README and docs are the contract: their Python examples run as written (on the small demo).

README's example and the guides' code blocks run in one namespace, in reading order (a
guide may use what an earlier one made: ``cfg``, ``built``, ``source``).
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, SMALL_DEMO

#: The pages whose ``python`` blocks run, in order.
PAGES = (
    "README.md",
    "docs/guides/jax.md",
    "docs/guides/torch.md",
    "docs/guides/lightning.md",
    "docs/guides/grain.md",
    "docs/guides/datasets.md",
)


def _python_blocks(page: str) -> list[str]:
    text = (REPO / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_every_page_has_examples():
    for page in PAGES:
        assert _python_blocks(page), page


def test_examples_that_build_are_under_a_main_guard():
    """An example that calls ``prepare_cache`` runs as a user's script: the build's
    worker processes import that script, so without the guard a copy pasted into a file
    failed (a tester: README's loop, ``RuntimeError`` alone and under two ranks a JAX
    abort). Each such block has the guard before its first ``prepare_cache`` call."""
    pages = ["README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))]
    for page in pages:
        for block in _python_blocks(page):
            if "prepare_cache(" not in block:
                continue
            guard = block.find('if __name__ == "__main__":')
            assert 0 <= guard < block.index("prepare_cache("), (page, block[:400])


@pytest.mark.slow
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
    # The guides read the built demo cache's folder from DEMO_CACHE.
    monkeypatch.setenv("DEMO_CACHE", str(built_cache.cache_dir))
    namespace: dict = {}
    for page in PAGES:
        # README's, the JAX guide's and the Grain guide's examples are scripts under a
        # main guard (the build's workers and Grain's re-import them): run as the main
        # module, as a user runs them.
        as_main = page in ("README.md", "docs/guides/jax.md", "docs/guides/grain.md")
        namespace["__name__"] = "__main__" if as_main else "docs_example"
        for block in _python_blocks(page):
            exec(compile(block, page, "exec"), namespace)  # noqa: S102
        if page.endswith("lightning.md"):
            # Its blocks are scripts with a main guard (DDP re-runs the file; the DDP run
            # itself is tests/test_lightning.py's): run the last one, the resume example.
            namespace["main"]()
            runs = list(tmp_path.glob("latent-run-*/epoch=0-step=*.ckpt"))
            assert {p.name for p in runs} == {"epoch=0-step=5.ckpt", "epoch=0-step=10.ckpt"}
    assert namespace["built"].fingerprint == built_cache.fingerprint
    assert namespace["emb"].shape == (16, 384)
    assert tuple(namespace["latents"].shape) == (16, 4, 32, 32)  # the torch example's batch
    assert namespace["sample"]["latents"].ndim == 3  # TorchSamples: one sample
    assert namespace["state"]["step"] == 10
    # Grain: per-record and global-batch paths give Loader-shaped batches.
    assert namespace["first"]["latents"].shape == (16, 4, 32, 32)
    assert namespace["sixth"]["keys"].shape == (16,)
    assert namespace["step_batch"]["keys"].shape == (16,)
    # Plain datasets: float latents in every format.
    assert namespace["values"].shape[0] == 4
    assert str(namespace["torch_ds"][0]["latents"].dtype).startswith("torch.float")


@pytest.mark.slow
def test_grain_dataloader_example_runs_as_a_script_and_exits_quietly(
    small_config, built_cache, tmp_path
):
    """The Grain guide's first example, run as the user runs it (``python example.py``:
    2 worker processes that re-import the file) exits 0 without a traceback: its
    iterators and the workers' shared-memory batches end before the interpreter does."""
    import subprocess

    from tests.conftest import PYTHON, script_env

    block = _python_blocks("docs/guides/grain.md")[0]
    assert 'if __name__ == "__main__":' in block  # the guard is in the example itself
    # Same code on the small demo and the session's cache root (as the test above).
    overrides = [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}"]
    assert block.count('load_config("demo")') == 1
    block = block.replace('load_config("demo")', f'load_config("demo", {overrides!r})')
    block += '\n    print("sixth", sixth["keys"].shape, first["latents"].shape)\n'
    script = tmp_path / "grain_example.py"
    script.write_text(block)
    p = subprocess.run(
        [PYTHON, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=script_env(),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert "sixth (16,) (16, 4, 32, 32)" in p.stdout, p.stdout
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr


def test_cli_docs_list_every_build_json_key():
    """docs/cli.md names the keys of ``build --json``: the ones the summary writes
    (``metadata`` was missing)."""
    from pathlib import Path

    from hf_pipeline.build.prepare import BuildResult

    report = {"rows_in": 0, "rows_out": 0, "dropped": {}, "duplicate_meta_rows": 0}
    keys = BuildResult(
        fingerprint="f", cache_dir=Path("c"), report=report, built=True, seconds=0.0
    ).summary()
    text = (REPO / "docs" / "cli.md").read_text()
    listed = re.search(r"writes `\{(.*?)\}`", text, re.S)
    assert listed, "docs/cli.md lost its build --json key list"
    assert sorted(re.findall(r'"(\w+)"', listed.group(1))) == sorted(keys)


def test_docs_torchrun_launches_of_training_fix_the_master_port():
    """One node, no --master-port: torchrun (2.x) serves its store on a random free
    port, and JAX's coordinator takes the next one (MASTER_PORT + 1), which may be in
    use: the documented launch failed now and then (outside tester). ``--standalone``
    picks a random port too; a chosen ``--master-port`` (or a multi-node rendezvous
    line, whose guide says the same) is what the docs launch with."""
    docs = REPO / "docs"
    lines = [
        (page.name, line)
        for page in sorted(docs.rglob("*.md"))
        if page.name != "changelog.md"
        for line in page.read_text().splitlines()
        if re.search(r"\btorchrun --", line) and re.search(r"train(\.py)?\b", line)
        and "--nnodes" not in line
    ]  # fmt: skip
    assert len(lines) >= 3, lines
    missing = [(name, line) for name, line in lines if "--master-port" not in line]
    assert not missing, missing
