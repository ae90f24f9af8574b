"""`llm-gateway check` catches a tokenizer directory that cannot count, without loading it.

By default each directory must exist and hold `tokenizer.json`, and a chat template where a
route may send its model chat requests; `--load-tokenizers` loads each as serve does, and
`--skip-tokenizers` looks at none (a machine without the fleet's directories)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import basic_policy, write_policy


def check(policy: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check", *flags, str(policy)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture
def copy(tokenizer_dir: Path, tmp_path: Path) -> Path:
    """A tokenizer directory of the test's own, to take files out of."""
    return Path(shutil.copytree(tokenizer_dir, tmp_path / "tokenizer"))


def policy_for(directory: Path, tmp_path: Path, **match: Any) -> Path:
    policy = basic_policy(directory, ["http://127.0.0.1:9"])
    policy["routes"][0]["match"].update(match)
    return write_policy(tmp_path, policy)


def test_a_missing_directory_is_refused_naming_line_and_field(tmp_path: Path) -> None:
    policy = policy_for(tmp_path / "nowhere", tmp_path)
    result = check(policy)
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith(f"{policy}:3: models.tiny.tokenizer: tokenizer directory")
    assert "nowhere' does not exist" in result.stderr
    # A machine without the fleet's directories checks the rest of the policy still.
    skipped = check(policy, "--skip-tokenizers")
    assert skipped.returncode == 0, skipped.stderr


def test_a_directory_without_tokenizer_json_is_refused(copy: Path, tmp_path: Path) -> None:
    (copy / "tokenizer.json").unlink()
    result = check(policy_for(copy, tmp_path))
    assert result.returncode == 1
    assert "holds no tokenizer.json" in result.stderr


def test_a_chat_template_is_needed_only_where_routes_send_chat(copy: Path, tmp_path: Path) -> None:
    (copy / "chat_template.jinja").unlink()
    refused = check(policy_for(copy, tmp_path))  # the route takes every endpoint
    assert refused.returncode == 1
    assert "holds no chat template" in refused.stderr
    assert "routes.0 sends it chat requests" in refused.stderr
    chat = check(policy_for(copy, tmp_path, endpoint=["completions", "messages"]))
    assert chat.returncode == 1 and "holds no chat template" in chat.stderr
    prompts = check(policy_for(copy, tmp_path, endpoint=["completions", "embeddings"]))
    assert prompts.returncode == 0, prompts.stderr
    # The template in tokenizer_config.json, as older tokenizers keep it, is one too.
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    kept = check(policy_for(copy, tmp_path))
    assert kept.returncode == 0, kept.stderr


def test_check_looks_at_the_files_and_load_tokenizers_loads_them(
    copy: Path, tmp_path: Path
) -> None:
    """A tokenizer.json that no library can read passes the file check (nothing is loaded)
    and fails the full load, which names the problem."""
    (copy / "tokenizer.json").write_text("not a tokenizer")
    policy = policy_for(copy, tmp_path)
    looked = check(policy)
    assert looked.returncode == 0, looked.stderr
    loaded = check(policy, "--load-tokenizers")
    assert loaded.returncode == 1
    assert f"{policy}:3: models.tiny.tokenizer: cannot load" in loaded.stderr


def test_a_whole_directory_passes_both(tokenizer_dir: Path, tmp_path: Path) -> None:
    policy = policy_for(tokenizer_dir, tmp_path)
    for flags in ((), ("--load-tokenizers",)):
        result = check(policy, *flags)
        assert result.returncode == 0, result.stderr
        assert "ok — 1 model(s)" in result.stdout
