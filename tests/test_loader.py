"""loader: batches, exact and elastic resume, prefetch thread hygiene, JAX sharding."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import traceback

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_pipeline.config import LoaderConfig
from hf_pipeline.errors import ConfigError
from hf_pipeline.read.loader import Loader, LoaderOptions, loader_options
from hf_pipeline.read.mapped import SampleSource
from hf_pipeline.read.sampler import ORDER_VERSION, GlobalSampler, SamplerOptions
from tests.helpers.caches import build_cache, open_source
from tests.helpers.ports import free_port, free_port_pair

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeSource:
    """In-memory source: ``keys`` = sample id (row * 3 + crop), so sequences compare."""

    num_crops = 3

    def __init__(
        self, num_rows: int, fingerprint: str = "fake", fail_at: int | None = None, fail_row=None
    ):
        self.num_rows = num_rows
        self.fingerprint = fingerprint
        self.fail_at = fail_at
        self.fail_row = fail_row
        self.calls = 0

    def _explode(self):
        raise ValueError("boom from the producer")

    def gather(self, rows, crops):
        self.calls += 1
        rows = np.asarray(rows, dtype=np.int64)
        if self.fail_at is not None and self.calls > self.fail_at:
            self._explode()
        if self.fail_row is not None and self.fail_row in rows:
            self._explode()
        sample = rows * 3 + np.broadcast_to(np.asarray(crops, dtype=np.int64), rows.shape)
        return {
            "latents": np.broadcast_to(sample[:, None, None, None], (len(rows), 1, 2, 2)).astype(
                np.float16
            ),
            "embeddings": rows[:, None].astype(np.float32),
            "keys": sample,
        }


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("hf_pipeline-prefetch")]


def _keys(batches):
    return [np.asarray(b["keys"]).tolist() for b in batches]


def _run_with_timeout(fn, timeout=30.0):
    result, error = [], []

    def target():
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            error.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for {timeout}s"
    if error:
        raise error[0]
    return result[0]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    with open_source(tmp_path_factory.mktemp("loader_cache"), 240, fingerprint="fp-test") as src:
        yield src


@pytest.fixture(autouse=True)
def _no_thread_left():
    yield
    gc.collect()
    assert _prefetch_threads() == []


def test_batches_match_sampler_and_source(source):
    with Loader(source, global_batch_size=32, seed=5, process_index=1, process_count=2) as ld:
        assert ld.steps_per_epoch == 160 // 32
        assert ld.layout.per_process_batch == 16
        assert "process 1/2 gathers 16" in ld.layout.describe()
        batches = _run_with_timeout(lambda: list(ld))
        assert len(batches) == 5
        assert ld.state_dict()["epoch"] == 1 and ld.state_dict()["step"] == 0
        s = ld.sampler
        for step, b in enumerate(batches):
            pb = s.process_batch(0, step, 1, 2)
            ref = source.gather(pb.rows, pb.crops)
            assert b["latents"].shape == (16, 4, 32, 32)
            assert str(b["latents"].dtype) == "float16"
            np.testing.assert_array_equal(np.asarray(b["latents"]), ref["latents"])
            np.testing.assert_array_equal(np.asarray(b["embeddings"]), ref["embeddings"])
            np.testing.assert_array_equal(np.asarray(b["keys"]), ref["keys"])
        st_ = ld.stats()
        assert st_.batches == 5 and st_.samples == 80 and st_.samples_per_s > 0
        assert st_.mean_wait_s >= 0 and st_.queue_depth == 0


def test_epochs_and_infinite_iteration():
    with Loader(
        FakeSource(50), global_batch_size=8, seed=1, process_count=1, process_index=0
    ) as ld:
        spe = ld.steps_per_epoch
        assert spe == 6
        first = _run_with_timeout(lambda: _keys(ld))  # epoch 0
        second = _run_with_timeout(lambda: _keys(ld))  # epoch 1: iterating again continues
        assert len(first) == len(second) == spe and first != second
        ld.load_state_dict({**ld.state_dict(), "epoch": 0, "step": 0})
        both = _run_with_timeout(lambda: _keys(ld.epochs(2)))
        assert both == first + second
        ld.load_state_dict({**ld.state_dict(), "epoch": 0, "step": 0})
        many = _run_with_timeout(lambda: _keys(itertools.islice(ld.epochs(), 3 * spe + 2)))
        assert many[: 2 * spe] == first + second
        assert ld.state_dict()["epoch"] == 3 and ld.state_dict()["step"] == 2


def test_no_full_batch_is_refused_when_made():
    # Not an epoch of no batch (epochs(1) ended at once, silently): a UserError naming
    # the batch size and the rows (scripts turn it into one line, exit 2).
    with pytest.raises(
        ConfigError, match=r"global_batch_size \(8\) is larger .* 5 samples \(5 rows"
    ):
        Loader(FakeSource(5), global_batch_size=8, process_count=1, process_index=0)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(20, 120),
    g=st.sampled_from([4, 6, 8, 12]),
    stop=st.integers(0, 40),
    seed=st.integers(0, 100),
    shuffle=st.sampled_from(["global", "block", "sequential"]),
    crop=st.sampled_from(["random", "all", 1]),
    prefetch=st.integers(1, 4),
    threads=st.integers(1, 3),
)
def test_resume_at_random_step_equals_uninterrupted(
    n, g, stop, seed, shuffle, crop, prefetch, threads
):
    kw = dict(
        global_batch_size=g,
        seed=seed,
        shuffle=shuffle,
        crop=crop,
        block_size=5,
        num_threads=threads,
    )
    src = FakeSource(n)
    with Loader(src, process_index=0, process_count=1, prefetch=prefetch, **kw) as ld:
        total = 2 * ld.steps_per_epoch + 1
        full = _keys(itertools.islice(ld.epochs(), total))
    with Loader(src, process_index=0, process_count=1, prefetch=prefetch, **kw) as ld:
        head = _keys(itertools.islice(ld.epochs(), min(stop, total)))
        state = json.loads(json.dumps(ld.state_dict()))  # checkpoints go through JSON
    with Loader(src, process_index=0, process_count=1, **kw) as ld2:
        ld2.load_state_dict(state)
        tail = _keys(itertools.islice(ld2.epochs(), total - len(head)))
    assert head + tail == full


def _global_steps(loaders, k):
    """Drive W per-process loaders k steps; return the concatenated global batches."""
    its = [ld.epochs() for ld in loaders]
    out = []
    for _ in range(k):
        shares = [next(it)["keys"] for it in its]
        out.append(np.concatenate([np.asarray(s) for s in shares]).tolist())
    for it in its:
        it.close()
    return out


@pytest.mark.parametrize("partition", ["contiguous", "strided"])
def test_elastic_resume_4_2_3(partition):
    src = FakeSource(100)
    kw = dict(global_batch_size=12, seed=3, partition=partition)
    with Loader(src, process_index=0, process_count=1, **kw) as ld:
        full = _keys(itertools.islice(ld.epochs(), 20))
    got, state = [], None
    for w, k in ((4, 5), (2, 7), (3, 8)):
        loaders = [Loader(src, process_index=p, process_count=w, **kw) for p in range(w)]
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        got += _global_steps(loaders, k)
        states = [ld.state_dict() for ld in loaders]
        assert all(s == states[0] for s in states)
        state = states[0]
        for ld in loaders:
            ld.close()
    if partition == "contiguous":
        assert got == full
    else:  # strided: same global batches, rows ordered by rank inside each
        assert [sorted(b) for b in got] == [sorted(b) for b in full]


def test_state_mismatch_is_refused():
    src = FakeSource(100, fingerprint="a")
    with Loader(src, global_batch_size=8, process_index=0, process_count=1) as ld:
        state = ld.state_dict()
    with Loader(
        FakeSource(100, fingerprint="b"), global_batch_size=8, process_index=0, process_count=1
    ) as ld:
        with pytest.raises(ValueError, match="fingerprint"):
            ld.load_state_dict(state)
    with Loader(src, global_batch_size=16, process_index=0, process_count=1) as ld:
        with pytest.raises(ValueError, match="global_batch_size"):
            ld.load_state_dict(state)
    with Loader(src, global_batch_size=8, seed=1, process_index=0, process_count=1) as ld:
        with pytest.raises(ValueError, match="seed"):
            ld.load_state_dict(state)
        with pytest.raises(ValueError, match="out of range"):
            ld.load_state_dict({**state, "seed": 1, "step": 99})
        with pytest.raises(ValueError, match="not a loader state"):
            ld.load_state_dict({"foo": 1})
    # The order's version travels with the state; a state from before the field was
    # added was drawn by order version 1.
    assert state["order_version"] == ORDER_VERSION
    with Loader(src, global_batch_size=8, process_index=0, process_count=1) as ld:
        with pytest.raises(ValueError, match="sample order version 0 but this code"):
            ld.load_state_dict({**state, "order_version": 0})
        old = {k: v for k, v in state.items() if k != "order_version"}
        if ORDER_VERSION == 1:
            ld.load_state_dict(old)
        else:
            with pytest.raises(ValueError, match="sample order version 1 but this code"):
                ld.load_state_dict(old)


@pytest.mark.parametrize("threads", [1, 3])
def test_producer_error_reaches_consumer_with_traceback(threads):
    probe = GlobalSampler(100, global_batch_size=4)
    src = FakeSource(100, fail_row=int(probe.process_batch(0, 3).rows[0]))
    with Loader(
        src,
        global_batch_size=4,
        process_index=0,
        process_count=1,
        prefetch=2,
        num_threads=threads,
    ) as ld:
        got = []
        with pytest.raises(ValueError, match="boom from the producer") as ei:
            _run_with_timeout(lambda: [got.append(b) for b in ld])
        frames = [f.name for f in traceback.extract_tb(ei.value.__traceback__)]
        assert "_explode" in frames and "_produce" in frames
        assert len(got) == 3
        assert ld.state_dict()["step"] == 3  # the failed batch is next, not skipped
    assert _prefetch_threads() == []


def test_a_cache_of_no_samples_says_so():
    """A cache whose build kept no row: one message saying so, not "use a batch of at
    most 0 or set loader.drop_last: false" (which gave the same message again); at
    construction, so ``epochs(1)`` cannot yield nothing silently."""
    for drop_last in (True, False):
        with pytest.raises(ConfigError, match="the cache holds no samples"):
            Loader(FakeSource(0), global_batch_size=4, process_index=0, process_count=1,
                   drop_last=drop_last)  # fmt: skip


def test_a_global_batch_larger_than_the_data_is_refused_at_construction(built_cache):
    """With drop_last an epoch of the built cache has no batch: the Loader refuses at
    construction (not 0 batches from ``epochs(1)`` or ``iter``, and ``epochs(None)`` the
    same error); without drop_last the one padded batch is served."""
    from hf_pipeline.cache.layout import open_sample_source

    with open_sample_source(built_cache.layout, built_cache.fingerprint) as src:
        big = src.num_rows + 1
        with pytest.raises(ConfigError, match=rf"global_batch_size \({big}\) is larger") as ei:
            Loader(src, global_batch_size=big, process_index=0, process_count=1)
        assert ei.value.field == "loader.global_batch_size"
        assert f"{src.num_rows} rows" in str(ei.value) and "drop_last" in str(ei.value)
        with Loader(src, global_batch_size=big, process_index=0, process_count=1,
                    drop_last=False) as padded:  # fmt: skip
            (batch,) = list(padded.epochs(1))
            assert int(batch["mask"].sum()) == src.num_rows


@pytest.mark.parametrize("dtype", ["int8", "nope", "uint16"])
def test_latents_dtype_must_be_a_float(dtype):
    """An integer (or unknown) output dtype would cast the latents silently: refused."""
    with pytest.raises(ValueError, match="latents_dtype must be a floating dtype"):
        Loader(FakeSource(16), global_batch_size=4, process_index=0, process_count=1,
               latents_dtype=dtype)  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_early_stop_and_close_leave_no_thread(threads):
    src = FakeSource(1000)
    ld = Loader(
        src, global_batch_size=4, process_index=0, process_count=1, prefetch=3, num_threads=threads
    )
    for i, _ in enumerate(ld):
        if i == 2:
            break
    gc.collect()
    assert _prefetch_threads() == []
    assert ld.state_dict()["step"] == 3
    it = iter(ld)
    next(it)  # producer now blocks on a full queue
    assert len(_prefetch_threads()) >= 1
    ld.close()
    ld.close()  # idempotent
    assert _prefetch_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(ld))


def test_new_iteration_supersedes_old():
    src = FakeSource(200)
    with Loader(src, global_batch_size=4, process_index=0, process_count=1) as ld:
        a = iter(ld)
        first = next(a)["keys"]
        b = iter(ld)
        second = next(b)["keys"]  # continues from the state, not from a's run-ahead
        assert list(a) == []  # the superseded iterator just ends
        assert len([t for t in _prefetch_threads() if "worker" not in t.name]) == 1
        s = ld.sampler
        np.testing.assert_array_equal(
            np.asarray(first), s.process_batch(0, 0).rows * 3 + s.process_batch(0, 0).crops
        )
        np.testing.assert_array_equal(
            np.asarray(second), s.process_batch(0, 1).rows * 3 + s.process_batch(0, 1).crops
        )
        b.close()


def test_pad_mode_mask_dtype_and_from_config(source):
    cfg = LoaderConfig(
        global_batch_size=64,
        seed=2,
        crop="1",
        drop_last=False,
        latents_dtype="bfloat16",
        prefetch=2,
    )
    with Loader.from_config(source, cfg, process_index=0, process_count=1) as ld:
        assert ld.steps_per_epoch == 3
        batches = _run_with_timeout(lambda: list(ld))
        assert [int(np.asarray(b["mask"]).sum()) for b in batches] == [64, 64, 32]
        assert str(batches[0]["latents"].dtype) == "bfloat16"
        keys = np.concatenate([np.asarray(b["keys"])[np.asarray(b["mask"])] for b in batches])
        assert sorted(keys.tolist()) == sorted(source.keys.tolist())
        pb = ld.sampler.process_batch(0, 0)
        ref = source.gather(pb.rows, 1)["latents"].astype(np.float32)
        np.testing.assert_allclose(
            np.asarray(batches[0]["latents"]).astype(np.float32), ref, rtol=1e-2
        )


def test_options_keywords_and_config_make_the_same_loader():
    """One map from keywords to LoaderOptions: the options object, flat keywords and the
    config section give the same order, state and batches."""
    order = dict(
        global_batch_size=8, seed=3, shuffle="block", block_size=4, window_blocks=2, drop_last=False
    )
    fields = dict(order, crop=1, prefetch=2, num_threads=2, latents_dtype="float32")
    cfg = LoaderConfig(**dict(fields, crop="1"))  # the config holds a crop index as text
    options = LoaderOptions.from_config(cfg)
    assert options == loader_options(**fields)
    assert options.order == SamplerOptions(**order, crop=1)
    assert (options.prefetch, options.num_threads, options.latents_dtype) == (2, 2, "float32")
    # The config's "use the default" values are the options' None.
    default = LoaderOptions.from_config(LoaderConfig())
    assert default.num_threads is None and default.latents_dtype is None
    # Keywords beside options replace those fields only.
    replaced = loader_options(options, seed=4, prefetch=3)
    assert replaced.order == dataclasses.replace(options.order, seed=4)
    assert (replaced.prefetch, replaced.num_threads) == (3, 2)
    where = dict(process_index=0, process_count=1)
    src = FakeSource(21)
    with (
        Loader(src, options, **where) as by_options,
        Loader(src, **fields, **where) as by_keywords,
        Loader.from_config(src, cfg, **where) as by_config,
        Loader.from_config(src, cfg, seed=4, **where) as overridden,
    ):
        loaders = (by_options, by_keywords, by_config)
        assert by_options.state_dict() == by_keywords.state_dict() == by_config.state_dict()
        assert overridden.state_dict()["seed"] == 4
        batches = [_run_with_timeout(lambda ld=ld: _keys(ld)) for ld in loaders]
        assert batches[0] == batches[1] == batches[2] and len(batches[0]) == 3
        assert _run_with_timeout(lambda: _keys(overridden)) != batches[0]


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"prefetch": 0}, ValueError, "prefetch must be >= 1, got 0"),
        ({"num_threads": 0}, ValueError, "num_threads must be >= 1, got 0"),
        ({"shuffle": "nope"}, ValueError, "shuffle must be one of"),
        ({"start_epoch": -1}, ValueError, "start_epoch must be >= 0, got -1"),
        ({"prefetchh": 2}, TypeError, "unexpected keyword argument 'prefetchh'"),
    ],
)
def test_bad_options_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        Loader(FakeSource(10), global_batch_size=2, process_index=0, process_count=1, **fields)
    with pytest.raises(TypeError, match="global_batch_size"):
        Loader(FakeSource(10), process_index=0, process_count=1)


def test_mesh_single_device(source):
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with Loader(source, global_batch_size=16, mesh=mesh) as ld:
        assert ld.layout.devices == 1 and ld.layout.per_device_batch == 16
        b = next(iter(ld))
        assert b["latents"].shape == (16, 4, 32, 32)
        assert b["latents"].sharding.spec == jax.sharding.PartitionSpec("data")
    with pytest.raises(ValueError, match="not an axis"):
        Loader(source, global_batch_size=16, mesh=mesh, data_axis="batch")


@pytest.mark.slow
def test_bfloat16_cache_yields_bfloat16_jax_arrays(tmp_path):
    """A bfloat16 cache reaches JAX as bfloat16 with the stored bits (subnormals too)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    files = build_cache(tmp_path, 90, dtype="bfloat16", num_proc=1, embed_dim=8)
    with SampleSource(*files, fingerprint="bf", latent_dtype="bfloat16") as src:
        kw = dict(global_batch_size=12, seed=2, process_index=0, process_count=1)
        with Loader(src, **kw) as ld, Loader(src, latents_dtype="float32", **kw) as wide:
            for step, (b, w) in enumerate(zip(ld, wide, strict=True)):
                pb = ld.sampler.process_batch(0, step, 0, 1)
                ref = src.gather(pb.rows, pb.crops)["latents"]
                assert b["latents"].dtype == jnp.bfloat16
                got = np.asarray(b["latents"])
                np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
                assert (got.view(np.uint16)[:, 0, 0, 0] == 3).all()  # a subnormal, kept
                # The cast on the device widens exactly.
                assert w["latents"].dtype == jnp.float32
                np.testing.assert_array_equal(np.asarray(w["latents"]), ref.astype(np.float32))
            assert step == 60 // 12 - 1
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        with Loader(src, global_batch_size=12, mesh=mesh) as ld:
            b = next(iter(ld))
            pb = ld.sampler.process_batch(0, 0, 0, 1)
            ref = src.gather(pb.rows, pb.crops)["latents"]
            assert b["latents"].dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                np.asarray(b["latents"]).view(np.uint16), ref.view(np.uint16)
            )


