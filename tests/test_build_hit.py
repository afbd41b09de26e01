"""A cache found at start (an index hit, :func:`hf_pipeline.build.prepare.prepare_cache`
in a fresh process) builds nothing, so it imports nothing a build needs: not
``datasets`` (``pandas``, ``huggingface_hub`` with it), not the encoder's torch or
transformers. A build with ``progress=False`` leaves ``datasets``' bars as it found
them. Real processes: ``sys.modules`` of a fresh interpreter."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ANY_CACHE_SAMPLES_PER_SHARD, PYTHON, SMALL_DEMO, script_env

pytestmark = pytest.mark.slow

#: What a build imports and a hit must not (seconds of a start each).
_HEAVY = ("datasets", "pandas", "torch", "transformers", "jax", "sentence_transformers")

_CHILD = """
import json, sys
from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.config import load_config
res = prepare_cache(load_config(None, json.loads(sys.argv[1]), environ={}), progress=False)
out = {"built": res.built, "fingerprint": res.fingerprint,
       "heavy": sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)}
if "datasets" in sys.modules:
    from datasets.utils import is_progress_bar_enabled
    out["bars_after"] = is_progress_bar_enabled()
print(json.dumps(out))
"""


def _start(root) -> tuple[dict, str]:
    """``prepare_cache`` of the small demo in ``root`` in a fresh interpreter: what it
    returned and imported, and its stderr."""
    over = [*SMALL_DEMO, f"data.demo.samples_per_shard={ANY_CACHE_SAMPLES_PER_SHARD}",
            f"build.cache_dir={root}"]  # fmt: skip
    proc = subprocess.run(
        [PYTHON, "-c", _CHILD, json.dumps(over), json.dumps(_HEAVY)],
        env=script_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("hit") / "cache"
    return root, *_start(root)


def test_a_build_without_progress_leaves_the_datasets_bars_as_it_found_them(first):
    """The bars go off at the first build (no longer at the start), and back on after.
    (Whether they were off in between is not seen from outside: the build's maps show
    no bar either way, progress=True included.)"""
    _, out, _ = first
    assert out["built"], out
    assert "datasets" in out["heavy"], out  # a build maps with datasets
    assert out["bars_after"] is True, out


def test_a_cache_found_at_start_imports_no_datasets_torch_or_transformers(first):
    """A fresh process that finds the cache built: the same fingerprint, nothing built,
    and none of the libraries only a build uses in ``sys.modules``."""
    root, built, _ = first
    out, _ = _start(root)
    assert not out["built"] and out["fingerprint"] == built["fingerprint"], out
    assert out["heavy"] == [], out
