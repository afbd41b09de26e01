"""Config: defaults, YAML, env and flag precedence, and one-line errors naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from hf_pipeline.config import (
    CONFIG_DIR,
    Config,
    default_cache_root,
    load_config,
    resolve_config_path,
)
from hf_pipeline.errors import ConfigError


def test_demo_is_default_and_bundled_configs_load():
    cfg = load_config(None, environ={})
    assert cfg.name == "demo" and cfg.data.shards == "demo"
    assert cfg.data.on_bad_rows == "drop"  # one bad row costs one row, not the build
    assert load_config(None, ["data.on_bad_rows=fail"], environ={}).data.on_bad_rows == "fail"
    assert resolve_config_path(None) == CONFIG_DIR / "demo.yaml"
    hub = load_config("coyo11m", environ={})
    assert (
        hub.data.shards.startswith("hf://datasets/") and hub.encoder.model == "google/gemma-3-270m"
    )
    gcs = load_config(CONFIG_DIR / "coyo11m_gcs.yaml", environ={})
    assert gcs.data.shards.startswith("gs://")


def test_precedence_defaults_yaml_env_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("build:\n  num_proc: 3\n  batch_size: 7\nloader:\n  seed: 5\n")
    cfg = load_config(y, environ={})
    assert (cfg.build.num_proc, cfg.build.batch_size, cfg.loader.seed) == (3, 7, 5)
    assert cfg.build.writer_batch_size == 10000  # default
    env = {"DATASET_NUM_PROC": "16", "DATASET_WRITER_BATCH_SIZE": "500", "DATASET_MAX_WAIT": "12.5"}
    cfg = load_config(y, environ=env)
    assert (cfg.build.num_proc, cfg.build.writer_batch_size, cfg.coord.max_wait) == (16, 500, 12.5)
    cfg = load_config(y, ["build.num_proc=2", "loader.crop=1"], environ=env)
    assert cfg.build.num_proc == 2 and cfg.loader.crop == "1"


def test_frozen_and_effective_num_proc():
    cfg = load_config(None, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "x"  # type: ignore[misc]
    assert 1 <= cfg.build.effective_num_proc <= 8
    assert load_config(None, ["build.num_proc=16"], environ={}).build.effective_num_proc == 16


@pytest.mark.parametrize(
    "override, field, fragment",
    [
        (["build.num_proc=-1"], "build.num_proc", "must be in [0, 4096] (0: min(8, CPUs)), got -1"),
        (["build.num_proc=5000"], "build.num_proc", "must be in [0, 4096]"),
        # Accepted once, then an OverflowError in pyarrow after the join had run.
        (["build.batch_size=99999999999999999999"], "build.batch_size", "in [1, 2147483647] rows"),
        (
            ["build.writer_batch_size=0"],
            "build.writer_batch_size",
            "in [1, 2147483647] rows, got 0",
        ),
        (
            ["build.overlap_parts=-2"],
            "build.overlap_parts",
            "must be >= 0 (0: automatic, 1: no overlap), got -2",
        ),
        (["build.batch_size=abc"], "build.batch_size", "must be int, got 'abc'"),
        (["loader.crop=7"], "loader.crop", "crop index 0-2, got '7'"),
        (["data.on_missing=ignore"], "data.on_missing", "'fail' or 'skip'"),
        (["data.on_bad_rows=skip"], "data.on_bad_rows", "must be 'drop' or 'fail', got 'skip'"),
        (["data.on_bad_rows=[drop]"], "data.on_bad_rows", "must be str"),
        (["nope.x=1"], "nope", "unknown config field 'nope'"),
        (["loader.bogus=1"], "loader.bogus", "unknown config field 'loader.bogus'"),
        (
            ["coord.heartbeat_interval=100"],
            "coord.heartbeat_interval",
            "coord.heartbeat_interval must be <= coord.lease_timeout / 2",
        ),
        (
            ["coord.poll_interval=0"],
            "coord.poll_interval",
            "coord.poll_interval must be > 0, got 0",
        ),
        (["loader.crop=3"], "loader.crop", "crop index 0-2, got '3'"),
        (["loader.crop=-1"], "loader.crop", "crop index 0-2, got '-1'"),
        (["justtext"], "justtext", "section.field=value"),
    ],
)
def test_bad_values_name_the_field(override, field, fragment):
    with pytest.raises(ConfigError) as ei:
        load_config(None, override, environ={})
    assert ei.value.field == field
    assert fragment in str(ei.value)
    assert "\n" not in str(ei.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match=r"DATASET_BATCH_SIZE"):
        load_config(None, environ={"DATASET_BATCH_SIZE": "0"})


def test_missing_or_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("build: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})


def test_store_settings_are_read_from_the_environment_given(tmp_path):
    from hf_pipeline.config import gcs_emulator_host, hub_cache_dir, hub_endpoint, hub_offline

    assert hub_endpoint({"HF_ENDPOINT": "http://127.0.0.1:5/"}) == "http://127.0.0.1:5"
    assert hub_endpoint({}).startswith("https://")  # huggingface_hub's default
    assert hub_offline({"HF_HUB_OFFLINE": "yes"}) and hub_offline({"HF_HUB_OFFLINE": "1"})
    cache = str(tmp_path / "c")
    assert hub_cache_dir({"HF_HUB_CACHE": cache, "HF_HOME": "x"}) == cache
    assert hub_cache_dir({"HF_HOME": str(tmp_path)}) == str(tmp_path / "hub")
    assert gcs_emulator_host({"STORAGE_EMULATOR_HOST": "localhost:9"}) == "localhost:9"
    assert gcs_emulator_host({}) == ""


def test_cache_root_from_env(tmp_path):
    assert default_cache_root({"HF_HOME": str(tmp_path)}) == tmp_path / "datasets" / "hf_pipeline"
    assert (
        default_cache_root({"HF_DATASETS_CACHE": str(tmp_path / "d")})
        == tmp_path / "d" / "hf_pipeline"
    )
    cfg = load_config(None, environ={"HF_PIPELINE_CACHE": str(tmp_path / "x")})
    assert cfg.cache_root == tmp_path / "x"
    assert isinstance(Config().to_dict()["loader"], dict)


@pytest.mark.parametrize("lease", [1.0, 4.0, 60.0])
@pytest.mark.parametrize("heartbeat", [0.1, 0.5, 0.6, 2.0, 30.0, 31.0, 0.0, -1.0])
@pytest.mark.parametrize("poll", [0.05, 0.0])
def test_coord_timing_config_accepts_exactly_what_the_coordinator_accepts(
    tmp_path, lease, heartbeat, poll
):
    from dist import ensure_built

    values = {"poll_interval": poll, "lease_timeout": lease, "heartbeat_interval": heartbeat}
    overrides = [f"coord.{k}={v}" for k, v in values.items()]
    try:
        load_config(None, overrides, environ={})
        config_error = None
    except ConfigError as e:
        config_error = str(e)
    # Valid timing makes ensure_built go on to reject the empty stage list.
    with pytest.raises(ValueError) as info:
        ensure_built(tmp_path, "fp", [], max_wait=3600.0, **values)
    coordinator_error = None if "stages must not be empty" in str(info.value) else str(info.value)
    assert (config_error is None) == (coordinator_error is None), (config_error, coordinator_error)
    if config_error is not None:
        # The same rule, named as the user set it.
        assert config_error.replace("coord.", "") == coordinator_error
        assert config_error.startswith("coord.")


def test_closed_value_sets_are_their_owners():
    """The config accepts exactly the values the code that uses them knows (each set is
    defined once, where it is used), and names them all when refusing one."""
    from dist.coordinator import SCOPES
    from hf_pipeline.latents import EMBEDDING_DTYPES
    from hf_pipeline.sampler import PARTITIONS, SHUFFLES

    # coord.scope: "process" needs a cache folder per process, which a config cannot name.
    settable = {
        "loader.shuffle": SHUFFLES,
        "loader.partition": PARTITIONS,
        "encoder.output_dtype": EMBEDDING_DTYPES,
        "coord.scope": tuple(s for s in SCOPES if s != "process"),
    }
    for field, values in settable.items():
        section, name = field.split(".")
        for value in values:
            cfg = load_config(None, [f"{field}={value}"], environ={})
            assert getattr(getattr(cfg, section), name) == value
        with pytest.raises(ConfigError) as ei:
            load_config(None, [f"{field}=nope"], environ={})
        assert ei.value.field == field
        assert all(repr(value) in str(ei.value) for value in values), str(ei.value)
    with pytest.raises(ConfigError, match="coord.scope must be 'shared' or 'node'"):
        load_config(None, ["coord.scope=process"], environ={})