_MULTI_DEVICE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    from jax.sharding import Mesh
    from hf_pipeline.read.loader import Loader, LoaderOptions, loader_options
    from hf_pipeline.read.mapped import SampleSource
    files = json.loads(sys.argv[1])
    src = SampleSource(*files)
    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    for partition in ("contiguous", "strided"):
        ld = Loader(src, global_batch_size=16, mesh=mesh, partition=partition, seed=4)
        lay = ld.layout
        assert (lay.devices, lay.per_device_batch, lay.per_process_batch) == (2, 8, 16), lay
        for step, b in enumerate(ld):
            pb = ld.sampler.process_batch(0, step, 0, 1)
            ref = src.gather(pb.rows, pb.crops)
            for name in ("latents", "embeddings", "keys"):
                arr = b[name]
                assert arr.shape[0] == 16
                assert len(arr.addressable_shards) == 4
                for shard in arr.addressable_shards:
                    assert shard.data.shape[0] == 8
                    np.testing.assert_array_equal(np.asarray(shard.data), ref[name][shard.index])
        ld.close()
    try:
        Loader(src, global_batch_size=6, mesh=Mesh(np.array(jax.devices()), ("data",)))
    except ValueError as e:
        assert "divisible by the 4 devices" in str(e)
    else:
        raise AssertionError("no error")
    print("OK")
    """
)


@pytest.mark.slow
def test_multi_device_subprocess(source, tmp_path):
    files = [source._latents.files, source._emb.files, None]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    script = tmp_path / "multi_device.py"
    script.write_text(_MULTI_DEVICE)
    r = subprocess.run(
        [sys.executable, str(script), json.dumps(files)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


_HELD_AT_EXIT = textwrap.dedent(
    """
    import json, sys
    if sys.argv[2] == "build":
        import hf_pipeline.build.prepare  # more modules to tear down at exit
    from hf_pipeline.read.loader import Loader
    from hf_pipeline.read.mapped import SampleSource
    rows, emb, _ = json.loads(sys.argv[1])
    loader = Loader(SampleSource(rows, emb), global_batch_size=4, process_index=0, process_count=1)
    it = iter(loader)
    next(it)  # the iterator, and its prefetch thread, are still held at exit
    if sys.argv[3] == "close":
        loader.close()
    print("OK")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("imports", ["loader", "build"])
