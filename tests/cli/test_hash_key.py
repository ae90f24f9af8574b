"""`llm-gateway hash-key`: the key comes in on standard input, never the command line, and what
it prints is what a tenant's `keys` takes: a gateway with it lets that key in, and no other."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import basic_policy

KEY = "sk-team-search-5f2c9a"


def hash_key(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "hash-key"],
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def test_the_printed_entry_admits_the_key_and_no_other(
    stub, gateway_factory, tokenizer_dir, http
) -> None:
    done = hash_key(f"{KEY}\n")
    assert done.returncode == 0, done.stderr
    (entry,) = done.stdout.split()
    assert entry.startswith("sha256:") and KEY not in done.stdout + done.stderr
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["tenants"] = {"search": {"keys": [entry]}}
    gw = await gateway_factory(policy)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for key, status in ((KEY, 200), (KEY + "x", 401)):
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == status


def test_one_entry_per_line_and_nothing_is_refused() -> None:
    many = hash_key("sk-one\n\n  sk-two  \n")
    assert many.returncode == 0 and len(many.stdout.split()) == 2
    assert hash_key("sk-two\n").stdout.split() == many.stdout.split()[1:]
    empty = hash_key("\n")
    assert empty.returncode == 2 and "no key" in empty.stderr and not empty.stdout


def test_a_key_on_the_command_line_is_not_accepted() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "hash-key", KEY],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "unrecognized arguments" in done.stderr
