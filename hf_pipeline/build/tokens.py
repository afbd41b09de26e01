"""Stage 1b, the token ids: a part's captions -> ``input_ids``, by the ``num_proc`` workers.

A part's token ids are a store unit of their own (``tokens-<part>-<captions>-<tokenizer>``,
:mod:`hf_pipeline.build.part_store`): they depend on the captions (the part's ``text``
unit) and on the tokenizer with its ``max_length`` (:func:`~hf_pipeline.build.part_store.tokenizer_key`),
not on the encoder's weights. So an encoder with the same tokenizer reuses them, and
another tokenizer or ``max_length`` recomputes them alone.

:func:`tokenize_part` hands slices of the part's rows (two per worker, at most ``batch_rows`` each) to the
build's :class:`TokenizerPool`: ``num_proc`` worker processes started once per build
(forked by the build's clean fork server, :mod:`hf_pipeline.workers.pool`, reused by
every part: :mod:`hf_pipeline.workers.persistent`), each of which loaded the tokenizer's
Rust backend once (:class:`~hf_pipeline.encoder.model.WorkerTokenizer`, from the
:class:`~hf_pipeline.encoder.model.TokenizerSpec` the builder exported). A worker opens
the caption file by path (memory-mapped) and sends back its slice's ids as one Arrow
list array; the builder writes the unit's one file. Before, a ``Dataset.map(num_proc)``
per part started a pool per part whose workers each loaded the tokenizer again, and
paid ``datasets``' map (fingerprint, a file per worker): measured on 2 CPUs, see
benchmarks/NOTES.md. Why workers and not threads of the builder: the builder's process
runs the encoder's thread and the next part's join on every CPU at once; 16 tokenizing
threads there made a 1M-row embed stage 0.17x its bare forward on a 16-CPU H200 host
(docs/performance.md). The build's tokens thread calls it, at most
``TOKENS_LOOKAHEAD`` parts ahead of the embedding (:mod:`hf_pipeline.build.prepare`),
while the main loop joins the next part and the embedding's thread embeds an earlier
one (called between two joins, on the main loop, it kept a 1M-row build's joins waiting
26 s; called on the embedding's thread just before the part's embedding, a
re-embedding, which joins nothing, took the sum of tokenizing and embedding).

A worker tokenizes on one thread (``TOKENIZERS_PARALLELISM=false`` in the worker): the
pool is the parallelism, and ``encode_batch``'s own thread pool in each of ``num_proc``
workers would put ``num_proc`` threads per CPU.

The file, row-aligned with the captions: ``input_ids`` (``list<int32>``), the ids of
every row whose pre-duplicate reason is kept, an empty list elsewhere (the schema the
``datasets`` map wrote; units of earlier versions, one file per worker, read the same).
The embedding (:func:`hf_pipeline.build.embed_stage.embed_joined_rows`) encodes the rows
that stay kept after duplicates and writes their ids beside the embeddings, as before.
A lost lease (``probe``) stops the part at its next slice; the unit is published by the
caller (a store unit: atomically, or not at all).

**Another ``max_length``, derived.** Truncation cuts a caption's ids before the special
tokens are added (``tokenizers``: truncate to ``max_length`` minus the specials, then
the post-processor wraps the ids in the same prefix and suffix whatever their length).
So the ids of a shorter ``max_length`` are those of a longer one cut to it: the prefix,
the caption's first ids (its last: left truncation), the suffix; and a row that was not
cut at a length is the same at every longer one. :func:`derive_part` makes a part's
token ids from a stored unit of the same tokenizer (:func:`tokenizer_family`: its
backend and settings but ``max_length``) that way, re-tokenizing only the rows the
stored length may have cut (at most a quarter, else the part is tokenized whole).
Before it writes, it tokenizes a sample of the rows (every one it cut, up to
:data:`CHECK_ROWS`, and as many others) and compares: a tokenizer for which the rule does
not hold is found there, and the part is tokenized as before. A re-embedding at half
the ``max_length`` tokenized 1M captions again on its critical path (issue 26: 2.0-2.7x
the embed stage of a full build on an H200 host, against 1.2).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hf_pipeline.build.accounting import keep_mask
from hf_pipeline.build.embed_stage import tokenize_kept
from hf_pipeline.encoder.model import TokenizerSpec, WorkerTokenizer
from hf_pipeline.workers.persistent import PersistentPool

__all__ = [
    "CHECK_ROWS",
    "TOKENS_FILE",
    "TokenizerPool",
    "derive_part",
    "tokenize_part",
    "tokenizer_family",
]

log = logging.getLogger(__name__)

#: Rows of a derived part tokenized again and compared before it is written: up to this
#: many of the rows the derivation cut, and as many others (:func:`derive_part`).
CHECK_ROWS = 256

#: The most rows of a part :func:`derive_part` tokenizes again (the rows a shorter stored
#: ``max_length`` may have cut), as a share of its kept rows; beyond it the part is
#: tokenized whole, by the pool's workers.
_MOST_RETOKENIZED = 0.25

#: The unit's file, under its folder (units of earlier versions: ``tokens/data*.arrow``).
TOKENS_FILE = Path("tokens") / "data.arrow"


def _load(spec: TokenizerSpec) -> dict[str, Any]:
    """A pool worker's state: its tokenizer, loaded once (run in the worker)."""
    # One thread per worker: the pool's processes are the parallelism (module docstring).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return {"tokenizer": WorkerTokenizer(spec), "files": None, "columns": None}


