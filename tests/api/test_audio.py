"""vLLM's speech-to-text endpoints (gateway/api/audio.py), transcriptions and translations,
admitted and counted: the `openai` SDK's multipart upload through the gateway to a replica on
loopback (the test's own, or the simulated vLLM), its body forwarded byte for byte (a rewritten
`model` spliced in), its text prompt counted; a body that is not a whole form is a 400 in
OpenAI's shape, one over the body limit a 413, and neither holds anything after."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from aiohttp import FormData, web
from tokenizers import Tokenizer

from gateway.api.audio import MAX_PARTS, decode_form
from gateway.errors import GatewayError
from loadtest.sim import ReplicaOptions, start_replica
from tests.conftest import _serve, accounted, basic_policy
from tests.loadtest.test_simulator import write_profile
from tests.request.test_tenants import hashed

AUDIO = bytes(range(256)) * 40  # 10 KB of "audio": the gateway never looks inside it
TRANSCRIBE = "/v1/audio/transcriptions"
PATHS = (TRANSCRIBE, "/v1/audio/translations")


class Replica:
    """A speech server on loopback: what it was sent, answered as vLLM answers a transcription."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.got.append((request.headers["Content-Type"], body))
        if b'name="stream"\r\n\r\ntrue' in body:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"object": "transcription.chunk", "choices": [{"delta": {"content": "hi"}}]}
            usage = {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32}
            for event in (chunk, chunk, {"choices": [], "usage": usage}):
                await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"text": "hello", "usage": {"type": "duration", "seconds": 1}})


LONG = " ".join(["stone river lamp"] * 700)  # a long audio's transcript


def logged(gw: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.access_log.getvalue().splitlines()]


@pytest.fixture
async def speech(tokenizer_dir: Path, gateway_factory) -> AsyncIterator[tuple[Any, Replica]]:
    replica, app = Replica(), web.Application()
    for path in PATHS:
        app.router.add_post(path, replica.handle)
    runner, url = await _serve(app)
    yield await gateway_factory(basic_policy(tokenizer_dir, [url])), replica
    await runner.cleanup()


def sdk(gw: Any, sent: list[bytes]) -> openai.AsyncOpenAI:
    """The real SDK, keeping the bytes it sends."""

    async def keep(request: Any) -> None:
        sent.append(await request.aread())

    client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [keep]})
    return openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, http_client=client
    )


async def test_the_sdks_upload_is_admitted_counted_and_forwarded_byte_for_byte(
    speech, tokenizer_dir: Path
) -> None:
    gw, replica = speech
    prompt = "Ada Lovelace and Charles Babbage discuss the analytical engine."
    sent: list[bytes] = []
    async with sdk(gw, sent) as client:
        answer = await client.audio.transcriptions.create(
            model="tiny",
            file=("speech.wav", io.BytesIO(AUDIO), "audio/wav"),
            prompt=prompt,
            language="en",
        )
    assert answer.text == "hello"
    await accounted(gw, 0)
    [(content_type, upstream)] = replica.got
    assert upstream == sent[0]  # the client's bytes, not one re-encoded
    assert content_type.startswith("multipart/form-data; boundary=")
    [line] = logged(gw)
    assert (line["endpoint"], line["status"], line["pool"]) == ("transcriptions", 200, "main")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    # The prompt's tokens, as vLLM's tokenizer counts them; the audio's are unknown here.
    assert line["input_tokens"] == len(tokenizer.encode(prompt).ids) > 0
    # vLLM's usage is the audio's seconds, no count: the answer's text is counted.
    assert line["output_tokens"] == len(tokenizer.encode("hello", add_special_tokens=False).ids)
    assert gw.inflight() == 0


async def test_an_alias_is_spliced_into_the_upload_and_nothing_else_changes(speech) -> None:
    gw, replica = speech
    sent: list[bytes] = []
    async with sdk(gw, sent) as client:
        await client.audio.transcriptions.create(
            model="tiny-alias", file=("speech.wav", io.BytesIO(AUDIO), "audio/wav")
        )
    [(_, upstream)] = replica.got
    assert sent[0].count(b"tiny-alias") == 1
    assert upstream == sent[0].replace(b"\r\n\r\ntiny-alias\r\n", b"\r\n\r\ntiny\r\n")


async def test_a_stream_keeps_the_usage_the_client_asked_for_and_is_settled_on_it(
    speech, http
) -> None:
    gw, _ = speech
    form = {"model": "tiny", "stream": "true", "stream_include_usage": "true"}
    data = aiohttp_form(form)
    async with http.post(gw.url + TRANSCRIBE, data=data) as resp:
        assert resp.status == 200
        text = await resp.read()
    assert b'"completion_tokens":2' in text and text.endswith(b"data: [DONE]\n\n")
    await accounted(gw, 0)
    [line] = logged(gw)
    assert (line["stream"], line["output_tokens"]) == (True, 2)


