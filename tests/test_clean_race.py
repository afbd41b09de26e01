"""A stored unit that ``hf-pipeline clean`` (or a person) removes in the instant after a
starting build found it, before the build took it up: the build makes it again and
says so, instead of failing on a missing file (the caption table: exit 2, as if the
input were bad) or calling the part damaged. An outside tester ran ``clean`` while a
build started and hit both (docs/operations.md: run ``clean`` when no build is starting).

The removal is made at that instant in a real build process: the script below wraps the
coordinator's calls so that the unit's folder is removed right after the build found
it (what ``clean`` does, at the one moment a test cannot otherwise hit).
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.conftest import PYTHON, SMALL_DEMO, script_env

_SCRIPT = textwrap.dedent(
    """
    import json, logging, shutil, sys
    from pathlib import Path

    import dist.coordinator as coordinator
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    root, what, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    base = [f"build.cache_dir={root}", *overrides]
    first = prepare_cache(load_config(None, base), progress=False)
    removed = []
    if what == "captions":
        real = coordinator.ensure_built

        def ensure_built(cache_dir, fingerprint, stages, **kw):
            out = real(cache_dir, fingerprint, stages, **kw)
            if Path(cache_dir).name.startswith("captions-") and not removed:
                removed.append(str(cache_dir))
                shutil.rmtree(cache_dir)  # what clean removes: the whole unit
            return out

        coordinator.ensure_built = ensure_built
    else:
        real = coordinator.retire_damaged

        def retire_damaged(cache_dir, fingerprint, stage):
            if stage == "join" and not removed:
                removed.append(str(cache_dir))
                shutil.rmtree(cache_dir)
            return real(cache_dir, fingerprint, stage)

        coordinator.retire_damaged = retire_damaged
    # Another encoder setting: the caption table and the joins are found, then removed.
    second = prepare_cache(load_config(None, [*base, "encoder.max_length=16"]), progress=False)
    print(json.dumps({"removed": removed, "built": second.built,
                      "rows": second.report["rows_out"], "first_rows": first.report["rows_out"],
                      "reuse": second.report.get("reuse")}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["captions", "join"])
def test_a_unit_removed_after_the_build_found_it_is_built_again(tmp_path, what):
    proc = subprocess.run(
        [PYTHON, "-c", _SCRIPT, str(tmp_path / "cache"), what, json.dumps(SMALL_DEMO)],
        capture_output=True, text=True, timeout=600, env=script_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["removed"]) == 1, out
    assert out["built"] and out["rows"] == out["first_rows"], out
    if what == "captions":
        assert "the caption table" in proc.stderr and "was removed while this build ran" in (
            proc.stderr
        ), proc.stderr[-3000:]
    else:
        assert out["reuse"]["joins_built"] >= 1, out
        assert "was removed while this build ran" in proc.stderr, proc.stderr[-3000:]
        assert "is damaged" not in proc.stderr, proc.stderr[-3000:]
