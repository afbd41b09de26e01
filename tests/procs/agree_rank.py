"""One rank of the agreement step alone (no build): ``agree_rank.py OVERRIDE...``.

Detects its rank from the launcher's variables, finds the job's store as
``prepare_cache`` does, agrees on the config and a fingerprint (``--fingerprint``), and
prints ``{"store": <type or null>}``; a disagreement exits as the CLI does (2, one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dist.env import EnvironmentConflictError, detect  # noqa: E402
from hf_pipeline.build import prepare as build  # noqa: E402
from hf_pipeline.config import load_config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fingerprint", default="fp")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(None, args.overrides)
    process = detect()
    store = build._agreement_store(cfg, process)
    try:
        if store is not None:
            build._agree(cfg, process, store)
            build._agree(cfg, process, store, fingerprint=args.fingerprint)
    except EnvironmentConflictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"store": None if store is None else type(store).__name__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