@pytest.mark.parametrize("response_format", ["json", "text"])
async def test_a_whole_transcription_is_charged_its_text_not_its_reservation(
    replica_app, tokenizer_dir: Path, gateway_factory, http, response_format: str
) -> None:
    """A whole answer's usage is the audio's seconds, and no bound limits its text: settled on
    the reservation (512 expected), a tenant's uploads of long audio got many times what they
    were charged (the adversary's `uploads` move, Q: 2.1x a tenant's TPM). The text is counted
    and charged whole, even from a replica whose usage claims one token."""

    async def long_answer(request: web.Request) -> web.Response:
        await request.read()
        if response_format == "text":
            return web.Response(text=LONG)
        usage = {"type": "duration", "seconds": 600, "completion_tokens": 1}
        return web.json_response({"text": LONG, "usage": usage})

    policy = basic_policy(tokenizer_dir, [await replica_app(long_answer, TRANSCRIBE)])
    policy["tenants"] = {"acme": {"keys": [hashed("acme-key")], "tpm": 100_000}}
    gw = await gateway_factory(policy)
    headers = {"Authorization": "Bearer acme-key"}
    data = aiohttp_form({"model": "tiny", "response_format": response_format})
    async with http.post(gw.url + TRANSCRIBE, data=data, headers=headers) as resp:
        assert resp.status == 200
    await accounted(gw, 0)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    spoken = len(tokenizer.encode(LONG, add_special_tokens=False).ids)
    [line] = logged(gw)
    assert (line["output_tokens"], line["expected_output_tokens"]) == (spoken, 512)
    async with http.post(
        gw.url + TRANSCRIBE, data=aiohttp_form({"model": "tiny"}), headers=headers
    ) as resp:
        remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    # The second upload reserves its 512 expected on top of the first's whole transcript.
    assert remaining == 100_000 - spoken - 512
    assert gw.inflight() == 0


async def test_a_streamed_transcriptions_usage_is_charged_whole_past_its_reservation(
    replica_app, tokenizer_dir: Path, gateway_factory, http
) -> None:
    """A stream's usage chunk, asked for and believed, past the reservation and its burst: no
    bound limits a transcript, so capping it there let a tenant's streamed long uploads take
    1.4x its TPM (the adversary's `uploads` move, streamed)."""

    async def long_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"object": "transcription.chunk", "choices": [{"delta": {"content": " hi"}}]}
        usage = {"prompt_tokens": 0, "completion_tokens": 3000, "total_tokens": 3000}
        for event in (chunk, chunk, {"choices": [], "usage": usage}):
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    policy = basic_policy(tokenizer_dir, [await replica_app(long_stream, TRANSCRIBE)])
    policy["tenants"] = {"acme": {"keys": [hashed("acme-key")], "tpm": 100_000}}
    gw = await gateway_factory(policy)
    headers = {"Authorization": "Bearer acme-key"}
    form = {"model": "tiny", "stream": "true", "stream_include_usage": "true"}
    async with http.post(gw.url + TRANSCRIBE, data=aiohttp_form(form), headers=headers) as resp:
        await resp.read()
    await accounted(gw, 0)
    [line] = logged(gw)
    assert (line["output_tokens"], line["expected_output_tokens"]) == (3000, 512)
    async with http.post(
        gw.url + TRANSCRIBE, data=aiohttp_form({"model": "tiny"}), headers=headers
    ) as resp:
        remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    assert remaining == 100_000 - 3000 - 512


def aiohttp_form(fields: dict[str, str]) -> FormData:
    form = FormData()
    for name, value in fields.items():
        form.add_field(name, value)
    form.add_field("file", AUDIO, filename="a.wav", content_type="audio/wav")
    return form


BOUNDARY = "b0undary"
FORM = f"multipart/form-data; boundary={BOUNDARY}"


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


