"""Hot reload: a valid change applies without dropping a stream; an invalid one changes nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import gateway.runtime as runtime
from tests.conftest import basic_policy, eventually, serving
from tests.server.test_tls import served

TOKEN = "s3cret-admin"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture
def admin_token(monkeypatch) -> str:
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_TOKEN", TOKEN)
    return TOKEN


async def reload(http: aiohttp.ClientSession, url: str, token: str = TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"}
    async with http.post(f"{url}/admin/reload", headers=headers) as resp:
        return resp.status, await resp.json()


async def policy_hash(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        line = next(x for x in (await resp.text()).splitlines() if x.startswith("llm_policy_info{"))
    return line.split('"')[1]


async def test_a_valid_change_applies_without_dropping_a_stream(
    stub_factory, gateway_factory, tokenizer_dir, tmp_path, http, admin_token
) -> None:
    slow, fresh = await stub_factory(chunk_delay_s=0.02), await stub_factory()
    policy = basic_policy(tokenizer_dir, [slow.url], max_concurrency=1)
    gw = await gateway_factory(policy)
    before = await policy_hash(http, gw.url)
    stream = await http.post(
        f"{gw.url}/v1/chat/completions", json={**CHAT, "max_tokens": 60, "stream": True}
    )
    await stream.content.readline()
    # Replace the replica, raise the cap, add an alias: the running stream keeps its old slot.
    policy["pools"]["main"] |= {"replicas": [fresh.url], "max_concurrency": 4}
    policy["routes"].insert(0, {"match": {"model": "new-alias"}, "pool": "main"})
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    status, body = await reload(http, gw.url)
    assert status == 200 and body["hash"] != before
    async with http.post(
        f"{gw.url}/v1/chat/completions", json={**CHAT, "model": "new-alias"}
    ) as resp:
        assert resp.status == 200
    assert fresh.stats.bodies[-1]["model"] == "tiny"  # the new route, on the new replica
    rest = await stream.read()
    assert (
        stream.status == 200 and rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") >= 59
    )
    stream.release()
    assert slow.stats.completed == 1 and slow.stats.disconnects == 0
    await eventually(lambda: gw.inflight() == 0)
    assert await policy_hash(http, gw.url) == body["hash"]


async def test_an_invalid_change_is_refused_with_line_and_field(
    stub, gateway_factory, tokenizer_dir, tmp_path, http, admin_token
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    before = await policy_hash(http, gw.url)
    path = tmp_path / "policy.yaml"
    path.write_text(path.read_text().replace("max_concurrency: 8", "max_concurrency: 0"))
    status, body = await reload(http, gw.url)
    assert status == 422 and body["error"]["code"] == "invalid_policy"
    assert f"{path}:" in body["error"]["message"]
    assert "pools.main.max_concurrency: must be >= 1" in body["error"]["message"]
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200  # the old policy keeps serving
    assert await policy_hash(http, gw.url) == before
    async with http.get(f"{gw.metrics_url}/metrics") as resp:
        assert "llm_policy_reload_errors_total 1.0" in await resp.text()


async def test_the_file_is_watched(stub, gateway_factory, tokenizer_dir, tmp_path, http) -> None:
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["admin"] = {"watch_interval_s": 0.05}
    gw = await gateway_factory(policy)
    policy["routes"][0]["match"]["model"] = ["tiny", "watched-alias"]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    await eventually(lambda: "watched-alias" in gw.gateway.policy.served_models)
    async with http.post(
        f"{gw.url}/v1/chat/completions", json={**CHAT, "model": "watched-alias"}
    ) as resp:
        assert resp.status == 200


async def test_admin_needs_its_token(
    stub, gateway_factory, tokenizer_dir, http, monkeypatch
) -> None:
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    monkeypatch.delenv("LLM_GATEWAY_ADMIN_TOKEN", raising=False)
    assert (await reload(http, gw.url))[0] == 403
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_TOKEN", TOKEN)
    status, body = await reload(http, gw.url, token="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await reload(http, gw.url))[0] == 200


async def test_reloading_keeps_what_was_learned_and_loaded(
    stub, gateway_factory, tokenizer_dir, tmp_path, http, admin_token
) -> None:
    policy = basic_policy(tokenizer_dir, [stub.url])
    gw = await gateway_factory(policy)
    old = gw.gateway.policy
    policy["pools"]["main"]["max_concurrency"] = 3
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    assert (await reload(http, gw.url))[0] == 200
    new = gw.gateway.policy
    assert new is not old and new.models["tiny"] is old.models["tiny"]  # tokenizer not reloaded
    assert new.estimator is old.estimator and new.tokenizer_threads is old.tokenizer_threads
    assert [r.max_concurrency for r in gw.gateway.slots["main"].replicas] == [3]


async def inflight(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """`llm_inflight_requests` by (pool, replica), as /metrics says now."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        (s.labels["pool"], s.labels["replica"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_inflight_requests"
        for s in family.samples
    }


