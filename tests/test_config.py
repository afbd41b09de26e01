"""Config: defaults, YAML, env and flag precedence, and one-line errors naming the field."""

from __future__ import annotations

import dataclasses
import subprocess
import time

import pytest

from hf_pipeline.config import (
    CONFIG_DIR,
    ENV_VARS,
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


def test_the_docs_configs_path_form_finds_the_packaged_config_from_any_folder(
    tmp_path, monkeypatch
):
    """`--config configs/demo.yaml` (cli.md's form) outside the checkout: the packaged
    config of that name, as the bare name `demo` gives; a file of the cwd still wins."""
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("configs/coyo11m.yaml") == CONFIG_DIR / "coyo11m.yaml"
    assert load_config("configs/demo.yaml", environ={}) == load_config("demo", environ={})
    with pytest.raises(ConfigError) as e:
        load_config("configs/nonexist.yaml", environ={})
    assert "configs/nonexist.yaml does not exist, nor does" in str(e.value), e.value
    assert str(CONFIG_DIR / "nonexist.yaml") in str(e.value)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("name: mine\n")
    assert load_config("configs/demo.yaml", environ={}).name == "mine"


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
            "must be in [0, 1024] (no effect), got -2",
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
        # a tester: accepted here, then a traceback at the Loader after the build
        (["loader.latents_dtype=foo"], "loader.latents_dtype", "floating dtype"),
        (["loader.latents_dtype=int8"], "loader.latents_dtype", "got 'int8'"),
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
    # a tester: a folder was said not to exist
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder, not a YAML file"):
        load_config(tmp_path, environ={})
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


@pytest.mark.parametrize("var", ["HF_DATASETS_CACHE", "HF_HOME"])
@pytest.mark.parametrize("blank", ["", " ", "\t"])
def test_a_blank_default_cache_root_variable_is_refused_naming_it(tmp_path, var, blank):
    """Set but blank is refused, as HF_PIPELINE_CACHE is: `HF_DATASETS_CACHE=" "` made
    the root `./ /hf_pipeline` and `HF_HOME=""` counted as unset, silently."""
    env = {"HF_HOME": str(tmp_path), "HF_DATASETS_CACHE": str(tmp_path / "d"), var: blank}
    with pytest.raises(ConfigError) as e:
        default_cache_root(env)
    assert str(e.value).startswith(f"${var} is set but blank ({blank!r})"), e.value
    assert e.value.field == "build.cache_dir"


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
    from hf_pipeline.cache.latents import EMBEDDING_DTYPES
    from hf_pipeline.read.sampler import PARTITIONS, SHUFFLES

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


# ------------------------------------------------ hostile values (issue 23, item 5)


#: Nested anchors inside data.caption_column whose aliases expand to 9**7 strings: the
#: old loader built the list and printed its whole repr (33 MB) in the "must be str"
#: message; two more levels of 30 bytes each make it gigabytes.
def _alias_bomb(levels: int = 7) -> str:
    node = "&a0 [" + ", ".join(["lol"] * 9) + "]"
    for i in range(1, levels):
        node = f"&a{i} [{node}" + f", *a{i - 1}" * 8 + "]"
    return f"data:\n  caption_column: {node}\n"


_ALIAS_BOMB = _alias_bomb()


def _refusal(override, environ=None) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        load_config(None, override, environ=environ or {})
    message = str(ei.value)
    assert "\n" not in message and len(message) < 400, message[:1000]
    return ei.value


@pytest.mark.parametrize(
    "override, field, fragment",
    [
        # name is one path component of the cache folder: never a way out of the root.
        (["name=../../../x"], "name", "must be one path component"),
        (["name=a/b"], "name", "must be one path component"),
        (["name=.hidden"], "name", "must be one path component"),
        (["name=" + "x" * 65], "name", "at most 64 characters"),
        ({"name": "de\x00mo"}, "name", "must be one path component"),
        ({"build.cache_dir": "/tmp/a\x00b"}, "build.cache_dir", "control character"),
        ({"data.shards": "/data/x\ny"}, "data.shards", "control character"),
        (["build.cache_dir=" + "/x" * 3000], "build.cache_dir", "at most 4096 characters"),
        # Non-finite floats: accepted before, as endless timeouts or a NaN learning rate.
        (["data.file_timeout=.inf"], "data.file_timeout", "finite number, got inf"),
        (["train.learning_rate=1e400"], "train.learning_rate", "finite number, got inf"),
        (["data.staging_max_gb=.nan"], "data.staging_max_gb", "finite number, got nan"),
        (["coord.max_wait=.inf"], "coord.max_wait", "finite number"),
        (["coord.lease_timeout=-.inf"], "coord.lease_timeout", "finite number"),
        # Bounds: values no machine can honour, accepted before.
        (["data.download_workers=100000"], "data.download_workers", "in [1, 256], got 100000"),
        (["data.prefetch_ahead=1000000000"], "data.prefetch_ahead", "in [0, 1024]"),
        (["data.max_retries=1000"], "data.max_retries", "in [0, 100]"),
        (["data.file_timeout=1e9"], "data.file_timeout", "in (0, 86400]"),
        (["data.staging_max_gb=1e12"], "data.staging_max_gb", "in (0, 1000000]"),
        (["data.max_caption_bytes=0"], "data.max_caption_bytes", "in [1, 1073741824], got 0"),
        (["data.max_caption_bytes=2147483648"], "data.max_caption_bytes", "in [1, 1073741824]"),
        (["loader.prefetch=100000"], "loader.prefetch", "in [1, 1024]"),
        (["loader.num_threads=100000"], "loader.num_threads", "in [0, 256]"),
        (["loader.global_batch_size=10000000000"], "loader.global_batch_size", "in [1, "),
        (["loader.seed=-1"], "loader.seed", "in [0, 2147483646]"),
        (["train.learning_rate=50"], "train.learning_rate", "in (0, 10]"),
        (["train.steps=0"], "train.steps", "in [1, 1000000000], got 0"),
        (["train.hidden=1000000"], "train.hidden", "in [8, 65536]"),
        (["train.checkpoint_every=-1"], "train.checkpoint_every", "in [0, "),
        (["train.keep_checkpoints=0"], "train.keep_checkpoints", "in [1, 1000], got 0"),
        (["coord.max_wait=1e9"], "coord.max_wait", "coord.max_wait must be in (0, 604800]"),
        (["encoder.max_length=10000000"], "encoder.max_length", "in [1, 131072]"),
        (["encoder.device=cudaX"], "encoder.device", "'cuda[:N]'"),
        (["build.part_shards=-1"], "build.part_shards", "(0: 16), got -1"),
        ({"build.cache_dir": "   "}, "build.cache_dir", "or '' for the default root"),
        (["data.demo.num_shards=100000000"], "data.demo.num_shards", "in [1, 100000]"),
        # A number too long to print (Python refuses str() of ints over 4300 digits).
        (["build.batch_size=" + "9" * 5000], "build.batch_size", "build.batch_size must be "),
        ({"build.batch_size": 10**5000}, "build.batch_size", "rows, got <int of 16610 bits>"),
        # The value's repr in a message is bounded, however big the value.
        ({"data.caption_column": list(range(10**6))}, "data.caption_column", "must be str"),
        ({"data.key_column": "k" * 10**6}, "data.key_column", "at most"),
    ],
)
def test_hostile_values_are_one_short_line_naming_the_field(override, field, fragment):
    err = _refusal(override)
    assert err.field == field, str(err)
    assert fragment in str(err), str(err)


def _float_fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_fields(value, f"{prefix}{f.name}.")
        elif f.type == "float":
            yield f"{prefix}{f.name}"


@pytest.mark.parametrize("field", list(_float_fields(Config())))
@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan", "1e999"])
def test_every_float_field_refuses_non_finite_values(field, bad):
    err = _refusal([f"{field}={bad}"])
    assert err.field == field and "finite number" in str(err), str(err)


def test_bounds_are_inclusive_and_bundled_configs_are_inside_them():
    cfg = load_config(
        None,
        [
            "data.download_workers=256",
            "data.prefetch_ahead=1024",
            "data.file_timeout=86400",
            "train.learning_rate=10",
            "loader.seed=2147483646",
            "name=coyo11m-gcs_v2.1",
            "train.checkpoint_every=0",
        ],
        environ={},
    )
    assert cfg.data.download_workers == 256 and cfg.name == "coyo11m-gcs_v2.1"
    for name in ("demo", "coyo11m", "coyo11m_gcs"):
        load_config(name, environ={})


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_ALIAS_BOMB)
    assert len(_ALIAS_BOMB) < 400
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as ei:
        load_config(bomb, environ={})
    assert time.perf_counter() - t0 < 5
    message = str(ei.value)
    assert "\n" not in message and len(message) < 400, message[:1000]
    assert str(bomb) in message and "alias" in message and "line 2" in message, message
    # Through --set as well: its values are parsed by the same loader.
    with pytest.raises(ConfigError, match="alias"):
        load_config(None, ["data.caption_column=[&a [1, 2], *a]"], environ={})


