"""A BERT model folder's own caption tokenizer, read with ``tokenizers`` alone: the
tokenizer of all-MiniLM-L6-v2 without transformers (issue 28).

The first build on a cache root loaded the tokenizer through transformers'
``AutoTokenizer``: 8.6 s after the build's entry on a 16-CPU H200 host (the cold 100k
build took 12.6 s, 8.3-8.9 s with the tokenizer already in the store,
:mod:`hf_pipeline.build.tokenizer_store`). For a folder holding BERT's fast tokenizer
with a ``tokenizer.json``, what transformers builds is known, so
:func:`native_tokenizer` reads the file directly when it can prove the result is the
same, and says why not otherwise (the build then loads through transformers).

What transformers (4.40 to 5.x) makes of such a folder: ``tokenizer_config.json``'s
``tokenizer_class`` (``BertTokenizer``, or ``BertTokenizerFast``) picks BERT's fast
tokenizer. transformers 4 loads ``tokenizer.json`` and rebuilds its normalizer where its
``lowercase``, ``strip_accents`` or ``handle_chinese_chars`` differ from the config's
``do_lower_case``, ``strip_accents``, ``tokenize_chinese_chars``; transformers 5 builds
the backend from the file's vocabulary and the config: ``BertNormalizer`` (clean text,
those three), ``BertPreTokenizer``, ``WordPiece`` (the unknown token, ``##``, 100
characters a word), the ``WordPiece`` decoder and the ``[CLS] $A [SEP]`` template; both
add the special tokens (``unk``, ``sep``, ``pad``, ``cls``, ``mask``: the config's or
``special_tokens_map.json``'s, else BERT's defaults) the backend lacks. So the file's
backend is transformers' exactly when the file already is all of that: here that
backend is built with ``tokenizers`` as transformers 5 builds it and compared with the
file's, part by part (as JSON, truncation and padding left out: the call sets its own),
with the five special tokens as the file's only added tokens (special, not normalized,
at their vocabulary ids).

The call is :class:`~hf_pipeline.encoder.model.WorkerTokenizer`'s (transformers' for
``tokenizer(texts, truncation=True, max_length=...)``): special tokens added, longest-
first truncation at ``encoder.max_length`` on the config's ``truncation_side``
(``model_max_length`` plays no part: the length is always given), no padding (the
encoder pads on the right with the pad token's id), special tokens in the text matched
(``split_special_tokens`` false).

Refused (a one-line reason naming the file and field; transformers loads it):
``encoder.backend: transformers``; a Hub id; a ``config.json`` whose ``model_type`` is
not ``bert`` (``AutoTokenizer`` may then choose another class); no ``tokenizer.json`` or
``tokenizer_config.json``; an ``added_tokens.json``; a config key this module does not
know (``auto_map``, ``additional_special_tokens``, ...) or one set to a value other than
the one it handles (``split_special_tokens: true``, ``padding_side: left``, a special
token written as an object, ...); a special token missing from the vocabulary; a
``tokenizer.json`` truncating on the left with no ``truncation_side`` in the config
(transformers 4 and 5 disagree there); anything in the file that differs from the
backend described above. The files are read up to a bound
(:data:`MAX_TOKENIZER_BYTES`, :data:`_MAX_CONFIG_BYTES`), and parsed only as JSON and by
``tokenizers``.

Imports ``tokenizers`` only (no torch, no transformers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TokenizerSpec, resolve_encoder_path

__all__ = ["MAX_TOKENIZER_BYTES", "native_tokenizer"]

#: The most of ``tokenizer.json`` read (BERT's is 0.5 MB, multilingual BERT's 2.9 MB).
MAX_TOKENIZER_BYTES = 64 << 20
#: The most of ``tokenizer_config.json``, ``special_tokens_map.json``, ``config.json``.
_MAX_CONFIG_BYTES = 1 << 20
_CLASSES = frozenset({"BertTokenizer", "BertTokenizerFast"})
#: BERT's special tokens and their defaults (transformers' BertTokenizer).
_SPECIALS = {
    "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}  # fmt: skip
#: The normalizer's settings in the config and their defaults.
_NORMALIZER = {"do_lower_case": True, "tokenize_chinese_chars": True, "strip_accents": None}
#: Config keys that do not change the ids of the call (names, decoding, loading, the
#: length a call without one would use).
_IRRELEVANT = frozenset({
    "name_or_path", "model_max_length", "max_len", "max_length", "clean_up_tokenization_spaces",
    "special_tokens_map_file", "is_local", "local_files_only", "_commit_hash",
})  # fmt: skip
#: Config keys handled only at the value BERT's tokenizer has by default.
_DEFAULTS: dict[str, Any] = {
    "do_basic_tokenize": True, "never_split": None, "split_special_tokens": False,
    "padding_side": "right", "stride": 0, "truncation_strategy": "longest_first",
    "pad_to_multiple_of": None, "pad_token_type_id": 0, "tokenizer_file": None,
    "backend": "tokenizers",
}  # fmt: skip
#: What an added special token's flags are in a BERT ``tokenizer.json``.
_ADDED_FLAGS = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True}  # fmt: skip


def _read(path: Path, limit: int) -> bytes | str:
    """The bytes of ``path`` (at most ``limit``), or why not (one line)."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return f"{path}: absent"
    except OSError as exc:
        return f"{path}: not read ({exc.strerror or exc})"
    if len(data) > limit:
        return f"{path}: larger than {limit} bytes"
    return data


