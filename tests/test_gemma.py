"""The native gemma-3 text encoder (hf_pipeline.encoder.gemma), COYO's encoder shape
without transformers: it computes what transformers' Gemma3TextModel computes (sliding
and full layers, grouped key/value heads, padding masks, both config formats, both
checkpoint layouts), a build whose tokenizer is in the root's store imports no
transformers at all, and folders it does not cover load with transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TextEncoder, native_model, resolve_encoder_path
from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env
from tests.helpers.fresh_builds import minilm_copy

# 7 layers: sliding 0-4, full 5, sliding 6 (transformers' pattern of 6); 4 query heads
# over 2 key/value heads; a window of 5 tokens, so that rows of 5+ tokens take the
# sliding mask.
_TINY = dict(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5)  # fmt: skip


def _gemma_folder(folder: Path, *, causal_lm: bool = False, tokenizer: bool = True, **config):
    """A random tiny gemma-3 text model saved by transformers (``causal_lm``: as
    Gemma3ForCausalLM, whose weights carry a ``model.`` prefix), its norm weights random
    too (transformers starts them at 0), with MiniLM's tokenizer."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(0)
    cls = Gemma3ForCausalLM if causal_lm else Gemma3TextModel
    model = cls(Gemma3TextConfig(**{**_TINY, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    if tokenizer:
        src = Path(resolve_encoder_path("minilm"))
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                     "special_tokens_map.json"):  # fmt: skip
            shutil.copy(src / name, folder / name)
    return folder


def _edit_config(folder: Path, edit) -> Path:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))
    return folder


def _hidden(model, ids, mask=None):
    import torch

    with torch.inference_mode():
        kwargs = {} if mask is None else {"attention_mask": mask}
        if type(model).__module__.startswith("transformers"):
            kwargs["use_cache"] = False
        return model(input_ids=ids, **kwargs).last_hidden_state.float()


