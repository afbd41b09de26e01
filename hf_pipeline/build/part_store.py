"""Built parts stored by their own identity, found by every later cache of one cache root.

A cache is assembled from *parts* (contiguous shard ranges, :mod:`hf_pipeline.build.parts`).
Each part's latents, its captions and its embeddings are stored once, under the cache
root, by what shapes their bytes, not by the cache that first needed them::

    <cache_root>/.parts/
      captions-<meta>/        the key-sorted caption table of one metadata file and
                              caption column
      join-<part>/            a part's latents: rows/data*.arrow (key, latents,
                              drop_reason: the latent-side reason, ``nonfinite_latents``
                              or kept); no caption, so no metadata in its identity
      text-<part>-<meta>/     its captions from one caption table: captions/data.arrow
                              (caption, drop_reason: the pre-duplicate reason)
      tokens-<part>-<meta>-<tok>/  its captions' token ids under one tokenizer and
                              max_length: tokens/data*.arrow (input_ids), written by the
                              ``num_proc`` workers (:mod:`hf_pipeline.build.tokens`)
      embed-<part>-<meta>-<enc>/  its embeddings under one encoder:
                              embeddings/data.arrow (embedding, input_ids, drop_reason)

Latents and captions are apart so that a new caption column (or a metadata file whose
captions differ) re-joins captions only: a ``text`` unit is computed from its part's
stored keys (the key column of the latents files, memory-mapped: not one latent byte
read) and the caption table, and writes no latent byte. Two caption columns, like two
encoders, cost the latents once on disk.

Every one of them is a cache unit of :mod:`dist.coordinator`: built in its lease's own
folder, published by a marker created last (never overwritten), taken over when its
builder dies, fenced against a builder that lost its lease. A part is never half
visible, and a SIGKILLed build leaves only an unpublished folder that the next builder
of that unit collects. A cache's ``converted`` stage hard-links the published files
(:func:`hf_pipeline.build.parts.assemble`): latent bytes are written once per part,
whatever the number of caches (encoders, caption columns, appended inputs) that use it.
Each unit's marker names the units it reads in ``uses`` (an embedding its ``text`` and
its ``tokens``, a ``tokens`` its ``text``, a ``text`` its ``join`` and caption table),
which ``--clean`` keeps while it is in use.

The token ids (:func:`tokenizer_key`, ``<tok>``) depend on the captions and on the
tokenizer alone: the serialized tokenizer (its Rust backend's JSON, the vocabulary and
normalizer and post-processor included), ``max_length``, the truncation side and
``split_special_tokens``; not the model's weights, dtype, pooling or output dtype. An
encoder with the same tokenizer (a fine-tuned or another-sized checkpoint of one
family, a new ``output_dtype``) reuses them; another tokenizer or ``max_length``
recomputes them alone. Their key is the tokenizer's content, so two model folders
that ship the same tokenizer share one unit. The ``embed`` unit keeps its id (the
encoder's key covers the tokenizer too): embeddings stored by a release without
``tokens`` units are still found, and only a missing embedding needs its tokens.

Identity (:func:`join_id`): the fields that shape the latents (``on_missing``,
``on_bad_rows``, ``latent_dtype``) and the part's shards' ``(name, size, etag)``, under
:data:`PART_SCHEMA` (``<part>``). Not ``data.key_column``: it names the *metadata's*
key column, so it shapes the captions (:func:`captions_id`, ``<meta>``), as the caption
column does. A ``text`` unit depends on the metadata only through the caption rows its
keys match, so one stored under another caption table is reused when those rows are
the same: its marker records :func:`caption_digest` of them, and a build compares it
with the digest of the same keys in its own caption table. New metadata rows for new
shards then cost only the new parts' captions (and their embeddings).

Boundaries (:func:`plan_content_parts`): content-defined, so that inserting a shard
moves no boundary but its own part's: a part ends after shard ``i`` when a hash of
``i``'s *name* is 0 modulo the average part size (between a minimum and a maximum
size). Fixed-size parts would shift every boundary after an inserted shard and so
re-join every later part. The name, not the whole identity: a shard whose bytes
change keeps the boundaries, and only its own part is re-joined.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_pipeline.build.parts import PartPlan
from hf_pipeline.cache.layout import PARTS_DIR

__all__ = [
    "DEFAULT_PART_SHARDS",
    "PARTS_DIR",
    "PART_SCHEMA",
    "backend_tokenizer_key",
    "StoredPart",
    "caption_digest",
    "captions_id",
    "encoder_key",
    "join_id",
    "part_bounds",
    "plan_content_parts",
    "store_dir",
    "stored_parts",
    "tokenizer_key",
]

#: Bump when a stored part's files or the meaning of a column change. 2: the captions
#: left the ``join`` units (latents only) for ``text`` units of their own.
PART_SCHEMA = 2
#: The average part size in shards when ``build.part_shards`` is 0 (a constant: a size
#: that followed the input's length would move every boundary when shards are added).
DEFAULT_PART_SHARDS = 16

#: The config fields that shape a part's latents (its ``join`` unit). Not the key or
#: caption column (the metadata's: :func:`captions_id`), not the encoder.
_JOIN_FIELDS = (
    ("data", "on_missing"),
    ("data", "on_bad_rows"),
    ("build", "latent_dtype"),
)


def store_dir(cache_root: str | Path) -> Path:
    """The stored parts of ``cache_root``."""
    return Path(cache_root) / PARTS_DIR


def _digest(payload: Any, n: int = 32) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def _plain(identity: Sequence[Any]) -> list[Any]:
    return [v if isinstance(v, (str, int, float, bool)) or v is None else str(v) for v in identity]


def captions_id(cfg, metadata: Sequence[Any]) -> str:
    """The caption table's identity: the metadata file's ``(name, size, etag)`` and the
    key and caption columns."""
    return _digest(
        {
            "schema": PART_SCHEMA,
            "metadata": _plain(metadata),
            "key_column": cfg.data.key_column,
            "caption_column": cfg.data.caption_column,
        }
    )


def join_id(cfg, shards: Sequence[Sequence[Any]]) -> str:
    """A part's identity, that of its latents (its ``join`` unit): the module docstring.

    Args:
        cfg: the :class:`hf_pipeline.config.Config`.
        shards: the part's shards' ``(name, size, etag)``, in build order.
    """
    fields = {f"{a}.{b}": getattr(getattr(cfg, a), b) for a, b in _JOIN_FIELDS}
    return _digest({"schema": PART_SCHEMA, "fields": fields, "shards": [_plain(s) for s in shards]})


def caption_digest(table, keys) -> str:
    """A digest of what the caption table gives ``keys`` (in order): for each key,
    whether it has a metadata row and its caption's bytes (or null). A ``text`` unit's
    output is a function of its part's latents unit and exactly this.

    Args:
        table: a :class:`hf_pipeline.build.captions.CaptionTable`.
        keys: the part's keys, in row order (int64).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = np.ascontiguousarray(np.asarray(keys, dtype="<i8"))
    caps, found = table.lookup(keys)
    caps = pa.concat_arrays([caps.cast(pa.large_binary())]) if len(caps) else caps
    h = hashlib.sha256()
    h.update(keys.tobytes())
    h.update(np.asarray(found, dtype=np.uint8).tobytes())
    lengths = pc.fill_null(pc.binary_length(caps), -1).to_numpy(zero_copy_only=False)
    h.update(np.asarray(lengths, dtype="<i8").tobytes())
    for value in caps.drop_null().to_pylist() if len(caps) else []:
        h.update(value)
    return h.hexdigest()[:32]


