"""`llm-gateway` and `llm-loadtest` explain themselves: help for every flag, a version, and a
clear refusal of a command that does not exist."""

from __future__ import annotations

import pytest

from gateway import __version__
from gateway.cli import main as gateway
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
