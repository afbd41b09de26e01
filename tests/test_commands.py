"""The ``hf-pipeline`` command (hf_pipeline/commands/): installed by pip, the scripts' output.

Each subcommand must print and exit exactly as the script operation it mirrors, so the
tests run both on the same input and compare. The command is the venv's installed
``hf-pipeline`` when there is one (``pip install -e .`` after setup.py gained the entry
point), else ``python -m hf_pipeline``; a pip install of this checkout into a folder of
its own checks the console-script declaration itself, whatever the venv holds.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pipeline import cli
from hf_pipeline.commands import main as hf_pipeline_main
from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env
from tests.helpers.checkout import copy_checkout
from tests.helpers.publishing import gcs_store  # noqa: F401 - a fixture

SUBCOMMANDS = ("build", "status", "verify", "clean", "publish", "train")


def _command() -> list[str]:
    """``hf-pipeline`` next to this interpreter if installed there, else ``python -m``."""
    exe = shutil.which("hf-pipeline", path=str(Path(sys.executable).parent))
    return [exe] if exe else [PYTHON, "-m", "hf_pipeline"]


def _run(argv, *, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv],
        env=env or script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _script(name: str, *args) -> subprocess.CompletedProcess:
    return _run([PYTHON, REPO / "scripts" / name, *args])


def _hf(*args, env=None) -> subprocess.CompletedProcess:
    return _run([*_command(), *args], env=env)


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def _untimed(text: str) -> str:
    """Output with its durations and speeds blanked (they differ run to run)."""
    return re.sub(r"\d+\.\d+ (s|GB/s)\b", r"_ \1", text)


@pytest.fixture(scope="module")
def pip_installed(tmp_path_factory) -> Path:
    """This checkout pip-installed (no deps) into a folder of its own: the real console
    script pip writes from setup.py, without touching the shared venv."""
    base = tmp_path_factory.mktemp("pip")
    copy_checkout(base / "repo", benchmarks=False)
    p = subprocess.run(
        [PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(base / "site"), str(base / "repo")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return base / "site"


@pytest.mark.slow
def test_pip_install_puts_hf_pipeline_on_path(pip_installed, tmp_path):
    exe = pip_installed / "bin" / "hf-pipeline"
    assert exe.is_file() and os.access(exe, os.X_OK)
    (ep,) = [
        e
        for d in importlib.metadata.distributions(path=[str(pip_installed)])
        if d.metadata["Name"] == "hf_pipeline"
        for e in d.entry_points
        if e.group == "console_scripts"
    ]
    assert (ep.name, ep.value) == ("hf-pipeline", "hf_pipeline.commands:main")
    # Only the installed copy on the path (not the checkout), run from elsewhere.
    env = {**script_env(), "PYTHONPATH": str(pip_installed)}
    p = subprocess.run([str(exe), "--help"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert all(f"    {name} " in p.stdout for name in SUBCOMMANDS), p.stdout
    assert "DATASET_NUM_PROC" in p.stdout
    (tmp_path / "empty").mkdir()
    p = subprocess.run([str(exe), "status", "--cache-dir", str(tmp_path / "empty")], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (p.returncode, p.stdout) == (0, f"no caches under {tmp_path / 'empty'}\n"), p.stderr


def test_venv_entry_point_when_installed():
    """The venv's own install, once re-installed from a tree with the entry point."""
    if not shutil.which("hf-pipeline", path=str(Path(sys.executable).parent)):
        pytest.skip("hf-pipeline not installed in this venv: run `pip install -e .`")
    eps = importlib.metadata.entry_points(group="console_scripts", name="hf-pipeline")
    assert [e.value for e in eps] == ["hf_pipeline.commands:main"]