def encoder_key(encoder: Mapping[str, Any]) -> str:
    """16 hex digits of an encoder's identity
    (:func:`hf_pipeline.encoder.model.encoder_identity`)."""
    return _digest({k: encoder[k] for k in sorted(encoder)}, 16)


#: Bump when a ``tokens`` unit's file or the meaning of its ids change.
_TOKENS_SCHEMA = 1


def tokenizer_key(tokenizer) -> str:
    """16 hex digits of a tokenizer's identity (the module docstring): what shapes the
    token ids of a :class:`hf_pipeline.encoder.model.CaptionTokenizer`.

    With a Rust backend (every fast tokenizer), the backend as the workers load it
    (:meth:`~hf_pipeline.encoder.model.CaptionTokenizer.export`'s JSON) and the call's
    settings; without one, the tokenizer's class, vocabulary and init settings.
    """
    hf = tokenizer.tokenizer
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return backend_tokenizer_key(
            backend.to_str(), max_length=int(tokenizer.max_length),
            truncation_side=getattr(hf, "truncation_side", "right"),
            split_special_tokens=bool(getattr(hf, "split_special_tokens", False)),
        )  # fmt: skip
    vocab = json.dumps(sorted(hf.get_vocab().items()), separators=(",", ":")).encode()
    content = {
        "class": type(hf).__name__,
        "vocab": hashlib.sha256(vocab).hexdigest(),
        "init": {k: v for k, v in hf.init_kwargs.items() if k != "name_or_path"},
    }
    return _digest(
        {
            "schema": _TOKENS_SCHEMA,
            **content,
            "max_length": int(tokenizer.max_length),
            "truncation_side": getattr(hf, "truncation_side", "right"),
            "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
        },
        16,
    )