def _read_object(path: Path, limit: int = _MAX_CONFIG_BYTES) -> dict[str, Any] | str:
    """The JSON object in ``path``, or why not."""
    data = _read(path, limit)
    if isinstance(data, str):
        return data
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return f"{path}: not JSON"
    return value if isinstance(value, dict) else f"{path}: not a JSON object"


def _same(a: Any, b: Any) -> bool:
    """Equal, with a bool never equal to an int (JSON's ``true`` is not ``1``)."""
    return type(a) is type(b) and a == b


def _config_settings(folder: Path) -> dict[str, Any] | str:
    """The settings transformers takes from ``tokenizer_config.json`` (and
    ``special_tokens_map.json``) for BERT's tokenizer: the normalizer's three, the five
    special tokens, ``truncation_side`` (None: not set), ``added_tokens_decoder`` (None:
    not set); or why the folder is refused."""
    path = folder / "tokenizer_config.json"
    cfg = _read_object(path)
    if isinstance(cfg, str):
        return cfg
    cls = cfg.get("tokenizer_class")
    if cls not in _CLASSES:
        return f"{path}: tokenizer_class {cls!r} is not BERT's ({sorted(_CLASSES)})"
    out: dict[str, Any] = {"truncation_side": None, "added_tokens_decoder": None}
    for key, value in cfg.items():
        if key in _IRRELEVANT or key == "tokenizer_class":
            continue
        if key in _NORMALIZER:
            ok = type(value) is bool or (key == "strip_accents" and value is None)
        elif key in _SPECIALS:
            ok = type(value) is str
        elif key == "truncation_side":
            ok = value in ("left", "right")
        elif key == "added_tokens_decoder":
            ok = isinstance(value, dict)
        elif key in _DEFAULTS:
            ok = _same(value, _DEFAULTS[key])
        elif key in ("additional_special_tokens", "extra_special_tokens"):
            ok = value in ([], {}, None)
        else:
            return f"{path}: {key!r} is not a setting the native tokenizer handles"
        if not ok:
            return f"{path}: {key} {_shown(value)} is not handled natively"
        out[key] = value
    settings = {**_NORMALIZER, **_SPECIALS, **out}
    # special_tokens_map.json may override the config's tokens (transformers' legacy
    # path) or be ignored (a config with added_tokens_decoder): it must agree with them.
    path = folder / "special_tokens_map.json"
    if path.exists():
        tokens = _read_object(path)
        if isinstance(tokens, str):
            return tokens
        for key, value in tokens.items():
            if key in ("additional_special_tokens", "extra_special_tokens") and not value:
                continue
            if isinstance(value, dict) and {**value, "special": True} == {
                **_ADDED_FLAGS, "content": value.get("content"),
            }:  # fmt: skip  # the saved form of a plain special token
                value = value["content"]
            if key not in _SPECIALS or not _same(value, settings[key]):
                return (
                    f"{path}: {key} {_shown(value)} is not "
                    f"{_shown(settings.get(key))} (tokenizer_config.json or BERT's default)"
                )
    return settings


def _expected_backend(settings: dict[str, Any], vocab: dict[str, int]) -> dict[str, Any]:
    """The backend transformers 5's BertTokenizer builds from ``settings`` and
    ``vocab``, with the special tokens added, as JSON (truncation and padding left out)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tok = Tokenizer(WordPiece(vocab, unk_token=settings["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=settings["tokenize_chinese_chars"],
        strip_accents=settings["strip_accents"], lowercase=settings["do_lower_case"],
    )  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    cls, sep = settings["cls_token"], settings["sep_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    tok.add_special_tokens([
        AddedToken(settings[k], special=True, normalized=False) for k in _SPECIALS
    ])  # fmt: skip
    return _state(tok.to_str())


def _state(text: str) -> dict[str, Any]:
    """A backend's JSON without the truncation and padding a call sets, its added
    tokens in id order."""
    state = {k: v for k, v in json.loads(text).items() if k not in ("truncation", "padding")}
    state["added_tokens"] = sorted(state.get("added_tokens") or [], key=lambda t: t["id"])
    return state


def _shown(value: Any, limit: int = 100) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Found:
    """A folder's tokenizer as :func:`native_tokenizer` found it."""

    def __init__(self, backend: str, pad_token_id: int, direction: Literal["left", "right"]):
        self.backend, self.pad_token_id, self.direction = backend, pad_token_id, direction


