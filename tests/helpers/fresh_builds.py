"""Fresh-process builds and what they stored, for the tokenizer tests
(``test_tokenizer_store``, ``test_bert_tokenizer``): a build in a new interpreter that
reports which transformers modules it imported and its start-up timeline, the token ids
and embeddings its parts stored, and copies of the MiniLM folder with a changed
tokenizer config."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np

from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env

_BUILD = """
import json, sys

from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.config import load_config

if __name__ == "__main__":
    result = prepare_cache(load_config(None, sys.argv[1:]), progress=False)
    print(json.dumps({
        "tokenizer_loaded": "transformers.models.auto.tokenization_auto" in sys.modules,
        "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
        "startup": result.report.get("startup"),
    }))
"""


def fresh_build(tmp_path: Path, root: Path, *overrides: str) -> dict:
    """Build the small demo on cache root ``root`` in a fresh interpreter; its
    ``tokenizer_loaded`` (transformers' AutoTokenizer module imported), ``transformers``
    (every transformers module imported) and ``startup`` (the report's timeline)."""
    script = tmp_path / "build.py"
    script.write_text(_BUILD)
    r = subprocess.run(
        [PYTHON, str(script), *SMALL_DEMO, f"build.cache_dir={root}", *overrides],
        capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def token_ids(root: Path) -> list:
    """Every stored token unit's ids under ``root``, in unit-name order."""
    import pyarrow as pa

    out = []
    for f in sorted(root.glob(".parts/tokens-*/*/tokens/data.arrow")):
        with pa.memory_map(str(f)) as source:
            out.append(pa.ipc.open_stream(source).read_all().column("input_ids").to_pylist())
    return out


def embeddings(root: Path) -> np.ndarray:
    """Every stored part's embeddings, in part order (one array)."""
    import pyarrow as pa

    out = []
    for f in sorted(root.glob(".parts/embed-*/*/embeddings/data.arrow")):
        with pa.memory_map(str(f)) as source:
            column = pa.ipc.open_stream(source).read_all().column("embedding")
            out.append(np.array(column.to_pylist(), dtype=np.float32))
    assert out, "no embeddings stored"
    return np.concatenate(out)


def fresh_start(root: Path) -> None:
    """Remove the caches and stored parts of ``root`` (the next build tokenizes and
    embeds every caption again), keeping its dot-folders (the tokenizer store)."""
    for old in root.iterdir():
        if not old.name.startswith(".") or old.name == ".parts":
            shutil.rmtree(old)


def minilm_copy(dest: Path, *, weights: bool = True, **tokenizer_config) -> Path:
    """A copy of the MiniLM folder at ``dest`` (its weights a symlink to the installed
    file, or left out), with ``tokenizer_config`` set in its ``tokenizer_config.json``
    (a value of None removes the key)."""
    from hf_pipeline.encoder.model import resolve_encoder_path

    src = Path(resolve_encoder_path("minilm"))
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    if weights:
        (dest / "model.safetensors").symlink_to(src / "model.safetensors")
    path = dest / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for name, value in tokenizer_config.items():
        if value is None:
            cfg.pop(name, None)
        else:
            cfg[name] = value
    path.write_text(json.dumps(cfg))
    return dest