def connections_to(url: str) -> int:
    """Established TCP connections to `url`'s port (IPv4) from this network namespace: the
    gateway's, as the tests run it in this process and nothing else here connects there."""
    port = int(url.rsplit(":", 1)[1])
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    established = "01"
    return sum(
        1
        for row in rows
        if (fields := row.split())[3] == established and int(fields[2].split(":")[1], 16) == port
    )


async def test_a_pool_a_reload_removes_lets_go_of_its_replica(
    stub_factory, gateway_factory, tokenizer_dir, tmp_path, http, admin_token, caplog
) -> None:
    """Its kept connection and its health checks' close at the reload; a stream still in flight
    on it ends normally, and its connection closes after it."""
    gone, kept = await stub_factory(chunk_delay_s=0.02), await stub_factory()
    policy = basic_policy(tokenizer_dir, [gone.url])
    gw = await gateway_factory(policy)
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200  # its connection is kept for the next request
    stream = await http.post(
        f"{gw.url}/v1/chat/completions", json={**CHAT, "max_tokens": 40, "stream": True}
    )
    await stream.content.readline()
    assert connections_to(gone.url) >= 2
    policy["pools"] = {"next": {"model": "tiny", "replicas": [kept.url], "max_concurrency": 8}}
    policy["routes"] = [{"match": {"model": ["tiny"]}, "pool": "next"}]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    caplog.set_level(logging.INFO, logger="gateway")
    assert (await reload(http, gw.url))[0] == 200
    assert "(added next; removed main)" in caplog.text
    assert connections_to(gone.url) == 1  # the stream's
    assert (await reload(http, gw.url))[0] == 200  # the same file again
    assert "reloaded: unchanged" in caplog.text
    assert await inflight(http, gw.url) == {("main", gone.url): 1.0, ("next", kept.url): 0.0}
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert kept.stats.completed == 1
    rest = await stream.read()
    assert stream.status == 200 and rest.endswith(b"data: [DONE]\n\n")
    stream.release()
    await eventually(lambda: connections_to(gone.url) == 0)
    assert gone.stats.completed == 2 and gone.stats.disconnects == 0
    assert await inflight(http, gw.url) == {("next", kept.url): 0.0}  # drained: its series go


async def test_a_reload_under_way_when_the_gateway_closes_ends_first_and_leaves_nothing(
    stub_factory, gateway_factory, tokenizer_dir, tmp_path, monkeypatch
) -> None:
    """SIGHUP just before SIGTERM: the reload's compile is still running when `close` starts.
    `close` waits for it, then stops what it started too; a reload after `close` does nothing."""
    first, second = await stub_factory(), await stub_factory()
    policy = basic_policy(tokenizer_dir, [first.url])
    gw = await gateway_factory(policy)
    compiled, real = threading.Event(), runtime.compile_policy

    def held(*args: object, **kwargs: object) -> object:
        compiled.wait(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "compile_policy", held)
    policy["pools"] = {"next": {"model": "tiny", "replicas": [second.url], "max_concurrency": 8}}
    policy["routes"] = [{"match": {"model": ["tiny"]}, "pool": "next"}]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    reloading = asyncio.create_task(gw.gateway.reload())
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(gw.gateway.close())
    await asyncio.sleep(0.05)
    compiled.set()
    await asyncio.gather(reloading, closing)
    assert set(gw.gateway.sessions) == {"next"}  # the reload ended first: main retired
    assert all(session.closed for session in gw.gateway.sessions.values())
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith(("health:", "adapters:"))]
    assert (await gw.gateway.reload()).pools.keys() == {"next"}  # the running one, unchanged


def laughs(levels: int) -> str:
    """A "billion laughs" in YAML: each level an anchored list of nine aliases to the one
    before, so a few hundred bytes stand for 9**levels strings."""
    lines = [f"laugh0: &laugh0 [{', '.join(['lol'] * 9)}]"]
    lines += [
        f"laugh{n}: &laugh{n} [{', '.join([f'*laugh{n - 1}'] * 9)}]" for n in range(1, levels)
    ]
    return "\n".join(lines) + "\n"


