"""The join workers' tokenizer, exported by a child interpreter while the builder starts.

The join's workers tokenize with a :class:`~hf_pipeline.embed.TokenizerSpec` that the
builder exports from its :class:`~hf_pipeline.embed.CaptionTokenizer`. Loading that needs
transformers, and transformers imports torch: seconds on a GPU host, and in the builder
they share one GIL with everything else it starts. Sampled on a 1xH100 host (100k-row
build, 16 workers, ``py-spy dump`` every 0.3 s): the fork server had the workers' libraries
imported 5.4 s after it started, but the builder's loading thread had the tokenizer 5 s
later still, and the first part's workers waited for it.

:class:`TokenizerExport` starts, at once, a child interpreter that loads the tokenizer and
exports its spec into a folder: its imports run on a core of their own, beside the
builder's start-up and the fork server's. The spec is the same file the builder would
write (:meth:`CaptionTokenizer.export`). If the child fails (whatever the reason), the
builder exports from its own tokenizer as before, which raises the load error, if any,
with its usual message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_pipeline.config import EncoderConfig
from hf_pipeline.embed import TokenizerSpec

__all__ = ["MIN_CPUS", "TokenizerExport"]

log = logging.getLogger("hf_pipeline")

#: Fewest usable CPUs for the child: it needs a core of its own to gain anything (with
#: 2, the builder, its loading thread and the fork server already share them).
MIN_CPUS = 4


class TokenizerExport:
    """A child interpreter exporting ``cfg``'s worker tokenizer into ``folder``; started
    on construction. :meth:`result` waits for it.

    Args:
        cfg: the encoder config (the tokenizer's model, revision and ``max_length``).
        folder: where the spec's file goes (kept by the caller while workers read it).
        fallback: returns the builder's own :class:`CaptionTokenizer` (waiting for it),
            used if the child fails; None: one is loaded then.
    """

    def __init__(
        self, cfg: EncoderConfig, folder: Path, *, fallback: Callable[[], Any] | None = None
    ):
        from hf_pipeline.workers import start_tied

        self._cfg = cfg
        self._folder = Path(folder)
        self._fallback = fallback
        self._lock = threading.Lock()
        self._done = False
        self._spec: TokenizerSpec | None = None
        self._folder.mkdir(parents=True, exist_ok=True)
        self._proc = start_tied(
            [sys.executable, "-m", "hf_pipeline.tokenizer_export", str(self._folder),
             str(os.getpid()), json.dumps(dataclasses.asdict(cfg))],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def result(self) -> TokenizerSpec | None:
        """The spec (None: the tokenizer has no Rust backend), waiting for the child; the
        builder's own export if the child failed. Raises what loading the tokenizer raises."""
        with self._lock:
            if not self._done:
                self._spec = self._wait()
                self._done = True
            return self._spec

    def _wait(self) -> TokenizerSpec | None:
        out, err = self._proc.communicate()
        if self._proc.returncode == 0:
            fields = json.loads(out)
            return None if fields is None else TokenizerSpec(**fields)
        last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        log.warning(
            "tokenizer export child exited %s (%s): the builder exports its own",
            self._proc.returncode, last,
        )  # fmt: skip
        if self._fallback is not None:
            tokenizer = self._fallback()
        else:
            from hf_pipeline.embed import CaptionTokenizer

            tokenizer = CaptionTokenizer(self._cfg)
        return tokenizer.export(self._folder)

    def close(self) -> None:
        """Stop the child if it still runs (the build ended before it was needed)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.communicate()


def _main(argv: list[str]) -> int:
    """Child: export the tokenizer of the EncoderConfig argv[2] (JSON) into argv[0], print
    the spec's fields as JSON (``null``: no Rust backend); argv[1] is the builder's pid."""
    from hf_pipeline.workers import die_with_parent

    die_with_parent()
    if os.getppid() != int(argv[1]):  # the builder died before the call
        return 1
    from hf_pipeline.embed import CaptionTokenizer

    cfg = EncoderConfig(**json.loads(argv[2]))
    spec = CaptionTokenizer(cfg).export(argv[0])
    print(json.dumps(None if spec is None else dataclasses.asdict(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