def test_oversized_or_deeply_nested_yaml_is_one_line(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: demo\n" + "# padding\n" * 200_000)
    err = _yaml_refusal(big)
    assert "larger than" in err and "1048576" in err
    deep = tmp_path / "deep.yaml"
    deep.write_text("data: " + "[" * 50_000 + "]" * 50_000 + "\n")
    err = _yaml_refusal(deep)
    assert "nested deeper than" in err


def test_a_setting_without_effect_warns_naming_it():
    with pytest.warns(FutureWarning, match=r"build.overlap_parts=2 has no effect"):
        load_config(None, ["build.overlap_parts=2"], environ={})


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `loader:` block silently dropped
    the first one's settings. Refused, naming the key and both lines."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("name: demo\nloader:\n  seed: 8\ntrain:\n  seed: 1\nloader:\n  seed: 3\n")
    err = _yaml_refusal(twice)
    assert "'loader'" in err and "line 6" in err and "line 2" in err, err
    nested = tmp_path / "nested.yaml"
    nested.write_text("loader:\n  seed: 8\n  seed: 16\n")
    err = _yaml_refusal(nested)
    assert "'seed'" in err and "line 3" in err and "line 2" in err, err
    # Equal keys in different mappings are fine.
    ok = tmp_path / "ok.yaml"
    ok.write_text("loader:\n  seed: 3\ntrain:\n  seed: 3\n")
    assert load_config(ok, environ={}).train.seed == 3


def _yaml_refusal(path) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, environ={})
    message = str(ei.value)
    assert "\n" not in message and len(message) < 400 and str(path) in message, message[:1000]
    assert ei.value.field == "--config"
    return message