async def reload_errors(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return next(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_policy_reload_errors"
        for s in family.samples
    )


async def test_a_billion_laughs_is_refused_before_it_is_expanded(
    stub, gateway_factory, tokenizer_dir, tmp_path, http, admin_token
) -> None:
    """9**9 strings from under a kilobyte: refused as the file is read, at the first anchor that
    stands for more than 100,000 values, never expanded (walking it grew its memory with the
    document and held SIGTERM until the walk ended)."""
    gw = await gateway_factory(basic_policy(tokenizer_dir, [stub.url]))
    before = await policy_hash(http, gw.url)
    path = tmp_path / "policy.yaml"
    first = len(path.read_text().splitlines()) + 1
    bomb = laughs(9)
    assert len(bomb) < 1024
    path.write_text(path.read_text() + bomb)
    status, body = await reload(http, gw.url)
    assert status == 422 and body["error"]["code"] == "invalid_policy"
    assert body["error"]["message"].startswith(
        f"{path}:{first + 5}: (yaml): stands for more than 100,000 values once its aliases are"
    )  # laugh5: 9**5 strings and their lists
    assert await policy_hash(http, gw.url) == before
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert await reload_errors(http, gw.url) == 1


async def test_the_watcher_outlives_a_self_referencing_alias(
    stub, gateway_factory, tokenizer_dir, tmp_path, http
) -> None:
    """An alias inside its own anchor is a cycle (it raised RecursionError, which ended the
    watcher): refused and counted, and the next valid edit still applies."""
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["admin"] = {"watch_interval_s": 0.05}
    gw = await gateway_factory(policy)
    path = tmp_path / "policy.yaml"
    path.write_text(path.read_text() + "loop: &loop [*loop]\n")
    await eventually(lambda: gw.gateway.reload_errors == 1)
    assert await reload_errors(http, gw.url) == 1
    policy["routes"][0]["match"]["model"] = ["tiny", "watched-alias"]
    path.write_text(yaml.safe_dump(policy))
    await eventually(lambda: "watched-alias" in gw.gateway.policy.served_models)


async def test_any_failed_reload_is_counted_answered_and_outlived(
    stub, gateway_factory, tokenizer_dir, tmp_path, http, admin_token, monkeypatch
) -> None:
    """A reload that fails other than on the file's content (a bug, memory): 500 in the error
    shape, counted, the running policy serving; the watcher and the next reload still work."""
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["admin"] = {"watch_interval_s": 0.05}
    gw = await gateway_factory(policy)
    before = await policy_hash(http, gw.url)
    real = runtime.compile_policy

    def broken(*args: object, **kwargs: object) -> object:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(runtime, "compile_policy", broken)
    status, body = await reload(http, gw.url)
    assert status == 500 and body["error"]["code"] == "reload_failed"
    assert "RecursionError" in body["error"]["message"]
    policy["routes"][0]["match"]["model"] = ["tiny", "watched-alias"]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    await eventually(lambda: gw.gateway.reload_errors >= 2)  # the watcher's try failed too
    assert await policy_hash(http, gw.url) == before
    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert await reload_errors(http, gw.url) == gw.gateway.reload_errors
    monkeypatch.setattr(runtime, "compile_policy", real)
    policy["routes"][0]["match"]["model"].append("next-alias")
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    await eventually(lambda: "next-alias" in gw.gateway.policy.served_models)


def kubelet_update(volume: Path, version: str, files: dict[str, str]) -> None:
    """What the kubelet's atomic writer does to a mounted ConfigMap: the files in a new
    timestamped directory, `..data_tmp -> it` renamed over `..data`, each key's link
    `<key> -> ..data/<key>` made once, and the previous directory removed."""
    new = volume / f"..2026_12_06_{version}"
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text)
    data = volume / "..data"
    old = data.readlink() if data.is_symlink() else None
    (volume / "..data_tmp").symlink_to(new.name)
    os.replace(volume / "..data_tmp", data)
    for name in files:
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(Path("..data") / name)
    if old is not None:
        for stale in (volume / old).iterdir():
            stale.unlink()
        (volume / old).rmdir()


async def served_model(http: aiohttp.ClientSession, url: str, model: str) -> int:
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": model}) as resp:
        return resp.status


async def test_a_mounted_configmaps_update_is_served_and_a_bad_one_refused_counted_and_outlived(
    stub, tokenizer_dir, tmp_path, http
) -> None:
    """The chart's policy ConfigMap, mounted as a directory: `llm-gateway serve --policy
    <volume>/policy.yaml` follows each swap of `..data`. The first update is a file of the same
    size and modification time as the one it replaces (written within one tick of the kernel's
    file clock, say): only where the path leads now tells it apart. A bad update is refused, the
    running policy serves on, the refusal is counted; the next good one applies."""
    volume = tmp_path / "policy"
    volume.mkdir()
    policy = basic_policy(tokenizer_dir, [stub.url])
    policy["admin"] = {"watch_interval_s": 0.05}
    first = yaml.safe_dump(policy)
    kubelet_update(volume, "v1", {"policy.yaml": first})
    path = volume / "policy.yaml"
    async with serving(path) as (proc, url):
        assert await served_model(http, url, "tiny-alias") == 200
        times = path.stat().st_mtime_ns
        kubelet_update(volume, "v2", {"policy.yaml": first.replace("tiny-alias", "tiny-other")})
        os.utime(path, ns=(times, times))
        assert path.stat().st_size == len(first)

        await served(lambda: served_model(http, url, "tiny-other"), 200)
        assert await served_model(http, url, "tiny-alias") == 404
        bad = first.replace("tiny-alias", "tiny-third").replace(
            "max_concurrency: 8", "max_concurrency: 0"
        )
        kubelet_update(volume, "v3", {"policy.yaml": bad})
        await served(lambda: reload_errors(http, url), 1)
        assert await served_model(http, url, "tiny-other") == 200  # the running policy stays
        assert await served_model(http, url, "tiny-third") == 404
        kubelet_update(volume, "v4", {"policy.yaml": first.replace("tiny-alias", "tiny-fourth")})
        await served(lambda: served_model(http, url, "tiny-fourth"), 200)
        assert await reload_errors(http, url) == 1
        assert proc.returncode is None
