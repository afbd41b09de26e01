"""Exported caption tokenizers kept under the cache root, so that the next build's token
pool starts without transformers (issue 28).

A build tokenizes with the ``tokenizers`` backend that
:meth:`~hf_pipeline.encoder.model.CaptionTokenizer.export` writes (a
:class:`~hf_pipeline.encoder.model.TokenizerSpec`); loading it through transformers'
``AutoTokenizer`` first took 7-10 s of a fresh build on a 16-CPU H200 host (beside the
busy join workers), and every part's tokens waited for it. Here, the first build saves
what the export made; a later build on the same root (any cache, any process) finds it by
:func:`store_key` and starts tokenizing at once; the encoder then needs only the pad id
(:class:`~hf_pipeline.encoder.model.WorkerTokenizer` carries it), so it skips
``AutoTokenizer`` too.

The key is what the exported spec depends on: the content of the tokenizer's files (the
model folder as ``encoder.model`` resolves it, weights left out; for a Hub id, the local
snapshot of the commit the cache's identity names, else no key: transformers loads as
before), the ``tokenizers`` and ``transformers`` versions (the export is transformers'
conversion, run by ``tokenizers``) and :data:`_SCHEMA` (what
:class:`~hf_pipeline.encoder.model.CaptionTokenizer` does on top: the pad-token fallback).
Not ``encoder.max_length``: the backend does not depend on it (the workers set their own
truncation, :class:`~hf_pipeline.encoder.model.WorkerTokenizer`, and the token units' key
leaves the backend's last truncation out), so :meth:`TokenizerSpecStore.load` applies the
asked length, and a re-embedding with another ``max_length`` starts tokenizing at once.

One file per key, ``<cache root>/.tokenizers/<key>.spec``: a JSON line (the spec's
settings, the pad id, the token units' key, the backend's size and sha256), then the
backend's JSON as exported. Published with temp + fsync + ``os.replace`` (a damaged entry
is replaced by the next save; two builders saving one key write the same bytes). The root
is shared, so an entry is foreign input: read only as a regular file (no symlink) of at
most :data:`MAX_ENTRY_BYTES`, and used only when every field checks out, the backend's
digest matches, ``tokenizers`` loads it, the pad id is in its vocabulary and the token
units' key recomputed from it is the stored one; anything else is absent (a miss, logged),
never an error. A dot-folder like ``.compiled``: neither a cache nor a store unit, so
``status`` does not list it and ``clean`` never removes it (it is reused across caches;
delete it by hand at any time: the next build exports again).

Process-safe: reads never see a partial entry; concurrent saves of a key are benign.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

from dist.atomic import atomic_write
from dist.safepath import own_folder
from hf_pipeline.cache.layout import TOKENIZER_SPECS_DIR
from hf_pipeline.config import EncoderConfig
from hf_pipeline.encoder.model import TokenizerSpec, resolve_encoder_path

__all__ = [
    "MAX_ENTRY_BYTES",
    "TOKENIZER_SPECS_DIR",
    "StoredTokenizer",
    "TokenizerSpecStore",
    "folder_tokenizer",
    "store_key",
]

log = logging.getLogger(__name__)

#: Bump when what a spec holds, or how CaptionTokenizer sets it up, changes.
_SCHEMA = 2  # 2: max_length left out of the key (1: in it)
_KIND = "hf_pipeline-tokenizer-spec"
#: The most an entry may hold (gemma-3's backend is ~33 MB; anything far larger is not
#: ours, and is not read).
MAX_ENTRY_BYTES = 256 << 20
_MAX_META_BYTES = 1 << 16
#: Files that hold weights, not the tokenizer: left out of the key (hashing GBs of
#: weights at every start would cost more than the tokenizer's load).
_WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf",
    ".ot", ".pb", ".tflite", ".npz", ".xml",
)  # fmt: skip
#: A non-weight file larger than this is keyed by its name and size only.
_MAX_HASHED_FILE = 256 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")
_KEY = re.compile(r"[0-9a-f]{32}")


def _hub_snapshot(model_id: str, revision: str, identity: dict[str, Any] | None) -> Path | None:
    """The local snapshot folder of ``model_id`` that transformers loads, when it is the
    commit ``identity`` (the cache's :func:`~hf_pipeline.encoder.model.encoder_identity`)
    names; else None."""
    commit = identity.get("revision") if identity else None
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        return None  # without the fingerprint's commit the snapshot may be another
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}"
    if not _COMMIT.fullmatch(revision):
        try:  # what transformers resolves the branch or tag to, offline
            local = (repo / "refs" / (revision or "main")).read_text(errors="replace").strip()
        except (OSError, ValueError):
            return None
        if local != commit:
            return None
    elif revision != commit:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _files_digest(folder: Path) -> list[list[Any]]:
    """``[relative path, size, sha256 | None]`` of the folder's files that are not
    weights (hidden ones left out, as in the encoder's identity); raises OSError."""
    out: list[list[Any]] = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        size = p.stat().st_size
        digest = None
        if size <= _MAX_HASHED_FILE:
            with open(p, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        out.append([rel.as_posix(), size, digest])
    return out


def store_key(cfg: EncoderConfig, identity: dict[str, Any] | None = None) -> str | None:
    """The key of ``cfg``'s exported tokenizer in the store (32 hex digits), or None when
    its files are not local (a Hub id without the snapshot ``identity`` names): then the
    tokenizer loads through transformers, as without a store.

    Args:
        cfg: the encoder's settings (``model``, ``revision``).
        identity: the cache's :func:`~hf_pipeline.encoder.model.encoder_identity` (needed
            for a Hub id: its ``revision`` is the commit the fingerprint names).
    """
    from importlib.metadata import PackageNotFoundError, version

    path = resolve_encoder_path(cfg.model)
    folder = Path(path) if Path(path).is_dir() else _hub_snapshot(path, cfg.revision, identity)
    if folder is None:
        return None
    try:
        files = _files_digest(folder)
    except OSError as exc:
        log.info("tokenizer store: %s not read (%s); loading with transformers", folder, exc)
        return None
    versions: dict[str, str | None] = {}
    for name in ("tokenizers", "transformers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    text = json.dumps(
        {"schema": _SCHEMA, "files": files, "versions": versions},
        sort_keys=True, separators=(",", ":"),
    )  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredTokenizer:
    """A tokenizer found in the store (or read from the model folder:
    :func:`folder_tokenizer`): ``spec`` (its backend in a private folder, with the pad
    id) and ``key``, the token units' key
    (:func:`~hf_pipeline.build.part_store.tokenizer_key` of the tokenizer it came from)."""

    spec: TokenizerSpec
    key: str


def folder_tokenizer(cfg: EncoderConfig, into: str | os.PathLike) -> StoredTokenizer | str:
    """``cfg``'s tokenizer read from its model folder without transformers
    (:func:`~hf_pipeline.encoder.bert_tokenizer.native_tokenizer`: BERT's fast tokenizer,
    all-MiniLM-L6-v2's) as the store gives one, its backend written to
    ``into/tokenizer.json``; or why not (one line: then the store, else transformers).
    Its key is the one transformers' tokenizer of that folder has (the same backend and
    settings): token units made by either serve the other."""
    from hf_pipeline.build.part_store import backend_tokenizer_key
    from hf_pipeline.encoder.bert_tokenizer import native_tokenizer

    spec = native_tokenizer(cfg, into)
    if isinstance(spec, str):
        return spec
    key = backend_tokenizer_key(
        Path(spec.path).read_text(), max_length=spec.max_length, truncation_side=spec.direction,
        split_special_tokens=spec.split_special_tokens,
    )  # fmt: skip
    return StoredTokenizer(spec=spec, key=key)


def _read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a symlink) of at most ``limit``
    bytes, else None (absent, foreign or unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, size = [], 0
        while size <= limit:  # the size checked above may grow while we read
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks) if size <= limit else None


class TokenizerSpecStore:
    """The exported tokenizers under a cache root (the module docstring).

    Args:
        folder: ``<cache root>/.tokenizers``.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"key must be 32 hex digits, got {key!r}")
        return self.folder / f"{key}.spec"

    def load(
        self, key: str, into: str | os.PathLike, *, max_length: int | None = None
    ) -> StoredTokenizer | None:
        """The tokenizer stored under ``key``, its backend written to ``into/tokenizer.json``
        (a private copy: the shared entry may change after this check); None when there
        is none or it does not check out (the module docstring). With ``max_length``
        (``encoder.max_length``) its spec truncates there and its token units' key is
        that length's (default: the length of the build that saved it)."""
        path = self._path(key)
        data = _read_regular(path, MAX_ENTRY_BYTES)
        if data is None:
            return None
        found = self._parse(key, data)
        if isinstance(found, str):
            log.warning("tokenizer store: %s ignored (%s); exporting it again", path, found)
            return None
        info, backend = found
        tok_key = info["tokenizer_key"]
        if max_length is not None and max_length != info["max_length"]:
            from hf_pipeline.build.part_store import backend_tokenizer_key

            if max_length < 1:
                raise ValueError(f"max_length must be >= 1, got {max_length}")
            tok_key = backend_tokenizer_key(
                backend.decode(), max_length=max_length, truncation_side=info["direction"],
                split_special_tokens=info["split_special_tokens"],
            )  # fmt: skip
            info = {**info, "max_length": max_length}
        out = Path(into) / "tokenizer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(backend)
        spec = TokenizerSpec(
            path=str(out), max_length=info["max_length"], direction=info["direction"],
            split_special_tokens=info["split_special_tokens"],
            pad_token_id=info["pad_token_id"],
        )  # fmt: skip
        return StoredTokenizer(spec=spec, key=tok_key)

    @staticmethod
    def _parse(key: str, data: bytes) -> tuple[dict[str, Any], bytes] | str:
        """The entry's settings and backend, or why it is not used."""
        from hf_pipeline.build.part_store import backend_tokenizer_key

        meta, newline, backend = data.partition(b"\n")
        if not newline or len(meta) > _MAX_META_BYTES:
            return "no settings line"
        try:
            info = json.loads(meta)
        except (ValueError, RecursionError):
            return "settings are not JSON"
        if not isinstance(info, dict):
            return "settings are not an object"
        shape = {
            "kind": str, "schema": int, "key": str, "max_length": int, "direction": str,
            "split_special_tokens": bool, "pad_token_id": int, "tokenizer_key": str,
            "backend_bytes": int, "backend_sha256": str,
        }  # fmt: skip
        if set(info) != set(shape) or any(type(info[k]) is not t for k, t in shape.items()):
            return "settings of another shape"
        if info["kind"] != _KIND or info["schema"] != _SCHEMA:
            return f"kind {info['kind']!r} schema {info['schema']!r}"
        if info["key"] != key:
            return f"an entry of key {info['key']!r}"
        if info["max_length"] < 1 or info["direction"] not in ("left", "right"):
            return "max_length or direction out of range"
        if len(backend) != info["backend_bytes"]:
            return f"backend of {len(backend)} bytes, {info['backend_bytes']} expected"
        if hashlib.sha256(backend).hexdigest() != info["backend_sha256"]:
            return "backend checksum mismatch"
        from tokenizers import Tokenizer

        try:
            text = backend.decode()
            vocab = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
            tok_key = backend_tokenizer_key(
                text, max_length=info["max_length"], truncation_side=info["direction"],
                split_special_tokens=info["split_special_tokens"],
            )  # fmt: skip
        # tokenizers raises its own Exception for a backend it cannot read.
        except Exception as exc:  # noqa: BLE001 - a foreign entry is absent, whatever it holds
            return f"backend not loadable: {type(exc).__name__}: {str(exc)[:200]}"
        if not 0 <= info["pad_token_id"] < vocab:
            return f"pad id {info['pad_token_id']} outside the vocabulary of {vocab}"
        if tok_key != info["tokenizer_key"]:
            return "token units' key does not match the backend"
        return info, backend

    def save(self, key: str, spec: TokenizerSpec, tokenizer_key: str) -> bool:
        """Store ``spec`` (its backend file read whole) under ``key`` for later builds;
        True if saved. Best effort: a root that cannot take it only logs."""
        path = self._path(key)
        if spec.pad_token_id is None:
            return False
        try:
            backend = Path(spec.path).read_bytes()
        except OSError as exc:
            log.info("tokenizer store: %s not read: %s", spec.path, exc)
            return False
        info = {
            "kind": _KIND, "schema": _SCHEMA, "key": key, "max_length": spec.max_length,
            "direction": spec.direction, "split_special_tokens": spec.split_special_tokens,
            "pad_token_id": spec.pad_token_id, "tokenizer_key": tokenizer_key,
            "backend_bytes": len(backend),
            "backend_sha256": hashlib.sha256(backend).hexdigest(),
        }  # fmt: skip
        data = json.dumps(info, sort_keys=True).encode() + b"\n" + backend
        if len(data) > MAX_ENTRY_BYTES:
            return False  # it would never be read
        try:
            # A real folder, never a link someone put in a shared root (refused: a
            # ForeignCacheFolderError is no OSError, not merely logged).
            own_folder(self.folder.parent, self.folder.name)
            # Replace, not link: what is there was not used (a miss), so it is damaged or
            # the same bytes from another builder.
            with atomic_write(path) as f:
                f.write(data)
            return True
        except OSError as exc:
            log.info("tokenizer store: %s not saved: %s", path, exc)
            return False
