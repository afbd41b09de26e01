"""What the native encoders share (internal): reading a model folder's ``config.json`` and
``model.safetensors`` header as untrusted input, mapping the file's tensors onto a
model's state-dict keys, loading them, and uninitialised modules.

The native models are a plain BERT (:mod:`hf_pipeline.encoder.bert`, all-MiniLM-L6-v2)
and a gemma-3 text decoder (:mod:`hf_pipeline.encoder.gemma`, the COYO encoder);
:func:`hf_pipeline.encoder.model.native_model` picks by the config's ``model_type``, and
anything neither covers is a reason string: the caller loads with transformers. The files are untrusted: ``config.json``
is read only up to :data:`MAX_CONFIG_BYTES`, sizes are bounded, and weights are read
only through ``safetensors`` (never a pickle).

This module imports torch and safetensors: import it where an encoder is built.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "MAX_CONFIG_BYTES",
    "WEIGHTS",
    "EncoderOutput",
    "Invalid",
    "NativeModel",
    "bounded_float",
    "bounded_sizes",
    "kind_problem",
    "embedding",
    "linear",
    "load_state",
    "map_weights",
    "read_config",
]

#: The most of ``config.json`` read (a BERT or gemma-3 config is 1-3 kB).
MAX_CONFIG_BYTES = 1 << 20
WEIGHTS = "model.safetensors"
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
#: Bounds of a config's sizes (far above any model loaded natively; a larger value is not
#: one).
MAX_SIZE = 1 << 20
MAX_LAYERS = 1024


class Invalid(str):
    """A reason (one line) why a folder of a kind a native model covers is broken, not
    merely outside what it covers: config values that are not sizes, weights missing or
    of the wrong shape or dtype, an unreadable weights file. transformers would fail on
    such a folder with a traceback, or fill the gaps with random weights and embed
    garbage, so the encoder refuses it (:func:`hf_pipeline.encoder.model.native_model`)
    instead of falling back to transformers. A plain ``str`` reason falls back."""


class EncoderOutput(NamedTuple):
    """A native model's output (what the pooling reads of transformers' ``ModelOutput``)."""

    last_hidden_state: torch.Tensor


def linear(n_in: int, n_out: int, *, bias: bool = True) -> torch.nn.Linear:
    """A ``torch.nn.Linear`` (its own type: the fusion looks for it) with uninitialised
    parameters: its random init cost 0.2-0.5 s for MiniLM on the 2-CPU VM, and the
    weights are loaded over it (on the meta device the init imports ``torch._dynamo``)."""
    layer = torch.nn.Linear.__new__(torch.nn.Linear)
    torch.nn.Module.__init__(layer)
    layer.in_features, layer.out_features = n_in, n_out
    layer.weight = torch.nn.Parameter(torch.empty(n_out, n_in))
    if bias:
        layer.bias = torch.nn.Parameter(torch.empty(n_out))
    else:
        layer.register_parameter("bias", None)
    return layer


def embedding(rows: int, dim: int) -> torch.nn.Embedding:
    """A ``torch.nn.Embedding`` with an uninitialised weight (see :func:`linear`)."""
    return torch.nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


def read_config(folder: Path) -> tuple[Path, Any] | str:
    """``(path, parsed JSON)`` of ``folder/config.json``, or why it cannot be read (one
    line naming the file): absent, larger than :data:`MAX_CONFIG_BYTES`, not JSON."""
    cfg_path = folder / "config.json"
    try:
        with open(cfg_path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return f"{cfg_path}: absent (a model folder holds its config.json)"
    except OSError as exc:
        return f"{cfg_path}: not read ({exc.strerror or exc})"
    if len(text) > MAX_CONFIG_BYTES:
        return f"{cfg_path}: larger than {MAX_CONFIG_BYTES} bytes"
    try:
        return cfg_path, json.loads(text)
    except (ValueError, RecursionError):
        return f"{cfg_path}: not JSON"


def kind_problem(
    raw: Any, model_type: str, architectures: frozenset[str], what: str, flags: Sequence[str]
) -> str | None:
    """Why a parsed ``config.json`` is not of ``model_type`` with ``architectures`` absent
    or among those (``what``: "a plain BERT's") and every one of ``flags`` absent or
    false; None when it is."""
    if not isinstance(raw, dict):
        return "its config.json is not a JSON object"
    if raw.get("model_type") != model_type:
        return f"model_type is {raw.get('model_type')!r}, not {model_type!r}"
    arch = raw.get("architectures")
    if arch is not None and (
        not isinstance(arch, list) or not arch or not set(arch) <= architectures
    ):
        return f"architectures {arch!r} are not {what}"
    for flag in flags:
        if raw.get(flag, False) is not False:
            return f"{flag} is set"
    return None


def bounded_sizes(
    raw: Mapping[str, Any], names: Sequence[str], defaults: Mapping[str, int] | None = None
) -> dict[str, Any] | str:
    """The integer sizes ``names`` of a config (``defaults`` where absent), each in
    ``[1, MAX_SIZE]`` (``num_hidden_layers``: ``[1, MAX_LAYERS]``); else why not."""
    defaults = defaults or {}
    sizes: dict[str, Any] = {}
    for name in names:
        value = raw.get(name, defaults.get(name))
        limit = MAX_LAYERS if name == "num_hidden_layers" else MAX_SIZE
        if type(value) is not int or not 1 <= value <= limit:
            return f"{name} is {value!r}, not an integer in [1, {limit}]"
        sizes[name] = value
    return sizes


def bounded_float(raw: Mapping[str, Any], name: str, default: float, low: float, high: float):
    """The number ``raw[name]`` (``default`` where absent), finite and in ``(low, high)``;
    else why not (a string)."""
    value = raw.get(name, default)
    if type(value) not in (int, float) or not (math.isfinite(value) and low < value < high):
        return f"{name} is {value!r}, not a number in ({low:g}, {high:g})"
    return float(value)


def map_weights(
    weights: Path,
    expected: Mapping[str, tuple[int, ...]],
    *,
    prefix: str,
    what: str,
    skip: Callable[[str], bool] = lambda key: False,
    optional: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, str] | str:
    """The name each model tensor has in the safetensors file ``weights`` (the model's
    key -> the file's), or why it does not map cleanly (one line naming the file and the
    tensor). The file's keys may carry ``prefix`` (all or none of them); ``skip``\\ ped
    ones (a head the model does not run) are left out; every ``expected`` tensor must be
    there, ``optional`` ones may, each of its shape and a float dtype, and nothing else.
    An absent file or a tensor the model does not have is a plain reason (another
    layout: transformers may load it); a missing, misshapen or non-float tensor or an
    unreadable file is :class:`Invalid`. Reads the file's header only."""
    from safetensors import SafetensorError, safe_open

    optional = optional or {}
    names: dict[str, str] = {}
    if not weights.is_file():
        return f"{weights}: absent (a native model loads from one safetensors file)"
    try:
        with safe_open(str(weights), framework="pt") as f:
            keys = list(f.keys())
            strip = prefix if prefix and any(k.startswith(prefix) for k in keys) else ""
            for key in keys:
                if skip(key):
                    continue
                mine = key[len(strip) :] if key.startswith(strip) else None
                want = expected.get(mine) or optional.get(mine) if mine is not None else None
                if mine is None or want is None:
                    return f"{weights}: tensor {key!r} is not {what}"
                piece = f.get_slice(key)
                shape = tuple(piece.get_shape())
                if shape != want:
                    return Invalid(
                        f"{weights}: tensor {key!r} has shape {list(shape)}, not {list(want)}"
                    )
                if piece.get_dtype() not in _FLOAT_DTYPES:
                    return Invalid(f"{weights}: tensor {key!r} is {piece.get_dtype()}, not a float")
                names[mine] = key
    except (SafetensorError, OSError) as exc:
        return Invalid(f"{weights}: not a readable safetensors file ({str(exc).strip()[:200]})")
    missing = sorted(set(expected) - set(names))
    if missing:
        return Invalid(
            f"{weights}: tensor {strip + missing[0]!r} is missing ({len(missing)} missing)"
        )
    return names


