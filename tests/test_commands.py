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
    junk = shutil.ignore_patterns(
        ".git", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "benchmarks"
    )

    def ignore(folder, names):  # the top-level build/ (setup.py's output), not a package
        return set(junk(folder, names)) | ({"build"} if folder == str(REPO) else set())

    shutil.copytree(REPO, base / "repo", ignore=ignore)
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
    p = subprocess.run([str(exe), "status", "--cache-dir", str(tmp_path / "none")], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (p.returncode, p.stdout) == (0, f"no caches under {tmp_path / 'none'}\n"), p.stderr


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


def test_status_of_an_empty_root_prints_what_the_script_prints(tmp_path):
    root = tmp_path / "empty"
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