@pytest.mark.parametrize("script", ["prebuild_cache.py", "train.py"])
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--set", "name=../../escaped"], "name must be one path component"),
        (["--set", "data.download_workers=100000"], "data.download_workers must be in [1, 256]"),
        (["--set", "coord.max_wait=.inf"], "coord.max_wait must be a finite number, got inf"),
        (["--config", "{bomb}"], "alias"),
        (["--set", "loader.latents_dtype=foo"], "loader.latents_dtype must be a floating dtype"),
    ],
)
def test_scripts_refuse_hostile_configs_in_one_line_exit_2(tmp_path, script, args, fragment):
    from tests.conftest import PYTHON, REPO, script_env

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_ALIAS_BOMB)
    root = tmp_path / "root" / "cache"
    args = [a.replace("{bomb}", str(bomb)) for a in args]
    p = subprocess.run(
        [PYTHON, str(REPO / "scripts" / script), "--cache-dir", str(root), *args],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: ") and fragment in line and len(line) < 400, line[:1000]
    # Refused before anything was written: no cache folder, inside the root or beside it.
    assert not (tmp_path / "root").exists() and not (tmp_path / "escaped").exists()


# ------------------------------------ one definition of each fact (issue 25, item 2)


def test_every_field_has_its_meaning_and_every_env_var_a_real_field():
    """Every field carries its meaning; each env variable that sets a field names one."""
    from hf_pipeline.config import ENV_VARS

    def fields(cls, prefix=""):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{prefix}{f.name} has no meaning"
            yield f"{prefix}{f.name}"
            value = getattr(cls(), f.name)
            if dataclasses.is_dataclass(value):
                yield from fields(type(value), f"{prefix}{f.name}.")

    known = set(fields(Config))
    for var in ENV_VARS:
        assert not var.field or var.field in known, var
    # Each variable load_config reads sets its field (and only through the one table).
    for var in (v for v in ENV_VARS if v.field):
        section, name = var.field.split(".")
        value = getattr(getattr(Config(), section), name)
        raw = "7" if not isinstance(value, str) else "gs://bucket/x"
        cfg = load_config(None, environ={var.name: raw})
        assert getattr(getattr(cfg, section), name) == type(value)(raw), var


def test_docs_configuration_reference_is_current():
    """docs/configuration.md's reference is what config.py renders now (regenerate with
    ``python -m hf_pipeline.config_docs --write-docs``), and names every field."""
    from hf_pipeline.config_docs import DOCS_PAGE, config_reference_markdown, render_docs_page

    page = DOCS_PAGE.read_text(encoding="utf-8")
    assert render_docs_page(page) == page, "run: python -m hf_pipeline.config_docs --write-docs"
    reference = config_reference_markdown()
    assert reference in page
    for section in ("data", "data.demo", "encoder", "build", "coord", "loader", "train"):
        assert f"### `{section}`" in reference
    # A field's bounds, default and meaning appear in its row.
    row = next(r for r in reference.splitlines() if r.startswith("| `build.num_proc` |"))
    assert "`0`" in row and "[0, 4096] (0: min(8, CPUs))" in row and "worker processes" in row


def test_docs_drift_is_detected(tmp_path):
    """A page whose generated block differs from the code is rewritten (so the check above
    can fail), and a page without the markers is refused by name."""
    from hf_pipeline.config_docs import DOCS_PAGE, render_docs_page, write_docs

    page = tmp_path / "configuration.md"
    stale = DOCS_PAGE.read_text(encoding="utf-8").replace("| `build.num_proc` |", "| `x` |")
    page.write_text(stale)
    assert render_docs_page(stale) != stale
    assert write_docs(page) is True and write_docs(page) is False
    assert page.read_text() == DOCS_PAGE.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="BEGIN GENERATED: config reference"):
        render_docs_page("# no markers\n")