def backend_tokenizer_key(
    backend_json: str, *, max_length: int, truncation_side: str, split_special_tokens: bool
) -> str:
    """:func:`tokenizer_key` of a tokenizer with a Rust backend, from the backend's JSON
    (as exported) and the call's settings: what a stored spec
    (:mod:`hf_pipeline.build.tokenizer_store`) is checked against, without transformers."""
    # Without the truncation and padding the last call left in the backend (the
    # workers set their own: WorkerTokenizer): a key must not depend on that call.
    state = {k: v for k, v in json.loads(backend_json).items()
             if k not in ("truncation", "padding")}  # fmt: skip
    blob = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
    content = {"backend": hashlib.sha256(blob).hexdigest()}
    return _digest(
        {
            "schema": _TOKENS_SCHEMA,
            **content,
            "max_length": int(max_length),
            "truncation_side": truncation_side,
            "split_special_tokens": bool(split_special_tokens),
        },
        16,
    )


def part_bounds(average: int) -> tuple[int, int]:
    """``(min, max)`` shards of a part whose average is ``average`` (>= 1): a quarter
    and four times it, so that a run of unlucky hashes neither makes a part per
    shard nor one part of everything."""
    if average < 1:
        raise ValueError(f"average must be >= 1, got {average}")
    return max(1, average // 4), average * 4


def _cuts_after(name: str, average: int) -> bool:
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return h % average == 0


def plan_content_parts(names: Sequence[str], average: int) -> list[PartPlan]:
    """Content-defined parts of the shard list (the module docstring says why).

    Args:
        names: the shard file names, in build order.
        average: the average part size in shards (>= 1; 1: a part per shard).

    Returns:
        Contiguous parts covering every shard, in order (one empty part for no shards).
    """
    low, high = part_bounds(average)
    plans: list[PartPlan] = []
    start = 0
    for i, name in enumerate(names):
        size = i + 1 - start
        if size >= high or (size >= low and _cuts_after(name, average)):
            plans.append(PartPlan(len(plans), start, i + 1))
            start = i + 1
    if start < len(names) or not plans:
        plans.append(PartPlan(len(plans), start, len(names)))
    return plans


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredPart:
    """One part of a build and where the store keeps it.

    Attributes:
        plan: the part's shard range in this build.
        part: its identity, that of its latents (:func:`join_id`).
        captions: the caption table its captions are stored under (16 hex digits of
            :func:`captions_id`): this build's, or the one of a stored ``text`` unit
            reused because its captions are the same.
        encoder: the encoder's key (:func:`encoder_key`).
        store: the store folder (:func:`store_dir`).
        tokenizer: the tokenizer's key (:func:`tokenizer_key`), once it is loaded
            (``""`` before: :attr:`tokens_id` is then unknown).
    """

    plan: PartPlan
    part: str
    captions: str
    encoder: str
    store: Path
    tokenizer: str = ""

    @property
    def join_id(self) -> str:
        """The latents unit's id (no captions in it)."""
        return self.part

    @property
    def text_id(self) -> str:
        return f"{self.part}-{self.captions}"

    @property
    def tokens_id(self) -> str:
        if not self.tokenizer:
            raise ValueError(f"part {self.part}: the tokenizer's key is not known yet")
        return f"{self.text_id}-{self.tokenizer}"

    @property
    def embed_id(self) -> str:
        return f"{self.text_id}-{self.encoder}"

    @property
    def join_dir(self) -> Path:
        return self.store / f"join-{self.join_id}"

    @property
    def text_dir(self) -> Path:
        return self.store / f"text-{self.text_id}"

    @property
    def tokens_dir(self) -> Path:
        return self.store / f"tokens-{self.tokens_id}"

    @property
    def embed_dir(self) -> Path:
        return self.store / f"embed-{self.embed_id}"


def stored_parts(
    cfg, *, shards: Sequence[Any], metadata: Sequence[Any], encoder: Mapping[str, Any]
) -> list[StoredPart]:
    """The parts of a build of ``shards`` (``RemoteFile`` s, in build order), each with
    its identity and its store folders under ``cfg.cache_root``."""
    average = cfg.build.part_shards or DEFAULT_PART_SHARDS
    plans = plan_content_parts([f.name for f in shards], average)
    key, root = encoder_key(encoder), store_dir(cfg.cache_root)
    return [
        StoredPart(
            plan=p,
            part=join_id(cfg, [f.identity() for f in shards[p.start : p.stop]]),
            captions=captions_id(cfg, metadata)[:16],
            encoder=key,
            store=root,
        )
        for p in plans
    ]