@pytest.mark.parametrize("close", ["keep", "close"])
def test_an_iterator_held_at_exit_ends_quietly(source, tmp_path, imports, close):
    """A program that still holds a started iterator when it exits, closed or not: the
    generator is finalized after the interpreter tore the modules down, and its close
    printed "Exception ignored in: <generator object Loader._iterate>" with a
    TypeError or AttributeError. Open prefetchers now close at exit, while the modules
    are whole, and a second close touches nothing."""
    files = [source._latents.files, source._emb.files, None]
    script = tmp_path / "held.py"
    script.write_text(_HELD_AT_EXIT)
    r = subprocess.run(
        [sys.executable, str(script), json.dumps(files), imports, close],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


_MULTI_PROCESS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    pid, port, files, out = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
        initialization_timeout=60,
    )
    from jax.sharding import Mesh
    from hf_pipeline.read.loader import Loader, LoaderOptions, loader_options
    from hf_pipeline.read.mapped import SampleSource
    src = SampleSource(*files)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    ld = Loader(src, global_batch_size=8, mesh=mesh, seed=9)
    assert ld.layout.process_index == jax.process_index() == pid
    assert ld.layout.process_count == 2 and ld.layout.per_device_batch == 2
    shards = []
    for step, b in enumerate(ld):
        assert b["keys"].shape == (8,)
        for s in b["keys"].addressable_shards:
            shards.append([step, s.index[0].start, np.asarray(s.data).tolist()])
        lat = b["latents"]
        assert lat.shape == (8, 4, 32, 32)
    state = ld.state_dict()
    ld.close()
    with open(out, "w") as f:
        json.dump({"shards": shards, "state": state}, f)
    jax.distributed.shutdown()
    """
)


@pytest.mark.slow
def test_two_processes_jax_distributed(source, tmp_path):
    files = [source._latents.files, source._emb.files, None]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    script = tmp_path / "multi_process.py"
    script.write_text(_MULTI_PROCESS)
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(p),
                str(port),
                json.dumps(files),
                str(tmp_path / f"out{p}.json"),
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    results = [json.loads((tmp_path / f"out{p}.json").read_text()) for p in range(2)]
    assert results[0]["state"] == results[1]["state"]
    s = GlobalSampler(240, global_batch_size=8, seed=9)  # no indices: all 240 rows
    keys = source._keys.read_all()
    steps = s.steps_per_epoch
    for step in range(steps):
        glob_rows, _ = s.global_batch(0, step)
        expect = keys[glob_rows]
        got = np.zeros(8, dtype=np.int64)
        seen = 0
        for pid, res in enumerate(results):
            for st_, start, data in res["shards"]:
                if st_ == step:
                    assert pid * 4 <= start < (pid + 1) * 4  # each process holds its own half
                    got[start : start + len(data)] = data
                    seen += len(data)
        assert seen == 8
        np.testing.assert_array_equal(got, expect)


@settings(max_examples=10, deadline=None)
@given(
    phases=st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 4, 6, 8]), st.integers(1, 6)), min_size=2, max_size=4
    ),
    seed=st.integers(0, 50),
    shuffle=st.sampled_from(["global", "block"]),
)
def test_elastic_resume_any_world_sizes(phases, seed, shuffle):
    src = FakeSource(70)
    kw = dict(global_batch_size=24, seed=seed, shuffle=shuffle, block_size=8, num_threads=1)
    total = sum(k for _, k in phases)
    with Loader(src, process_index=0, process_count=1, **kw) as ld:
        full = _keys(itertools.islice(ld.epochs(), total))
    got, state = [], None
    for w, k in phases:
        loaders = [Loader(src, process_index=p, process_count=w, **kw) for p in range(w)]
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        got += _global_steps(loaders, k)
        state = loaders[0].state_dict()
        for ld in loaders:
            ld.close()
    assert got == full


@pytest.mark.slow
def test_readme_loop_under_torchrun_is_refused_or_split(built_cache, tmp_path):
    """README's loop launched by real torchrun (2 ranks): JAX was never joined, so the
    Loader saw one process and every rank read the same batches, silently. Now each rank
    refuses in one line naming the fix; inside ``hf_pipeline.jax_distributed()`` (as
    README shows it) the ranks take disjoint shares of every global batch."""
    from tests.conftest import REPO, run_each

    def launch(*mode: str) -> tuple[int, str]:
        argv = ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port_pair()),
                REPO / "tests/procs/readme_loop.py", tmp_path / ("{rank}" + "".join(mode)),
                *mode]  # fmt: skip
        env = {"DEMO_CACHE": str(built_cache.cache_dir), "JAX_PLATFORMS": "cpu",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        ((code, out, err),) = run_each([(argv, env)], timeout=300)
        return code, out + err

    code, out = launch()
    assert code != 0, out[-3000:]
    # Each rank refuses on its own; torchrun ends the job at the first rank's exit 2
    # (SIGTERM to the other), so one or both lines are printed, and no rank read a batch.
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert 1 <= len(lines) <= 2, out[-3000:]
    assert not list(tmp_path.glob("[01]")), "a rank read batches although JAX saw one process"
    for line in lines:
        assert "2 processes" in line and "JAX sees one" in line, line
        assert "hf_pipeline.jax_distributed()" in line and "process_count" in line, line
    code, out = launch("distributed")
    assert code == 0, out[-3000:]
    got = [json.loads((tmp_path / f"{r}distributed").read_text()) for r in range(2)]
    assert [g["process"] for g in got] == [[0, 2], [1, 2]]
    for a, b in zip(got[0]["keys"], got[1]["keys"], strict=True):
        assert len(a) == len(b) == 8 and not set(a) & set(b)


def test_a_launched_rank_says_how_to_split_or_opts_out(monkeypatch):
    """Rank 1 of 2 (torchrun's variables) with JAX alone: refused in one line naming this
    rank's explicit share; an explicit process_count (1 included: every batch on
    purpose) is taken as given."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"2 processes \(torchrun\) but JAX sees one") as ei:
        Loader(FakeSource(64), global_batch_size=4)
    assert "process_index=1, process_count=2" in str(ei.value)
    assert len(str(ei.value).splitlines()) == 1
    for index, count in ((0, 1), (1, 2)):
        with Loader(FakeSource(64), global_batch_size=4, process_index=index,
                    process_count=count) as ld:  # fmt: skip
            assert ld.layout.process_count == count


def test_an_invalid_option_is_a_public_config_error(source):
    """`Loader(src, global_batch_size=0)`: a ValueError the docs name, ConfigError (it was
    OptionError, neither public nor a ConfigError), naming the option; picklable."""
    import hf_pipeline

    with pytest.raises(hf_pipeline.ConfigError, match=r"global_batch_size must be >= 1") as e:
        hf_pipeline.Loader(source, global_batch_size=0)
    assert isinstance(e.value, ValueError) and e.value.field == "global_batch_size"
    again = pickle.loads(pickle.dumps(e.value))
    assert (type(again), str(again), again.field) == (
        type(e.value),
        str(e.value),
        "global_batch_size",
    )
