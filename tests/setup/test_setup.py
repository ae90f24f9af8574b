"""`make`'s own set-up (tests/setup/): which Python builds .venv, and what a machine without the
tests' programs is told. Run as the scripts run, in a shell, with a PATH the test controls."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SETUP = Path(__file__).parent


def fake_bin(tmp_path: Path, *programs: str) -> Path:
    """A PATH directory holding only the named programs of this machine (and a shell's needs)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for name in ("bash", "id", "dirname", *programs):
        found = shutil.which(name)
        assert found, name
        (directory / name).symlink_to(found)
    return directory


def run(
    script: str, *args: str, path: Path, env: dict[str, str] | None = None, as_root: bool = True
) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash
    command = [bash, str(SETUP / script), *args]
    if not as_root and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "util-linux's setpriv runs the script as nobody"
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    return subprocess.run(
        command, env={"PATH": str(path), **(env or {})}, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


def test_the_first_python_3_11_or_newer_is_picked_and_older_ones_are_passed_over(tmp_path):
    path = fake_bin(tmp_path)
    old = path / "python3.11"
    old.write_text("#!/bin/bash\nexit 1\n")  # claims to be too old: the version check fails
    old.chmod(0o755)
    (path / "python3.12").symlink_to(sys.executable)
    out = run("python.sh", path=path)
    assert (out.returncode, out.stdout.strip()) == (0, "python3.12")


def test_an_explicit_python_is_checked_not_trusted(tmp_path):
    path = fake_bin(tmp_path)
    out = run("python.sh", path=path, env={"PYTHON": "python3.9"})
    assert out.returncode == 1
    assert "PYTHON=python3.9" in out.stderr and "3.11 or newer" in out.stderr
    (path / "mine").symlink_to(sys.executable)
    assert run("python.sh", path=path, env={"PYTHON": "mine"}).stdout.strip() == "mine"


def test_no_python_at_all_says_what_to_install(tmp_path):
    out = run("python.sh", path=fake_bin(tmp_path))
    assert out.returncode == 1
    assert "apt-get install python3 python3-venv" in out.stderr and "PYTHON=" in out.stderr


def test_missing_test_programs_stop_the_run_with_the_one_command_to_run():
    with tempfile.TemporaryDirectory() as tmp:  # not under pytest's tmp_path: nobody reads it
        os.chmod(tmp, 0o755)
        path = fake_bin(Path(tmp), "redis-server", "prometheus", "openssl", "npm")
        out = run("tools.sh", f"{tmp}/venv", path=path, as_root=False)
    assert out.returncode == 1, out.stderr
    # promtool alone is missing: it comes with Debian's prometheus
    assert "sudo apt-get install -y prometheus\n" in out.stderr


def test_nothing_is_installed_when_every_program_is_there_and_the_tokenizers_are_fetched(
    tmp_path,
):
    path = fake_bin(tmp_path, "redis-server", "prometheus", "promtool", "openssl", "kubectl", "npm")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!{shutil.which("bash")}\necho "$@" > {tmp_path}/ran\n')
    python.chmod(0o755)
    out = run("tools.sh", str(tmp_path / "venv"), path=path)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert (tmp_path / "ran").read_text() == "-m loadtest.real_tokenizers\n"