def test_help_lists_subcommands_and_environment():
    p = _hf("--help")
    assert p.returncode == 0, p.stderr
    for name in SUBCOMMANDS:
        assert f"    {name} " in p.stdout, p.stdout
    assert cli.ENV_HELP in p.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_help_has_the_scripts_flags_and_environment(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        hf_pipeline_main([name, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for flag in ("--config", "--set", "--cache-dir", "--num-proc", "--quiet"):
        assert flag in out, out
    assert cli.ENV_HELP in out
    extra = {"clean": ["--dry-run", "--json"], "train": ["--steps", "--checkpoint-every"]}
    for flag in extra.get(name, ["--json"]):
        assert flag in out, out
    if name == "train":
        assert "JAX_COORDINATOR_ADDRESS" in out
    # The script's operation flags are not the subcommands' (`clean --dry-run`, not --clean).
    for script_flag in ("--clean", "--verify", "--status", "--publish"):
        assert script_flag not in out, out


def test_a_missing_config_names_the_paths_tried(tmp_path):
    p = _hf("status", "--config", "nonexist", "--cache-dir", tmp_path / "c")
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "nonexist" in line and str(Path("configs") / "nonexist.yaml") in line, line


@pytest.mark.parametrize("var", ["HF_HOME", "HF_DATASETS_CACHE"])
def test_a_missing_default_root_names_the_variable_it_came_from(tmp_path, var):
    """`HF_HOME=rel hf-pipeline status` said `build.cache_dir rel/datasets/hf_pipeline: no
    such folder` without saying that HF_HOME made that path."""
    env = {
        k: v for k, v in script_env().items() if k not in ("HF_PIPELINE_CACHE", "HF_DATASETS_CACHE")
    }
    env[var] = str(tmp_path / "nowhere")
    p = _hf("status", env=env)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert f"(from ${var})" in line and "no such folder" in line, line


def test_status_of_an_empty_root_prints_what_the_script_prints(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    script = _script("prebuild_cache.py", "--cache-dir", root, "--status")
    command = _hf("status", "--cache-dir", root)
    assert script.returncode == command.returncode == 0, script.stderr + command.stderr
    assert command.stdout == script.stdout == f"no caches under {root}\n"
    # --json too: the same report.
    _script("prebuild_cache.py", "--cache-dir", root, "--status", "--json", tmp_path / "a.json")
    _hf("status", "--cache-dir", root, "--json", tmp_path / "b.json")
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


@pytest.mark.slow
def test_build_finds_the_session_cache_and_reports_what_the_script_reports(
    tmp_path, session_cache_root, built_cache
):
    args = ["-q", "--cache-dir", session_cache_root, *_sets(SMALL_DEMO)]
    script = _script("prebuild_cache.py", *args, "--json", tmp_path / "script.json")
    command = _hf("build", *args, "--json", tmp_path / "command.json")
    assert script.returncode == command.returncode == 0, script.stderr + command.stderr
    s, c = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("script", "command"))
    assert c["built"] is False and c["fingerprint"] == built_cache.fingerprint  # found
    # seconds and the inputs' hashing stats are the run's own (the first start hashed,
    # the second hit the content index)
    assert {**c, "seconds": 0, "hashing": None} == {**s, "seconds": 0, "hashing": None}
    assert _untimed(command.stdout) == _untimed(script.stdout)
    assert "found" in command.stdout


def test_verify_and_clean_print_what_the_script_prints(session_cache_root, built_cache):
    root = ["--cache-dir", session_cache_root]
    out = {}
    for sub, flags in (("verify", ["--verify"]), ("clean", ["--clean", "--dry-run"])):
        script = _script("prebuild_cache.py", *root, *flags)
        command = _hf(sub, *root, *flags[1:])
        assert script.returncode == command.returncode == 0, script.stdout + command.stdout
        assert _untimed(command.stdout) == _untimed(script.stdout)
        out[sub] = command.stdout
    assert f"{built_cache.cache_dir.name}: ok" in out["verify"]
    assert "would remove 0 item(s)" in out["clean"]  # the live session cache is kept


def test_a_reader_that_stops_reading_changes_no_exit_code(tmp_path, built_cache):
    """``status | head -1``: the reader closed the pipe, the command said ``error:
    [Errno 32] Broken pipe`` and exited 1 after doing its work (outside tester). Now the
    rest of the output goes nowhere and each command ends with its own code: 0 for
    status and clean, 1 for a verify that found a damaged file (checked to the end)."""
    root = tmp_path / "root"
    shutil.copytree(built_cache.cache_dir.parent, root, symlinks=True)
    cache = root / built_cache.cache_dir.name
    arrow = sorted(cache.rglob("*.arrow"))[0]
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrow.write_bytes(bytes(data))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        codes = {}
        for sub in (["status"], ["clean", "--dry-run"], ["verify"]):
            p = subprocess.run(
                [*_command(), *sub, "--cache-dir", str(root)],
                stdout=write_end, stderr=subprocess.PIPE, text=True, env=script_env(),
                timeout=300,
            )  # fmt: skip
            assert "Broken pipe" not in p.stderr and "Traceback" not in p.stderr, p.stderr
            codes[sub[0]] = p.returncode
    finally:
        os.close(write_end)
    assert codes == {"status": 0, "clean": 0, "verify": 1}, codes


@pytest.mark.parametrize(
    "command, script",
    [
        # A URL no store opens: the positional of `status` is the script's --status URL.
        (["status", "file:///nowhere"], ["prebuild_cache.py", "--status", "file:///nowhere"]),
        pytest.param(
            ["build", "--set", "build.num_proc=-2"],
            ["prebuild_cache.py", "--set", "build.num_proc=-2"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["train", "--steps", "0"], ["train.py", "--steps", "0"], marks=pytest.mark.slow
        ),
    ],
)
def test_bad_input_is_the_scripts_one_line_and_exit_2(tmp_path, command, script):
    root = ["--cache-dir", tmp_path / "c"]
    s = _script(script[0], *root, *script[1:])
    c = _hf(*command, *root)
    assert s.returncode == c.returncode == 2, s.stderr + c.stderr
    assert c.stderr == s.stderr and len(c.stderr.strip().splitlines()) == 1, c.stderr
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["build", "--bogus"], "unrecognized arguments: --bogus"),
        (["build", "--dry-run"], "unrecognized arguments: --dry-run"),  # only `clean` has it
        (["train", "--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["rebuild"], "invalid choice: 'rebuild'"),
        ([], "the following arguments are required: COMMAND"),
        # a tester: a flag before any command said COMMAND was missing
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--bogus", "build"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_flag_is_one_line_exit_2(args, fragment):
    p = _hf(*args)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: hf-pipeline") and fragment in line, line


def test_scripts_are_wrappers_of_the_commands_code():
    """One copy of each operation: the scripts define nothing, they call
    hf_pipeline.commands (which `hf-pipeline` calls too)."""
    for name, module in (("prebuild_cache.py", "prebuild"), ("train.py", "train")):
        tree = ast.parse((REPO / "scripts" / name).read_text(encoding="utf-8"))
        defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defs == [], f"scripts/{name} defines {defs}: move them to hf_pipeline.commands"
        imported = [
            alias.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module == "hf_pipeline.commands"
            for alias in n.names
        ]
        assert module in imported, f"scripts/{name} does not call hf_pipeline.commands.{module}"


# ------------------------------------------------ the outside tester's findings (clifix)


def _only_json(p: subprocess.CompletedProcess) -> dict:
    """``p``'s stdout parsed as one JSON document: what ``--json - 2>/dev/null | jq``
    sees (a human line before it would make this raise)."""
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.slow
def test_build_json_to_stdout_is_the_json_alone_when_found(session_cache_root, built_cache):
    p = _hf("build", "-q", "--cache-dir", session_cache_root, *_sets(SMALL_DEMO), "--json", "-")
    summary = _only_json(p)
    assert summary["built"] is False and summary["fingerprint"] == built_cache.fingerprint
    # The human summary is still there, on stderr.
    assert f"fingerprint {built_cache.fingerprint}" in p.stderr and "[found" in p.stderr


@pytest.mark.slow
def test_build_json_to_stdout_is_the_json_alone_when_built(tmp_path):
    root = tmp_path / "c"
    small = [*SMALL_DEMO, "data.demo.num_shards=2", "data.demo.samples_per_shard=25"]
    p = _hf("build", "-q", "--cache-dir", root, *_sets(small), "--json", "-")
    summary = _only_json(p)
    assert summary["built"] is True and summary["rows_in"] == 50
    assert "[built in" in p.stderr and "rows        50 latent rows in" in p.stderr


@pytest.mark.slow
def test_build_json_paths_are_absolute_when_the_cache_dir_is_relative(tmp_path):
    """``--cache-dir c`` (relative): the JSON named ``c/...`` paths (``cache_dir``,
    ``hashing.index``), wrong for a reader in another folder (outside tester)."""
    small = [*SMALL_DEMO, "data.demo.num_shards=2", "data.demo.samples_per_shard=25"]
    p = subprocess.run(
        [*_command(), "build", "-q", "--cache-dir", "c", *_sets(small), "--json", "-"],
        env=script_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    summary = _only_json(p)
    assert Path(summary["cache_dir"]).is_absolute(), summary
    assert Path(summary["cache_dir"]).resolve().parent == (tmp_path / "c").resolve()
    assert summary["hashing"].get("index"), summary["hashing"]
    assert Path(summary["hashing"]["index"]).is_absolute(), summary["hashing"]


@pytest.mark.slow
def test_publish_json_to_stdout_is_the_json_alone(
    source_cache,
    gcs_store,  # noqa: F811 - the fixture
):
    server, url = gcs_store
    result = source_cache.result
    env = script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    p = _hf(
        "publish", url, "-q", "--set", f"data.shards={source_cache.data}",
        "--cache-dir", Path(result.cache_dir).parent, *_sets(SMALL_DEMO), "--json", "-",
        env=env,
    )  # fmt: skip
    summary = _only_json(p)
    assert summary["fingerprint"] == result.fingerprint and not summary["built"]
    assert summary["publish"]["state"] == "published"
    assert f"published   {url}/{Path(result.cache_dir).name}" in p.stderr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_cache_dir_that_is_a_file_is_one_line_exit_2(tmp_path, how):
    afile = tmp_path / "small.yaml"
    afile.write_text("build: {}\n")
    for where in (afile, afile / "below"):
        if how == "flag":
            p = _hf("build", "--cache-dir", where)
            names = "--cache-dir"
        else:
            p = _hf("build", env=script_env(HF_PIPELINE_CACHE=str(where)))
            names = "HF_PIPELINE_CACHE"
        assert p.returncode == 2, p.stderr[-2000:]
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith("error: ") and "build.cache_dir" in line and names in line, line
        assert str(where) in line and "folder" in line and "Errno" not in line, line
    assert afile.read_text() == "build: {}\n"


@pytest.mark.parametrize("sub", ["status", "verify", "clean"])
def test_a_cache_root_that_does_not_exist_is_one_line_exit_2(tmp_path, sub):
    root = tmp_path / "nonexist"
    for extra in ([], ["--json", "-"]):
        p = _hf(sub, "--cache-dir", root, *extra)
        assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
        (line,) = p.stderr.strip().splitlines()
        assert "no such folder" in line and str(root) in line and "--cache-dir" in line, line
    assert not root.exists()  # not created by a look at it


@pytest.mark.parametrize(
    "args",
    [["--cache-dir", ""], ["--cache-dir", " "], ["--set", "build.cache_dir="],
     ["--set", "build.cache_dir= "]],
    ids=["flag-empty", "flag-blank", "set-empty", "set-blank"],
)  # fmt: skip
def test_a_blank_cache_root_is_one_line_exit_2(tmp_path, args):
    """``--cache-dir "$DIR"`` with DIR unset (or a blank ``--set``) ran with the default
    root: a build wrote a whole cache into the home folder. Now one line, exit 2, and
    the default root is not touched (HF_HOME points at an empty folder here)."""
    home = tmp_path / "hf_home"
    env = {**script_env(), "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets")}
    p = _hf("status", *args, env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "build.cache_dir" in line and "is blank" in line, line
    assert not home.exists()


def test_clean_exit_0_for_what_it_keeps_on_purpose(tmp_path):
    """A `left` line for what clean never touches (a symlink, a folder without the mark)
    is not a failure: exit 0."""
    root = tmp_path / "root"
    (root / "demo-0123456789abcdef").mkdir(parents=True)
    (root / "link").symlink_to(tmp_path)
    p = _hf("clean", "--cache-dir", root)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"left {root / 'link'}: a symbolic link" in p.stdout
    assert f"left {root / 'demo-0123456789abcdef'}: named like a cache but without" in p.stdout
    assert (root / "demo-0123456789abcdef").is_dir() and (root / "link").is_symlink()


def test_clean_exit_1_when_a_removal_fails(tmp_path, mounts):
    """Something clean set out to remove (an earlier run's trash) but could not (a
    read-only mount): named on a `left` line, exit 1."""
    from tests.conftest import run_mount

    src, root = tmp_path / "src", tmp_path / "root"
    src.mkdir()
    root.mkdir()
    trash = src / ".demo-0123456789abcdef.trash-0badf00d"
    trash.symlink_to(tmp_path / "gone")
    mounts("--bind", str(src), str(root))
    run_mount("-o", "remount,bind,ro", str(root))
    p = _hf("clean", "--cache-dir", root, "--json", "-")
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert [x["path"] for x in report["left"]] == [str(root / trash.name)]
    assert report["left"][0]["why"].startswith("could not remove")
    assert f"left {root / trash.name}: could not remove" in p.stderr
    assert trash.is_symlink()


@pytest.mark.slow
def test_build_into_a_folder_whose_identity_names_another_fingerprint_exits_2(
    tmp_path, session_cache_root, built_cache
):
    """A copy of the session cache whose identity file names another fingerprint: the
    build served it as found (status, verify and clean call it no cache). Now: exit 2,
    one line naming the folder and both fingerprints; nothing in it changes."""
    from dist.layout import IDENTITY_FILE, identity_bytes

    root = tmp_path / "root"
    cache = root / built_cache.cache_dir.name
    shutil.copytree(built_cache.cache_dir, cache)
    (cache / IDENTITY_FILE).unlink()
    (cache / IDENTITY_FILE).write_bytes(identity_bytes("0" * 16, host="h", pid=1))
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    res = _script("prebuild_cache.py", "-q", "--cache-dir", root, *_sets(SMALL_DEMO))
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ") and str(cache) in line, line
    assert f"'{'0' * 16}'" in line and f"'{built_cache.fingerprint}'" in line, line
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_a_cache_folder_given_as_the_cache_root_is_one_line_exit_2(tmp_path, sub):
    """The build prints the cache folder and the guides call it DEMO_CACHE: passed as
    --cache-dir, status said "no caches under" it and build made a whole cache inside
    it (outside tester). Now one line naming the folder and the root to use, exit 2,
    before any work; nothing in the folder is written or removed."""
    from dist.layout import IDENTITY_FILE, identity_bytes

    root = tmp_path / "root"
    cache = root / "demo-0123456789abcdef"
    cache.mkdir(parents=True)
    (cache / IDENTITY_FILE).write_bytes(identity_bytes("0123456789abcdef", host="h", pid=1))
    before = sorted(p.name for p in cache.iterdir())
    args = {"status": [], "publish": ["gs://nowhere-bucket/x"], "train": ["--steps", "1"]}
    p = _hf(sub, "--cache-dir", cache, *args.get(sub, []), *_sets(SMALL_DEMO))
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr[-2000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: ") and str(cache) in line, line
    assert "is a cache folder (demo-0123456789abcdef), not a cache root" in line, line
    assert line.endswith(f"--cache-dir takes the folder that holds it: {root}"), line
    assert sorted(p.name for p in cache.iterdir()) == before


def test_a_roots_own_folders_and_what_is_inside_a_cache_are_refused_as_roots(tmp_path, built_cache):
    """``<root>/.parts`` given as the root listed every stored part as a stale cache,
    verified them as caches with problems and a build made a whole cache root inside it;
    a stored part's folder was refused with the advice to use ``.parts`` (outside
    tester). Every folder hf_pipeline keeps in a root, a stored part, and a folder
    inside a cache (existing or not) is refused naming the root that holds it; a
    user's folder that merely looks like a cache is a root."""
    import argparse

    from dist.layout import IDENTITY_FILE, identity_bytes
    from hf_pipeline.cache.layout import ROOT_FOLDERS
    from hf_pipeline.config import load_config
    from hf_pipeline.errors import ConfigError

    root = tmp_path / "root"
    cache = root / "demo-0123456789abcdef"
    part = root / ".parts" / ("join-" + "ab" * 16)
    for folder, fingerprint in ((cache, "0123456789abcdef"), (part, "ab" * 16)):
        folder.mkdir(parents=True)
        (folder / IDENTITY_FILE).write_bytes(identity_bytes(fingerprint, host="h", pid=1))
    lookalike = tmp_path / "mine-0123456789abcdef"  # no identity file: not a cache
    # The list is the build's: every dot folder a build leaves in its root is on it.
    from dist.layout import parse_trash_name

    made = built_cache.cache_dir.parent.iterdir()
    made_own = {p.name for p in made if p.name.startswith(".") and not parse_trash_name(p.name)}
    assert made_own and made_own <= set(ROOT_FOLDERS), made_own
    lookalike.mkdir()

    def check(path: Path, *, must_exist: bool = True) -> None:
        cfg = load_config(None, [f"build.cache_dir={path}"], environ={})
        args = argparse.Namespace(cache_dir=str(path), overrides=[])
        cli.check_cache_root(cfg, args, must_exist=must_exist)

    stored = f".parts, the stored parts of the cache root {root}"
    cases = {
        root / ".parts": f"is hf_pipeline's own folder ({stored}), not a cache root",
        part: f"is inside {stored}, not a cache root",
        root / ".parts" / "new": f"is inside {stored}, not a cache root",
        cache / "converted.x": "is inside the cache folder demo-0123456789abcdef, not",
        cache: "is a cache folder (demo-0123456789abcdef), not a cache root",
    }
    cases |= {root / name: f"hf_pipeline's own folder ({name}, " for name in ROOT_FOLDERS}
    for path, what in cases.items():
        for must_exist in (True, False):
            with pytest.raises(ConfigError) as err:
                check(path, must_exist=must_exist)
            line = str(err.value)
            assert what in line and "(from --cache-dir)" in line, line
            assert line.endswith(f"--cache-dir takes the folder that holds it: {root}"), line
    check(root)
    check(lookalike)
    check(tmp_path / "new-root", must_exist=False)
    # A symlink to one of them is refused as what it leads to (the real root named).
    for target, what in ((root / ".parts", f"own folder ({stored})"),
                         (cache, "a cache folder (demo-0123456789abcdef)")):  # fmt: skip
        link = tmp_path / f"link-{target.name}"
        link.symlink_to(target)
        for path in (link, Path(f"{link}/")):
            with pytest.raises(ConfigError) as err:
                check(path, must_exist=False)
            assert what in str(err.value) and str(err.value).endswith(f": {root}"), err.value
    (tmp_path / "root-link").symlink_to(root)
    check(tmp_path / "root-link")  # a link to a root is a root
    # Through the command: a build into .parts is one line, exit 2, nothing made there.
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    p = _hf("build", "--cache-dir", root / ".parts", *_sets(SMALL_DEMO))
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr[-2000:]
    (line,) = p.stderr.strip().splitlines()
    assert f"is hf_pipeline's own folder ({stored})" in line, line
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_a_cache_folder_as_the_root_from_the_environment_names_it(tmp_path):
    from dist.layout import IDENTITY_FILE, identity_bytes

    cache = tmp_path / "demo-0123456789abcdef"
    cache.mkdir()
    (cache / IDENTITY_FILE).write_bytes(identity_bytes("0123456789abcdef", host="h", pid=1))
    p = _hf("status", env=script_env(HF_PIPELINE_CACHE=str(cache)))
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert f"$HF_PIPELINE_CACHE takes the folder that holds it: {tmp_path}" in line, line


@pytest.mark.parametrize("sub", ["build", "status"])
def test_a_json_path_that_cannot_be_written_is_one_line_exit_2_before_the_work(tmp_path, sub):
    """--json /proc/x.json built first, then failed with the OS's words, exit 1; a
    folder that is a file was called missing (outside tester). Checked up front now,
    exit 2, and nothing is created: no cache, no JSON file."""
    root = tmp_path / "root"
    root.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    cases = [
        (Path("/proc/x.json"), "its folder /proc cannot hold files"),
        (afile / "x.json", f"{afile} is a file, not a folder"),
        (afile / "sub" / "x.json", f"{afile} is a file, not a folder"),
        (tmp_path / "nodir" / "x.json", f"its folder {tmp_path / 'nodir'} does not exist"),
    ]
    for path, why in cases:
        p = _hf(sub, "-q", "--cache-dir", root, "--json", path, *_sets(SMALL_DEMO))
        assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr[-2000:]
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(f"error: --json {path}: ") and why in line, line
        assert not path.exists()
    assert list(root.iterdir()) == []  # nothing built
    assert afile.read_text() == "x\n"


@pytest.mark.slow
def test_a_build_waiting_for_another_says_whom_it_waits_for(tmp_path):
    """Two real builds of one cache: the second printed nothing until `[found (52.6
    s)]` (outside tester). Now its log names the builder (host/pid) and the folder it
    waits for when the wait starts (every 30 s a line more); `-q` keeps it quiet."""
    import socket
    import time

    root = tmp_path / "root"
    args = [*_command(), "build", "--cache-dir", root, *_sets(SMALL_DEMO)]
    first = subprocess.Popen([str(a) for a in args], env=script_env(), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("demo-*/lease")) and time.monotonic() < deadline:
            assert first.poll() is None, "the first build ended before its lease was seen"
            time.sleep(0.05)
        quiet = subprocess.Popen([str(a) for a in [*args, "-q"]], env=script_env(), cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        second = _run(args)
        q_out, q_err = quiet.communicate(timeout=300)
        assert first.wait(timeout=300) == 0
    finally:
        first.kill()
    assert second.returncode == 0 and quiet.returncode == 0, second.stderr + q_err
    (cache,) = root.glob("demo-*")
    waits = [ln for ln in second.stderr.splitlines() if "waiting for" in ln]
    assert waits and f"waiting for {cache} (stages converted, filtered): built by " in waits[0]
    assert waits[0].endswith(f"built by {socket.gethostname()}/{first.pid}"), waits
    assert "found" in second.stdout
    assert "waiting for" not in q_err and "found" in q_out


@pytest.mark.slow
@pytest.mark.remote
def test_the_emulator_walkthrough_of_the_publish_guide_runs(tmp_path, built_cache):
    """docs/guides/publish-pull.md "Trying it on one machine": the bash block as written
    (the emulator's binary found, started, a bucket made, publish, status, a streamed
    training run, the emulator stopped), over a copy of the session's cache root and the
    small demo's settings; the port and folders are this test's."""
    from tests.helpers.ports import free_port

    text = (REPO / "docs" / "guides" / "publish-pull.md").read_text()
    section = text[text.index("## Trying it on one machine") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)  # type: ignore[union-attr]
    root = tmp_path / "root"
    shutil.copytree(built_cache.cache_dir.parent, root, symlinks=True)
    port = str(free_port())
    for old, new in (("4443", port), ("/tmp/gcs-data", str(tmp_path / "gcs-data")),
                     ("/tmp/gcs.log", str(tmp_path / "gcs.log")),
                     ("demo-<fingerprint>", built_cache.cache_dir.name)):  # fmt: skip
        assert old in block, old
        block = block.replace(old, new)
    command = " ".join(f"'{c}'" for c in _command())
    sets = " ".join(f"--set '{o}'" for o in SMALL_DEMO)
    prelude = (
        "set -euo pipefail\ntrap 'kill ${GCS_PID:-} 2>/dev/null || true' EXIT\n"
        f'hf-pipeline() {{ {command} "$1" --cache-dir \'{root}\' {sets} "${{@:2}}"; }}\n'
    )
    env = script_env()
    env.pop("STORAGE_EMULATOR_HOST", None)
    p = subprocess.run(["bash", "-c", prelude + block], env=env, capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    name = built_cache.cache_dir.name
    assert f"published   gs://my-bucket/caches/{name}  [published]" in p.stdout, p.stdout
    assert re.search(rf"^{name} .* complete ", p.stdout, flags=re.M), p.stdout
    assert f"streaming gs://my-bucket/caches/{name} (390 rows" in p.stdout, p.stdout[-2000:]
    assert "done: 20 steps" in p.stdout, p.stdout[-2000:]
    import socket
    import time

    for _ in range(100):  # the block stopped its emulator (SIGTERM: it exits soon)
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        except ConnectionRefusedError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the emulator still answers on port {port}")


def test_a_hostile_marker_or_a_fifo_in_a_cache_is_reported_not_a_crash_or_a_hang(
    tmp_path, built_cache
):
    """An adversarial tester: ``"pid": Infinity`` (or ``1e999``) in a marker made every
    command crash with an OverflowError traceback, in a cache or in a folder that is no
    cache; a fifo in the lease's or a marker's place made them wait forever. Now the
    marker is malformed JSON (the cache is damaged: listed, verified as such, cleaned
    as such), the fifo is no lease and no marker, and each command ends in seconds."""

    def copy(name: str) -> tuple[Path, Path]:
        root = tmp_path / name
        shutil.copytree(built_cache.cache_dir.parent, root, symlinks=True)
        return root, root / built_cache.cache_dir.name

    def run_all(root: Path) -> dict[str, subprocess.CompletedProcess]:
        out = {}
        for sub in (["status"], ["verify"], ["clean", "--dry-run"]):
            p = _run([*_command(), *sub, "--cache-dir", root], timeout=120)
            assert "Traceback" not in p.stderr, (sub, p.stderr[-3000:])
            out[sub[0]] = p
        return out

    root, cache = copy("infinite")
    text = (cache / "filtered.json").read_text()
    assert re.search(r'"pid": \d+', text)
    (cache / "filtered.json").write_text(re.sub(r'"pid": \d+', '"pid": Infinity', text))
    fake = root / "notes-0123456789abcdef"  # no identity file: not a cache of ours
    fake.mkdir()
    (fake / "converted.json").write_text(
        re.sub(r'"pid": \d+', '"pid": 1e999', (cache / "converted.json").read_text())
    )
    results = run_all(root)
    assert {k: p.returncode for k, p in results.items()} == {"status": 0, "verify": 1, "clean": 0}
    status = results["status"].stdout
    assert re.search(rf"^{cache.name} .* corrupt ", status, flags=re.M), status
    assert "filtered.json: pid: inf is not a finite number" in status, status
    assert "not a cache: notes-0123456789abcdef" in status, status

    # A 400-digit time (float() of it overflowed), a job post naming 10**12 ranks (a set
    # of them was built: MemoryError).
    root, cache = copy("huge-int")
    text = (cache / "converted.json").read_text()
    assert re.search(r'"finished_at": [0-9.]+', text)
    (cache / "converted.json").write_text(
        re.sub(r'"finished_at": [0-9.]+', '"finished_at": ' + "9" * 400, text)
    )
    (root / ".jobs" / "j1").mkdir(parents=True)
    (root / ".jobs" / "j1" / "k_0_rank-0").write_text(
        json.dumps({"rank": 0, "world_size": 10**12, "values": {}, "host": "h", "pid": 1})
    )
    results = run_all(root)
    assert {k: p.returncode for k, p in results.items()} == {"status": 0, "verify": 1, "clean": 0}
    assert "converted.json: finished_at: an integer beyond 64 bits" in results["status"].stdout

    # A fifo or a sparse 1 TiB file in a listed data file's place: verify names it at
    # once, reading neither (it waited forever; it read the terabyte).
    for how in ("fifo", "sparse"):
        root, cache = copy(f"data-{how}")
        listed = max((p for p in cache.rglob("*.arrow")), key=lambda p: p.stat().st_size)
        listed.unlink()
        if how == "fifo":
            os.mkfifo(listed)
        else:
            with open(listed, "wb") as f:
                f.truncate(1 << 40)
        p = _run([*_command(), "verify", "--cache-dir", root], timeout=120)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stdout + p.stderr[-2000:]
        assert listed.name in p.stdout, p.stdout
        assert "TiB read" not in p.stdout and "GiB read" not in p.stdout, p.stdout

    for place in ("lease", "filtered.json"):
        root, cache = copy(f"fifo-{place}")
        if (cache / place).exists():
            (cache / place).unlink()
        os.mkfifo(cache / place)
        results = run_all(root)  # each under a timeout: a wait would fail the test
        assert results["status"].returncode == 0, results["status"].stderr
        assert results["verify"].returncode == (1 if place == "filtered.json" else 0), results
        assert re.search(rf"^{cache.name} ", results["status"].stdout, flags=re.M)


def test_status_and_clean_name_a_link_where_hf_pipeline_keeps_a_folder(tmp_path):
    """A second outside tester: a symlinked `.staging` (or a file in the place of
    `.content-index`) made every build on the root fail, while `status` and `clean`
    said nothing of it (docs/operations.md: they name symlinks they leave). Both now list
    it, and neither follows it."""
    import json

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (root / ".staging").symlink_to(elsewhere)
    (root / ".content-index").write_text("not a folder")
    (root / ".mine").symlink_to(elsewhere)  # a user's own dot link: not hf_pipeline's
    hf = [PYTHON, "-m", "hf_pipeline"]
    status = _run([*hf, "status", "--cache-dir", root])
    assert status.returncode == 0, status.stderr
    why = "where hf_pipeline keeps a folder of its own: builds on this root refuse it"
    assert f"not a cache: .staging: a symbolic link {why}" in status.stdout, status.stdout
    assert f"not a cache: .content-index: a file {why}" in status.stdout, status.stdout
    assert ".mine" not in status.stdout, status.stdout
    listed = json.loads(_run([*hf, "status", "--cache-dir", root, "--json", "-"]).stdout)
    assert sorted(Path(e["path"]).name for e in listed["ignored"]) == [
        ".content-index", ".staging",
    ]  # fmt: skip
    clean = _run([*hf, "clean", "--cache-dir", root])
    assert clean.returncode == 0, clean.stderr
    assert f"left {root / '.staging'}: a symbolic link {why}" in clean.stdout, clean.stdout
    assert (root / ".staging").is_symlink() and (root / ".content-index").is_file()
    assert [p.name for p in elsewhere.iterdir()] == ["keep.txt"]
