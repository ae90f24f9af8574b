"""TLS with certificates made here (`openssl`): the listener serves HTTPS from the policy's pair
and takes a renewed one without a restart (a Kubernetes Secret's `..data` symlink swapped, a
pair that does not load kept out); an `https://` replica is verified against the pool's CA bundle
and refused, quickly and clearly, without it."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from loadtest.stub_backend import create_stub_app
from tests.conftest import basic_policy, longest_loop_gap, serving

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def ca(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "ca.crt", tmp_path / "ca.key"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test CA",
            "-keyout", str(key), "-out", str(cert))  # fmt: skip
    return cert, key


def issue(ca: tuple[Path, Path], directory: Path, serial: int) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by `ca`, with `serial`, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, csr = directory / "tls.crt", directory / "tls.key", directory / "tls.csr"
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(key), "-out", str(csr))  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
            "-set_serial", str(serial), "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return cert, key


def swap(secret: Path, version: str) -> None:
    """What the kubelet does on a Secret update: `..data` repointed atomically."""
    tmp = secret / "..data_tmp"
    tmp.symlink_to(version)
    os.replace(tmp, secret / "..data")


async def peer_serial(url: str, ca: Path) -> int:
    context = ssl.create_default_context(cafile=ca)
    host, port = url.removeprefix("https://").split(":")
    _, writer = await asyncio.open_connection(host, int(port), ssl=context)
    try:
        cert: Any = writer.get_extra_info("ssl_object").getpeercert()
        return int(cert["serialNumber"], 16)
    finally:
        writer.close()


async def served(probe: Callable[[], Awaitable[Any]], wanted: Any, within_s: float = 10) -> None:
    """Probe the running gateway until it answers `wanted` (the watch ticks every 0.1 s)."""
    for _ in range(int(within_s / 0.05)):
        if await probe() == wanted:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never {wanted!r}")


async def test_the_listener_serves_https_and_takes_a_renewed_certificate(
    ca, tmp_path, tokenizer_dir
) -> None:
    secret = tmp_path / "secret"  # the layout of a mounted Kubernetes Secret
    issue(ca, secret / "v1", serial=1001)
    issue(ca, secret / "v2", serial=2002)
    (secret / "v3").mkdir()  # a renewal that is not a pair: v2's certificate, v1's key
    (secret / "v3" / "tls.crt").write_bytes((secret / "v2" / "tls.crt").read_bytes())
    (secret / "v3" / "tls.key").write_bytes((secret / "v1" / "tls.key").read_bytes())
    swap(secret, "v1")
    for name in ("tls.crt", "tls.key"):
        (secret / name).symlink_to(Path("..data") / name)
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    policy["server"] = {"tls": {"cert_file": "secret/tls.crt", "key_file": "secret/tls.key"}}
    policy["admin"] = {"watch_interval_s": 0.1}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    async with serving(path) as (proc, url), aiohttp.ClientSession() as http:
        assert url.startswith("https://")
        trusted = ssl.create_default_context(cafile=ca[0])
        async with http.get(f"{url}/healthz", ssl=trusted) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # not without the CA
            await http.get(f"{url}/healthz")
        assert await peer_serial(url, ca[0]) == 1001
        swap(secret, "v2")
        await served(lambda: peer_serial(url, ca[0]), 2002)  # no restart: the same process
        swap(secret, "v3")

        async def errors() -> bool:
            async with http.get(f"{url}/metrics", ssl=trusted) as resp:
                return "llm_tls_reload_errors_total 1.0" in await resp.text()

        await served(errors, True)
        assert await peer_serial(url, ca[0]) == 2002  # the pair that loaded stays
        assert proc.returncode is None


async def test_a_missing_certificate_stops_the_start_with_a_clear_error(tmp_path, tokenizer_dir):
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    policy["server"] = {"tls": {"cert_file": "none.crt", "key_file": "none.key"}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await done.communicate()
    assert done.returncode == 1
    assert b"server.tls: cannot load" in err and b"none.crt" in err


async def test_an_https_replica_is_verified_with_the_pools_ca_bundle(
    ca, tmp_path, tokenizer_dir, gateway_factory, http
) -> None:
    cert, key = issue(ca, tmp_path / "replica", serial=7)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    runner = web.AppRunner(create_stub_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    replica = f"https://127.0.0.1:{runner.addresses[0][1]}"
    try:
        policy = basic_policy(tokenizer_dir, [replica])
        policy["pools"]["main"]["tls_ca_file"] = str(ca[0])
        trusted = await gateway_factory(policy)
        async with http.post(f"{trusted.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        untrusted = await gateway_factory(basic_policy(tokenizer_dir, [replica]))
        async with asyncio.timeout(10):  # refused at the handshake, not a hang
            async with http.post(f"{untrusted.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["code"] == "upstream_error"
    finally:
        await runner.cleanup()


def secret_of(ca: tuple[Path, Path], tmp_path: Path) -> Path:
    """A mounted Secret's layout, `v1` (serial 1001) in it; the files through `..data`."""
    secret = tmp_path / "secret"
    issue(ca, secret / "v1", serial=1001)
    swap(secret, "v1")
    for name in ("tls.crt", "tls.key"):
        (secret / name).symlink_to(Path("..data") / name)
    return secret


