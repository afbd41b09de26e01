"""A process that streams with worker processes (``loader.stream_workers``) and never
stops: tests/test_stream_workers.py kills it (SIGKILL) or interrupts it (SIGINT) and
checks its workers go with it.

Prints one JSON line once the first batch arrived: its workers' pids. Config as
``--set`` overrides after the script name; ``HF_PIPELINE_STREAM_FROM`` names the cache.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from hf_pipeline.config import load_config
    from hf_pipeline.read.loader import Loader
    from hf_pipeline.read.stream import open_stream

    cfg = load_config(None, sys.argv[1:])
    with (
        open_stream(cfg.loader, cfg.data) as source,
        Loader.from_config(source, cfg.loader, process_index=0, process_count=1) as loader,
    ):
        said = False
        for _ in loader.epochs(None):
            if not said:
                print(json.dumps({"pids": source.pids}), flush=True)
                said = True
            time.sleep(0.05)


if __name__ == "__main__":
    main()
