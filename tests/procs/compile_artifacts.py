"""One process that compiles a small encoder on the CPU (``encoder.compile: default``)
through a shared :class:`hf_pipeline.encoder.model.CompileArtifacts` folder, as a rank's
encoder does in a build.

``compile_artifacts.py MODEL_DIR SHARED_DIR`` prints one JSON line: whether it
loaded the shared artifacts or published its own, the seconds of its first call (the
compile), and torch's cache counters. Run it with a ``TORCHINDUCTOR_CACHE_DIR`` of its
own: another host's (or rank's) local caches, which only the shared folder links.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import pyarrow as pa
    from torch._dynamo.utils import counters

    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import CompileArtifacts, TextEncoder, compile_artifacts_key

    folder, shared_dir = sys.argv[1], sys.argv[2]
    cfg = EncoderConfig(model=folder, device="cpu", compile="default", max_length=16)
    enc = TextEncoder(cfg)
    key = compile_artifacts_key(cfg, {"model": folder}, "cpu", backend=enc.backend)
    shared = CompileArtifacts(shared_dir, key, wait_s=0)
    loaded = shared.load()
    ids = pa.array([[2, 5 + i % 7, 6, 3] for i in range(8)], type=pa.list_(pa.int32()))
    t0 = time.monotonic()
    out = enc.encode_ids(ids)
    first_call = time.monotonic() - t0
    published = False if loaded else shared.save()
    print(json.dumps({
        "loaded": loaded, "published": published, "first_call_s": round(first_call, 3),
        "inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
        "embedding": out[0].tolist(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