def _tokenize_slice(state: dict[str, Any], task: tuple[tuple[str, ...], int, int]) -> dict:
    """A pool worker's task: the ids of rows ``[start, stop)`` of the caption files
    (``list<int32>``; an empty list where the row is not kept), with its timeline."""
    from hf_pipeline.build.parts import read_column

    files, start, stop = task
    t0 = time.time()  # wall clock: the timeline compares processes
    if state["files"] != files:  # memory-mapped once per part
        paths = [Path(f) for f in files]
        state["columns"] = (read_column(paths, "caption"), read_column(paths, "drop_reason"))
        state["files"] = files
    captions, reasons = (c.slice(start, stop - start).combine_chunks() for c in state["columns"])
    ids = tokenize_kept(captions, keep_mask(reasons), state["tokenizer"], threads=1)
    return {"ids": ids, "pid": os.getpid(), "start": t0, "end": time.time()}


@functools.lru_cache(maxsize=2)
def _in_process(spec: TokenizerSpec) -> WorkerTokenizer:
    """The tokenizer of ``spec`` in this process (``num_proc`` 1), loaded once for every
    part of a build, as a pool worker loads it once."""
    return WorkerTokenizer(spec)


class TokenizerPool(PersistentPool):
    """The build's tokenizing workers: ``num_proc`` processes, each with the tokenizer of
    ``spec`` loaded once, started on the first part and reused by every later one
    (:mod:`hf_pipeline.workers.persistent`). Close it (a context manager) when the build
    ends."""

    def __init__(self, spec: TokenizerSpec, *, num_proc: int):
        super().__init__(
            setup=_load, arg=spec, work=_tokenize_slice, num_proc=num_proc,
            name="hf_pipeline-tokenize",
        )  # fmt: skip
        self.spec = spec


def _write(out: Path, ids: pa.Array, writer_batch_size: int) -> None:
    """The unit's file, as ``datasets`` writes it (its ``Features`` in the schema)."""
    from datasets import Features, List, Value
    from datasets.arrow_writer import ArrowWriter

    features = Features({"input_ids": List(Value("int32"))})
    with ArrowWriter(features=features, path=str(out), writer_batch_size=writer_batch_size) as w:
        if len(ids):
            w.write_table(pa.table({"input_ids": ids}), writer_batch_size)
        w.finalize()