WHOLE = part("model", b"tiny") + part("file", AUDIO, "a.wav") + f"--{BOUNDARY}--\r\n".encode()


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code", "param"),
    [
        (WHOLE[:-40], FORM, 400, "invalid_multipart", None),  # cut short
        (WHOLE, "multipart/form-data", 400, "invalid_multipart", None),  # no boundary
        (b"junk" + WHOLE, FORM, 400, "invalid_multipart", None),
        (
            WHOLE.replace(b"Content-Disposition", b"X-Nothing", 1),
            FORM,
            400,
            "invalid_multipart",
            None,
        ),
        (part("model", b"tiny") + f"--{BOUNDARY}--".encode(), FORM, 400, "invalid_request", "file"),
        (part("model", b"tiny") + WHOLE, FORM, 400, "invalid_request", "model"),  # twice
        (part("model", b"\xff") + WHOLE, FORM, 400, "invalid_multipart", None),
        (b'{"model": "tiny"}', "application/json", 415, "unsupported_media_type", None),
        (  # one name to the gateway, the other to a parser keeping the last
            WHOLE.replace(b'name="model"', b'name="prompt"; name="model"', 1),
            FORM,
            400,
            "invalid_multipart",
            None,
        ),
        (
            WHOLE.replace(
                b"Content-Disposition: form-data",
                b'Content-Disposition: form-data; name="prompt"\r\nContent-Disposition: form-data',
                1,
            ),
            FORM,
            400,
            "invalid_multipart",
            None,
        ),
    ],
    ids=[
        "cut",
        "no-boundary",
        "preamble",
        "no-disposition",
        "no-file",
        "twice",
        "not-utf8",
        "json",
        "name-twice",
        "disposition-twice",
    ],
)
@pytest.mark.parametrize("path", PATHS)
async def test_a_body_that_is_not_a_whole_form_is_refused_in_openais_shape(
    speech, http, path, body: bytes, content_type: str, status: int, code: str, param: str | None
) -> None:
    gw, replica = speech
    async with http.post(gw.url + path, data=body, headers={"Content-Type": content_type}) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert replica.got == []
    await accounted(gw, 0)
    assert gw.inflight() == 0


@pytest.mark.parametrize("path", PATHS)
async def test_an_upload_over_the_body_limit_is_a_413_and_holds_nothing(
    replica_app, tokenizer_dir: Path, gateway_factory, http, path: str
) -> None:
    replica = Replica()
    policy = basic_policy(tokenizer_dir, [await replica_app(replica.handle, path)])
    policy["server"] = {"max_body_bytes": len(WHOLE) - 1}
    gw = await gateway_factory(policy)
    async with http.post(gw.url + path, data=WHOLE, headers={"Content-Type": FORM}) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    await accounted(gw, 0)
    assert replica.got == [] and gw.inflight() == 0


def test_a_form_of_too_many_parts_is_refused_before_it_is_read_whole() -> None:
    many = part("x", b"1") * (MAX_PARTS + 1) + WHOLE
    with pytest.raises(GatewayError, match=f"over {MAX_PARTS} parts"):
        decode_form(many, FORM)
    form = decode_form(part("x", b"1") * (MAX_PARTS - 2) + WHOLE, FORM)
    offset = len(part("x", b"1")) * (MAX_PARTS - 2) + WHOLE.index(b"tiny")
    assert form["model"] == "tiny" and form.spans["model"] == (offset, offset + 4)


async def test_the_sdks_translation_is_admitted_counted_and_forwarded_byte_for_byte(
    speech,
) -> None:
    gw, replica = speech
    sent: list[bytes] = []
    async with sdk(gw, sent) as client:
        answer = await client.audio.translations.create(
            model="tiny-alias", file=("speech.wav", io.BytesIO(AUDIO), "audio/wav")
        )
    assert answer.text == "hello"
    await accounted(gw, 0)
    [(_, upstream)] = replica.got
    assert upstream == sent[0].replace(b"\r\n\r\ntiny-alias\r\n", b"\r\n\r\ntiny\r\n")
    [line] = logged(gw)
    assert (line["endpoint"], line["status"], line["model"]) == ("translations", 200, "tiny-alias")
    assert gw.inflight() == 0


async def test_the_simulated_vllm_translates_an_upload_through_the_gateway(
    tmp_path: Path, tokenizer_dir: Path, gateway_factory
) -> None:
    replica = await start_replica(
        write_profile(tmp_path), ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir)
    )
    try:
        gw = await gateway_factory(basic_policy(tokenizer_dir, [replica.url]))
        async with sdk(gw, []) as client:
            answer = await client.audio.translations.create(
                model="tiny", file=("speech.wav", io.BytesIO(AUDIO), "audio/wav")
            )
        assert answer.text
        await accounted(gw, 0)
    finally:
        await replica.close()
    [line] = logged(gw)
    assert (line["endpoint"], line["status"], line["replica"]) == ("translations", 200, replica.url)
    assert gw.inflight() == 0


def test_a_file_named_only_in_rfc_5987_form_is_a_file_and_its_bytes_are_never_decoded() -> None:
    named = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file";'
    named += " filename*=UTF-8''sp%C3%A9ech.wav\r\n\r\n"
    body = part("model", b"tiny") + named.encode() + b"\xff\xfe" + AUDIO
    form = decode_form(body + f"\r\n--{BOUNDARY}--".encode(), FORM)
    upload = form["file"]
    assert body[upload.start : upload.end] == b"\xff\xfe" + AUDIO
