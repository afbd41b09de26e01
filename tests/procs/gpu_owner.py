"""A process given ``cuda:N`` as a rank of ``build.parallel: ranks`` is: its main thread's
device is made the rank's own as the build does (``prepare._own_device``), the encoder
(``encoder.compile: graphs``) is built and run on other threads, as the build's loading
and embedding threads do, then the process ends through the interpreter's own
shut-down (a library caller's: no ``os._exit``), which releases the CUDA graphs.

``gpu_owner.py N MODEL_DIR`` prints ``ready`` once the encoder ran, then waits for a line on
standard input before it exits (the parent watches which GPUs it holds meanwhile).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from hf_pipeline.build.prepare import _own_device
    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import TextEncoder

    device = f"cuda:{int(sys.argv[1])}"
    _own_device(device)
    cfg = EncoderConfig(model=sys.argv[2], device=device, dtype="float16", compile="graphs")
    with ThreadPoolExecutor(1) as loading:
        enc = loading.submit(lambda: TextEncoder(cfg)).result()
        loading.submit(enc.warm_up).result()
    with ThreadPoolExecutor(1) as embedding:
        embedding.submit(enc.encode, ["w1 w2", "w3 w4 w5 w6"] * 100).result()
    print("ready", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