def test_native_gemma_computes_as_transformers(tmp_path):
    """Both checkpoint layouts (Gemma3TextModel; Gemma3ForCausalLM with its ``model.``
    prefix and tied head), float32 and bfloat16, rows shorter and longer than the
    sliding window, with and without a padding mask: the native model's hidden states
    are transformers' (float32 to 1e-5; bfloat16 within its rounding), its state dict
    has transformers' keys, and it is a causal decoder to the encoder."""
    import torch
    from transformers import AutoModel

    from hf_pipeline.encoder.gemma import GemmaModel
    from hf_pipeline.encoder.model import _causal_decoder

    gen = torch.Generator().manual_seed(1)
    for causal_lm in (False, True):
        folder = _gemma_folder(tmp_path / f"lm{causal_lm}", causal_lm=causal_lm)
        plan = native_model(EncoderConfig(model=str(folder)))
        assert not isinstance(plan, str), plan
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            native = plan.load(dtype)
            ref = AutoModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
            assert type(native) is GemmaModel and _causal_decoder(native)
            assert set(native.state_dict()) == set(ref.state_dict())
            assert native.embed_tokens.weight.dtype == dtype
            for tokens in (3, 5, 12):  # below, at and past the window of 5
                ids = torch.randint(0, 30522, (3, tokens), generator=gen)
                got, want = _hidden(native, ids), _hidden(ref, ids)
                scale = max(want.abs().max().item(), 1.0)
                assert (got - want).abs().max().item() <= tol * scale, (causal_lm, dtype, tokens)
                mask = torch.ones_like(ids)
                mask[1, tokens // 2 :] = 0
                got, want = _hidden(native, ids, mask), _hidden(ref, ids, mask)
                real = mask.bool()
                assert (got - want)[real].abs().max().item() <= tol * scale, (causal_lm, tokens)


def test_the_encoder_loads_gemma_natively_and_embeds_as_transformers(tmp_path):
    """TextEncoder with ``encoder.backend: auto`` loads the gemma folder natively (no
    transformers module among its model's), embeds rows of many lengths (the causal
    pooling, row buckets with filler rows, rows past the sliding window) as the
    transformers-loaded encoder does, and keeps the older config format (``rope_theta``
    / ``rope_local_base_freq``, no ``layer_types``) the same."""
    folder = _gemma_folder(tmp_path / "gemma")
    native = TextEncoder(EncoderConfig(model=str(folder), micro_batch_size=4))
    ref = TextEncoder(EncoderConfig(model=str(folder), micro_batch_size=4, backend="transformers"))
    assert (native.backend, ref.backend) == ("native", "transformers")
    assert native.causal and ref.causal and native.dim == ref.dim == 32
    assert type(native.model).__module__ == "hf_pipeline.encoder.gemma"
    texts = ["a red circle on a blue background", "stripes", "word " * 40, "", "a b c d e f"]
    want = ref.encode(texts)
    np.testing.assert_allclose(native.encode(texts), want, rtol=0, atol=1e-5)

    def older(cfg):
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params["full_attention"]["rope_theta"]
        cfg["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        cfg["rope_scaling"] = None

    old = _edit_config(shutil.copytree(folder, tmp_path / "old"), older)
    enc = TextEncoder(EncoderConfig(model=str(old), micro_batch_size=4))
    assert enc.backend == "native"
    np.testing.assert_allclose(enc.encode(texts), want, rtol=0, atol=1e-5)
    # Without layer_types the layers' pattern is transformers' to derive (its versions
    # read it from different keys; an outside tester's `_sliding_window_pattern: 2` gave
    # other layers than transformers 5's): transformers loads such a folder.
    for key, value in (("sliding_window_pattern", 2), ("_sliding_window_pattern", 2)):
        pattern = _edit_config(shutil.copytree(old, tmp_path / key),
                               lambda c, k=key, v=value: (c.pop("layer_types"), c.update({k: v})))  # fmt: skip
        why = native_model(EncoderConfig(model=str(pattern)))
        assert isinstance(why, str) and "layer_types is absent" in why, why
        assert TextEncoder(EncoderConfig(model=str(pattern))).backend == "transformers"


def test_gemma_folders_the_native_model_does_not_cover_say_why(tmp_path):
    """Configs outside what the native model computes (bidirectional attention, logit
    soft-capping, another activation or rotary type, attention biases), a vision
    model's config, a tensor the text model does not have: each one line naming the
    file (and the tensor); the encoder then loads with transformers and embeds as it
    does."""
    import torch
    from safetensors.torch import load_file, save_file

    base = _gemma_folder(tmp_path / "base")

    def case(name, edit_config=None, edit_tensors=None):
        folder = shutil.copytree(base, tmp_path / name)
        if edit_config is not None:
            _edit_config(folder, edit_config)
        if edit_tensors is not None:
            path = folder / "model.safetensors"
            tensors = load_file(path)
            edit_tensors(tensors)
            save_file(tensors, path)
        return folder, native_model(EncoderConfig(model=str(folder)))

    want = {
        "bidirectional": (dict(use_bidirectional_attention=True),
                          "config.json: use_bidirectional_attention is set"),
        "softcap": (dict(attn_logit_softcapping=50.0), "config.json: attn_logit_softcapping"),
        "act": (dict(hidden_activation="gelu"), "config.json: hidden_activation is 'gelu'"),
        "bias": (dict(attention_bias=True), "config.json: attention_bias is set"),
        "vision": (dict(model_type="gemma3"), "config.json: model_type is 'gemma3'"),
        "linear_rope": (dict(rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
            "config.json: rope_parameters['full_attention']"),
    }  # fmt: skip
    for name, (update, start) in want.items():
        folder, why = case(name, edit_config=lambda c, u=update: c.update(u))
        assert isinstance(why, str) and f"{folder}/{start}" in why and "\n" not in why, why
    folder, why = case("extra", edit_tensors=lambda t: t.update(
        {"vision_tower.weight": torch.zeros(2, 2)}))  # fmt: skip
    assert f"{folder}/model.safetensors: tensor 'vision_tower.weight' is not a gemma-3" in why
    # Not covered natively: transformers loads it, with the same embeddings as ever.
    folder = tmp_path / "bias"
    shutil.rmtree(folder)
    folder = _gemma_folder(folder, attention_bias=True)
    enc = TextEncoder(EncoderConfig(model=str(folder), micro_batch_size=4))
    assert enc.backend == "transformers" and enc.causal
    assert enc.encode(["a red circle"]).shape == (1, 32)


def test_a_broken_gemma_folder_is_refused_naming_what_is_wrong(tmp_path):
    """A gemma-3 text folder whose config values are not sizes, or whose weights are
    missing, misshapen or unreadable, is refused in one line naming the file and the
    field or tensor (a ConfigError: exit 2), not handed to transformers, which failed
    on them with a traceback or filled the gaps with random weights and built a cache
    of garbage embeddings with exit 0 (an outside tester). Token ids past the model's
    vocabulary (another model's tokenizer) are refused too, naming both numbers."""
    import torch
    from safetensors.torch import load_file, save_file

    from hf_pipeline.errors import ConfigError

    base = _gemma_folder(tmp_path / "base")
    configs = {
        "negative": (dict(hidden_size=-32), "config.json: hidden_size is -32"),
        "text": (dict(head_dim="8"), "config.json: head_dim is '8'"),
        "kv": (dict(num_key_value_heads=3), "config.json: num_attention_heads is not a multiple"),
        "layers": (dict(layer_types=["sliding_attention"] * 3),
                   "config.json: layer_types has 3 entries, not num_hidden_layers (7)"),
        "chunked": (dict(layer_types=["chunked_attention"] * 7),
                    "config.json: layer_types holds 'chunked_attention'"),
        "eps": (dict(rms_norm_eps=float("nan")), "config.json: rms_norm_eps is nan"),
        "theta": (dict(rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": -1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
            "config.json: rope_parameters['full_attention']: rope_theta is -1.0"),
        "more_layers": (dict(num_hidden_layers=9, layer_types=["full_attention"] * 9),
                        "model.safetensors: tensor 'layers.7."),
    }  # fmt: skip
    tensors = {
        "missing": (lambda t: t.pop("norm.weight"),
                    "model.safetensors: tensor 'norm.weight' is missing"),
        "shape": (lambda t: t.update({"norm.weight": torch.zeros(31)}),
                  "model.safetensors: tensor 'norm.weight' has shape [31], not [32]"),
        "ints": (lambda t: t.update({"norm.weight": torch.zeros(32, dtype=torch.int32)}),
                 "model.safetensors: tensor 'norm.weight' is I32, not a float"),
    }  # fmt: skip
    cases = {}
    for name, (update, start) in configs.items():
        folder = _edit_config(shutil.copytree(base, tmp_path / name),
                              lambda c, u=update: c.update(u))  # fmt: skip
        cases[name] = (folder, start)
    for name, (edit, start) in tensors.items():
        folder = shutil.copytree(base, tmp_path / name)
        weights = load_file(folder / "model.safetensors")
        edit(weights)
        save_file(weights, folder / "model.safetensors")
        cases[name] = (folder, start)
    folder = shutil.copytree(base, tmp_path / "truncated")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (folder, "model.safetensors: not a readable safetensors file")
    for name, (folder, start) in cases.items():
        for call in (native_model, TextEncoder):
            with pytest.raises(ConfigError) as ei:
                call(EncoderConfig(model=str(folder)))
            msg = str(ei.value)
            assert ei.value.field == "encoder.model" and "\n" not in msg, (name, msg)
            assert f"{folder}/{start}" in msg, (name, msg)
            assert msg.count(start) == 1, (name, msg)

    small = _gemma_folder(tmp_path / "small", vocab_size=1000)  # MiniLM's ids reach 30k
    enc = TextEncoder(EncoderConfig(model=str(small)))
    with pytest.raises(ConfigError) as ei:
        enc.encode(["a red circle on a blue background"])
    assert "outside the model's vocabulary of 1000" in str(ei.value)
    assert enc.encode([]).shape == (0, 32)


_NO_TRANSFORMERS = """
import json, sys

from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TextEncoder, TokenizerSpec, WorkerTokenizer

spec = TokenizerSpec(path=sys.argv[2], max_length=64, direction="right",
                     split_special_tokens=False, pad_token_id=0)
enc = TextEncoder(EncoderConfig(model=sys.argv[1]), tokenizer=WorkerTokenizer(spec))
out = enc.encode(["a cat", "a dog on a mat, " * 9])
print(json.dumps({
    "backend": enc.backend, "causal": enc.causal, "shape": list(out.shape),
    "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
}))
"""


# slow: a fresh interpreter with torch (about 4 CPU-s on the 2-CPU VM).
@pytest.mark.slow
def test_the_native_gemma_encoder_imports_no_transformers(tmp_path):
    """In a fresh process, the gemma folder with a tokenizers-only tokenizer loads and
    embeds without importing any transformers module (what its ``AutoModel`` import cost
    an append build: 4.1 s of a 21 s build on the H200 host)."""
    folder = _gemma_folder(tmp_path / "gemma")
    script = tmp_path / "native.py"
    script.write_text(_NO_TRANSFORMERS)
    r = subprocess.run([PYTHON, str(script), str(folder), str(folder / "tokenizer.json")],
                       capture_output=True, text=True, env=script_env(), cwd=REPO,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"backend": "native", "causal": True, "shape": [2, 32], "transformers": []}


def _report(cache_root: Path, name: str) -> dict:
    (report,) = cache_root.glob(f"{name}-*/filtered.*/report.json")
    return json.loads(report.read_text())


# slow: two fresh-process builds (about 30 CPU-s).
@pytest.mark.slow
def test_a_gemma_build_with_a_stored_tokenizer_imports_no_transformers(tmp_path):
    """Two fresh-process builds of a gemma folder on one root. Its tokenizer is not
    one hf_pipeline reads natively (its class is left to transformers), so the first
    build loads it with transformers and saves it in the root's tokenizer store; the
    second finds it there and loads the model natively: it imports no transformers
    (no ``transformers`` mark: the join waits for no import), as an append of COYO's
    encoder does."""
    folder = _gemma_folder(tmp_path / "gemma", tokenizer=False)
    tok = minilm_copy(tmp_path / "tok", weights=False, tokenizer_class="DistilBertTokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):  # fmt: skip
        shutil.copy(tok / name, folder / name)
    root = tmp_path / "cache"
    for i in (1, 2):
        r = subprocess.run([
            PYTHON, str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root), "-q",
            *(a for o in [*SMALL_DEMO, f"name=gemma{i}", f"data.demo.seed={i}",
                          f"encoder.model={folder}"] for a in ("--set", o)),
        ], capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
    first, second = (_report(root, f"gemma{i}")["startup"] for i in (1, 2))
    assert first["notes"]["tokenizer"] == "transformers", first["notes"]
    assert "transformers" in first["seconds"], first
    assert second["notes"] == {**second["notes"], "tokenizer": "store", "encoder_backend": "native"}
    assert "transformers" not in second["seconds"], second
    t = second["seconds"]
    assert t["join_map"] <= t["encoder_loading"] < t["encoder"], t
