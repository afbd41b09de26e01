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
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from hf_pipeline.build.accounting import keep_mask
from hf_pipeline.build.embed_stage import tokenize_kept
from hf_pipeline.encoder.model import TokenizerSpec, WorkerTokenizer
from hf_pipeline.workers.persistent import PersistentPool

__all__ = ["TOKENS_FILE", "TokenizerPool", "tokenize_part"]

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