def _inspect(folder: Path) -> _Found | str:
    """The folder's tokenizer when it is provably transformers' (the module docstring),
    else why not."""
    from tokenizers import Tokenizer

    model_cfg = folder / "config.json"
    if model_cfg.exists():
        raw = _read_object(model_cfg)
        if isinstance(raw, str):
            return raw
        if raw.get("model_type") != "bert":
            return f"{model_cfg}: model_type {raw.get('model_type')!r} is not 'bert'"
    if (folder / "added_tokens.json").exists():
        return f"{folder / 'added_tokens.json'}: added tokens are left to transformers"
    settings = _config_settings(folder)
    if isinstance(settings, str):
        return settings
    path = folder / "tokenizer.json"
    data = _read(path, MAX_TOKENIZER_BYTES)
    if isinstance(data, str):
        return data
    try:
        file_tok = Tokenizer.from_str(data.decode())
    # tokenizers raises its own Exception for a file it cannot read.
    except Exception as exc:  # noqa: BLE001 - a file it cannot read is left to transformers
        return f"{path}: not loadable by tokenizers ({type(exc).__name__}: {str(exc)[:120]})"
    truncation = file_tok.truncation
    direction = settings["truncation_side"]
    if direction is None:
        # transformers 5 takes the file's side where the config says none, 4 takes "right".
        if truncation is not None and truncation.get("direction") != "right":
            return f"{path}: truncation {truncation.get('direction')!r} without a truncation_side"
        direction = "right"
    padding = file_tok.padding
    if padding is not None and (
        padding.get("pad_token") != settings["pad_token"] or padding.get("direction") != "right"
    ):
        return f"{path}: padding {padding.get('pad_token')!r} {padding.get('direction')!r}"
    have = _state(file_tok.to_str())
    model = have.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "WordPiece" or not isinstance(vocab, dict):
        return f"{path}: model {model.get('type')!r} is not a WordPiece"
    for key in _SPECIALS:
        if settings[key] not in vocab:
            return f"{path}: {key} {settings[key]!r} is not in the vocabulary"
    if settings["added_tokens_decoder"] is not None:
        listed = {int(i) if str(i).isdigit() else -1: t for i, t in
                  settings["added_tokens_decoder"].items()}  # fmt: skip
        theirs = {t["id"]: {k: v for k, v in t.items() if k != "id"} for t in have["added_tokens"]}
        if listed != theirs:
            return f"{folder / 'tokenizer_config.json'}: added_tokens_decoder is not {path}'s"
    try:
        want = _expected_backend(settings, vocab)
    # tokenizers raises ValueError or its own Exception for settings it cannot build.
    except Exception as exc:  # noqa: BLE001 - settings it cannot build are left to transformers
        return (
            f"{folder / 'tokenizer_config.json'}: BERT's tokenizer cannot be built from its "
            f"settings ({type(exc).__name__}: {str(exc)[:120]})"
        )
    for part in ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder",
                 "added_tokens"):  # fmt: skip
        if have.get(part) != want.get(part):
            return (
                f"{path}: its {part} {_shown(have.get(part))} is not BERT's as "
                f"tokenizer_config.json sets it, {_shown(want.get(part))}"
            )
    file_tok.no_truncation()
    file_tok.no_padding()
    return _Found(file_tok.to_str(), int(vocab[settings["pad_token"]]), direction)


def native_tokenizer(cfg: EncoderConfig, into: str | os.PathLike) -> TokenizerSpec | str:
    """``cfg``'s tokenizer read from its model folder without transformers, as a
    :class:`~hf_pipeline.encoder.model.TokenizerSpec` (its backend written to
    ``into/tokenizer.json``, truncating at ``cfg.max_length``, with the pad id) that
    gives transformers' ids; or why not (one line: the build loads it through
    transformers). The module docstring says when. Reads the folder's tokenizer files
    (milliseconds); imports ``tokenizers`` only."""
    if cfg.backend != "auto":
        return f"encoder.backend is {cfg.backend!r}"
    path = resolve_encoder_path(cfg.model)
    if not Path(path).is_dir():
        return f"{path!r} is not a local folder (a Hub tokenizer loads with transformers)"
    found = _inspect(Path(path))
    if isinstance(found, str):
        return found
    out = Path(into) / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(found.backend)
    return TokenizerSpec(
        path=str(out), max_length=cfg.max_length, direction=found.direction,
        split_special_tokens=False, pad_token_id=found.pad_token_id,
    )  # fmt: skip