def test_env_table_is_current():
    """The scripts' --help and the docs' env table both list every variable of the one
    table, with its field and default."""
    from hf_pipeline import cli
    from hf_pipeline.config import ENV_VARS
    from hf_pipeline.config_docs import DOCS_PAGE, env_help, env_table_markdown

    assert cli.ENV_HELP == env_help()
    assert env_table_markdown() in DOCS_PAGE.read_text(encoding="utf-8")
    for var in ENV_VARS:
        assert var.name in cli.ENV_HELP, var.name
        assert var.field in cli.ENV_HELP
        assert var.default.replace("`", "") in cli.ENV_HELP
    # A field's variable shows the field's own built-in default, not a copy of it.
    assert "DATASET_BATCH_SIZE" in cli.ENV_HELP and "else 1000)" in cli.ENV_HELP


# ------------------------------ loader options defined once (issue 25, item 3)


def test_loader_config_builds_the_loader_options():
    """LoaderConfig has exactly the options' fields and builds them; a value the options
    refuse is a one-line ConfigError naming loader.<field>."""
    from hf_pipeline.config import LoaderConfig
    from hf_pipeline.read.loader import LoaderOptions
    from hf_pipeline.read.sampler import SamplerOptions

    option_fields = {f.name for f in dataclasses.fields(SamplerOptions)} | {
        f.name for f in dataclasses.fields(LoaderOptions)
    } - {"order"}
    stream_fields = {
        "stream_from", "stream_ahead", "stream_cache_bytes", "stream_concurrency",
        "stream_read_timeout", "stream_workers",
    }  # fmt: skip
    assert {f.name for f in dataclasses.fields(LoaderConfig)} == option_fields | stream_fields
    cfg = load_config(
        None,
        ["loader.crop=1", "loader.shuffle=block", "loader.num_threads=3", "loader.seed=9"],
        environ={},
    ).loader
    options = cfg.loader_options()
    assert options == LoaderOptions.from_config(cfg)
    assert (
        options.order
        == cfg.sampler_options()
        == SamplerOptions(global_batch_size=64, seed=9, crop=1, shuffle="block")
    )
    assert (options.num_threads, options.latents_dtype) == (3, None)
    assert LoaderConfig().loader_options().num_threads is None
    err = _refusal(["loader.partition=diagonal"])
    assert err.field == "loader.partition" and "\n" not in str(err)
    assert str(err).startswith("loader.partition must be one of ('contiguous', 'strided')")