def tokenize_part(
    caption_files: Sequence[Path],
    *,
    tokenizer,
    pool: TokenizerPool | None,
    probe,
    out_dir: Path,
    batch_rows: int,
    writer_batch_size: int,
    timeout: float,
) -> dict[str, Any]:
    """Tokenize a part's captions (its ``text`` unit's published ``caption_files``) into
    ``out_dir/tokens/data.arrow`` with the ``pool``'s workers.

    Args:
        tokenizer: a :class:`~hf_pipeline.encoder.model.TokenizerSpec` (the ``pool``'s),
            or a tokenizer without a Rust backend (called in this process: it cannot be
            handed to a worker; ``pool`` is then None).
        pool: the build's :class:`TokenizerPool`; None: the tokenizer runs in this
            process, on one thread (``num_proc`` 1: no worker process at all).
        probe: a :class:`dist.lease.LeaseProbe` checked before every slice and while
            waiting.
        batch_rows: rows per worker task at most (each worker gets two at least).
        timeout: seconds the part may take (the build's ``coord.max_wait``).

    Returns:
        The unit's timeline: ``rows``, ``num_proc``, ``worker_pids`` (the processes
        that tokenized), ``worker_busy_seconds`` and ``seconds_tokenize`` (the wall).

    Raises:
        dist.lease.LeaseLostError: the probe's lease was taken over.
        TimeoutError: the part took longer than ``timeout``.
        hf_pipeline.workers.persistent.WorkerExitedError: a worker died.
    """
    from hf_pipeline.build.parts import read_column

    t0 = time.monotonic()
    files = tuple(str(f) for f in caption_files)
    probe.check()  # never re-create a lost lease's folder
    out = out_dir / TOKENS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [Path(f) for f in files]
    reasons = read_column(paths, "drop_reason")  # memory-mapped: no caption read
    rows = len(reasons)
    # Every worker gets work (two slices each, so a slow one delays the part less),
    # at most batch_rows per tokenizer call.
    procs = pool.num_proc if pool is not None else 1
    step = max(1, min(batch_rows, -(-rows // (2 * procs))))
    times: list[dict[str, Any]] = []
    if pool is not None and rows:
        if tokenizer != pool.spec:
            raise ValueError(f"the pool's tokenizer is {pool.spec}, the part's {tokenizer}")
        tasks = [(files, a, min(a + step, rows)) for a in range(0, rows, step)]
        done = pool.run(tasks, timeout=timeout, check=probe.check)
        ids = pa.concat_arrays([d["ids"] for d in done])
        times = [{k: d[k] for k in ("pid", "start", "end")} for d in done]
    elif rows:  # num_proc 1 (no worker process), or a tokenizer no worker can load
        if isinstance(tokenizer, TokenizerSpec):
            tokenizer = _in_process(tokenizer)
        keep = keep_mask(reasons.combine_chunks())
        ids = tokenize_kept(read_column(paths, "caption"), keep, tokenizer, threads=1)
    else:
        ids = pa.array([], pa.list_(pa.int32()))
    probe.check()  # nothing written for a lost lease
    _write(out, ids, writer_batch_size)
    return {
        "rows": rows,
        "num_proc": procs,
        "worker_pids": sorted({int(t["pid"]) for t in times}),
        "worker_busy_seconds": round(sum(t["end"] - t["start"] for t in times), 3),
        "seconds_tokenize": round(time.monotonic() - t0, 3),
    }


@functools.lru_cache(maxsize=4)
def tokenizer_family(spec: TokenizerSpec) -> str:
    """What two tokenizers must share for one's ids to be derived from the other's: the
    key of :func:`~hf_pipeline.build.part_store.tokenizer_key` without ``max_length``
    (the backend's content, truncation side, special-token splitting). Once per build
    (a large vocabulary's backend is tens of MB of JSON)."""
    from hf_pipeline.build.part_store import backend_tokenizer_key

    return backend_tokenizer_key(
        Path(spec.path).read_text(encoding="utf-8"), max_length=0,
        truncation_side=spec.direction, split_special_tokens=spec.split_special_tokens,
    )  # fmt: skip


def _specials(tok: WorkerTokenizer) -> tuple[int, int] | None:
    """How many special tokens the tokenizer puts before and after a caption's ids (the
    same for any caption), or None where its output is not that shape."""
    backend = tok.tokenizer
    found = set()
    for text in ("a", "hello world, 1234", "Ünïcode ☃ text"):
        core = backend.encode(text, add_special_tokens=False).ids
        full = backend.encode(text, add_special_tokens=True).ids
        if not core or len(full) < len(core):
            return None
        cut = [i for i in range(len(full) - len(core) + 1) if full[i : i + len(core)] == core]
        if len(cut) != 1:
            return None
        found.add((cut[0], len(full) - cut[0] - len(core), tuple(full[: cut[0]]),
                   tuple(full[cut[0] + len(core) :])))  # fmt: skip
    if len(found) != 1:
        return None
    prefix, suffix, _, _ = found.pop()
    return prefix, suffix


def _take_rows(values: np.ndarray, head_start, head_len, tail_start, tail_len) -> pa.Array:
    """A ``list<int32>`` array whose row ``i`` is ``values[head_start[i]:][:head_len[i]]``
    followed by ``values[tail_start[i]:][:tail_len[i]]`` (vectorized)."""
    lengths = head_len + tail_len
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row = np.repeat(np.arange(len(lengths)), lengths)
    j = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][row]
    idx = np.where(j < head_len[row], head_start[row] + j, tail_start[row] + (j - head_len[row]))
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values[idx].astype(np.int32, copy=False))
    )


