"""A part's token ids (:mod:`hf_pipeline.build.tokens`) and the build's tokenizing pool
(:mod:`hf_pipeline.workers.persistent`): real worker processes from the build's clean
fork server, a real lease taken over, a real SIGKILL of the builder."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from hf_pipeline.build.parts import read_column
from hf_pipeline.build.tokens import TOKENS_FILE, TokenizerPool, tokenize_part
from hf_pipeline.config import load_config

CAPTIONS = [f"caption number {i} of a cat on a mat, {'very ' * (i % 9)}long" for i in range(40)]
#: Every 7th row is not kept: its ids are an empty list.
REASONS = ["missing_caption" if i % 7 == 3 else "" for i in range(len(CAPTIONS))]


def _caption_file(folder: Path, captions=CAPTIONS, reasons=REASONS) -> Path:
    """A ``text`` unit's captions file (the schema :func:`text_part` writes)."""
    from datasets import Features, Value
    from datasets.arrow_writer import ArrowWriter

    path = folder / "captions" / "data.arrow"
    path.parent.mkdir(parents=True)
    features = Features({"caption": Value("string"), "drop_reason": Value("string")})
    with ArrowWriter(features=features, path=str(path)) as writer:
        writer.write_table(pa.table({"caption": captions, "drop_reason": reasons}))
        writer.finalize()
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The MiniLM tokenizer (transformers) and the spec the workers load."""
    from hf_pipeline.encoder.model import CaptionTokenizer

    tok = CaptionTokenizer(load_config(None, ["encoder.max_length=16"]).encoder)
    return tok, tok.export(tmp_path_factory.mktemp("spec"))


class _Lease:
    """A real lease (``dist.lease``) and its probe; ``take_over_at`` checks in, another
    builder takes the lease over (before the check reads it)."""

    def __init__(self, folder: Path, take_over_at: int | None = None):
        from dist.lease import LeaseProbe, try_claim

        folder.mkdir(parents=True, exist_ok=True)
        assert try_claim(folder, "ours", "host", os.getpid())
        self.folder, self.probe = folder, LeaseProbe(folder, "ours")
        self.take_over_at, self.checks = take_over_at, 0

    def check(self) -> None:
        from dist.lease import move_lease, try_claim

        self.checks += 1
        if self.checks == self.take_over_at:
            assert move_lease(self.folder, "ours", "takeover")
            assert try_claim(self.folder, "theirs", "host", os.getpid())
        self.probe.check()


def _ids(out_dir: Path) -> list[list[int]]:
    return read_column([out_dir / TOKENS_FILE], "input_ids").to_pylist()


def _gone(pids, timeout: float = 30.0) -> bool:
    """Every process of ``pids`` has exited (or is a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_token_ids_are_the_tokenizers_and_one_pool_tokenizes_every_part(tmp_path, tokenizer):
    """The ids are the transformers tokenizer's own (an empty list where a row is not
    kept), by the same worker processes for every part (started once, the tokenizer
    loaded once each), which exit when the pool closes; ``num_proc`` 1 (no pool)
    writes the same file."""
    tok, spec = tokenizer
    first, second = (
        _caption_file(tmp_path / "a"),
        _caption_file(tmp_path / "b", CAPTIONS[::-1], REASONS[::-1]),
    )
    lease = _Lease(tmp_path / "lease")
    infos = []
    with TokenizerPool(spec, num_proc=2) as pool:
        for k, part in enumerate([first, second, first]):
            infos.append(
                tokenize_part(
                    [part],
                    tokenizer=spec,
                    pool=pool,
                    probe=lease,
                    out_dir=tmp_path / f"o{k}",
                    batch_rows=8,
                    writer_batch_size=8,
                    timeout=120,
                )  # fmt: skip
            )
        pids = pool.pids
        assert pool.starts == 1 and len(pids) == 2 and os.getpid() not in pids
    want = [ids if r == "" else [] for ids, r in zip(tok(CAPTIONS), REASONS, strict=True)]
    assert _ids(tmp_path / "o0") == want == _ids(tmp_path / "o2")
    assert _ids(tmp_path / "o1") == want[::-1]
    for info in infos:
        # Every worker took a slice of every part: two slices each at least.
        assert info["worker_pids"] == sorted(pids), (info, pids)
        assert info["rows"] == len(CAPTIONS) and info["num_proc"] == 2, info
    assert _gone(pids), f"the pool's workers {pids} outlived it"
    alone = tokenize_part(
        [first], tokenizer=spec, pool=None, probe=lease, out_dir=tmp_path / "alone",
        batch_rows=8, writer_batch_size=8, timeout=120,
    )  # fmt: skip
    assert alone["worker_pids"] == [] and alone["num_proc"] == 1, alone
    assert (tmp_path / "alone" / TOKENS_FILE).read_bytes() == (
        tmp_path / "o0" / TOKENS_FILE
    ).read_bytes()


def test_a_part_of_no_rows_has_an_empty_file(tmp_path, tokenizer):
    _, spec = tokenizer
    empty = _caption_file(tmp_path / "e", [], [])
    with TokenizerPool(spec, num_proc=2) as pool:
        info = tokenize_part(
            [empty], tokenizer=spec, pool=pool, probe=_Lease(tmp_path / "lease"),
            out_dir=tmp_path / "o", batch_rows=8, writer_batch_size=8, timeout=60,
        )  # fmt: skip
        assert pool.starts == 0, "workers started for no rows"
    assert info["rows"] == 0 and _ids(tmp_path / "o") == []


@pytest.mark.slow
def test_a_lost_lease_stops_the_part_and_its_workers(tmp_path, tokenizer):
    """A lease taken over while the workers tokenize: the part stops (LeaseLostError),
    writes no file, its workers are stopped (their slices were in flight); the next
    part starts new ones and is right."""
    from dist.lease import LeaseLostError

    tok, spec = tokenizer
    part = _caption_file(tmp_path / "a")
    with TokenizerPool(spec, num_proc=2) as pool:
        lease = _Lease(tmp_path / "lost", take_over_at=4)  # after 2 slices are handed out
        with pytest.raises(LeaseLostError):
            tokenize_part(
                [part], tokenizer=spec, pool=pool, probe=lease, out_dir=tmp_path / "o",
                batch_rows=4, writer_batch_size=8, timeout=120,
            )  # fmt: skip
        assert not (tmp_path / "o" / TOKENS_FILE).exists()
        assert pool.pids == [] and pool.starts == 1
        tokenize_part(
            [part], tokenizer=spec, pool=pool, probe=_Lease(tmp_path / "ok"),
            out_dir=tmp_path / "o2", batch_rows=4, writer_batch_size=8, timeout=120,
        )  # fmt: skip
        assert pool.starts == 2
    want = [ids if r == "" else [] for ids, r in zip(tok(CAPTIONS), REASONS, strict=True)]
    assert _ids(tmp_path / "o2") == want


@pytest.mark.slow
def test_a_worker_killed_between_parts_is_replaced(tmp_path, tokenizer):
    _, spec = tokenizer
    part = _caption_file(tmp_path / "a")
    lease = _Lease(tmp_path / "lease")
    kw = dict(tokenizer=spec, probe=lease, batch_rows=8, writer_batch_size=8, timeout=120)
    with TokenizerPool(spec, num_proc=2) as pool:
        tokenize_part([part], pool=pool, out_dir=tmp_path / "o1", **kw)
        victim = pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        assert _gone([victim])
        info = tokenize_part([part], pool=pool, out_dir=tmp_path / "o2", **kw)
        assert pool.starts == 2 and victim not in info["worker_pids"], info
    assert _ids(tmp_path / "o1") == _ids(tmp_path / "o2")


_BUILDER = """
import json, sys, time
from pathlib import Path
from hf_pipeline.build.tokens import TokenizerPool, tokenize_part
from hf_pipeline.encoder.model import TokenizerSpec

class Probe:
    def check(self):
        pass

if __name__ == "__main__":
    spec = TokenizerSpec(**json.loads(sys.argv[1]))
    pool = TokenizerPool(spec, num_proc=2)
    tokenize_part(
        [Path(sys.argv[2])], tokenizer=spec, pool=pool, probe=Probe(),
        out_dir=Path(sys.argv[3]), batch_rows=8, writer_batch_size=8, timeout=120,
    )
    print(json.dumps(pool.pids), flush=True)
    time.sleep(600)  # SIGKILLed here, the pool open
"""


@pytest.mark.slow
def test_the_workers_die_with_a_sigkilled_builder(tmp_path, tokenizer):
    """A builder SIGKILLed with its pool open (workers idle, tokenizer loaded) leaves no
    worker running: they die with the fork server, which dies with the builder."""
    import dataclasses

    _, spec = tokenizer
    part = _caption_file(tmp_path / "a")
    script = tmp_path / "builder.py"
    script.write_text(_BUILDER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(dataclasses.asdict(spec)), str(part),
         str(tmp_path / "o")],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        assert ready, "the builder did not start its pool within 180 s"
        line = proc.stdout.readline()
        pids = json.loads(line)
        assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert _gone(pids), f"workers {pids} outlived their SIGKILLed builder"


def _stored_ids(folder: Path, spec, captions=CAPTIONS, reasons=REASONS, *, change=None) -> Path:
    """A ``tokens`` unit's file of ``captions`` tokenized by ``spec`` (``change``: a
    function that edits the ids before they are written)."""
    import numpy as np

    from hf_pipeline.build.accounting import keep_mask
    from hf_pipeline.build.embed_stage import tokenize_kept
    from hf_pipeline.build.tokens import _write
    from hf_pipeline.encoder.model import WorkerTokenizer

    keep = keep_mask(pa.array(reasons))
    ids = tokenize_kept(pa.array(captions), np.asarray(keep), WorkerTokenizer(spec), threads=1)
    if change is not None:
        ids = pa.array(change(ids.to_pylist()), pa.list_(pa.int32()))
    out = folder / TOKENS_FILE
    out.parent.mkdir(parents=True)
    _write(out, ids, 8)
    return out


@pytest.mark.parametrize(("stored", "wanted"), [(16, 8), (20, 16), (21, 40), (8, 16)])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_ids_at_another_max_length_derived_equal_the_tokenizers(tmp_path, tokenizer, stored,
                                                               wanted, direction):  # fmt: skip
    """derive_part's ids at ``wanted`` from ids stored at ``stored`` are the tokenizer's
    own at ``wanted``, for both truncation sides: shorter (rows cut: prefix, first ids,
    suffix; left: last ids), longer (rows the stored length may have cut tokenized
    again, only those; more than a quarter of the rows: the part is tokenized whole).
    The captions are 14 to 22 ids long untruncated."""
    import dataclasses

    from hf_pipeline.build.tokens import derive_part

    _, spec = tokenizer
    at = {n: dataclasses.replace(spec, max_length=n, direction=direction) for n in (stored, wanted)}
    captions = _caption_file(tmp_path / "text")
    source = _stored_ids(tmp_path / "stored", at[stored])
    info = derive_part([source], stored, [captions], spec=at[wanted], probe=Probe(),
                       out_dir=tmp_path / "derived", writer_batch_size=8)  # fmt: skip
    tokenize_part([captions], tokenizer=at[wanted], pool=None, probe=Probe(),
                  out_dir=tmp_path / "tokenized", batch_rows=8, writer_batch_size=8,
                  timeout=60)  # fmt: skip
    kept = REASONS.count("")
    if wanted > stored and sum(len(x) == stored for x in _ids(tmp_path / "stored")) > kept / 4:
        assert info is None  # most rows cut at the stored length: tokenized whole instead
        return
    assert info is not None
    assert _ids(tmp_path / "derived") == _ids(tmp_path / "tokenized")
    assert (tmp_path / "derived" / TOKENS_FILE).read_bytes() == (
        tmp_path / "tokenized" / TOKENS_FILE
    ).read_bytes()
    longer = wanted > stored
    again = sum(len(x) == stored for x in _ids(tmp_path / "stored")) if longer else 0
    assert info["tokenized_rows"] == again and info["derived_rows"] == kept - again, info
    assert info["checked_rows"] > 0, info


class Probe:
    def check(self):
        pass


def test_stored_ids_that_the_rule_does_not_give_are_found_by_the_check(tmp_path, tokenizer, caplog):
    """Ids stored at 16 that are not the tokenizer's (one id changed in a row that 8
    cuts): the derived ids at 8 would differ from the tokenizer's in that row; the sample
    check tokenizes every row the derivation cut (up to CHECK_ROWS), finds it, writes
    nothing and says so (the part is then tokenized whole)."""
    import dataclasses
    import logging

    from hf_pipeline.build.tokens import derive_part

    _, spec = tokenizer
    s16, s8 = (dataclasses.replace(spec, max_length=n) for n in (16, 8))

    def change(rows):
        rows[5][2] = rows[5][2] + 1  # row 5 is kept and longer than 8 ids
        return rows

    source = _stored_ids(tmp_path / "stored", s16, change=change)
    captions = _caption_file(tmp_path / "text")
    with caplog.at_level(logging.WARNING, logger="hf_pipeline.build.tokens"):
        info = derive_part([source], 16, [captions], spec=s8, probe=Probe(),
                           out_dir=tmp_path / "derived", writer_batch_size=8)  # fmt: skip
    assert info is None
    assert not (tmp_path / "derived" / TOKENS_FILE).exists()
    assert "differ from the tokenizer's at row 5" in caplog.text, caplog.text


def test_stored_ids_damaged_past_their_edges_are_not_derived_from(tmp_path, caplog):
    """A stored token-ids unit whose file changed in the middle (past the first and last
    MiB that a reused unit's edge check reads): its ids would be copied into the new
    cache (outside tester: a flipped id in a derived cache, `verify` said ok). The
    source is read whole against its marker before it is derived from: a sound one is
    offered, a damaged one skipped with a warning."""
    import dataclasses
    import logging

    import numpy as np

    from dist.coordinator import Stage, ensure_built
    from hf_pipeline.build.part_store import StoredPart
    from hf_pipeline.build.parts import PartPlan
    from hf_pipeline.build.prepare import _derivable_tokens
    from hf_pipeline.build.tokens import _write

    store = tmp_path / ".parts"
    part = StoredPart(plan=PartPlan(0, 0, 1), part="p" * 16, captions="c" * 16, encoder="e",
                      store=store, tokenizer="t16")  # fmt: skip
    rows = np.arange(200_000 * 8, dtype=np.int32).reshape(200_000, 8) % 30_000
    ids = pa.array(rows.tolist(), pa.list_(pa.int32()))  # 6.4 MB of ids

    def build(ctx):
        (Path(ctx.tmp_dir) / TOKENS_FILE).parent.mkdir(parents=True)
        _write(Path(ctx.tmp_dir) / TOKENS_FILE, ids, 10_000)
        return {"tokens": {"family": "fam", "max_length": 64}}

    stored = dataclasses.replace(part, tokenizer="t64")
    ensure_built(
        stored.tokens_dir, stored.tokens_id, [Stage(name="tokens", build=build)], builder=True
    )
    (data,) = stored.tokens_dir.glob("tokens.*/" + str(TOKENS_FILE))
    assert data.stat().st_size > 3 << 20
    assert [length for _, length in _derivable_tokens(part, "fam", 16)] == [64]

    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert list(_derivable_tokens(part, "fam", 16)) == []
    assert "not deriving token ids from it" in caplog.text, caplog.text
