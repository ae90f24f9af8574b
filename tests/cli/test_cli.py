"""`llm-gateway` and `llm-loadtest` explain themselves: help for every flag, a version, and a
clear refusal of a command that does not exist."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway import __version__
from gateway.cli import main as gateway
from loadtest.autoscale.cli import tokenizer
from loadtest.cli import COMMANDS
from loadtest.cli import main as loadtest


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = gateway(list(argv))
    except SystemExit as exc:  # argparse ends --help and --version this way
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_top_level_help_names_every_command(capsys) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "serve | check | explain | schema" in out


def test_version(capsys) -> None:
    assert run(capsys, "--version")[:2] == (0, f"llm-gateway {__version__}\n")


@pytest.mark.parametrize("flag", ["--policy", "--host", "--port"])
def test_every_serve_flag_has_help(capsys, flag) -> None:
    _, out, _ = run(capsys, "serve", "--help")
    line = next(line for line in out.splitlines() if line.strip().startswith(flag))
    assert line.split(maxsplit=2)[2:], f"{flag} has no help text"


def test_loadtest_refuses_an_unknown_command(capsys) -> None:
    assert loadtest(["bogus"]) == 2
    out, err = capsys.readouterr()
    assert "unknown command 'bogus'" in err and out == ""


def test_loadtest_help_is_not_an_error(capsys) -> None:
    assert loadtest(["--help"]) == 0
    assert "llm-loadtest sweep" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_loadtest_writes_where_it_is_run_not_into_its_package(command, monkeypatch) -> None:
    """An installed `llm-loadtest` lives in site-packages: every report or file a command writes
    by default goes under the current directory."""
    parsers: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *_: object) -> None:
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        loadtest([command])
    (parser,) = parsers
    paths = [a.default for a in parser._actions if isinstance(a.default, Path)]
    assert all(not path.is_absolute() for path in paths), paths


def test_autoscales_own_tokenizer_is_built_in_the_users_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = Path(tokenizer(None))
    assert built.is_relative_to(tmp_path) and (built / "tokenizer.json").is_file()
