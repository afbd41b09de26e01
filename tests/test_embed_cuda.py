"""``encoder.compile: graphs`` on a GPU: eager kernels replayed from CUDA graphs, one
captured per micro-batch shape. Skipped without CUDA (CI has none); run on a GPU host:
``pytest tests/test_embed_cuda.py``. The model is a random-weight BERT of MiniLM's shape
with a small vocabulary, made here (no download)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TextEncoder, warm_up_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WORDS = [f"w{i}" for i in range(500)]
#: 1 to 70 words: both padded widths of max_length 64 (32, 64), truncated rows among them.
TEXTS = [" ".join(WORDS[(7 * i + j) % 500] for j in range(1 + i % 70)) for i in range(3000)]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    # The vocabulary itself: transformers 5 ignores vocab_file= (every word was [UNK]).
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=384, num_hidden_layers=6,
        num_attention_heads=12, intermediate_size=1536,
    )  # fmt: skip
    BertModel(config).save_pretrained(folder)
    return folder


def _encoder(folder, compile_mode: str, dtype: str) -> TextEncoder:
    return TextEncoder(
        EncoderConfig(
            model=str(folder),
            device="cuda",
            dtype=dtype,
            compile=compile_mode,
            tokens_per_batch=8192,
            micro_batch_size=4096,
        )  # fmt: skip
    )


def _captured(enc: TextEncoder) -> int:
    return len(enc._forward) + len(enc._forward_unmasked)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_graphs_give_the_eager_embeddings_and_capture_each_shape_once_as_it_comes(
    bert_dir, dtype, atol
):
    import pyarrow as pa

    eager = _encoder(bert_dir, "eager", dtype)
    graphs = _encoder(bert_dir, "graphs", dtype)
    assert graphs.compile_mode == "graphs"
    graphs.warm_up()  # each width (masked or not) at its smallest row count, as eager
    warmed = warm_up_ids(graphs.cfg, 0, full_batches=True, every_bucket=False)
    assert _captured(graphs) == len(warmed) == 4
    ref = eager.encode(TEXTS)
    # Many micro-batches of every shape kind, one after another: each replay's output
    # is copied before the next replay (of any graph in the shared pool) overwrites it.
    np.testing.assert_allclose(graphs.encode(TEXTS), ref, atol=atol)
    np.testing.assert_allclose(graphs.encode(TEXTS[::-3]), ref[::-3], atol=atol)
    # Rows that fill their width run unmasked (BERT), with and without filler rows.
    full = pa.array([[5 + i] * n for i, n in enumerate([32, 64, 64, 5, 64])], pa.list_(pa.int32()))
    np.testing.assert_allclose(graphs.encode_ids(full), eager.encode_ids(full), atol=atol)
    # Each shape is captured once: the same calls again replay what is there.
    shapes = _captured(graphs)
    assert shapes > len(warmed)
    np.testing.assert_allclose(graphs.encode(TEXTS), ref, atol=atol)
    # The build embeds on another thread than the one that warmed up.
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(graphs.encode, TEXTS).result()
    np.testing.assert_allclose(got, ref, atol=atol)
    assert _captured(graphs) == shapes


def test_a_shape_first_seen_after_the_warm_up_is_captured_where_it_comes(bert_dir):
    """Without a warm-up, the embedding thread captures (after a run outside the capture
    that makes its cuBLAS handle), while another thread waits on an earlier call's event
    (the capture does not wait for the device: the earlier call may still run)."""
    graphs = _encoder(bert_dir, "graphs", "float32")
    eager = _encoder(bert_dir, "eager", "float32")
    first = graphs.submit_ids(_ids(graphs, TEXTS[:50]))
    waiter = threading.Thread(target=first.result)
    with ThreadPoolExecutor(1) as pool:
        waiter.start()
        got = pool.submit(graphs.encode, TEXTS[50:400]).result()
    waiter.join()
    np.testing.assert_allclose(got, eager.encode(TEXTS[50:400]), atol=1e-5)
    np.testing.assert_allclose(first.result(), eager.encode(TEXTS[:50]), atol=1e-5)
    assert _captured(graphs) > 0


def _ids(enc: TextEncoder, texts):
    import pyarrow as pa

    return pa.array(enc.tokenizer(texts), type=pa.list_(pa.int32()))


def test_a_forward_that_cannot_be_captured_runs_eager_with_one_warning(caplog):
    """A forward that waits for the device (``.item()``) cannot be recorded: the calls
    run it eager, with the same results, and the reason is logged once."""
    import logging

    from hf_pipeline.encoder.model import CapturedGraphs

    def forward(x):
        return x * float(x.sum().item()) + 1  # the host reads a result: no capture

    graphs = CapturedGraphs(forward, torch.cuda.graph_pool_handle())
    x = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        for k in range(3):
            torch.testing.assert_close(graphs(x + k), forward(x + k))
    assert len(graphs) == 0 and graphs.eager_because
    warned = [r for r in caplog.records if "cannot be captured" in r.getMessage()]
    assert len(warned) == 1
    # The device is fine afterwards: another function captures and replays.
    ok = CapturedGraphs(lambda t: t * 2, torch.cuda.graph_pool_handle())
    torch.testing.assert_close(ok(x).clone(), x * 2)
    assert len(ok) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_rank_given_gpu_1_never_opens_a_context_on_gpu_0_not_even_at_exit(bert_dir):
    """Issue 28: ranks 1-3 of `compile: graphs` builds opened a ~520 MiB context on GPU 0
    while exiting (CUDA graphs released from the main thread, whose device was 0). The
    process given GPU 1 is watched (NVML) while it runs and while it shuts down."""
    import subprocess
    import sys
    import time

    import pynvml

    from tests.conftest import REPO, script_env

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1)]

    def gpus_of(pid: int) -> set[int]:
        held = set()
        for i, h in enumerate(handles):
            if any(p.pid == pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)):
                held.add(i)
        return held

    p = subprocess.Popen(
        [sys.executable, str(REPO / "tests/procs/gpu_owner.py"), "1", str(bert_dir)],
        env=script_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        running = gpus_of(p.pid)
        if 1 not in running:
            pytest.skip("NVML does not list this host's processes (a container?)")
        seen = set(running)
        p.stdin.write("\n")
        p.stdin.flush()
        while p.poll() is None:  # the shut-down: where GPU 0 was touched
            seen |= gpus_of(p.pid)
            time.sleep(0.005)
    finally:
        p.kill()
        p.wait(timeout=60)
    assert seen == {1}, f"the process held contexts on GPUs {sorted(seen)}"