def tls_policy(tokenizer_dir: Path) -> dict[str, Any]:
    policy = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    policy["server"] = {"tls": {"cert_file": "secret/tls.crt", "key_file": "secret/tls.key"}}
    policy["admin"] = {"watch_interval_s": 0.05}
    return policy


def renewal(secret: Path, version: str, cert: Callable[[Path], None]) -> None:
    """`version` with the key of v1 and a certificate `cert` makes at its path."""
    (secret / version).mkdir()
    (secret / version / "tls.key").write_bytes((secret / "v1" / "tls.key").read_bytes())
    cert(secret / version / "tls.crt")


async def test_a_fifo_then_a_path_that_never_resolves_are_counted_and_the_watch_goes_on(
    ca, tmp_path, tokenizer_dir
) -> None:
    """A FIFO at the certificate path wedged the loop (the file read waited for a writer), and a
    path that did not resolve was a swap under way for ever, uncounted: now each is one failure,
    `/healthz` answers throughout, and the next good renewal still loads."""
    secret = secret_of(ca, tmp_path)
    renewal(secret, "fifo", os.mkfifo)
    issue(ca, secret / "v2", serial=2002)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(tls_policy(tokenizer_dir)))
    trusted = ssl.create_default_context(cafile=ca[0])
    timeout = aiohttp.ClientTimeout(total=10)  # a wedged gateway answers nothing at all
    async with serving(path) as (proc, url), aiohttp.ClientSession(timeout=timeout) as http:

        async def errors() -> str:
            async with http.get(f"{url}/healthz", ssl=trusted) as resp:
                assert resp.status == 200
            async with http.get(f"{url}/metrics", ssl=trusted) as resp:
                text = await resp.text()
            return next(x for x in text.splitlines() if x.startswith("llm_tls_reload_errors_total"))

        swap(secret, "fifo")
        await served(errors, "llm_tls_reload_errors_total 1.0")
        assert await peer_serial(url, ca[0]) == 1001
        swap(secret, "gone")  # `..data` names nothing: past the grace, one failure
        await served(errors, "llm_tls_reload_errors_total 2.0", within_s=20)
        swap(secret, "v2")
        await served(lambda: peer_serial(url, ca[0]), 2002)
        assert await errors() == "llm_tls_reload_errors_total 2.0"
        assert proc.returncode is None


async def test_a_huge_certificate_file_is_refused_without_holding_the_loop(
    ca, tmp_path, tokenizer_dir, gateway_factory
) -> None:
    """150 MB at the certificate path was read and parsed on the loop (118-145 ms); now it is
    refused unread past `MAX_PEM_BYTES`, in a thread."""
    secret = secret_of(ca, tmp_path)
    gw = await gateway_factory(tls_policy(tokenizer_dir))
    tls = gw.gateway.listener_tls
    assert tls is not None
    renewal(secret, "huge", lambda p: p.write_bytes(b"A" * (150 << 20)))
    swap(secret, "huge")

    async def counted() -> None:
        while not tls.reload_errors:  # noqa: ASYNC110 - the watch's own tick counts it
            await asyncio.sleep(0.001)

    _, gap = await longest_loop_gap(asyncio.wait_for(counted(), 30), 0.002)
    assert tls.reload_errors == 1
    assert gap < 0.05  # ~0.13 s when it was read on the loop