def load_state(
    weights: Path, names: Mapping[str, str], dtype: torch.dtype, *, copy: bool = True
) -> dict[str, Any]:
    """The tensors ``names`` (the model's key -> the file's) of ``weights``, in ``dtype``.

    safetensors hands out views of the file mapped into memory: a tensor already in
    ``dtype`` would stay one, and the model would read the file for as long as it runs,
    whatever is written over it later (a checkpoint copied over the folder's: other
    embeddings under the hashed weights' name, or SIGBUS when the copy truncates it).
    ``copy`` (the default) reads every tensor into memory of its own; without it the
    caller must copy them itself before the file may change (``.to("cuda")`` does).

    Raises:
        ValueError: the file changed since it was inspected and no longer holds a tensor
            it named, or could not be read; naming the file.
    """
    from safetensors import SafetensorError, safe_open

    state = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for mine, theirs in names.items():
                state[mine] = f.get_tensor(theirs).to(dtype, copy=copy)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights}: not read ({exc})") from None
    return state


@dataclasses.dataclass(frozen=True)
class NativeModel(abc.ABC):
    """A model folder that loads natively: its config, its weights file and the name
    each of the model's tensors has there (a checkpoint's prefix kept). Subclasses make
    the model (:meth:`_model`)."""

    config: Any
    weights: Path
    names: dict[str, str]  # the model's key -> the file's

    @abc.abstractmethod
    def _model(self) -> torch.nn.Module:
        """The model of :attr:`config`, its parameters uninitialised."""

    def load(self, dtype: torch.dtype, *, copy: bool = True) -> Any:
        """The model, its weights in ``dtype``, on the CPU, in eval mode (``copy``:
        :func:`load_state`'s; without it the weights are the file's mapped memory until
        the caller moves the model to a device).

        Raises:
            ValueError: the weights file changed since it was inspected and no longer
                holds a tensor it named, or could not be read; naming the file.
        """
        model = self._model()
        state = load_state(self.weights, self.names, dtype, copy=copy)
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)