# ------------------------------------------ a variable set but blank (clifix, item 5)


_BLANK_VARS = [v.name for v in ENV_VARS if v.field]
_BLANKS = [" ", "", "\t"]


@pytest.mark.parametrize("blank", _BLANKS)
@pytest.mark.parametrize("var", _BLANK_VARS)
def test_a_blank_env_var_is_refused_by_load_config(var, blank):
    """Every variable, every blank: load_config refuses it in one line naming the variable
    and its field (every variable is read by that one loop over the table)."""
    field = next(v.field for v in ENV_VARS if v.name == var)
    err = _refusal([], environ={var: blank})
    assert err.field == field, err.field
    assert str(err).startswith(f"${var} is set but blank ({blank!r})"), str(err)


@pytest.mark.parametrize(
    "var, blank",
    [
        # Each variable and each blank through a real process in the loop (variable i
        # with blank i % 3); the other 18 pairs are slow: a process each (0.35 CPU-s),
        # and load_config's refusal of all 27 is test_a_blank_env_var_is_refused_by_load_config.
        pytest.param(var, blank, marks=() if j == i % len(_BLANKS) else pytest.mark.slow)
        for i, var in enumerate(_BLANK_VARS)
        for j, blank in enumerate(_BLANKS)
    ],
)
def test_a_blank_env_var_is_refused_naming_it(tmp_path, var, blank):
    """Set but blank is a mistake (a launcher's empty template, a stray space), not
    "unset": the docs' table says a variable is either unset or holds a value."""
    from tests.conftest import PYTHON, REPO, script_env

    root = tmp_path / "c"
    root.mkdir()
    p = subprocess.run(
        [PYTHON, "-m", "hf_pipeline", "status", "--cache-dir", str(root)],
        env=script_env(**{var: blank}),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"${var}" in line and "blank" in line, line


def test_overrides_given_as_one_string_is_a_type_error():
    """`load_config("demo", "loader.seed=1")`: overrides is a list of strings; a str
    was iterated letter by letter (`override 'l' must look like section.field=value`)."""
    with pytest.raises(TypeError, match=r"overrides must be a list of 'section\.field=value'"):
        load_config("demo", "loader.seed=1", environ={})
    with pytest.raises(TypeError, match=r"overrides\[1\] must be a str, got int"):
        load_config("demo", ["loader.seed=1", 3], environ={})