def derive_part(
    source_files: Sequence[Path],
    source_max_length: int,
    caption_files: Sequence[Path],
    *,
    spec: TokenizerSpec,
    probe,
    out_dir: Path,
    writer_batch_size: int,
    threads: int = 1,
) -> dict[str, Any] | None:
    """A part's token ids at ``spec.max_length`` from a stored unit of the same tokenizer
    at ``source_max_length`` (its ``source_files``), into ``out_dir/tokens/data.arrow``
    as :func:`tokenize_part` writes them (the module docstring says why that is exact).

    Returns:
        The unit's timeline (:func:`tokenize_part`'s keys, with ``derived_rows``,
        ``tokenized_rows`` and ``checked_rows``), or None where the part must be
        tokenized whole: the tokenizer's output is not prefix + ids + suffix, the stored
        unit does not match the captions, too many rows need tokenizing again, or a
        sampled row's ids differ from the tokenizer's (logged: a tokenizer the rule does
        not hold for).
    """
    from hf_pipeline.build.parts import read_column

    t0 = time.monotonic()
    probe.check()
    caption_paths = [Path(f) for f in caption_files]
    reasons = read_column(caption_paths, "drop_reason").combine_chunks()
    keep = keep_mask(reasons)
    rows, length = len(keep), int(spec.max_length)
    source = read_column(list(source_files), "input_ids").combine_chunks()
    if len(source) != rows or source.null_count:
        return None
    tok = _in_process(spec)
    specials = _specials(tok)
    if specials is None or min(length, source_max_length) <= sum(specials):
        return None
    prefix, suffix = specials
    offsets = source.offsets.to_numpy().astype(np.int64)
    values = source.values.to_numpy(zero_copy_only=False)
    starts, ends = offsets[:-1], offsets[1:]
    have = ends - starts
    if np.any((have > 0) != keep):  # not this text's ids
        return None
    # Rows the stored length may have cut, and that are longer now: tokenized again.
    again = keep & (have >= source_max_length) if length > source_max_length else None
    cut = keep & (have > length)  # rows longer than the new length: cut to it
    if again is not None and again.sum() > _MOST_RETOKENIZED * max(1, keep.sum()):
        return None
    head = np.where(cut, length - suffix if spec.direction == "right" else prefix, have)
    tail = np.where(cut, length - head, 0)
    tail_start = ends - tail
    captions = read_column(caption_paths, "caption")  # memory-mapped
    if again is not None and again.any():
        fresh = tokenize_kept(captions, again, tok, threads=threads)
        fresh_offsets = fresh.offsets.to_numpy().astype(np.int64)
        base = len(values)
        values = np.concatenate([values, fresh.values.to_numpy(zero_copy_only=False)])
        starts = np.where(again, base + fresh_offsets[:-1], starts)
        head = np.where(again, fresh_offsets[1:] - fresh_offsets[:-1], head)
        tail = np.where(again, 0, tail)
    ids = _take_rows(values, starts, head, tail_start, tail)
    # The proof on this data: the rows it cut (up to CHECK_ROWS) and as many others,
    # tokenized and compared.
    sample = np.concatenate([_spread(np.flatnonzero(cut), CHECK_ROWS),
                             _spread(np.flatnonzero(keep & ~cut), CHECK_ROWS)])  # fmt: skip
    if len(sample):
        texts = captions.take(pa.array(sample)).to_pylist()
        want = tok(texts)
        got = ids.take(pa.array(sample)).to_pylist()
        if want != got:
            bad = next(int(r) for r, w, g in zip(sample, want, got, strict=True) if w != g)
            log.warning(
                "token ids of %s derived from max_length %d differ from the tokenizer's "
                "at row %d: tokenizing the part instead", out_dir, source_max_length, bad,
            )  # fmt: skip
            return None
    probe.check()  # nothing written for a lost lease
    out = out_dir / TOKENS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, ids, writer_batch_size)
    return {
        "rows": rows,
        "num_proc": 1,
        "worker_pids": [],
        "worker_busy_seconds": 0.0,
        "seconds_tokenize": round(time.monotonic() - t0, 3),
        "derived_rows": int(keep.sum()) - int(again.sum() if again is not None else 0),
        "tokenized_rows": int(again.sum()) if again is not None else 0,
        "checked_rows": len(sample),
    }


def _spread(rows: np.ndarray, most: int) -> np.ndarray:
    """Up to ``most`` of ``rows``, evenly spread (first and last included)."""
    if len(rows) <= most:
        return rows
    return rows[np.linspace(0, len(rows) - 1, most).round().astype(np.int64)]
